"""Qwen3-VL's vision projector file as llama.cpp writes it (`clip.projector_type`
qwen3vl_merger: Qwen3-VL 2B-32B beside a `qwen3vl` GGUF), made into Qwen3-VL's image encoder
(model/qwen_vl_images.py).

The converter's own renames are undone: the patch embedding, a 3D convolution over two
frames, stored as its two frames' 2D kernels (`v.patch_embd.weight`, `.weight.1`); the
merger's norm and linear layers as `v.post_ln`, `mm.0`, `mm.2`; each DeepStack merger under
the number of the tower layer it reads (`v.deepstack.N`, the file's `is_deepstack_layers`).
The file does not say how large an image may be: llama.cpp's bounds for Qwen's towers are
taken (8 to 4,096 rows an image), where the HF processor allows 64 to 16,384."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_loader import read_gguf_tensor
from iterserve.model.projector_file import ProjectorFile
from iterserve.model.qwen_vl_images import QwenVLImages

# The image's pad token (what the chat template writes between the other two), its start and
# its end.
QWEN3VL_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
# llama.cpp's bounds on an image of Qwen's towers, in rows (merged patches).
_FEWEST_ROWS, _MOST_ROWS = 8, 4096
_MERGER = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def read_qwen3vl(
    file: ProjectorFile, text: ModelConfig, tokenizer: Any, dtype: torch.dtype
) -> QwenVLImages:
    key = file.key
    if text.mrope_section is None:
        raise ModelLoadError(
            f"{file.path}: a Qwen3-VL projector, but the model beside it turns no image by "
            "M-RoPE (its GGUF has no rope.dimension_sections): is it a Qwen3-VL?"
        )
    table = file.tensors.get("v.position_embd.weight")
    if table is None:
        raise ModelLoadError(f"{file.path}: no v.position_embd.weight")
    deepstack = file.metadata.get("clip.vision.is_deepstack_layers") or []
    patch, merge = (
        int(key("patch_size")),
        int(file.metadata.get("clip.vision.spatial_merge_size", 2)),
    )
    vision = transformers.models.qwen3_vl.Qwen3VLVisionConfig(
        depth=int(key("block_count")),
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("feed_forward_length")),
        num_heads=int(key("attention.head_count")),
        patch_size=patch,
        spatial_merge_size=merge,
        out_hidden_size=text.hidden_size,
        num_position_embeddings=int(table.shape[0]),
        deepstack_visual_indexes=[i for i, read in enumerate(deepstack) if read],
    )
    ids = file.token_ids(tokenizer, QWEN3VL_TOKENS, "Qwen3-VL")
    config = transformers.Qwen3VLConfig(
        text_config={"hidden_size": text.hidden_size},
        vision_config=vision.to_dict(),
        image_token_id=ids[0],
    )
    factor = patch * merge
    processor = Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=merge,
        size={
            "shortest_edge": _FEWEST_ROWS * factor * factor,
            "longest_edge": _MOST_ROWS * factor * factor,
        },
        image_mean=list(key("image_mean")),
        image_std=list(key("image_std")),
    )
    images = QwenVLImages(config, processor, QWEN3VL_TOKENS[0], dtype)

    def name_of(hf: str, names: Any) -> str | None:
        return qwen3vl_file_name(hf, names, vision.deepstack_visual_indexes)

    def value(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name != "patch_embed.proj.weight":
            return tensor
        second = file.tensors.get("v.patch_embd.weight.1")
        if second is None:
            raise ModelLoadError(f"{file.path}: no v.patch_embd.weight.1 (the second frame's)")
        return torch.stack((tensor, read_gguf_tensor(second).float()), dim=2)

    file.load(images, vision.depth, lambda prefix, name: prefix + name, value, dtype, name_of)
    return images


def qwen3vl_file_name(hf: str, names: Any, deepstack: list[int]) -> str | None:
    """A checkpoint's tower tensor (`visual.*`) under its name in llama.cpp's projector file
    (`names`: the converter's map; `deepstack`: the tower layers the DeepStack mergers
    read). The patch embedding's kernel is its first frame's name (the second's adds .1)."""
    parts = hf.split(".")  # visual.<module>...
    if parts[1] == "merger":
        return ".".join((_MERGER[parts[2]], *parts[3:]))
    if parts[1] == "deepstack_merger_list":
        layer = deepstack[int(parts[2])]
        return ".".join(("v.deepstack", str(layer), _DEEPSTACK[parts[3]], *parts[4:]))
    return names.get_name(hf, try_suffixes=(".weight", ".bias"))
