"""Shapes of the C++ ops' results, so torch.compile can trace through them without running them.

Each ISA variant registers the same ops in its own namespace (see kernels/__init__.py);
`register_fakes` gives that namespace these shape functions."""

from __future__ import annotations

import torch

TILE = 16  # outputs per weight tile, as in csrc/linear.cpp


def _tiled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    format: int,
    wide_weight: torch.Tensor | None,
    wide_scales: torch.Tensor | None,
    wide_format: int,
    max_tile_rows: int,
    fp32_out: bool = False,
) -> torch.Tensor:
    dtype = torch.float32 if fp32_out else x.dtype
    return x.new_empty(x.shape[0], weight.shape[0] * TILE, dtype=dtype)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(
        (x.shape[0], x.shape[1] // 32), dtype=torch.float32
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
) -> torch.Tensor:
    return q.new_empty(q.shape)


def _decoder_layer(
    hidden: torch.Tensor,
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
    eps: float,
    weights: list[torch.Tensor | None],
    formats: list[int],
    max_rows: list[int],
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
) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)


_FAKES = {
    "tiled_linear": _tiled_linear,
    "quantize_rows": _quantize_rows,
    "paged_attention": _paged_attention,
    "store_and_attend": _store_and_attend,
    "decoder_layer": _decoder_layer,
}


def register_fakes(namespace: str) -> None:
    """Shape functions for one variant's ops (`namespace`: iterserve_avx2, ...)."""
    for op, fake in _FAKES.items():
        torch.library.register_fake(f"{namespace}::{op}")(fake)
