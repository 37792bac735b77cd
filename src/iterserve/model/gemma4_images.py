"""Images for Gemma 4 E2B and E4B checkpoints (HF form): Gemma 4's vision tower and its
multimodal embedder, transformers' own modules with the checkpoint's weights, and the text
Gemma's processor gives an image in the prompt.

An image keeps its aspect ratio: it is resized to the largest size whose 16-pixel patches
fit the soft-token budget (`max_soft_tokens` rows, 280 by default, each pooled from 3 x 3
patches), and stands in the prompt as its boi token, a soft token per row, its eoi token,
where the chat template wrote the image token. The E2B and E4B attend to an image
causally (llama.cpp says so too); the larger models' images attend both ways on their
windowed layers alone, which is not read here (their text is served, their images refused
by name). At an image's soft tokens
the per-layer embeddings are looked up as padding (transformers' rule: the language model,
model/llama.py, does it for any given rows)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image
from transformers.models.gemma4.image_processing_pil_gemma4 import (
    Gemma4ImageProcessorPil,
    get_aspect_ratio_preserving_size,
)
from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

from iterserve.model.images import (
    EncodedImage,
    TowerAndProjector,
    built_in,
    family_config,
    has_image_processor,
    image_tokens,
    read_tower_weights,
)

logger = logging.getLogger(__name__)

# The image's soft token (what the chat template writes), its start and its end, as Gemma 4's
# tokenizer names them (llama.cpp's too).
GEMMA4_TOKENS = ("<|image|>", "<|image>", "<image|>")
# The soft-token budgets Gemma 4's image processor takes (`max_soft_tokens`).
_BUDGETS = (70, 140, 280, 560, 1120)


class Gemma4Images(TowerAndProjector):
    bidirectional = False

    def __init__(
        self,
        config: transformers.Gemma4Config,
        processor: Gemma4ImageProcessorPil,
        tokens: tuple[str, str, str],
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.processor = processor
        self.marker, self.boi, self.eoi = tokens
        self.image_token_id = config.image_token_id
        self.tower = built_in(transformers.Gemma4VisionModel, config.vision_config, dtype)
        self.projector = Gemma4MultimodalEmbedder(config.vision_config, config.text_config)
        self.projector = self.projector.to(dtype).eval()
        self.dtype = dtype

    @property
    def parts(self) -> dict[str, torch.nn.Module]:
        return {"vision_tower.": self.tower, "embed_vision.": self.projector}

    @classmethod
    def load(
        cls, directory: Path, raw: Mapping[str, Any], tokenizer: Any, dtype: torch.dtype
    ) -> Gemma4Images | None:
        """The checkpoint's tower, or None when it has no image processor to go with it."""
        if not has_image_processor(directory):
            return None
        config = family_config(transformers.Gemma4Config, raw)
        if config.vision_config is None:
            return None
        if (both_ways := config.text_config.use_bidirectional_attention) is not None:
            logger.warning(
                "%s: this Gemma 4's images attend both ways on its windowed layers "
                "(use_bidirectional_attention %r), which is not read here: its text is "
                "served, its images refused",
                directory, both_ways,
            )  # fmt: skip
            return None
        tokens = image_tokens(
            tokenizer, [config.image_token_id, config.boi_token_id, config.eoi_token_id], directory
        )
        processor = Gemma4ImageProcessorPil.from_pretrained(directory, local_files_only=True)
        images = cls(config, processor, (tokens[0], tokens[1], tokens[2]), dtype)
        read_tower_weights(directory, images.parts, dtype)
        return images

    @torch.inference_mode()
    def encode(self, image: Image.Image) -> EncodedImage:
        inputs = self.processor(images=[image.convert("RGB")], return_tensors="pt")
        out = self.tower(
            pixel_values=inputs["pixel_values"].to(self.dtype),
            pixel_position_ids=inputs["image_position_ids"],
        )
        rows = self.projector(out.last_hidden_state)  # the padding patches left out already
        return EncodedImage(self._layout(len(rows)), rows.contiguous())

    def placeholder(self, image: Image.Image) -> str:
        p = self.processor
        height, width = get_aspect_ratio_preserving_size(
            image.height, image.width, p.patch_size,
            p.max_soft_tokens * p.pooling_kernel_size**2, p.pooling_kernel_size,
        )  # fmt: skip
        return self._layout(height * width // (p.patch_size * p.pooling_kernel_size) ** 2)

    def cap_rows(self, most: int) -> int:
        # The processor takes five budgets; the largest that fits, else the smallest.
        fitting = [n for n in _BUDGETS if n <= most] or [_BUDGETS[0]]
        self.processor.max_soft_tokens = min(max(fitting), self.processor.max_soft_tokens)
        return self.processor.max_soft_tokens

    def _layout(self, rows: int) -> str:
        return f"{self.boi}{self.marker * rows}{self.eoi}"
