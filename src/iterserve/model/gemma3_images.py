"""Images for Gemma 3 checkpoints (4B, 12B, 27B in the HF form): SigLIP's tower and Gemma 3's
projector, transformers' own modules with the checkpoint's weights, and the text Gemma's
processor gives an image in the prompt.

An image is resized to the tower's square (896 pixels in the releases; no pan and scan),
its patches pooled to `mm_tokens_per_image` rows (256), and stands in the prompt as
"\n\n<start_of_image>", a soft token per row, "<end_of_image>\n\n" where the chat template
wrote <start_of_image>. An image's soft tokens attend to each other both ways (transformers
ORs each image's block into the causal mask), so a prompt chunk never ends inside one."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from iterserve.model.images import (
    EncodedImage,
    TowerAndProjector,
    built_in,
    family_config,
    has_image_processor,
    image_tokens,
    read_tower_weights,
)


class Gemma3Images(TowerAndProjector):
    bidirectional = True

    def __init__(
        self,
        config: transformers.Gemma3Config,
        processor: Gemma3ImageProcessorPil,
        tokens: tuple[str, str, str],
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.processor = processor
        self.marker, end, soft = tokens
        self.image_token_id = config.image_token_id
        self.text = f"\n\n{self.marker}{soft * config.mm_tokens_per_image}{end}\n\n"
        self.tower = built_in(transformers.SiglipVisionModel, config.vision_config, dtype)
        self.projector = Gemma3MultiModalProjector(config).to(dtype).eval()
        self.dtype = dtype

    @classmethod
    def load(
        cls, directory: Path, raw: Mapping[str, Any], tokenizer: Any, dtype: torch.dtype
    ) -> Gemma3Images | None:
        """The checkpoint's tower, or None when it has no image processor to go with it."""
        if not has_image_processor(directory):
            return None
        config = family_config(transformers.Gemma3Config, raw)
        tokens = image_tokens(
            tokenizer, [config.boi_token_id, config.eoi_token_id, config.image_token_id], directory
        )
        processor = Gemma3ImageProcessorPil.from_pretrained(directory, local_files_only=True)
        images = cls(config, processor, (tokens[0], tokens[1], tokens[2]), dtype)
        read_tower_weights(directory, images.parts, dtype)
        return images

    def placeholder(self, image: Image.Image) -> str:
        return self.text  # every image is resized to the tower's square

    def cap_rows(self, most: int) -> int:
        return self.config.mm_tokens_per_image  # the tower's square, pooled: fixed

    @torch.inference_mode()
    def encode(self, image: Image.Image) -> EncodedImage:
        inputs = self.processor(images=[image.convert("RGB")], return_tensors="pt")
        out = self.tower(pixel_values=inputs["pixel_values"].to(self.dtype))
        rows = self.projector(out.last_hidden_state)[0]
        return EncodedImage(self.text, rows.contiguous())
