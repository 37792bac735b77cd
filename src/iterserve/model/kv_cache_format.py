"""How K and V are stored in the block pool: in the model's dtype, or in 8 bits.

`--kv-cache-dtype auto` keeps K/V in the model's dtype. `int8` stores each row (one token,
one kv head) as a llama.cpp-style q8 block the size of the row: head_dim int8 values q and
then their fp32 scale s, with s = max|x| / 127 and q = round(x * (127 / max|x|)) (half to
even), so x ~ s * q. The scale is per row because rows are written one token at a time: a
scale per block would have to change, and its rows be requantized, as the block fills. A
row of SmolLM2's head_dim 64 takes 68 bytes instead of 128, so the same memory holds 1.88x
the tokens and a decode step reads half the K/V bytes.

The C++ kernels (kernels/csrc/paged_attention.cpp, ops.h) read and write the same layout,
and compute the same q and s bit for bit (tests/kernels/test_attention_kernel.py); the torch paths
of model/attention.py quantize and dequantize with the functions here.
"""

from __future__ import annotations

import torch

from iterserve.model.config import ModelConfig

ROW_SCALE_BYTES = 4  # one fp32 scale after each int8 row (kernels/csrc/ops.h kRowScaleBytes)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for a --kv-cache-dtype choice (config.KVCacheDType)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}")


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of the pool's last dimension: head_dim, plus the scale's bytes for int8."""
    return head_dim + ROW_SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    width = cache.shape[-1]
    return width - ROW_SCALE_BYTES if is_quantized(cache) else width


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers, in a pool of this dtype (an
    LFM2 conv layer's one row of its convolution's input: model/short_conv.py; none for a
    layer that reads an earlier layer's: Gemma 4)."""
    total = 0
    for i in range(config.num_hidden_layers):
        if config.layer_kv_source(i) != i:
            continue
        if config.layer_is_conv(i):
            total += row_width(config.hidden_size, dtype) * dtype.itemsize
        else:
            row = row_width(config.layer_head_dim(i), dtype) * dtype.itemsize
            total += 2 * config.layer_kv_heads(i) * row
    return total


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] bf16/fp32 -> [..., head_dim + 4] int8 rows: the values, then the scale."""
    x = x.float()
    top = x.abs().amax(-1, keepdim=True)
    # A true division, as the kernels' 127.0f / top: torch computes `127.0 / top` as 127 times
    # top's reciprocal, which rounds differently a quarter of the time.
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / top, torch.zeros_like(top))
    q = torch.round(x * inv).to(torch.int8)
    scale = (top / 127.0).contiguous().view(torch.int8)  # its 4 bytes, in memory order
    return torch.cat([q, scale], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., head_dim + 4] int8 rows -> [..., head_dim] of `dtype` (s * q, in fp32 first)."""
    head_dim = rows.shape[-1] - ROW_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)
