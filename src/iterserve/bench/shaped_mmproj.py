"""A vision projector file (llama.cpp's `mmproj-*.gguf`) of a released tower's shape with
random weights, for timing images against llama.cpp on the same file
(benchmarks/image_prompt.py): Gemma 3's SigLIP (4B-27B), Ministral 3's Pixtral and Gemma 4
E2B's tower, with the metadata and tensor names llama.cpp's converter writes and its types
(F16 matrices, Gemma's input projection included; F32 norms, biases, clamps and the patch
and position embeddings).
Written tensor by tensor, as shaped_gguf.py writes models."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFWriter

from iterserve.bench.shaped_gguf import WEIGHT_STD


@dataclass(frozen=True)
class TowerShape:
    """A tower and its projector, as the released config gives them: SigLIP and Gemma 3's
    (`gemma3`), or Pixtral and Mistral 3's (`pixtral`, its patches merged `merge` x `merge`)."""

    kind: str  # clip.projector_type
    hidden: int  # vision_config.hidden_size
    intermediate: int  # vision_config.intermediate_size
    layers: int  # vision_config.num_hidden_layers
    heads: int  # vision_config.num_attention_heads
    image_size: int
    patch_size: int
    text_hidden: int  # the language model's hidden size, which the projector maps to
    eps: float = 1e-6
    merge: int = 1
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    positions: int = 0  # Gemma 4's position table: positions along each side; Qwen3-VL's: all
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: the layers its DeepStack mergers read
    window_period: int = 0  # Qwen2.5-VL: every this-many-th layer sees the whole image


GEMMA3_4B_TOWER = TowerShape("gemma3", 1152, 4304, 27, 16, 896, 14, 2560)
# Ministral 3 3B's (mistralai/Ministral-3-3B-Instruct-2512): CLIP's mean and deviation.
MINISTRAL3_3B_TOWER = TowerShape(
    "pixtral", 1024, 4096, 24, 16, 1540, 14, 3072, eps=1e-5, merge=2,
    mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711),
)  # fmt: skip
# Gemma 4 E2B's (google/gemma-4-E2B-it): 16 layers of 768, 16-pixel patches pooled 3 x 3,
# clipped linears; pixels as they are (mean 0, deviation 1); the image size llama.cpp's
# converter writes ("unused").
GEMMA4_E2B_TOWER = TowerShape(
    "gemma4v", 768, 3072, 16, 12, 224, 16, 1536, merge=3,
    mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), positions=10240,
)  # fmt: skip
# Qwen3-VL-2B's (Qwen/Qwen3-VL-2B-Instruct): 24 layers of 1024, 16-pixel patches merged 2 x 2,
# a 48 x 48 position grid, DeepStack mergers of layers 5, 11 and 17; the image size llama.cpp's
# converter writes (the position grid's side in pixels).
QWEN3VL_2B_TOWER = TowerShape(
    "qwen3vl_merger", 1024, 4096, 24, 16, 768, 16, 2048, merge=2, positions=2304,
    deepstack=(5, 11, 17),
)  # fmt: skip
# Qwen2.5-VL-3B's (Qwen/Qwen2.5-VL-3B-Instruct): 32 layers of 1280, 14-pixel patches merged
# 2 x 2, windows of 112 pixels but on every eighth layer (n_wa_pattern 8), CLIP's mean and
# deviation; the image size llama.cpp's converter writes (its default).
QWEN25VL_3B_TOWER = TowerShape(
    "qwen2.5vl_merger", 1280, 3420, 32, 16, 560, 14, 2048, merge=2,
    mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711),
    window_period=8,
)  # fmt: skip
TOWERS = {
    "gemma3": GEMMA3_4B_TOWER,
    "pixtral": MINISTRAL3_3B_TOWER,
    "gemma4v": GEMMA4_E2B_TOWER,
    "qwen3vl_merger": QWEN3VL_2B_TOWER,
    "qwen2.5vl_merger": QWEN25VL_3B_TOWER,
}


def _tensors(shape: TowerShape) -> list[tuple[str, tuple[int, ...], type]]:
    """(name, numpy shape, dtype) of every tensor, in the converter's order of kinds."""
    if shape.kind == "gemma4v":
        return _gemma4_tensors(shape)
    if shape.kind == "qwen3vl_merger":
        return _qwen3vl_tensors(shape)
    if shape.kind == "qwen2.5vl_merger":
        return _qwen25vl_tensors(shape)
    return _pixtral_tensors(shape) if shape.kind == "pixtral" else _gemma3_tensors(shape)


def _gemma4_tensors(shape: TowerShape) -> list[tuple[str, tuple[int, ...], type]]:
    """Gemma 4's: every tensor of transformers' tower and embedder (on the meta device),
    named as llama.cpp's converter names it (model/gguf_images.py reads the same names)."""
    import torch
    import transformers
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

    from iterserve.model.gguf_images import gemma4_file_name

    h = shape.hidden
    vision = transformers.Gemma4VisionConfig(
        hidden_size=h, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.heads,
        head_dim=h // shape.heads, patch_size=shape.patch_size,
        pooling_kernel_size=shape.merge, position_embedding_size=shape.positions,
        use_clipped_linears=True,
    )  # fmt: skip
    text = transformers.Gemma4TextConfig(hidden_size=shape.text_hidden)
    with torch.device("meta"):
        parts = {
            "model.vision_tower.": transformers.Gemma4VisionModel(vision),
            "model.embed_vision.": Gemma4MultimodalEmbedder(vision, text),
        }
    found: list[tuple[str, tuple[int, ...], type]] = []
    for prefix, module in parts.items():
        for name, tensor in module.state_dict().items():
            ours = gemma4_file_name(prefix + name, shape.layers)
            dims = tuple(tensor.shape) or (1,)  # a clamp: one value
            if name == "patch_embedder.input_proj.weight":
                dims = (h, 3, shape.patch_size, shape.patch_size)  # a convolution's kernel
            matrix = len(dims) == 2 and "position" not in name
            found.append((ours, dims, np.float16 if matrix else np.float32))
    return found


def _qwen3vl_tensors(shape: TowerShape) -> list[tuple[str, tuple[int, ...], type]]:
    """Qwen3-VL's: named as llama.cpp's converter names them (model/gguf_qwen_vl.py reads
    the same names), its DeepStack mergers by their tower layers."""
    import torch
    import transformers

    from iterserve.model.gguf_qwen_vl import qwen3vl_file_name
    from iterserve.model.projector_file import mmproj_names

    vision = transformers.models.qwen3_vl.Qwen3VLVisionConfig(
        depth=shape.layers, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_heads=shape.heads, patch_size=shape.patch_size, spatial_merge_size=shape.merge,
        out_hidden_size=shape.text_hidden, num_position_embeddings=shape.positions,
        deepstack_visual_indexes=list(shape.deepstack),
    )  # fmt: skip
    with torch.device("meta"):
        tower = transformers.Qwen3VLVisionModel(vision)
    names = mmproj_names(shape.layers)
    return _qwen_tensors(tower, lambda hf: qwen3vl_file_name(hf, names, list(shape.deepstack)))


def _qwen25vl_tensors(shape: TowerShape) -> list[tuple[str, tuple[int, ...], type]]:
    """Qwen2.5-VL's: named by the converter's map, its fused q/k/v as three."""
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from iterserve.model.projector_file import mmproj_names

    vision = Qwen2_5_VLVisionConfig(
        depth=shape.layers, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_heads=shape.heads, patch_size=shape.patch_size, spatial_merge_size=shape.merge,
        out_hidden_size=shape.text_hidden,
    )  # fmt: skip
    with torch.device("meta"):
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision)
    names = mmproj_names(shape.layers)

    def name_of(hf: str) -> str | None:
        return names.get_name(hf, try_suffixes=(".weight", ".bias"))

    return _qwen_tensors(tower, name_of, split_qkv=True)


def _qwen_tensors(
    tower: Any, name_of: Callable[[str], str | None], split_qkv: bool = False
) -> list[tuple[str, tuple[int, ...], type]]:
    """Every tensor of a Qwen tower (built on the meta device) under `name_of(visual.NAME)`:
    the patch embedding's 3D kernel as its two frames' 2D kernels, with `split_qkv` a fused
    q/k/v as three; matrices F16, the rest (the position table too) F32."""
    found: list[tuple[str, tuple[int, ...], type]] = []
    for name, tensor in tower.state_dict().items():
        dims = tuple(tensor.shape)
        if name == "patch_embed.proj.weight":  # [out, in, 2 frames, p, p]
            frame = (dims[0], dims[1], *dims[3:])
            found += [("v.patch_embd.weight", frame, np.float16)]
            found += [("v.patch_embd.weight.1", frame, np.float16)]
            continue
        pieces = {name: dims}
        if split_qkv and ".qkv." in name:
            pieces = {name.replace("qkv", part): (dims[0] // 3, *dims[1:]) for part in "qkv"}
        for piece, piece_dims in pieces.items():
            ours = name_of("visual." + piece)
            assert ours is not None, piece
            matrix = len(piece_dims) == 2 and "pos_embed" not in piece
            found.append((ours, piece_dims, np.float16 if matrix else np.float32))
    return found


def _pixtral_tensors(shape: TowerShape) -> list[tuple[str, tuple[int, ...], type]]:
    """Pixtral's: RMS norms, a SiLU-gated MLP, no biases, no position table (2D RoPE);
    Mistral 3's projector: a norm, the patch merger, two linear layers."""
    h, f, p, t = shape.hidden, shape.intermediate, shape.patch_size, shape.text_hidden
    found: list[tuple[str, tuple[int, ...], type]] = [
        ("mm.1.weight", (t, h), np.float16),
        ("mm.2.weight", (t, t), np.float16),
        ("mm.input_norm.weight", (h,), np.float32),
        ("mm.patch_merger.weight", (h, h * shape.merge**2), np.float16),
        ("v.patch_embd.weight", (h, 3, p, p), np.float32),
        ("v.pre_ln.weight", (h,), np.float32),
        ("v.token_embd.img_break", (t,), np.float32),  # [IMG_BREAK]'s embedding, for llama.cpp
    ]
    for i in range(shape.layers):
        blk = f"v.blk.{i}"
        found += [(f"{blk}.ln1.weight", (h,), np.float32), (f"{blk}.ln2.weight", (h,), np.float32)]
        for part, rows, cols in (("attn_q", h, h), ("attn_k", h, h), ("attn_v", h, h),
                                 ("attn_out", h, h), ("ffn_gate", f, h), ("ffn_up", f, h),
                                 ("ffn_down", h, f)):  # fmt: skip
            found += [(f"{blk}.{part}.weight", (rows, cols), np.float16)]
    return found


def _gemma3_tensors(shape: TowerShape) -> list[tuple[str, tuple[int, ...], type]]:
    h, f, p = shape.hidden, shape.intermediate, shape.patch_size
    patches = (shape.image_size // p) ** 2
    found: list[tuple[str, tuple[int, ...], type]] = [
        ("mm.input_projection.weight", (h, shape.text_hidden), np.float16),
        ("mm.soft_emb_norm.weight", (h,), np.float32),
        ("v.patch_embd.weight", (h, 3, p, p), np.float32),
        ("v.patch_embd.bias", (h,), np.float32),
        ("v.position_embd.weight", (patches, h), np.float32),
    ]
    for i in range(shape.layers):
        blk = f"v.blk.{i}"
        for norm in ("ln1", "ln2"):
            found += [(f"{blk}.{norm}.weight", (h,), np.float32)]
            found += [(f"{blk}.{norm}.bias", (h,), np.float32)]
        for part, rows, cols in (("attn_q", h, h), ("attn_k", h, h), ("attn_v", h, h),
                                 ("attn_out", h, h), ("ffn_up", f, h), ("ffn_down", h, f)):  # fmt: skip
            found += [(f"{blk}.{part}.weight", (rows, cols), np.float16)]
            found += [(f"{blk}.{part}.bias", (rows,), np.float32)]
    found += [("v.post_ln.weight", (h,), np.float32), ("v.post_ln.bias", (h,), np.float32)]
    return found


def _values(name: str, shape: tuple[int, ...], dtype: type, rng: np.random.Generator) -> np.ndarray:
    if name.endswith(
        ("ln1.weight", "ln2.weight", "post_ln.weight", "pre_ln.weight", "norm.weight")
    ):
        return np.ones(shape, dtype=dtype)  # Gemma's projector norm stored as 1 + w: w = 0
    if name.endswith(("_min", "_max")):  # Gemma 4's clamps, wide enough not to bite
        return np.full(shape, -100.0 if name.endswith("_min") else 100.0, dtype=dtype)
    if name.endswith("ln1.bias") or name.endswith("ln2.bias") or name.endswith("post_ln.bias"):
        return np.zeros(shape, dtype=dtype)
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(WEIGHT_STD)).astype(dtype)


def write_shaped_mmproj(path: Path, shape: TowerShape = GEMMA3_4B_TOWER, seed: int = 0) -> Path:
    """A vision projector file of `shape` with random weights at `path` (written to `path`
    + ".partial" and renamed when whole)."""
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, "clip")
    writer.add_name("random weights")
    writer.add_type("mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    # Gemma 4's converter writes a type a tower (its file may hold an audio tower too).
    kind = "clip.vision.projector_type" if shape.kind == "gemma4v" else "clip.projector_type"
    writer.add_string(kind, shape.kind)
    if shape.kind != "gemma4v":
        silu = shape.kind in ("pixtral", "qwen2.5vl_merger")
        writer.add_bool("clip.use_silu" if silu else "clip.use_gelu", True)
    if shape.merge > 1:
        writer.add_uint32("clip.vision.spatial_merge_size", shape.merge)
    if shape.deepstack:
        layers = [i in shape.deepstack for i in range(shape.layers)]
        writer.add_array("clip.vision.is_deepstack_layers", layers)
    if shape.window_period:
        writer.add_uint32("clip.vision.n_wa_pattern", shape.window_period)
    for key, value in {
        "image_size": shape.image_size,
        "patch_size": shape.patch_size,
        "embedding_length": shape.hidden,
        "feed_forward_length": shape.intermediate,
        "block_count": shape.layers,
        "attention.head_count": shape.heads,
        "projection_dim": shape.text_hidden,
    }.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", shape.eps)
    writer.add_array("clip.vision.image_mean", list(shape.mean))
    writer.add_array("clip.vision.image_std", list(shape.std))
    tensors = _tensors(shape)
    for name, dims, dtype in tensors:
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        for index, (name, dims, dtype) in enumerate(tensors):
            writer.write_tensor_data(
                _values(name, dims, dtype, np.random.default_rng([seed, index]))
            )
    finally:
        writer.close()
    os.replace(partial, path)
    return path
