"""Every GGUF block format the kernels keep (model/block_formats.py), on every ISA variant
this CPU runs: unpacked bit for bit as the `gguf` package dequantizes the file's bytes, and
multiplied as "dequantize, then matmul against the int8-rounded activations", at every row
count (a few rows' stream and many rows' sweep), with the same bits for a row whatever else
shares the step."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from iterserve import kernels
from iterserve.model import block_formats as bf
from tiny_gguf import gguf_blocks

pytestmark = pytest.mark.usefixtures("any_kernel_isa")


def gguf_bytes(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] of a weight in GGUF type `name`."""
    weight = np.random.default_rng(seed).standard_normal((n, k)) * 0.05
    return gguf_blocks(name, weight, seed=seed)


def reference(raw: np.ndarray, name: str, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]).reshape(shape))


def close(out: torch.Tensor, want: torch.Tensor, rounded: bool) -> None:
    """out is `want` up to fp32 summation order (and one bf16 rounding if `rounded`)."""
    error = (out.double() - want).abs()
    allowed = want.abs() * (2.0**-8 if rounded else 0) + 2e-5 * want.abs().max() + 1e-6
    assert bool((error <= allowed).all()), f"max excess {(error - allowed).max().item()}"


@pytest.mark.parametrize("name", sorted(bf.BLOCK_FORMATS))
def test_sizes_agree_with_the_kernels(name: str) -> None:
    fmt = bf.BLOCK_FORMATS[name]
    assert kernels.ops().format_sizes(fmt.code) == (fmt.inputs, fmt.tile_bytes, fmt.file_bytes)
    assert GGMLQuantizationType[name].value is not None


@pytest.mark.parametrize("name", sorted(bf.BLOCK_FORMATS))
def test_tiles_unpack_bit_for_bit_as_gguf_dequantizes(name: str) -> None:
    fmt = bf.BLOCK_FORMATS[name]
    n, k = 40, 2 * max(fmt.inputs, 64)  # 40 rows: the last tile padded with zero rows
    raw = gguf_bytes(name, n, k)
    tiles = bf.repack(kernels.ops(), raw, fmt, k)
    assert tiles.shape == (3, fmt.bytes_per_tile(k))
    rows = torch.tensor([0, 39, 17, 5, 40, 47])  # 40-47: padding, all zero
    got = kernels.ops().dequantize_rows(tiles, fmt.code, k, rows, False)
    want = reference(raw, name, (n, k))
    assert torch.equal(got[:4], want[rows[:4]])
    assert not got[4:].any()
    as_bf16 = kernels.ops().dequantize_rows(tiles, fmt.code, k, rows[:4], True)
    assert torch.equal(as_bf16, want[rows[:4]].bfloat16())


def test_mxfp4_scales_at_the_ends_of_e8m0_unpack_bit_for_bit() -> None:
    """MXFP4's scales 2^(e - 128) at both ends: llama.cpp's two subnormals (e = 0, 1), the
    smallest normal (2), 2^-1 (127) and the largest (254, 255: 2^126, 2^127), whose larger
    values are infinite in the reference too, every 4-bit index under each. Unpacked only: a
    product of such weights overflows."""
    fmt = bf.BLOCK_FORMATS["MXFP4"]
    n, k = 24, 512
    blocks = gguf_bytes("MXFP4", n, k).reshape(n, k // 32, 17)
    rng = np.random.default_rng(1)
    blocks[..., 1:] = rng.integers(0, 256, blocks[..., 1:].shape, dtype=np.uint8)
    edges = np.array([0, 1, 2, 127, 254, 255], dtype=np.uint8)
    # Every other block at an edge, each exponent in every lane of a tile; the rest at the
    # quantizer's exponents.
    blocks[:, ::2, 0] = np.resize(edges, (n, k // 64))
    raw = blocks.reshape(n, -1)
    tiles = bf.repack(kernels.ops(), raw, fmt, k)
    with np.errstate(over="ignore"):
        want = reference(raw, "MXFP4", (n, k))
    tiny = (want != 0) & (want.abs() < torch.finfo(torch.float32).tiny)
    assert tiny.any() and want.isinf().any() and not want.isnan().any()
    rows = torch.arange(n)
    assert torch.equal(kernels.ops().dequantize_rows(tiles, fmt.code, k, rows, False), want)
    as_bf16 = kernels.ops().dequantize_rows(tiles, fmt.code, k, rows, True)
    assert torch.equal(as_bf16, want.bfloat16())  # d times a 4-bit integer: exact in bf16


@pytest.mark.parametrize("name", sorted(bf.BLOCK_FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 33, 65])
def test_products_match_dequantize_then_matmul(name: str, rows: int) -> None:
    fmt = bf.BLOCK_FORMATS[name]
    n, k = 48, 2 * max(fmt.inputs, 64)
    raw = gguf_bytes(name, n, k, seed=rows)
    tiles = bf.repack(kernels.ops(), raw, fmt, k)
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, k, generator=gen) * 2).bfloat16()
    x[0, : fmt.activation_unit] = 0  # an all-zero unit: scale 0, no division by it
    want = (
        bf.activations_as_quantized(x, fmt.activation_unit)
        @ reference(raw, name, (n, k)).double().T
    )
    out = kernels.ops().tiled_linear(x, [tiles], [fmt.code], None, None, True)
    close(out, want, rounded=False)


# Where each unsigned format's fp16 fields (d, and m or dmin) sit in its GGUF block.
FP16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82],
    "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(FP16_FIELDS))
@pytest.mark.parametrize("rows", [2, 6])
def test_products_at_the_largest_integer_sums(name: str, rows: int) -> None:
    """Every value and scale bit set (each format's largest values) against activations of
    one sign (all +-127 once quantized): the integer dot products at their largest. Without
    VNNI the 16-bit pair sums of `vpmaddubsw` then come within 7% of where they saturate
    (Q6_K's chunk: 32004 of 32767, simd.h `dot_u8`; summed before widening, `dot_u8_16`, a
    4-bit block's four chunks 30480 and a 5-bit block's two 31496), and a loop that summed more
    of them would saturate. 2 rows: a few rows' stream; 6: the sweep."""
    fmt = bf.BLOCK_FORMATS[name]
    n, k = 32, 512
    blocks = np.full((n, k // fmt.inputs, fmt.file_bytes), 0xFF, dtype=np.uint8)
    for offset in FP16_FIELDS[name]:  # 2^-10, so that no sum overflows fp32
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(2**-10).tobytes(), np.uint8)
    raw = blocks.reshape(n, -1)
    tiles = bf.repack(kernels.ops(), raw, fmt, k)
    signs = torch.tensor([1.0, -1.0]).repeat(rows // 2)
    x = (signs[:, None] * torch.ones(rows, k)).bfloat16()
    dequantized = reference(raw, name, (n, k)).double()
    want = bf.activations_as_quantized(x, fmt.activation_unit) @ dequantized.T
    out = kernels.ops().tiled_linear(x, [tiles], [fmt.code], None, None, True)
    close(out, want, rounded=False)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K", "IQ4_XS", "Q8_0"])
@pytest.mark.parametrize("k", [512, 8192])
def test_a_rows_result_does_not_depend_on_the_step(name: str, k: int) -> None:
    """The same bits for row 0 alone, among 3 (a few rows' stream), among 12 (the sweep) and
    among 70 (the sweep in slabs of rows: 64 and 6 at K = 512, five of at most 16 at 8192),
    and for every row of the 70 as alone. 37 tiles: a thread's share of a few rows' step is
    lanes of several tiles side by side and a ragged rest (tiles.h `LaneRun`)."""
    fmt = bf.BLOCK_FORMATS[name]
    n = 16 * 37
    tiles = bf.repack(kernels.ops(), gguf_bytes(name, n, k), fmt, k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(0)).bfloat16()

    def product(rows: torch.Tensor) -> torch.Tensor:
        return kernels.ops().tiled_linear(rows, [tiles], [fmt.code], None, None, True)

    results = [product(x[:m])[0] for m in (1, 3, 12)]
    among_70 = product(x)
    assert all(torch.equal(results[0], other) for other in [*results[1:], among_70[0]])
    assert torch.equal(among_70, torch.cat([product(x[m : m + 1]) for m in range(70)]))


@pytest.mark.parametrize("rows", [1, 2, 6, 40, 1100])
def test_segments_of_different_formats_run_as_one_weight(rows: int) -> None:
    """A fused q/k/v of Q4_K, Q4_K and Q6_K rows (as a Q4_K_M stores them), plus a bf16
    part, with bias and residual: the concatenation of each part's product. The parts span
    several passes of 8 tiles, ragged at their ends, so that the threads claim passes of each
    in turn (6 and 40 rows: the sweep; 1100: the sweep in blocks of 512 rows, the last
    ragged, tiles.h `kSweepRowBlock`)."""
    k = 256
    parts = [("Q4_K", 16 * 20), ("Q4_K", 16 * 9), ("Q6_K", 16 * 11)]
    raws = [gguf_bytes(name, n, k, seed=i) for i, (name, n) in enumerate(parts)]
    segments = [
        bf.repack(kernels.ops(), raw, bf.BLOCK_FORMATS[name], k)
        for raw, (name, _) in zip(raws, parts, strict=True)
    ]
    codes = [bf.BLOCK_FORMATS[name].code for name, _ in parts]
    gen = torch.Generator().manual_seed(rows)
    dense = (torch.randn(16, k, generator=gen) * 0.05).bfloat16()
    tiles, code = bf.tile_dense(dense)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    n = sum(m for _, m in parts) + 16
    bias = torch.randn(n, generator=gen).bfloat16()
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    out = kernels.ops().tiled_linear(x, [*segments, tiles], [*codes, code], bias, residual, False)
    blocks = torch.cat(
        [reference(raw, name, (m, k)) for raw, (name, m) in zip(raws, parts, strict=True)]
    )
    rounded = bf.activations_as_quantized(x, 256)  # the K-quants' unit
    want = torch.cat((rounded @ blocks.double().T, x.double() @ dense.double().T), dim=1)
    close(out, want + bias.double() + residual.double(), rounded=True)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 4])
def test_a_few_rows_step_takes_every_tile_once_whatever_the_threads(
    threads: int, rows: int
) -> None:
    """A few rows' step splits the tiles among the threads by bytes, each share in lanes and
    its last quarter in steps of one or more tiles, and a thread done with its share takes
    the back half of another's (thread_shares.h, tiles.h `LaneRun`): every tile computed
    once, into the bits one thread gives, and the product, for segments of 1 to 67 tiles of
    small and large tiles (K = 256 and 8192)."""
    for k, counts in ((256, [67, 1, 9, 30]), (8192, [2, 37, 5])):
        names = ["Q4_K" if i % 2 else "Q6_K" for i in range(len(counts))]
        raws = [gguf_bytes(name, 16 * m, k, seed=m) for name, m in zip(names, counts, strict=True)]
        segments = [
            bf.repack(kernels.ops(), raw, bf.BLOCK_FORMATS[name], k)
            for raw, name in zip(raws, names, strict=True)
        ]
        codes = [bf.BLOCK_FORMATS[name].code for name in names]
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            alone = kernels.ops().tiled_linear(x, segments, codes, None, None, True)
            torch.set_num_threads(threads)
            out = kernels.ops().tiled_linear(x, segments, codes, None, None, True)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(out, alone)
        blocks = torch.cat(
            [
                reference(raw, name, (16 * m, k))
                for raw, name, m in zip(raws, names, counts, strict=True)
            ]
        )
        close(out, bf.activations_as_quantized(x, 256) @ blocks.double().T, rounded=False)


def test_q8_0_made_at_load_is_llamas_quantizer() -> None:
    """`--weights int8` blocks: quantize_q8_0 gives the bytes gguf's Q8_0 quantizer gives."""
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(5)) * 0.1
    ours = bf.quantize_q8_0(w)
    theirs = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(
        dequantize(ours, GGMLQuantizationType.Q8_0), dequantize(theirs, GGMLQuantizationType.Q8_0)
    )


def test_a_row_permutation_and_padding_rows_are_applied_at_repack() -> None:
    fmt = bf.BLOCK_FORMATS["Q4_0"]
    raw = gguf_bytes("Q4_0", 20, 64)
    order = torch.tensor([*range(19, -1, -1), -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1])
    tiles = bf.repack(kernels.ops(), raw, fmt, 64, order)
    got = kernels.ops().dequantize_rows(tiles, fmt.code, 64, torch.arange(32), False)
    want = reference(raw, "Q4_0", (20, 64))
    assert torch.equal(got[:20], want.flip(0)) and not got[20:].any()
