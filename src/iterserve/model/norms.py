"""The RMS norm every layer of every family uses."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, times `weight` (None: none, as Gemma 4's norm of V)."""
    # Statistics in fp32 like transformers, but without materialising an fp32 copy of x:
    # vector_norm accumulates in fp32 in one pass, and scaling stays in x's dtype. On a
    # 512-token bf16 prefill this is ~3x faster than the textbook form (and F.rms_norm, which
    # is composite on CPU; measured once, no script); fp32 results are unchanged, bf16 differs by at most a rounding.
    sum_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).square_()
    inv_rms = sum_sq.div_(x.shape[-1]).add_(eps).rsqrt_()
    normed = x * inv_rms.to(x.dtype)
    return normed if weight is None else normed.mul_(weight)
