"""The kernels' `norm_rows` (a model's final norm, csrc/layer.cpp) against transformers'
LlamaRMSNorm in bf16 on the same rows: fp32 statistics, the normed row rounded to bf16, times
the weight, rounded again; rows picked in any order and repeated; bad arguments refused."""

from __future__ import annotations

import pytest
import torch

from iterserve import kernels

pytestmark = pytest.mark.usefixtures("any_kernel_isa")


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward on bf16 input."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(torch.bfloat16)


@pytest.mark.parametrize("hidden", [16, 576, 2048, 3072 + 16])
def test_rows_match_transformers_rounding(hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(9, hidden, generator=gen) * 3).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16()
    rows = torch.tensor([8, 0, 3, 3])
    got = kernels.ops().norm_rows(x, rows, weight, 1e-5)
    want = _reference(x[rows], weight, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # The fp32 mean of squares is summed in another order than torch's: a value lying
    # within an fp32 rounding of a bf16 halfway point may round the other way.
    ulps = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)
    assert ulps.max() <= 2**-7
    assert (got == want).float().mean() > 0.99


def test_rows_of_a_wider_tensor_and_no_rows() -> None:
    x = torch.randn(6, 96).bfloat16()
    wide = torch.cat([x, torch.full((6, 32), float("nan")).bfloat16()], 1)[:, :96]
    weight = torch.ones(96).bfloat16()
    ops = kernels.ops()
    assert torch.equal(
        ops.norm_rows(wide, torch.tensor([1, 5]), weight, 1e-6),
        ops.norm_rows(x, torch.tensor([1, 5]), weight, 1e-6),
    )
    assert ops.norm_rows(x, torch.tensor([], dtype=torch.long), weight, 1e-6).shape == (0, 96)


def test_many_rows_split_across_threads_give_each_rows_bits() -> None:
    x = torch.randn(64, 128).bfloat16()
    weight = torch.randn(128).bfloat16()
    ops = kernels.ops()
    every = ops.norm_rows(x, torch.arange(64), weight, 1e-6)
    for r in (0, 17, 63):
        assert torch.equal(every[r], ops.norm_rows(x, torch.tensor([r]), weight, 1e-6)[0])


@pytest.mark.parametrize(
    ("x", "rows", "weight", "message"),
    [
        (torch.randn(2, 32).bfloat16(), torch.tensor([2]), torch.ones(32).bfloat16(), "outside"),
        (torch.randn(2, 32).bfloat16(), torch.tensor([-1]), torch.ones(32).bfloat16(), "outside"),
        (torch.randn(2, 32), torch.tensor([0]), torch.ones(32).bfloat16(), "bf16"),
        (torch.randn(2, 24).bfloat16(), torch.tensor([0]), torch.ones(24).bfloat16(), "16"),
        (torch.randn(2, 32).bfloat16(), torch.tensor([0]), torch.ones(16).bfloat16(), "weight"),
        (torch.randn(2, 32).bfloat16(), torch.tensor([0.0]), torch.ones(32).bfloat16(), "int64"),
    ],
)
def test_bad_arguments_are_refused(
    x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        kernels.ops().norm_rows(x, rows, weight, 1e-6)
