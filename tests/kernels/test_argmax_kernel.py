"""The kernels' `argmax_rows` (greedy sampling, csrc/argmax.cpp) against torch.argmax: the
first index of each row's maximum, or of its first NaN, at every row length (whole vectors,
a tail, a row shorter than one vector), with ties, -inf and rows of a wider tensor; and the
sampler's greedy tokens through it."""

from __future__ import annotations

import pytest
import torch

from iterserve import kernels
from iterserve.sample.sampler import Sampler
from iterserve.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("any_kernel_isa")


def _check(logits: torch.Tensor) -> None:
    got = kernels.ops().argmax_rows(logits)
    assert got.dtype == torch.long
    assert torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("n", [1, 5, 16, 17, 47, 64, 1000, 49152, 262144 + 3])
def test_rows_of_every_length(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    _check(torch.randn(6, n, generator=gen))


@pytest.mark.parametrize("n", [16, 33, 4096 + 7])
def test_ties_go_to_the_first_index(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    # Few distinct values: every row's maximum appears many times, in several lanes.
    _check(torch.randint(0, 4, (8, n), generator=gen).float())
    _check(torch.zeros(3, n))


def test_minus_infinity_and_nan() -> None:
    rows = torch.randn(7, 100)
    rows[0] = -torch.inf  # all -inf: index 0
    rows[1, :50] = -torch.inf
    rows[2, 70] = torch.inf
    rows[3, 40] = torch.nan  # a NaN wins, the first one
    rows[3, 90] = torch.nan
    rows[4, 97] = torch.nan  # in the tail past whole vectors
    rows[5, 3] = torch.nan
    rows[5, 10] = torch.inf
    _check(rows)


def test_rows_of_a_wider_tensor() -> None:
    wide = torch.randn(5, 300)
    _check(wide[:, :250])


def test_greedy_sampling_takes_the_same_tokens() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 49152, generator=gen)
    logits[2, 100:200] = logits[2].max() + 1  # a tie over a range
    greedy = SamplingParams(temperature=0.0)
    plain, fast = Sampler(), Sampler(kernels.ops().argmax_rows)
    args = ([greedy] * 9, [None] * 9)
    assert fast(logits, *args).token_ids == plain(logits, *args).token_ids
    mixed = [greedy if i % 2 else SamplingParams(temperature=0.8, seed=i) for i in range(9)]
    generators = [torch.Generator().manual_seed(i) for i in range(9)]
    out_plain = plain(logits, mixed, generators).token_ids
    generators = [torch.Generator().manual_seed(i) for i in range(9)]
    assert fast(logits, mixed, generators).token_ids == out_plain
