"""AVX2 with AVX-VNNI against AVX2 alone: the same integer dot products made one way
(`vpdpbusd` on ymm, signed weights stored + 128) or the other (`vpmaddubsw` + `vpmaddwd`),
each exact, so the two builds give the same bits for every block format at every row count;
test_block_formats.py holds both to the `gguf` package's dequantization."""

from __future__ import annotations

import pytest
import torch
from test_block_formats import gguf_bytes

from iterserve import kernels
from iterserve.model import block_formats as bf

pytestmark = pytest.mark.skipif(
    "avx2vnni" not in kernels.runnable_isas(), reason="this CPU has no AVX-VNNI (avx_vnni)"
)


@pytest.mark.parametrize("name", sorted(bf.BLOCK_FORMATS))
def test_the_same_bits_as_avx2(name: str) -> None:
    fmt = bf.BLOCK_FORMATS[name]
    n, k = 16 * 5, 2 * max(fmt.inputs, 256)
    raw = gguf_bytes(name, n, k)
    x = torch.randn(65, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    rows = (1, 2, 3, 4, 16, 65)  # a few rows' streams, then the many rows' sweep
    products = {}
    for isa in ("avx2", "avx2vnni"):
        assert kernels.available(isa), kernels.why_unavailable(isa)
        ops = kernels.ops(isa)
        tiles = bf.repack(ops, raw, fmt, k)  # the signed formats' bytes differ by the build
        products[isa] = [
            ops.tiled_linear(x[:m], [tiles], [fmt.code], None, None, True) for m in rows
        ]
    for m, ours, theirs in zip(rows, products["avx2vnni"], products["avx2"], strict=True):
        assert torch.equal(ours, theirs), f"{m} rows"
