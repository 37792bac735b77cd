"""The C++ tiled linear kernels' dense formats (bf16, fp16) against the fp32 matmul, and what
the driver does for every format: bias and residual, strided rows, ragged passes over many
tiles and rows, padding, fp32 output. The block formats: test_block_formats.py."""

from __future__ import annotations

import pytest
import torch

from iterserve import kernels
from iterserve.model import block_formats as bf

# Every test runs once per ISA variant of the kernels (conftest.kernel_test_isas).
pytestmark = pytest.mark.usefixtures("any_kernel_isa")


def _tiled(x, weight, bias=None, residual=None, fp32_out=False):  # type: ignore[no-untyped-def]
    tiles, code = bf.tile_dense(weight)
    return kernels.ops().tiled_linear(x, [tiles], [code], bias, residual, fp32_out)


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
    out = _tiled(x, w, bias, residual)
    reference = x.float() @ w.float().T + bias.float() + residual.float()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    _close_to_bf16_rounding(out, reference)


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_fp16_tiles_stay_fp16_and_match_fp32_matmul(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = (torch.randn(48, 96, generator=gen) * 0.1).half()
    tiles, code = bf.tile_dense(w)
    assert code == bf.F16 and tiles.numel() == w.numel() * 2
    out = kernels.ops().tiled_linear(x, [tiles], [code], None, None, True)
    torch.testing.assert_close(out, x.float() @ w.float().T, atol=1e-4, rtol=1e-5)
    rows_back = kernels.ops().dequantize_rows(tiles, code, 96, torch.tensor([0, 47, 5]), False)
    assert torch.equal(rows_back, w[[0, 47, 5]].float())


@pytest.mark.parametrize("rows", [1, 37, 130])
def test_many_rows_over_many_tiles(rows: int) -> None:
    """Passes of a few tiles over every block of rows: a head-sized N and prefill-sized M."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = (torch.randn(16 * 37, 96, generator=gen) * 0.1).bfloat16()  # 37 tiles: ragged passes
    _close_to_bf16_rounding(_tiled(x, w), x.float() @ w.float().T)


def test_a_strided_row_view_is_read_in_place() -> None:
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 200, generator=gen).bfloat16()
    x = wide[:, 8:72]  # rows 200 apart, as a slice of a fused projection is
    w = (torch.randn(16, 64, generator=gen) * 0.1).bfloat16()
    out = _tiled(x, w)
    _close_to_bf16_rounding(out, x.float() @ w.float().T)


@pytest.mark.parametrize("inference", [True, False])
def test_results_held_by_the_caller_are_never_written_again(inference: bool) -> None:
    """The kernels reuse small tensors nothing holds (reused_empty.h): results kept in
    Python, and views of them, must keep their values over many later calls of every shape."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(1, 64, 32), (2, 64, 48), (1, 64, 32), (4, 96, 16)]  # (rows, k, n), one repeated
    calls = [
        (
            torch.randn(m, k, generator=gen).bfloat16(),
            (torch.randn(n, k, generator=gen) * 0.1).bfloat16(),
        )
        for m, k, n in shapes * 12
    ]
    with torch.inference_mode(inference):
        held = [_tiled(x, w) for x, w in calls[::2]]
        views = [out[:, :8] for out in held]
        for x, w in calls[1::2]:
            _tiled(x, w)  # dropped at once: its tensor may be handed out again
        for (x, w), out, view in zip(calls[::2], held, views, strict=True):
            assert torch.equal(out, _tiled(x, w)) and torch.equal(view, out[:, :8])
        assert len({out.data_ptr() for out in held}) == len(held)


@pytest.mark.parametrize("unit", [32, 256])
def test_the_activations_are_rounded_as_documented(unit: int) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 2 * unit, generator=gen) * 4).bfloat16()
    x[1, unit + 8] = 100.0  # one outlier: its unit's scale, not the row's
    q, s = kernels.ops().quantize_rows(x, unit)
    q_ref, s_ref = bf.quantize_activations(x, unit)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert int(q.abs().max()) == 127 and int(q[1, unit : 2 * unit].abs().max()) == 127
    # Per-unit scales keep the other units precise: within half a step of each input.
    step = s.repeat_interleave(unit, dim=1)
    assert bool(((q.float() * step - x.float()).abs() <= step / 2 + 1e-6).all())


def test_a_weight_not_whole_tiles_is_padded_and_its_bf16_rows_read_back() -> None:
    gen = torch.Generator().manual_seed(4)
    w = (torch.randn(37, 64, generator=gen) * 0.1).bfloat16()  # 2.3 tiles
    tiles, code = bf.tile_dense(w)
    assert tiles.shape[0] == 3
    x = torch.randn(2, 64, generator=gen).bfloat16()
    out = kernels.ops().tiled_linear(x, [tiles], [code], None, None, False)
    _close_to_bf16_rounding(out[:, :37], x.float() @ w.float().T)
    assert not out[:, 37:].any()
    rows = kernels.ops().dequantize_rows(tiles, code, 64, torch.tensor([36, 0]), True)
    assert torch.equal(rows, w[[36, 0]])
