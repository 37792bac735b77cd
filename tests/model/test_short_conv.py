"""LFM2's convolution in the C++ layer op (csrc/short_conv.cpp) against the torch op
(model/short_conv.py) it follows: the same rows stored in the pool and the same outputs, bit
for bit, over a step of a fresh prompt, a decode and a chunk over a cached prefix, in a bf16
and an int8 pool, on every kernel variant the CPU runs."""

from __future__ import annotations

import random

import pytest
import torch

from iterserve import kernels
from iterserve.model.attention import attention_context
from iterserve.model.attention_metadata import SeqSpan, build_attention_metadata
from iterserve.model.kv_cache_format import quantize_rows, row_width
from iterserve.model.short_conv import short_conv

HIDDEN, WIDTH, BLOCK = 64, 3, 4


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("pool", [torch.bfloat16, torch.int8])
def test_the_layer_ops_convolution_is_the_torch_ops(pool: torch.dtype) -> None:
    torch.manual_seed(0)
    blocks = list(range(12))
    random.Random(0).shuffle(blocks)
    # (computed, new): a prompt from its start, a decode, a chunk over a cached prefix.
    shapes = [(0, 6), (9, 1), (5, 4)]
    spans = [SeqSpan(blocks[4 * i : 4 * i + 4], n, k) for i, (n, k) in enumerate(shapes)]
    meta = build_attention_metadata(spans, BLOCK, torch.device("cpu"), True, None, WIDTH - 1)
    assert meta.kernel is not None
    cache = torch.zeros(1, 12, BLOCK, row_width(HIDDEN, pool), dtype=pool)
    earlier = torch.randn(12 * BLOCK, HIDDEN).bfloat16()  # rows steps before this one wrote
    cache.view(12 * BLOCK, -1).copy_(quantize_rows(earlier) if pool == torch.int8 else earlier)
    tokens = sum(k for _, k in shapes)
    bcx = torch.randn(tokens, 3 * HIDDEN).bfloat16()
    kernel = (torch.randn(HIDDEN, WIDTH) * 0.5).bfloat16()

    torch_cache = cache.clone()
    with attention_context(meta, [(torch_cache, torch_cache[:0])]):
        b, c, x = bcx.split(HIDDEN, dim=1)
        want = c * short_conv(b * x, kernel, 0)
    got = kernels.ops().short_conv(bcx, kernel, cache, meta.slot_mapping, meta.kernel.packed)
    assert torch.equal(cache, torch_cache)
    assert torch.equal(got, want)


@pytest.mark.usefixtures("kernel_isa")
def test_a_rows_convolution_does_not_depend_on_its_step() -> None:
    """A decode's output alone and beside a prompt's chunk: the same bits."""
    torch.manual_seed(1)
    kernel = torch.randn(HIDDEN, WIDTH).bfloat16()
    decode = torch.randn(1, 3 * HIDDEN).bfloat16()
    chunk = torch.randn(5, 3 * HIDDEN).bfloat16()
    earlier = torch.randn(2, BLOCK, HIDDEN).bfloat16()  # the decode's prefix, stored before
    outs = []
    for rows, spans in (
        (decode, [SeqSpan([0, 1], 6, 1)]),
        (torch.cat([decode, chunk]), [SeqSpan([0, 1], 6, 1), SeqSpan([2, 3], 0, 5)]),
    ):
        cache = torch.zeros(1, 4, BLOCK, HIDDEN, dtype=torch.bfloat16)
        cache[0, :2] = earlier
        meta = build_attention_metadata(spans, BLOCK, torch.device("cpu"), True, None, WIDTH - 1)
        assert meta.kernel is not None
        outs.append(
            kernels.ops().short_conv(rows, kernel, cache, meta.slot_mapping, meta.kernel.packed)[0]
        )
    assert torch.equal(outs[0], outs[1])
