"""Images for Mistral 3 checkpoints (Ministral 3 3B/8B/14B, Mistral Small 3.1/3.2): Pixtral's
vision tower and Mistral 3's projector, transformers' own modules with the checkpoint's
weights, and the layout Mistral's processor gives an image in the prompt.

An image is resized by the checkpoint's image processor to multiples of a merged patch
(patch_size x spatial_merge_size pixels; at most `longest_edge` on its longer side); each
merged patch is one row, and the prompt holds the image as rows of [IMG] tokens, each row
ended by [IMG_BREAK] and the last by [IMG_END]. The rows are computed per image: the tower
attends within an image only, so a prompt's images are the same rows alone or together."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image
from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

from iterserve.model.errors import ModelLoadError
from iterserve.model.images import EncodedImage
from iterserve.model.safetensors_file import stored_tensors

# Where a checkpoint keeps the tower and the projector (released files; transformers 5's
# own saves put them under model.), and the names the modules here take them by.
_PARTS = {
    "vision_tower.": "tower",
    "model.vision_tower.": "tower",
    "multi_modal_projector.": "projector",
    "model.multi_modal_projector.": "projector",
}
_BREAK, _END = "[IMG_BREAK]", "[IMG_END]"


class PixtralImages:
    marker = "[IMG]"

    def __init__(
        self,
        config: transformers.Mistral3Config,
        processor: PixtralImageProcessorPil,
        token_ids: tuple[int, int, int],
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.processor = processor
        self.image_token_id, self.break_id, self.end_id = token_ids
        self.merged_patch = config.vision_config.patch_size * config.spatial_merge_size
        self.tower = transformers.PixtralVisionModel(config.vision_config).to(dtype).eval()
        self.projector = Mistral3MultiModalProjector(config).to(dtype).eval()
        self.dtype = dtype

    @classmethod
    def load(
        cls, directory: Path, raw: Mapping[str, Any], tokenizer: Any, dtype: torch.dtype
    ) -> PixtralImages | None:
        """The checkpoint's tower, or None when it has no image processor to go with it
        (preprocessor_config.json)."""
        if not (directory / "preprocessor_config.json").exists():
            return None
        config = transformers.Mistral3Config(**{k: v for k, v in raw.items() if k != "model_type"})
        processor = PixtralImageProcessorPil.from_pretrained(directory, local_files_only=True)
        ids = [config.image_token_id, *tokenizer.convert_tokens_to_ids([_BREAK, _END])]
        if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids[1:]):
            raise ModelLoadError(f"{directory}: the tokenizer has no {_BREAK} or {_END} token")
        images = cls(config, processor, (ids[0], ids[1], ids[2]), dtype)
        images._read_weights(directory)
        return images

    def _read_weights(self, directory: Path) -> None:
        found: dict[str, dict[str, torch.Tensor]] = {"tower": {}, "projector": {}}
        for path in sorted(directory.glob("*.safetensors")):
            for name, stored in stored_tensors(path).items():
                for prefix, part in _PARTS.items():
                    if name.startswith(prefix):
                        found[part][name.removeprefix(prefix)] = stored.read().to(self.dtype)
        for part, module in (("tower", self.tower), ("projector", self.projector)):
            missing, unexpected = module.load_state_dict(found[part], strict=False)
            if missing or unexpected:
                raise ModelLoadError(
                    f"{directory}: the vision {part}'s weights do not fit Mistral 3's "
                    f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
                )

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
        height, width = (int(n) // self.merged_patch for n in sizes[0])
        token_ids = ([self.image_token_id] * width + [self.break_id]) * height
        token_ids[-1] = self.end_id
        return EncodedImage(tuple(token_ids), rows.contiguous())
