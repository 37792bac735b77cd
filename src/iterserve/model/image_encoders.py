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
    if "Mistral3ForConditionalGeneration" in (raw.get("architectures") or []):
        from iterserve.model.pixtral_images import PixtralImages

        return PixtralImages.load(directory, raw, tokenizer, dtype)
    return None
