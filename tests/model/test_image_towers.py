"""A vision tower's weights read from a checkpoint under either naming: the released files'
(SigLIP's under `vision_tower.vision_model.`, as transformers 4 saved Gemma 3) and
transformers 5's own saves (`model.vision_tower.`, the module's names); an image's
placeholder text, by its size alone, is its encoding's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from iterserve.model.errors import ModelLoadError
from iterserve.model.images import read_tower_weights
from iterserve.model.loader import load_model
from tiny_qwen_vl import save_tiny_qwen3vl, save_tiny_qwen25vl
from tiny_vision import picture, save_tiny_gemma3, save_tiny_gemma4, save_tiny_mistral3

VISION = transformers.SiglipVisionConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    image_size=28, patch_size=14,
)  # fmt: skip
CONFIG = transformers.Gemma3Config(
    text_config=transformers.Gemma3TextConfig(hidden_size=64).to_dict(),
    vision_config=VISION.to_dict(),
    mm_tokens_per_image=4,
)


def _modules() -> dict[str, torch.nn.Module]:
    return {
        "vision_tower.": transformers.SiglipVisionModel(VISION),
        "multi_modal_projector.": Gemma3MultiModalProjector(CONFIG),
    }


@pytest.mark.parametrize("names", ["released", "transformers5"], ids=["released", "transformers5"])
def test_a_tower_reads_either_naming(tmp_path: Path, names: str) -> None:
    torch.manual_seed(0)
    saved = _modules()
    tensors = {}
    for prefix, module in saved.items():
        for key, value in module.state_dict().items():
            if names == "released":
                inner = "vision_model." if prefix == "vision_tower." else ""
                tensors[prefix + inner + key] = value.normal_()
            else:
                tensors["model." + prefix + key] = value.normal_()
    save_file(tensors, tmp_path / "model.safetensors")
    read = _modules()
    read_tower_weights(tmp_path, read, torch.float32)
    for prefix, module in read.items():
        for key, value in module.state_dict().items():
            torch.testing.assert_close(value, saved[prefix].state_dict()[key], rtol=0, atol=0)


def test_a_tower_of_other_shapes_is_refused(tmp_path: Path) -> None:
    save_file(
        {"vision_tower.vision_model.odd.weight": torch.ones(2)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(ModelLoadError, match="do not fit the model's SiglipVisionModel"):
        read_tower_weights(tmp_path, _modules(), torch.float32)


@pytest.mark.parametrize("family", ["mistral3", "gemma3", "gemma4", "qwen3vl", "qwen25vl"])
def test_an_images_placeholder_is_its_encodings_text(
    family: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    """What a prompt's tokens are counted by (the image's size alone) is the text its
    encoding stands as, at sizes under, at and over the tower's bound, odd and even."""
    save = {
        "mistral3": save_tiny_mistral3,
        "gemma3": save_tiny_gemma3,
        "gemma4": save_tiny_gemma4,
        "qwen3vl": save_tiny_qwen3vl,
        "qwen25vl": save_tiny_qwen25vl,
    }[family]
    images = load_model(save(tmp_path, tokenizer_dir), torch.float32).images
    assert images is not None
    for height, width in [(30, 30), (60, 41), (112, 112), (300, 97), (13, 250)]:
        image = picture(height, height, width)
        assert images.placeholder(image) == images.encode(image).text, (height, width)
