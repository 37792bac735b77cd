"""Models Ollama pulled, served by their Ollama names (model/ollama_store.py): a store laid
out as Ollama lays it (manifests naming blobs by digest), a tiny GGUF as the model layer and
a Modelfile's PARAMETERs as the params layer; found under $OLLAMA_MODELS, loaded as the
same GGUF by its path, with those sampling settings as the model's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import VOCAB
from iterserve import LLM
from iterserve.model.errors import ModelLoadError
from iterserve.model.model_source import find_model
from iterserve.model.tokenizer import load_hf_tokenizer
from iterserve.sampling_params import SamplingParams
from ollama_store_files import pull
from tiny_checkpoints import tiny_hf_model
from tiny_gguf import write_gguf

SMALL = dict(dtype="float32", compile=False, num_kv_blocks=64)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer_dir: Path) -> Path:
    root = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    gguf = tmp_path / "tiny.gguf"
    hf = tiny_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    write_gguf(gguf, "llama", hf, load_hf_tokenizer(tokenizer_dir), sampling={"top_k": 3})
    params = {"temperature": 0.6, "top_k": 20, "stop": ["<|im_end|>"], "num_ctx": 4096}
    pull(root, "registry.ollama.ai/library/tiny/1b", gguf, params)
    pull(root, "registry.ollama.ai/library/tiny/latest", gguf)
    pull(root, "registry.ollama.ai/acme/tiny/q8", gguf)
    pull(root, "hf.co/acme/tiny-GGUF/Q8_0", gguf)
    return gguf


def test_names_resolve_as_ollama_resolves_them(store: Path) -> None:
    pulled = find_model("tiny:1b")
    assert pulled.path.read_bytes() == store.read_bytes() and pulled.name == "tiny:1b"
    assert pulled.sampling == {"temperature": 0.6, "top_k": 20}  # the sampling PARAMETERs
    assert find_model("tiny").sampling == {}  # tag latest, no params layer
    assert find_model("acme/tiny:q8").name == "acme/tiny:q8"  # not in the HF cache
    assert find_model("hf.co/acme/tiny-GGUF:Q8_0").path.is_file()
    with pytest.raises(ModelLoadError, match="no model Ollama pulled has that name"):
        find_model("tiny:70b")
    with pytest.raises(ModelLoadError, match="Hugging Face cache"):  # the HF error stands
        find_model("acme/other:q8")


def test_a_projector_layer_comes_with_its_model(store: Path, tmp_path: Path) -> None:
    projector = tmp_path / "mmproj.gguf"
    projector.write_bytes(b"GGUF projector")
    root = tmp_path / "ollama"
    pull(root, "registry.ollama.ai/library/seeing/latest", store, projector=projector)
    found = find_model("seeing")
    assert found.projector is not None and found.projector.read_bytes() == b"GGUF projector"
    assert find_model("tiny:1b").projector is None


def test_a_missing_blob_says_to_pull_again(store: Path) -> None:
    root = store.parent / "ollama"
    for blob in (root / "blobs").iterdir():
        if blob.read_bytes() == store.read_bytes():
            blob.unlink()
    with pytest.raises(ModelLoadError, match=r"ollama pull tiny:1b"):
        find_model("tiny:1b")


def test_a_pulled_model_serves_its_gguf_with_its_parameters(store: Path) -> None:
    llm = LLM("tiny:1b", **SMALL)
    assert llm.engine.model_name == "tiny:1b"
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.6, 20)  # over the GGUF's top_k 3
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    direct = LLM(str(store), **SMALL)
    prompt = "The capital of France is"
    assert (
        llm.generate(prompt, greedy, use_tqdm=False)[0].token_ids
        == direct.generate(prompt, greedy, use_tqdm=False)[0].token_ids
    )


def test_a_gguf_with_its_vision_tower_serves_its_text_model(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """Ollama keeps a multimodal model's tower and projector in the text model's own GGUF
    (llama.cpp puts them in an mmproj file, under the same v.*, a.* and mm.* names): they are
    left out, and the text model answers as the same file without them does."""
    import numpy as np

    hf = tiny_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    tower = {"v.blk.0.attn_q": np.ones((32, 32), np.float32),
             "v.patch_embd": np.ones((16, 3, 4, 4), np.float32),
             "a.blk.0.attn_k": np.ones((8, 32), np.float32),
             "mm.input_projection": np.ones((32, 64), np.float32)}  # fmt: skip
    with_tower, text_only = tmp_path / "with-tower.gguf", tmp_path / "text.gguf"
    write_gguf(with_tower, "llama", hf, tokenizer, rope_tensors=tower)
    write_gguf(text_only, "llama", hf, tokenizer)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    both = [LLM(str(path), **SMALL) for path in (with_tower, text_only)]
    answers = [llm.generate("The sea is", greedy, use_tqdm=False)[0] for llm in both]
    assert answers[0].token_ids == answers[1].token_ids
    assert both[0].engine.model_facts == both[1].engine.model_facts  # the tower not counted


def test_ollamas_gemma3_conversion_loads_as_llama_cpps(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Ollama's Gemma 3 file (its multimodal conversion) leaves out the norm's epsilon, the
    RoPE bases (the windowed layers' under its own name, rope.local.freq_base) and the layer
    pattern, and carries the vision tower: it answers as llama.cpp's form of the same
    weights, which says them all (Gemma 3's own values: 1e-6, 1e6 and 1e4, five windowed
    layers to one full; the windowed layers' base is not Gemma 3's 1e4 here, so that the file's
    own is seen read)."""
    import numpy as np

    layers = ["sliding_attention"] * 5 + ["full_attention"]
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}  # fmt: skip
    hf = tiny_hf_model(
        "gemma3", vocab_size=VOCAB, weight_std=0.15, hidden_size=128, intermediate_size=192,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        query_pre_attn_scalar=32, sliding_window=24, rope_parameters=rope, layer_types=layers,
        attn_implementation="eager", bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    llama_cpp, ollama = tmp_path / "llama-cpp.gguf", tmp_path / "ollama.gguf"
    pattern = [t == "sliding_attention" for t in layers]
    write_gguf(llama_cpp, "gemma3", hf, tokenizer, rope_freq_base=1e6,
               metadata={"attention.sliding_window": 24, "rope.freq_base_swa": 2e4,
                         "attention.sliding_window_pattern": pattern})  # fmt: skip
    write_gguf(ollama, "gemma3", hf, tokenizer, rope_freq_base=1e6, metadata={"attention.sliding_window": 24,
               "rope.local.freq_base": 2e4},
               omit=("attention.layer_norm_rms_epsilon", "rope.freq_base"),
               rope_tensors={"v.blk.0.attn_q": np.ones((32, 32), np.float32),
                             "mm.mm_input_projection": np.ones((32, 128), np.float32)})  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = "The capital of France is a city with " * 4  # past the 24-token window
    answers = [
        LLM(str(path), **SMALL).generate(prompt, greedy, use_tqdm=False)[0].token_ids
        for path in (llama_cpp, ollama)
    ]
    assert answers[0] == answers[1]
