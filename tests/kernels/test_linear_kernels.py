"""The C++ tiled linear kernels against dequantize-then-matmul in fp32, and the repacking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from iterserve import kernels
from iterserve.model import quant

# Every test runs once per ISA variant of the kernels (conftest.kernel_test_isas).
pytestmark = pytest.mark.usefixtures("any_kernel_isa")

BF16, Q4, Q8, I8 = 0, 1, 2, 3


def _tiled(
    x, weight, scales, fmt, bias=None, residual=None, wide=None, max_rows=64, wide_fmt=BF16,
    wide_scales=None,
):  # fmt: skip
    return kernels.ops().tiled_linear(
        x, weight, scales, bias, residual, fmt, wide, wide_scales, wide_fmt, max_rows
    )


def _random_q4(n: int, k: int, gen: torch.Generator) -> quant.QuantizedWeight:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = (torch.rand(n, k // 32, generator=gen) * 0.02).half()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.15).half()
    return quant.QuantizedWeight("q4", q, d, m)


def _close_to_bf16_rounding(out: torch.Tensor, reference: torch.Tensor) -> None:
    """out is reference rounded once to bf16, up to fp32 summation order."""
    error = (out.float() - reference).abs()
    # Half a bf16 ulp of each value, plus fp32 accumulation slack.
    allowed = reference.abs() * 2.0**-8 + 1e-4 * reference.abs().max()
    assert bool((error <= allowed).all()), f"max excess {(error - allowed).max().item()}"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("n,k", [(16, 32), (96, 64), (208, 576)])
def test_bf16_tiles_match_fp32_matmul_with_bias_and_residual(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    out = _tiled(x, quant.tile_bf16(w), None, BF16, bias, residual)
    reference = x.float() @ w.float().T + bias.float() + residual.float()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    _close_to_bf16_rounding(out, reference)


def _q4_reference(x: torch.Tensor, weight: quant.QuantizedWeight) -> torch.Tensor:
    """What the q4 kernel computes on this ISA variant: exact products against the
    dequantized weights where the CPU has bf16 dot products; elsewhere the activations
    quantized to int8 per block of 32 (as the i8 format does) against the nibbles, with each
    block's offset m times the exact sum of its inputs:
        sum_k x_k (d q_k + m) ~ d * sum_k (s xq_k) q_k + m * sum_k x_k."""
    variant = kernels.describe()
    if variant is not None and variant.native_bf16:
        return x.float() @ weight.dequantize().T
    xq, xs = quant.quantize_activations(x)
    rows, k = x.shape
    x_dequantized = (xq.double().view(rows, k // 32, 32) * xs.double()[..., None]).view(rows, k)
    n = weight.shape[0]
    offsets = weight.m.double().repeat_interleave(32, dim=1)  # type: ignore[union-attr]
    scaled = weight.q.double() * weight.d.double().repeat_interleave(32, dim=1)
    return (x_dequantized @ scaled.T + x.double() @ offsets.T).float().view(rows, n)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 9])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (208, 576)])
def test_q4_tiles_match_dequantize_then_matmul(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 100 + k)
    weight = _random_q4(n, k, gen)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    q, scales = quant.tile_quantized(weight)
    out = _tiled(x, q, scales, Q4, residual=residual)
    _close_to_bf16_rounding(out, _q4_reference(x, weight) + residual.float())


@pytest.mark.parametrize("rows", [1, 4, 7])
def test_q8_tiles_match_dequantize_then_matmul(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    n, k = 128, 96
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    weight = quant.QuantizedWeight("q8", q, (torch.rand(n, 3, generator=gen) * 0.01).half(), None)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    out = _tiled(x, *quant.tile_quantized(weight), Q8)
    _close_to_bf16_rounding(out, x.float() @ weight.dequantize().T)


def test_rows_past_the_quantized_limit_run_the_bf16_copy() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = _random_q4(32, 64, gen)
    dense = weight.dequantize(torch.bfloat16)
    x = torch.randn(9, 64, generator=gen).bfloat16()
    residual = torch.randn(9, 32, generator=gen).bfloat16()
    q, scales = quant.tile_quantized(weight)
    wide = quant.tile_bf16(dense)
    for res in (None, residual):
        extra = 0 if res is None else res.float()
        as_bf16 = _tiled(x, q, scales, Q4, residual=res, wide=wide, max_rows=4)
        _close_to_bf16_rounding(as_bf16, x.float() @ dense.float().T + extra)
        as_q4 = _tiled(x, q, scales, Q4, residual=res, wide=wide, max_rows=9)
        _close_to_bf16_rounding(as_q4, _q4_reference(x, weight) + extra)
        assert not torch.equal(as_bf16, as_q4)  # the copy is rounded to bf16, the blocks not


def _w8a8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Quantize the activations as documented, then an exact matmul of the int8 values."""
    xq, xs = quant.quantize_activations(x)
    m, k = x.shape
    dequantized = (xq.double().view(m, k // 32, 32) * xs.double()[..., None]).view(m, k)
    return (dequantized @ (q.double() * scales.double()[:, None]).T).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 70])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (208, 576)])
def test_i8_tiles_match_quantize_then_exact_matmul(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 10 + n)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = (torch.randn(rows, k, generator=gen) * 3).bfloat16()
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    bias = torch.randn(n, generator=gen).bfloat16()
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    q, scales = quant.quantize_int8(w)
    out = _tiled(x, quant.tile_int8(q), scales, I8, bias, residual)
    _close_to_bf16_rounding(out, _w8a8_reference(x, q, scales) + bias.float() + residual.float())


def test_i8_rounds_activations_as_the_documented_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 96, generator=gen) * 4).bfloat16()
    x[1, 40] = 100.0  # one outlier: its block's scale, not the row's
    q, s = kernels.ops().quantize_rows(x)
    q_ref, s_ref = quant.quantize_activations(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert int(q.abs().max()) == 127 and int(q[1, 32:64].abs().max()) == 127
    # Per-block scales keep small blocks precise: within half a step of each input.
    step = s.repeat_interleave(32, dim=1)
    assert bool(((q.float() * step - x.float()).abs() <= step / 2 + 1e-6).all())


def test_quantize_int8_is_symmetric_per_output_row() -> None:
    w = torch.tensor([[0.5, -1.0, 0.25, 0.0], [2.0, 1.0, -0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = quant.quantize_int8(w)
    assert torch.equal(s, torch.tensor([1.0, 2.0, 0.0]) / 127)
    assert q.tolist() == [[64, -127, 32, 0], [127, 64, -32, 0], [0, 0, 0, 0]]


def test_rows_past_the_quantized_limit_run_the_int8_copy() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = _random_q4(32, 64, gen)
    q8, s8 = quant.quantize_int8(weight.dequantize())
    x = torch.randn(9, 64, generator=gen).bfloat16()
    q, scales = quant.tile_quantized(weight)
    wide = dict(wide=quant.tile_int8(q8), wide_scales=s8, wide_fmt=I8)
    as_i8 = _tiled(x, q, scales, Q4, max_rows=4, **wide)
    _close_to_bf16_rounding(as_i8, _w8a8_reference(x, q8, s8))
    as_q4 = _tiled(x, q, scales, Q4, max_rows=9, **wide)
    _close_to_bf16_rounding(as_q4, _q4_reference(x, weight))


@pytest.mark.parametrize("rows", [1, 37, 130])
def test_many_rows_over_many_tiles(rows: int) -> None:
    """Passes of a few tiles over every block of rows: a head-sized N and prefill-sized M."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = (torch.randn(16 * 37, 96, generator=gen) * 0.1).bfloat16()  # 37 tiles: ragged passes
    _close_to_bf16_rounding(_tiled(x, quant.tile_bf16(w), None, BF16), x.float() @ w.float().T)


def test_a_strided_row_view_is_read_in_place() -> None:
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 200, generator=gen).bfloat16()
    x = wide[:, 8:72]  # rows 200 apart, as a slice of a fused projection is
    w = (torch.randn(16, 64, generator=gen) * 0.1).bfloat16()
    out = _tiled(x, quant.tile_bf16(w), None, BF16)
    _close_to_bf16_rounding(out, x.float() @ w.float().T)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_unpack_like_the_gguf_reference_dequantizer(qtype: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    values = rng.standard_normal((32, 96)).astype(np.float32)
    kind = GGMLQuantizationType[qtype]
    raw = quantize(values, kind)
    expected = dequantize(raw, kind)
    weight = quant.from_gguf_blocks(raw.reshape(-1), qtype, (32, 96))
    np.testing.assert_array_equal(weight.dequantize().numpy(), expected)
