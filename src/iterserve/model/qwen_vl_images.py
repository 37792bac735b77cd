"""Images for Qwen3-VL and Qwen2.5-VL checkpoints (HF form): the family's vision tower,
whose patch merger is its projector, transformers' own module with the checkpoint's
weights, and the text Qwen's processor gives an image in the prompt.

An image keeps its aspect ratio: it is resized to multiples of two patches (Qwen3-VL's 16
pixels, Qwen2.5-VL's 14, merged 2 x 2) within the processor's pixel bounds, and stands in
the prompt as one `<|image_pad|>` a merged patch, where the chat template wrote
`<|image_pad|>` between `<|vision_start|>` and `<|vision_end|>`. Attended causally. What
sets these families apart (the language model does it, model/llama.py):

- an image's tokens turn by grid positions (M-RoPE): the token at row r, column c of an
  image whose first rotary position is p by (p, p + r, p + c), and the text after the image
  goes on from p + max(rows, columns) (EncodedImage.grid; core/request.py PromptEmbeds);
- Qwen3-VL's DeepStack: the tower's rows from three of its middle layers, merged as the
  last ones are, are added to the image's positions after the language model's first three
  layers. An image's row holds them after its input row, side by side.

Qwen2.5-VL's tower attends within windows of 8 x 8 patches on most layers, the whole image
on a few; its rows come out in the image's row order (the module puts them back).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
    smart_resize,
)

from iterserve.model.images import (
    EncodedImage,
    built_in,
    family_config,
    has_image_processor,
    image_tokens,
    read_tower_weights,
)

# Each family's whole config and its tower, by the checkpoint's architecture.
FAMILIES: dict[str, tuple[type[Any], type[torch.nn.Module]]] = {
    "Qwen3VLForConditionalGeneration": (
        transformers.Qwen3VLConfig,
        transformers.Qwen3VLVisionModel,
    ),
    "Qwen2_5_VLForConditionalGeneration": (
        transformers.Qwen2_5_VLConfig,
        Qwen2_5_VisionTransformerPretrainedModel,
    ),
}


class QwenVLImages:
    bidirectional = False

    def __init__(
        self,
        config: Any,
        processor: Qwen2VLImageProcessorPil,
        marker: str,
        dtype: torch.dtype,
    ) -> None:
        self.processor = processor
        self.marker = marker
        self.image_token_id = config.image_token_id
        tower = next(tower for kind, tower in FAMILIES.values() if isinstance(config, kind))
        self.tower = built_in(tower, config.vision_config, dtype)
        self.dtype = dtype

    @property
    def parts(self) -> dict[str, torch.nn.Module]:
        """The tower and its mergers, where a checkpoint keeps them."""
        return {"visual.": self.tower}

    @classmethod
    def load(
        cls, directory: Path, raw: Mapping[str, Any], tokenizer: Any, dtype: torch.dtype
    ) -> QwenVLImages | None:
        """The checkpoint's tower, or None when it has no image processor to go with it."""
        if not has_image_processor(directory):
            return None
        (architecture,) = (name for name in raw.get("architectures") or [] if name in FAMILIES)
        config = family_config(FAMILIES[architecture][0], raw)
        (marker,) = image_tokens(tokenizer, [config.image_token_id], directory)
        processor = Qwen2VLImageProcessorPil.from_pretrained(directory, local_files_only=True)
        images = cls(config, processor, marker, dtype)
        read_tower_weights(directory, images.parts, dtype)
        return images

    @torch.inference_mode()
    def encode(self, image: Image.Image) -> EncodedImage:
        inputs = self.processor(images=[image.convert("RGB")], return_tensors="pt")
        grid_thw = inputs["image_grid_thw"]
        out = self.tower(inputs["pixel_values"].to(self.dtype), grid_thw=grid_thw)
        rows = torch.cat([out.pooler_output, *getattr(out, "deepstack_features", ())], dim=1)
        merge = self.processor.merge_size
        grid = (int(grid_thw[0, 1]) // merge, int(grid_thw[0, 2]) // merge)
        return EncodedImage(self.marker * len(rows), rows.contiguous(), grid)

    def placeholder(self, image: Image.Image) -> str:
        rows, columns = self._grid(image.height, image.width)
        return self.marker * (rows * columns)

    def cap_rows(self, most: int) -> int:
        factor = self.processor.patch_size * self.processor.merge_size
        size = self.processor.size
        longest = min(size.longest_edge, max(most, 1) * factor * factor)
        self.processor.size = type(size)(
            shortest_edge=min(size.shortest_edge, longest), longest_edge=longest
        )
        return longest // (factor * factor)

    def _grid(self, height: int, width: int) -> tuple[int, int]:
        """An image's merged patches as (rows, columns), by the processor's sizing rule."""
        p = self.processor
        factor = p.patch_size * p.merge_size
        size = p.size
        height, width = smart_resize(
            height, width, factor, min_pixels=size.shortest_edge, max_pixels=size.longest_edge
        )
        return height // factor, width // factor
