"""Qwen's vision projector files as llama.cpp writes them, made into their image encoder
(model/qwen_vl_images.py): Qwen3-VL's (`clip.projector_type` qwen3vl_merger, beside a
`qwen3vl` GGUF) and Qwen2.5-VL's (qwen2.5vl_merger, beside a `qwen2vl` GGUF).

The converter's own renames are undone: the patch embedding, a 3D convolution over two
frames, stored as its two frames' 2D kernels (`v.patch_embd.weight`, `.weight.1`);
Qwen3-VL's merger's norm and linear layers as `v.post_ln`, `mm.0`, `mm.2`, and each
DeepStack merger under the number of the tower layer it reads (`v.deepstack.N`, the file's
`is_deepstack_layers`); Qwen2.5-VL's fused q/k/v split in three, its layers that attend the
whole image said by their period (`n_wa_pattern`). The file does not say how large an image
may be: llama.cpp's bounds for Qwen's towers are taken (8 to 4,096 rows an image), where
the HF processors allow 64 to 16,384 (Qwen3-VL) and 4 to 16,384 (Qwen2.5-VL); nor
Qwen2.5-VL's window, llama.cpp's 112 pixels (the releases')."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_loader import read_gguf_tensor
from iterserve.model.projector_file import ProjectorFile
from iterserve.model.qwen_vl_images import QwenVLImages

# The image's pad token (what the chat template writes between the other two), its start and
# its end.
QWEN_VL_TOKENS = ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
# llama.cpp's bounds on an image of Qwen's towers, in rows (merged patches).
_FEWEST_ROWS, _MOST_ROWS = 8, 4096
_QWEN25VL_WINDOW = 112  # pixels a side
_MERGER = {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}
_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def read_qwen3vl(
    file: ProjectorFile, text: ModelConfig, tokenizer: Any, dtype: torch.dtype
) -> QwenVLImages:
    table = file.tensors.get("v.position_embd.weight")
    if table is None:
        raise ModelLoadError(f"{file.path}: no v.position_embd.weight")
    deepstack = file.metadata.get("clip.vision.is_deepstack_layers") or []
    vision = transformers.models.qwen3_vl.Qwen3VLVisionConfig(
        **_vision_shape(file, text),
        num_position_embeddings=int(table.shape[0]),
        deepstack_visual_indexes=[i for i, read in enumerate(deepstack) if read],
    )
    config = transformers.Qwen3VLConfig(
        text_config={"hidden_size": text.hidden_size},
        vision_config=vision.to_dict(),
        image_token_id=_image_token(file, tokenizer, "Qwen3-VL"),
    )
    images = QwenVLImages(config, _processor(file, vision), QWEN_VL_TOKENS[0], dtype)

    def name_of(hf: str, names: Any) -> str | None:
        return qwen3vl_file_name(hf, names, vision.deepstack_visual_indexes)

    file.load(images, vision.depth, _prefixed, _frames_stacked(file), dtype, name_of)
    return images


def read_qwen25vl(
    file: ProjectorFile, text: ModelConfig, tokenizer: Any, dtype: torch.dtype
) -> QwenVLImages:
    shape = _vision_shape(file, text)
    period = int(file.metadata.get("clip.vision.n_wa_pattern", 0))
    if period <= 0:
        raise ModelLoadError(f"{file.path}: clip.vision.n_wa_pattern is missing")
    vision = Qwen2_5_VLVisionConfig(
        **shape,
        window_size=int(file.metadata.get("clip.vision.window_size", _QWEN25VL_WINDOW)),
        fullatt_block_indexes=[i for i in range(shape["depth"]) if (i + 1) % period == 0],
        hidden_act="silu" if file.metadata.get("clip.use_silu") else "gelu",
    )
    config = transformers.Qwen2_5_VLConfig(
        text_config={"hidden_size": text.hidden_size},
        vision_config=vision.to_dict(),
        image_token_id=_image_token(file, tokenizer, "Qwen2.5-VL"),
    )
    images = QwenVLImages(config, _processor(file, vision), QWEN_VL_TOKENS[0], dtype)
    stacked = _frames_stacked(file)

    def name_of(hf: str, names: Any) -> str | None:
        # The fused q/k/v under q's name (`value` reads k and v beside it).
        return names.get_name(hf.replace(".qkv.", ".q."), try_suffixes=(".weight", ".bias"))

    def value(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if ".attn.qkv." not in name:
            return stacked(name, tensor)
        layer, kind = name.split(".")[1], name.rsplit(".", 1)[1]
        rest = [_read(file, f"v.blk.{layer}.attn_{part}.{kind}") for part in "kv"]
        return torch.cat((tensor, *rest))

    file.load(images, vision.depth, _prefixed, value, dtype, name_of)
    return images


def qwen3vl_file_name(hf: str, names: Any, deepstack: list[int]) -> str | None:
    """A checkpoint's Qwen3-VL tower tensor (`visual.*`) under its name in llama.cpp's
    projector file (`names`: the converter's map; `deepstack`: the tower layers the
    DeepStack mergers read). The patch embedding's kernel is its first frame's name (the
    second's adds .1)."""
    parts = hf.split(".")  # visual.<module>...
    if parts[1] == "merger":
        return ".".join((_MERGER[parts[2]], *parts[3:]))
    if parts[1] == "deepstack_merger_list":
        layer = deepstack[int(parts[2])]
        return ".".join(("v.deepstack", str(layer), _DEEPSTACK[parts[3]], *parts[4:]))
    return names.get_name(hf, try_suffixes=(".weight", ".bias"))


def _vision_shape(file: ProjectorFile, text: ModelConfig) -> dict[str, int]:
    """The tower's shape both families' configs take, from the file's keys; the language
    model beside it must turn images by M-RoPE."""
    if text.mrope_section is None:
        raise ModelLoadError(
            f"{file.path}: a Qwen vision projector, but the model beside it turns no image by "
            "M-RoPE (its GGUF has no rope.dimension_sections): is it a Qwen-VL?"
        )
    key = file.key
    return {
        "depth": int(key("block_count")),
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_heads": int(key("attention.head_count")),
        "patch_size": int(key("patch_size")),
        "spatial_merge_size": int(file.metadata.get("clip.vision.spatial_merge_size", 2)),
        "out_hidden_size": text.hidden_size,
    }


def _image_token(file: ProjectorFile, tokenizer: Any, family: str) -> int:
    """The pad token's id, the start and end tokens checked to be there too."""
    return file.token_ids(tokenizer, QWEN_VL_TOKENS, family)[0]


def _processor(file: ProjectorFile, vision: Any) -> Qwen2VLImageProcessorPil:
    factor = vision.patch_size * vision.spatial_merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        merge_size=vision.spatial_merge_size,
        size={
            "shortest_edge": _FEWEST_ROWS * factor * factor,
            "longest_edge": _MOST_ROWS * factor * factor,
        },
        image_mean=list(file.key("image_mean")),
        image_std=list(file.key("image_std")),
    )


def _prefixed(prefix: str, name: str) -> str:
    return prefix + name


def _read(file: ProjectorFile, name: str) -> torch.Tensor:
    if (found := file.tensors.get(name)) is None:
        raise ModelLoadError(f"{file.path}: no {name}")
    return read_gguf_tensor(found).float()


def _frames_stacked(file: ProjectorFile) -> Any:
    """`value` for ProjectorFile.load: the patch embedding's two frames' kernels stacked
    back into its 3D kernel; any other tensor as stored."""

    def value(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name != "patch_embed.proj.weight":
            return tensor
        return torch.stack((tensor, _read(file, "v.patch_embd.weight.1")), dim=2)

    return value
