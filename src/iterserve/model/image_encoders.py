"""Which family's vision tower reads a multimodal checkpoint's images (model/images.py says
what an image becomes)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from iterserve.model.images import ImageEncoder


def load_image_encoder(
    directory: Path, raw: Mapping[str, Any], tokenizer: Any, dtype: torch.dtype
) -> ImageEncoder | None:
    """The vision tower of an HF multimodal checkpoint (`raw`: its whole config.json), or
    None for a family whose images are not read here (its text is served all the same)."""
    architectures = raw.get("architectures") or []
    if "Mistral3ForConditionalGeneration" in architectures:
        from iterserve.model.pixtral_images import PixtralImages

        return PixtralImages.load(directory, raw, tokenizer, dtype)
    if "Gemma3ForConditionalGeneration" in architectures:
        from iterserve.model.gemma3_images import Gemma3Images

        return Gemma3Images.load(directory, raw, tokenizer, dtype)
    if "Gemma4ForConditionalGeneration" in architectures:
        from iterserve.model.gemma4_images import Gemma4Images

        return Gemma4Images.load(directory, raw, tokenizer, dtype)
    if {"Qwen3VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"} & set(
        architectures
    ):
        from iterserve.model.qwen_vl_images import QwenVLImages

        return QwenVLImages.load(directory, raw, tokenizer, dtype)
    return None
