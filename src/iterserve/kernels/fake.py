"""Shapes of the C++ ops' results, so torch.compile can trace through them without running them.

Each ISA variant registers the same ops in its own namespace (see kernels/__init__.py);
`register_fakes` gives that namespace these shape functions."""

from __future__ import annotations

import torch

TILE = 16  # outputs per weight tile, as in csrc/linear.cpp


def _tiled_linear(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    formats: list[int],
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    fp32_out: bool = False,
) -> torch.Tensor:
    dtype = torch.float32 if fp32_out else x.dtype
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in weights) * TILE, dtype=dtype)


def _quantize_rows(x: torch.Tensor, unit: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(
        (x.shape[0], x.shape[1] // unit), dtype=torch.float32
    )


def _paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous [T, num_heads, head_dim] in q's dtype


def _store_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    step: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return q.new_empty(q.shape)


def _decoder_layer(
    hidden: torch.Tensor,
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    eps: float,
    weights: list[torch.Tensor],
    formats: list[int],
    segments: list[int],
    biases: list[torch.Tensor | None],
    qk_norm: torch.Tensor | None,
    attn_out_norm: torch.Tensor | None,
    mlp_out_norm: torch.Tensor | None,
    gelu: bool,
    softcap: float,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    step: torch.Tensor,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    sliding_window: int,
    lora: list[torch.Tensor],
    lora_parts: list[int],
    lora_rows: torch.Tensor | None,
    experts: list[torch.Tensor],
    expert_formats: list[int],
    top_k: int,
    sinks: torch.Tensor | None = None,
    query_scales: torch.Tensor | None = None,
    value_norm: bool = False,
    shares_kv: bool = False,
    per_layer_input: torch.Tensor | None = None,
    per_layer_norm: torch.Tensor | None = None,
    layer_scalar: torch.Tensor | None = None,
    keys_as_values: bool = False,
) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


def _dequantize_rows(
    tiles: torch.Tensor, format: int, k: int, rows: torch.Tensor, bf16_out: bool
) -> torch.Tensor:
    dtype = torch.bfloat16 if bf16_out else torch.float32
    return tiles.new_empty((rows.numel(), k), dtype=dtype)


def _decoder_stack(hidden: torch.Tensor, *_: object) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


def _norm_rows(x: torch.Tensor, rows: torch.Tensor, *_: object) -> torch.Tensor:
    return x.new_empty((rows.numel(), x.shape[1]))


_FAKES = {
    "tiled_linear": _tiled_linear,
    "quantize_rows": _quantize_rows,
    "paged_attention": _paged_attention,
    "store_and_attend": _store_and_attend,
    "decoder_layer": _decoder_layer,
    "decoder_stack": _decoder_stack,
    "norm_rows": _norm_rows,
    "dequantize_rows": _dequantize_rows,
}


def register_fakes(namespace: str) -> None:
    """Shape functions for one variant's ops (`namespace`: iterserve_avx2, ...)."""
    for op, fake in _FAKES.items():
        torch.library.register_fake(f"{namespace}::{op}")(fake)
