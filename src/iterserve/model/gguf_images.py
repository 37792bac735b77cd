"""A vision projector file as llama.cpp writes one (`mmproj-*.gguf`, `--mmproj`): the tower
and projector of the model beside it, made into the family's image encoder
(model/images.py). Gemma 3's (`clip.projector_type` gemma3) is read.

The file's tensors carry llama.cpp's names (`v.blk.N.attn_q`, `mm.input_projection`), which
the gguf package's own map (the converter's) gives for each of transformers' names; the
image's preparation comes from the file's metadata (`clip.vision.image_size`, its mean and
deviation), and the image tokens from the model's tokenizer. Gemma's projector norm is
stored as 1 + w (llama.cpp's converter adds the one Gemma's RMS norm adds at run time)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import torch
import transformers
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.gemma3_images import Gemma3Images
from iterserve.model.gguf_loader import GGUFTensorInfo, read_gguf_header, read_gguf_tensor
from iterserve.model.images import ImageEncoder

_GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
# llama.cpp's default: 64 x 64 patches pooled 4 x 4, 256 rows (Gemma 3 4B-27B).
_GEMMA3_POOL = 4


def load_mmproj(path: Path, text: ModelConfig, tokenizer: Any, dtype: torch.dtype) -> ImageEncoder:
    metadata, tensors = read_gguf_header(path)
    if metadata.get("general.architecture") != "clip":
        raise ModelLoadError(
            f"{path} is not a vision projector (its architecture is "
            f"{metadata.get('general.architecture')!r}, not clip)"
        )
    kind = metadata.get("clip.projector_type")
    if kind != "gemma3":
        raise ModelLoadError(f"{path}: a {kind!r} projector; Gemma 3's (gemma3) is read here")
    return _gemma3(path, metadata, tensors, text, tokenizer, dtype)


def _gemma3(
    path: Path,
    metadata: dict[str, Any],
    tensors: dict[str, GGUFTensorInfo],
    text: ModelConfig,
    tokenizer: Any,
    dtype: torch.dtype,
) -> Gemma3Images:
    def key(name: str) -> Any:
        if (value := metadata.get(f"clip.vision.{name}")) is None:
            raise ModelLoadError(f"{path}: clip.vision.{name} is missing")
        return value

    size, patch = int(key("image_size")), int(key("patch_size"))
    vision = transformers.SiglipVisionConfig(
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=int(key("attention.head_count")),
        image_size=size,
        patch_size=patch,
        layer_norm_eps=float(key("attention.layer_norm_epsilon")),
        vision_use_head=False,  # SigLIP's pooling head: not Gemma's (nor in the file)
    )
    pool = int(metadata.get("clip.vision.projector.scale_factor", _GEMMA3_POOL))
    ids = tokenizer.convert_tokens_to_ids(list(_GEMMA3_TOKENS))
    if any(not isinstance(i, int) or i == tokenizer.unk_token_id for i in ids):
        raise ModelLoadError(
            f"{path}: the model's tokenizer has no {', '.join(_GEMMA3_TOKENS)}: is the model "
            "beside it a Gemma 3?"
        )
    config = transformers.Gemma3Config(
        text_config={"hidden_size": text.hidden_size},
        vision_config=vision.to_dict(),
        mm_tokens_per_image=(size // patch // pool) ** 2,
        boi_token_index=ids[0],
        eoi_token_index=ids[1],
        image_token_index=ids[2],
    )
    processor = Gemma3ImageProcessorPil(
        size={"height": size, "width": size},
        image_mean=list(key("image_mean")),
        image_std=list(key("image_std")),
    )
    images = Gemma3Images(config, processor, _GEMMA3_TOKENS, dtype)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for prefix, module in images.parts.items():
        state = {}
        for name in module.state_dict():
            # transformers' name as the converter reads it: SigLIP's under vision_model.,
            # the projector's parameter named as a module's weight.
            theirs = (f"{prefix}vision_model." if prefix == "vision_tower." else prefix) + name
            theirs = theirs.replace("_projection_weight", "_projection.weight")
            found = names.get_name(theirs, try_suffixes=(".weight", ".bias"))
            if found is None or found not in tensors:
                raise ModelLoadError(f"{path}: no tensor for {theirs} ({found or 'unmapped'})")
            value = read_gguf_tensor(tensors[found]).float()
            if name.endswith("soft_emb_norm.weight"):
                value = value - 1  # stored as 1 + w (see above)
            state[name] = value.to(dtype)
        module.load_state_dict(state, strict=True)
    return images
