"""csrc/lora.cpp's `lora_add_` (each row's adapter delta added to a projection's output)
against the same arithmetic in float64, on every kernel variant this CPU runs: rows of one
slot in groups of every size the op takes together (1-4, and more), rows of no adapter left
alone, fused projections of several parts, slots used out of order."""

from __future__ import annotations

import pytest
import torch

from iterserve import kernels


def _reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor], slots: list[int]
) -> torch.Tensor:
    out = y.double()
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        shrunk = a[slot].double() @ x[row].double()
        column = lo = 0
        for b in bs:
            rank, n = b.shape[1], b.shape[2]
            out[row, column : column + n] += shrunk[lo : lo + rank] @ b[slot].double()
            column, lo = column + n, lo + rank
    return out


@pytest.mark.parametrize(
    "k,parts,rank,slots",
    [
        (64, [32], 8, [0, -1, 0, 0, 0, 0, 0, -1, 0]),  # 7 rows of one slot: a group of 4, of 3
        (128, [64, 32, 32], 16, [2, 0, -1, 1, 2, 2, 0, 1, 2]),  # q/k/v-like: three parts
        (96, [48, 48], 4, [1, 1]),  # gate/up-like, two rows of slot 1, slot 0 unused
        (256, [16], 32, [-1, -1]),  # no adapter rows: y untouched
    ],
)
def test_lora_add_matches_float64(
    any_kernel_isa: str, k: int, parts: list[int], rank: int, slots: list[int]
) -> None:
    ops = kernels.ops()
    generator = torch.Generator().manual_seed(k + rank)
    num_slots = 3
    x = torch.randn(len(slots), k, generator=generator).bfloat16()
    a = (torch.randn(num_slots, rank * len(parts), k, generator=generator) * 0.2).bfloat16()
    bs = [(torch.randn(num_slots, rank, n, generator=generator) * 0.2).bfloat16() for n in parts]
    y = torch.randn(len(slots), sum(parts), generator=generator).bfloat16()
    want = _reference(y, x, a, bs, slots)
    got = y.clone()
    ops.lora_add_(got, x, a, bs, torch.tensor(slots, dtype=torch.int32))
    # One bf16 rounding of y + delta (the delta itself is summed in fp32).
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3)
    base_rows = [row for row, slot in enumerate(slots) if slot < 0]
    assert torch.equal(got[base_rows], y[base_rows])
    if any(slot >= 0 for slot in slots):
        assert not torch.equal(got, y)


def test_lora_add_refuses_a_bad_slot_and_mismatched_parts(kernel_isa: str) -> None:
    ops = kernels.ops()
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    a = torch.zeros(2, 8, 32, dtype=torch.bfloat16)
    b = torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    y = torch.zeros(2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="has slot 2 of 2"):
        ops.lora_add_(y, x, a, [b], torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="ranks add up to 16"):
        ops.lora_add_(y.new_zeros(2, 32), x, a, [b, b], torch.tensor([0, 1], dtype=torch.int32))
