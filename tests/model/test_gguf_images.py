"""A Gemma 3 GGUF and a Mistral 3 one, each with its vision projector file (llama.cpp's
`--mmproj`): the tower and projector read from llama.cpp's names and metadata answer a
prompt with images as the same weights do from their HF checkpoint (fp32); a file that is
not a projector read here, or not the model's, is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import constants
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from hub_cache import cache_repo
from iterserve import LLM, SamplingParams
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_images import load_mmproj
from iterserve.model.loader import load_model
from iterserve.sampling_params import InvalidRequestError
from ollama_store_files import pull
from tiny_families import gguf_metadata
from tiny_gguf import gemma4_rope_freqs, write_gguf
from tiny_qwen_vl import (
    QWEN3VL_MARKER,
    llama_cpp_pixels,
    save_tiny_qwen3vl,
    save_tiny_qwen25vl,
    write_qwen3vl_mmproj,
    write_qwen25vl_mmproj,
)
from tiny_vision import (
    ollama_gemma3_tower,
    picture,
    save_tiny_gemma3,
    save_tiny_gemma4,
    save_tiny_mistral3,
    write_gemma3_mmproj,
    write_gemma4_mmproj,
    write_pixtral_mmproj,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# No punctuation right after an image: the test GGUF's tokenizer (tiny_gguf, a "default"
# pre-tokenizer) splits "\n\n," otherwise than the bundled tokenizer.json does.
PROMPT = "<s>user: {image} and {image} which one?\nassistant:"


def _text_gguf(
    directory: Path,
    whole: transformers.PreTrainedModel,
    causal_lm: type[transformers.PreTrainedModel],
    arch: str,
    rope_base: float,
    name: str = "text.gguf",
    tower: tuple[dict, dict] = ({}, {}),
    rope_tensors: dict | None = None,
) -> Path:
    """The multimodal checkpoint's language model as a GGUF of `arch` beside it; `tower`:
    keys and tensors of a tower kept in the same file."""
    text = causal_lm(whole.config.text_config)
    text.model.load_state_dict(whole.model.language_model.state_dict())
    text.lm_head.load_state_dict(whole.lm_head.state_dict())
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(directory)
    metadata, _ = gguf_metadata(text)
    path = directory.parent / name
    keys, tensors = tower
    write_gguf(
        path, arch, text.eval(), tokenizer, rope_freq_base=rope_base,
        metadata={**metadata, **keys}, extra_tensors=tensors, rope_tensors=rope_tensors,
    )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def gemma3_files(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[Path, ...]:
    out = tmp_path_factory.mktemp("gemma3-gguf")
    directory = save_tiny_gemma3(out / "hf", tokenizer_dir)
    whole = transformers.Gemma3ForConditionalGeneration.from_pretrained(directory).eval()
    text = _text_gguf(directory, whole, transformers.Gemma3ForCausalLM, "gemma3", 1e6)
    write_gemma3_mmproj(out / "mmproj.gguf", whole)
    tower = ollama_gemma3_tower(whole)
    _text_gguf(
        directory, whole, transformers.Gemma3ForCausalLM, "gemma3", 1e6, "ollama.gguf", tower
    )
    keys_alone = (tower[0], {})  # a tower this reader cannot read: the text is served
    _text_gguf(
        directory, whole, transformers.Gemma3ForCausalLM, "gemma3", 1e6, "odd.gguf", keys_alone
    )
    return directory, text, out / "mmproj.gguf"


@pytest.fixture(scope="module")
def mistral3_files(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[Path, ...]:
    out = tmp_path_factory.mktemp("mistral3-gguf")
    directory = save_tiny_mistral3(out / "hf", tokenizer_dir)
    whole = transformers.Mistral3ForConditionalGeneration.from_pretrained(directory).eval()
    rope = whole.config.text_config.rope_parameters["rope_theta"]
    text = _text_gguf(directory, whole, transformers.Ministral3ForCausalLM, "mistral3", rope)
    write_pixtral_mmproj(out / "mmproj.gguf", whole, directory)
    return directory, text, out / "mmproj.gguf"


@pytest.fixture(scope="module")
def gemma4_files(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[Path, ...]:
    out = tmp_path_factory.mktemp("gemma4-gguf")
    # The processor's default budget (280 rows), which a projector file does not say.
    directory = save_tiny_gemma4(out / "hf", tokenizer_dir, max_soft_tokens=280)
    whole = transformers.Gemma4ForConditionalGeneration.from_pretrained(directory).eval()
    freqs = {"rope_freqs": gemma4_rope_freqs(whole.config.text_config)}
    text = _text_gguf(
        directory, whole, transformers.Gemma4ForCausalLM, "gemma4", 1e6, rope_tensors=freqs
    )
    write_gemma4_mmproj(out / "mmproj.gguf", whole)
    return directory, text, out / "mmproj.gguf"


@pytest.fixture(scope="module")
def qwen3vl_files(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[Path, ...]:
    out = tmp_path_factory.mktemp("qwen3vl-gguf")
    # llama.cpp's bounds on an image, which a projector file does not say.
    directory = save_tiny_qwen3vl(out / "hf", tokenizer_dir, llama_cpp_pixels(32))
    whole = transformers.Qwen3VLForConditionalGeneration.from_pretrained(directory).eval()
    section = whole.config.text_config.rope_parameters["mrope_section"]
    keys = {"rope.dimension_sections": [*section, 0], "n_deepstack_layers": 2}

    def qwen3(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config.to_dict()))

    base = whole.config.text_config.rope_parameters["rope_theta"]
    text = _text_gguf(directory, whole, qwen3, "qwen3vl", base, tower=(keys, {}))
    write_qwen3vl_mmproj(out / "mmproj.gguf", whole, directory)
    return directory, text, out / "mmproj.gguf"


@pytest.fixture(scope="module")
def qwen25vl_files(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> tuple[Path, ...]:
    """A Qwen2.5-VL as its released files are, and its language model as llama.cpp's
    `qwen2vl` GGUF beside its projector file. Its processor takes llama.cpp's bounds."""
    out = tmp_path_factory.mktemp("qwen25vl-gguf")
    directory = save_tiny_qwen25vl(out / "hf", tokenizer_dir)
    Qwen2VLImageProcessorPil(patch_size=14, size=llama_cpp_pixels(28)).save_pretrained(directory)
    whole = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(directory).eval()
    section = whole.config.text_config.rope_parameters["mrope_section"]
    keys = {"rope.dimension_sections": [*section, 0]}

    def qwen2(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config.to_dict()))

    base = whole.config.text_config.rope_parameters["rope_theta"]
    text = _text_gguf(directory, whole, qwen2, "qwen2vl", base, tower=(keys, {}))
    write_qwen25vl_mmproj(out / "mmproj.gguf", whole, directory)
    return directory, text, out / "mmproj.gguf"


@pytest.mark.parametrize(
    ("family", "marker"),
    [
        ("gemma3_files", "<start_of_image>"),
        ("mistral3_files", "[IMG]"),
        ("gemma4_files", "<|image|>"),
        ("qwen3vl_files", QWEN3VL_MARKER),
        ("qwen25vl_files", QWEN3VL_MARKER),
    ],
)
def test_a_gguf_and_its_mmproj_answer_as_the_hf_checkpoint(
    family: str, marker: str, request: pytest.FixtureRequest
) -> None:
    directory, text, mmproj = request.getfixturevalue(family)
    prompt = {
        "prompt": PROMPT.format(image=marker),
        "multi_modal_data": {"image": [picture(4, 70, 40), picture(5, 30, 30)]},
    }
    from_hf = LLM(str(directory), dtype="float32", compile=False)
    from_gguf = LLM(str(text), mmproj=str(mmproj), dtype="float32", compile=False)
    want = from_hf.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert from_gguf.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


def test_ollamas_gemma3_file_reads_its_own_tower(gemma3_files: tuple[Path, ...]) -> None:
    """A Gemma 3 GGUF that keeps its tower as Ollama keeps it (its names and keys, in the
    model's own file) answers images as the HF checkpoint, with no --mmproj; with
    --no-mmproj-auto it serves text alone and refuses images by name, as it does when the
    tower cannot be read."""
    directory, text, _ = gemma3_files
    ollama = text.parent / "ollama.gguf"
    import gguf

    names = {tensor.name for tensor in gguf.GGUFReader(ollama).tensors}
    assert {"v.patch_embedding.weight", "v.blk.1.attn_output.weight", "v.blk.0.mlp.fc2.bias",
            "v.post_layernorm.weight", "mm.mm_input_projection.weight",
            "mm.mm_soft_emb_norm.weight"} <= names  # fmt: skip
    prompt = {
        "prompt": PROMPT.format(image="<start_of_image>"),
        "multi_modal_data": {"image": [picture(4, 70, 40), picture(5, 30, 30)]},
    }
    from_hf = LLM(str(directory), dtype="float32", compile=False)
    want = from_hf.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    from_ollama = LLM(str(ollama), dtype="float32", compile=False)
    assert from_ollama.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    for path, auto in ((ollama, False), (text.parent / "odd.gguf", True)):
        text_only = LLM(str(path), dtype="float32", compile=False, mmproj_auto=auto)
        with pytest.raises(InvalidRequestError, match="images"):
            text_only.generate(prompt, GREEDY, use_tqdm=False)
        assert text_only.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_a_projector_that_comes_with_the_model_is_read(
    gemma3_files: tuple[Path, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As llama-server's --mmproj-auto: a GGUF repository's mmproj file in the Hugging Face
    cache, and an Ollama model's projector layer, come with the model named."""
    directory, text, mmproj = gemma3_files
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    files = {"tiny-gemma3-F32.gguf": text, "mmproj-tiny-gemma3-F16.gguf": mmproj}
    cache_repo(tmp_path / "hub", "acme/tiny-gemma3-GGUF", files)
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "ollama"))
    pull(tmp_path / "ollama", "registry.ollama.ai/library/seeing/latest", text, projector=mmproj)
    prompt = {
        "prompt": PROMPT.format(image="<start_of_image>"),
        "multi_modal_data": {"image": [picture(4, 70, 40), picture(5, 30, 30)]},
    }
    want = (
        LLM(str(directory), dtype="float32", compile=False)
        .generate(prompt, GREEDY, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    for name in ("acme/tiny-gemma3-GGUF", "seeing"):
        named = LLM(name, dtype="float32", compile=False)
        assert named.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


def _header_only(path: Path, **keys: str | int) -> Path:
    """A projector file of metadata alone (clip.NAME: value)."""
    import gguf

    writer = gguf.GGUFWriter(path, "clip")
    for name, value in keys.items():
        if isinstance(value, str):
            writer.add_string(f"clip.{name}", value)
        else:
            writer.add_uint32(f"clip.{name}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_what_is_not_a_projector_of_the_model_is_refused(
    gemma3_files: tuple[Path, ...], mistral3_files: tuple[Path, ...], tmp_path: Path
) -> None:
    _, text, _ = gemma3_files
    loaded = load_model(text, torch.float32)

    def load(path: Path) -> object:
        return load_mmproj(path, loaded.config, loaded.tokenizer, torch.float32)

    with pytest.raises(ModelLoadError, match="not a vision projector"):
        load(text)
    with pytest.raises(ModelLoadError, match="a 'qwen2vl_merger' projector; those read here"):
        load(_header_only(tmp_path / "other.gguf", projector_type="qwen2vl_merger"))
    with pytest.raises(ModelLoadError, match="its rows are 32 wide and the model's 64"):
        narrow = {"projector_type": "gemma3", "vision.projection_dim": 32}
        load(_header_only(tmp_path / "narrow.gguf", **narrow))
    with pytest.raises(ModelLoadError, match=r"no \[IMG\].*beside it a Mistral 3"):
        load(mistral3_files[2])  # Mistral's projector beside a Gemma
