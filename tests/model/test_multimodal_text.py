"""The language model of a multimodal checkpoint (Gemma 3 4B and up, Ministral 3, Mistral Small
3.1: `*ForConditionalGeneration` with a vision tower) read from its HF directory as the text
model it holds: the same logits as transformers' whole model given text alone, its vision
tensors left unread."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
import transformers

from iterserve.model.errors import ModelLoadError
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import load_model, text_model_config
from paged_runner import PagedRunner
from tiny_checkpoints import save_checkpoint
from tiny_families import MINISTRAL3_ROPE, family_checkpoint, family_model, gemma4_model
from tiny_gguf import write_gguf
from tiny_vision import TEXT_SHAPE

VOCAB = 49152  # the bundled tokenizer's
TEXT = dict(**TEXT_SHAPE, vocab_size=VOCAB, max_position_embeddings=256)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


def _gemma3() -> transformers.PreTrainedModel:
    text = transformers.Gemma3TextConfig(**TEXT, sliding_window=16)
    vision = transformers.SiglipVisionConfig(**VISION)
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )
    return transformers.Gemma3ForConditionalGeneration(config)


def _ministral3() -> transformers.PreTrainedModel:
    text = transformers.Ministral3Config(**TEXT, rope_parameters=dict(MINISTRAL3_ROPE))
    vision = transformers.PixtralVisionConfig(**VISION)
    config = transformers.Mistral3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False
    )
    return transformers.Mistral3ForConditionalGeneration(config)


def _qwen3_vl() -> transformers.PreTrainedModel:
    rope = {
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_section": [6, 5, 5],  # of a head's 16 frequencies: time, height, width
        "mrope_interleaved": True,
    }
    text = transformers.Qwen3VLTextConfig(**TEXT, rope_parameters=rope)
    vision = transformers.models.qwen3_vl.Qwen3VLVisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=TEXT["hidden_size"],
        deepstack_visual_indexes=[0],
    )
    config = transformers.Qwen3VLConfig(text_config=text.to_dict(), vision_config=vision.to_dict())
    return transformers.Qwen3VLForConditionalGeneration(config)


def _gemma4_26b() -> transformers.PreTrainedModel:
    """26B-A4B's form as released: its experts in stacks under model.language_model."""
    text = gemma4_model("26b").config
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    config = transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None
    )
    return transformers.Gemma4ForConditionalGeneration(config)


@pytest.mark.parametrize(
    "make",
    [_gemma3, _ministral3, _qwen3_vl, _gemma4_26b],
    ids=["gemma3", "ministral3", "qwen3_vl", "gemma4_26b"],
)
def test_a_multimodal_checkpoint_serves_its_language_model(
    make: object, tmp_path: Path, tokenizer_dir: Path
) -> None:
    torch.manual_seed(0)
    hf = make().eval()  # type: ignore[operator]
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.normal_(0.0, 0.1) if "norm" not in name else param.uniform_(0.7, 1.3)
    directory = save_checkpoint(hf, tmp_path, tokenizer_dir)
    loaded = load_model(directory, torch.float32)
    text_type = hf.config.text_config.model_type
    families = {"gemma3_text": "gemma3", "qwen3_vl_text": "qwen3", "gemma4_text": "gemma4"}
    assert loaded.config.architecture == families.get(text_type, text_type)
    assert not [n for n in loaded.weights if "vision" in n or "projector" in n]
    assert loaded.config.tie_word_embeddings == hf.config.tie_word_embeddings
    model = LlamaForCausalLM(loaded.config, torch.float32, torch.device("cpu"))
    model.load(loaded.weights, "torch")
    runner = PagedRunner(model, block_size=8, num_blocks=32)
    rng = random.Random(3)
    tokens = [rng.randrange(100, 40000) for _ in range(60)]  # no image token among them
    runner.add("s", tokens)
    got = torch.cat([runner.step([("s", n)])["s"] for n in (40, 20)])
    with torch.inference_mode():
        want = hf(input_ids=torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_multimodal_checkpoint_of_another_language_model_is_refused() -> None:
    raw = {
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": {"model_type": "llama4_text"},
    }
    with pytest.raises(ModelLoadError, match="'llama4_text' is not supported"):
        text_model_config(raw)
    assert text_model_config({"architectures": ["MistralForCausalLM"]}) is None


def test_a_qwen3_vl_gguf_reads_as_qwen3(tmp_path: Path, tokenizer_dir: Path) -> None:
    """llama.cpp's Qwen3-VL language model (qwen3vl: Qwen3's tensors, M-RoPE's sections and
    the deepstack layers' count for images): the Qwen3 file's config and weights, and its
    frequencies split between an image's grid positions, taking turns (llama.cpp's IMROPE)."""
    hf = family_model("qwen3")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    path = tmp_path / "tiny-vl.gguf"
    images = {"rope.dimension_sections": [12, 10, 10, 0], "n_deepstack_layers": 3}
    write_gguf(path, "qwen3vl", hf, tokenizer, metadata=images)
    vl = load_model(path, torch.float32)
    plain = load_model(family_checkpoint("f32", hf, tmp_path, tokenizer_dir), torch.float32)
    assert vl.config == dataclasses.replace(
        plain.config, mrope_section=(12, 10, 10), mrope_interleaved=True
    )
    assert set(vl.weights) == set(plain.weights)
    for name, tensor in plain.weights.items():
        torch.testing.assert_close(vl.weights[name], tensor, rtol=0, atol=0, msg=name)
