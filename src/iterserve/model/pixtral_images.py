"""Images for Mistral 3 checkpoints (Ministral 3 3B/8B/14B, Mistral Small 3.1/3.2): Pixtral's
vision tower and Mistral 3's projector, transformers' own modules with the checkpoint's
weights, and the layout Mistral's processor gives an image in the prompt.

An image is resized by the checkpoint's image processor to multiples of a merged patch
(patch_size x spatial_merge_size pixels; at most `longest_edge` on its longer side); each
merged patch is one row, and the prompt holds the image as rows of [IMG] tokens, each row
ended by [IMG_BREAK] and the last by [IMG_END]. The rows are computed per image: the tower
attends within an image only, so a prompt's images are the same rows alone or together."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from transformers.image_utils import ChannelDimension
from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector
from transformers.models.pixtral.image_processing_pil_pixtral import (
    PixtralImageProcessorPil,
    get_resize_output_image_size,
)

from iterserve.model.errors import ModelLoadError
from iterserve.model.images import (
    EncodedImage,
    TowerAndProjector,
    built_in,
    family_config,
    has_image_processor,
    read_tower_weights,
)

# The image's token, a row's end, the image's end.
PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
_BREAK, _END = PIXTRAL_TOKENS[1:]


class PixtralImages(TowerAndProjector):
    marker = PIXTRAL_TOKENS[0]
    bidirectional = False

    def __init__(
        self,
        config: transformers.Mistral3Config,
        processor: PixtralImageProcessorPil,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.processor = processor
        self.image_token_id = config.image_token_id
        self.merged_patch = config.vision_config.patch_size * config.spatial_merge_size
        self.tower = built_in(transformers.PixtralVisionModel, config.vision_config, dtype)
        self.projector = Mistral3MultiModalProjector(config).to(dtype).eval()
        self.dtype = dtype

    @classmethod
    def load(
        cls, directory: Path, raw: Mapping[str, Any], tokenizer: Any, dtype: torch.dtype
    ) -> PixtralImages | None:
        """The checkpoint's tower, or None when it has no image processor to go with it."""
        if not has_image_processor(directory):
            return None
        config = family_config(transformers.Mistral3Config, raw)
        processor = PixtralImageProcessorPil.from_pretrained(directory, local_files_only=True)
        ids = tokenizer.convert_tokens_to_ids([cls.marker, _BREAK, _END])
        if ids[0] != config.image_token_id or any(
            not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids
        ):
            raise ModelLoadError(
                f"{directory}: the tokenizer's {cls.marker}, {_BREAK} and {_END} are not the "
                f"model's image tokens ({ids}; image_token_id {config.image_token_id})"
            )
        images = cls(config, processor, dtype)
        read_tower_weights(directory, images.parts, dtype)
        return images

    @torch.inference_mode()
    def encode(self, image: Image.Image) -> EncodedImage:
        inputs = self.processor(
            images=[image.convert("RGB")], patch_size=self.merged_patch, return_tensors="pt"
        )
        pixels, sizes = inputs["pixel_values"].to(self.dtype), inputs["image_sizes"]
        out = self.tower(pixels, image_sizes=sizes, output_hidden_states=True)
        layer = self.config.vision_feature_layer
        layers = [layer] if isinstance(layer, int) else list(layer)
        features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        rows = self.projector(features.squeeze(0), sizes)
        height, width = (int(n) for n in sizes[0])
        return EncodedImage(self._layout(height, width), rows.contiguous())

    def placeholder(self, image: Image.Image) -> str:
        # The processor's own sizing rule, given a stand-in of the image's shape (it reads
        # the shape alone): no pixels converted or resized.
        longest = self.processor.size["longest_edge"]
        shape = np.broadcast_to(np.uint8(0), (3, image.height, image.width))
        height, width = get_resize_output_image_size(
            shape, (longest, longest), self.merged_patch, ChannelDimension.FIRST
        )
        return self._layout(height, width)

    def cap_rows(self, most: int) -> int:
        # A square image is the largest: its side cut to fit `most` merged patches.
        side = math.isqrt(most) * self.merged_patch  # most >= 1 (EngineConfig checks)
        longest = min(side, self.processor.size["longest_edge"])
        self.processor.size = {"longest_edge": longest}
        return (longest // self.merged_patch) ** 2

    def _layout(self, height: int, width: int) -> str:
        """An image resized to `height` x `width` pixels: a row of markers per merged patch
        row, each ended by [IMG_BREAK], the last by [IMG_END]."""
        rows, columns = height // self.merged_patch, width // self.merged_patch
        text = (self.marker * columns + _BREAK) * rows
        return text.removesuffix(_BREAK) + _END
