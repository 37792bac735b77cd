"""Projections with LoRA slots: the base product, plus each row's adapter's delta.

    y = x @ W.T (+ residual) + scale * (x @ A.T) @ B.T      for rows of an adapter

Every adapted projection holds `max_loras` slots of A and B, stacked (loading an adapter is a
copy into its slot, model/lora_weights.py folds the scale into B). A fused projection (q/k/v,
gate/up) holds its parts' A's one above the other, so one product shrinks x for all its parts,
and one B per part (part p's output columns read part p's ranks only: a block-diagonal B would
read zeros, and at decode the deltas' cost is reading these stacks); a part an adapter leaves
alone has zeros there. Ranks below --max-lora-rank are padded with zeros. The slots hold the
model's dtype (bf16 slots are half the bytes a decode step reads for them).

Two ways compute the deltas, both per adapter, never per row:

- iterserve's C++ op (csrc/lora.cpp), on the tiled fast path: one call a projection, given
  each row's slot, also from inside the fused C++ layer op, which therefore keeps running
  with adapters (model/lora_model.py).
- torch, the reference and the path without the kernels. The step's rows are grouped by slot
  once (`LoRABatch`), then per projection either
  `bmm`: the rows gathered into one zero-padded [adapters, most rows, in] batch, batched
  products against the slots' stacks, added back where the rows came from (the decode case,
  a few rows per adapter); or `segments`: per adapter, its rows' products, for a step whose
  rows are unevenly spread (a long prompt beside a few decodes), where padding every adapter
  to the longest would multiply zeros. On a CPU these products run in fp32 and on one thread:
  torch's bf16 batched products there ran 1.5-2x slower than fp32 ones at these shapes (no
  bf16 arithmetic on the machine measured; docs/lora.md), and products of a few rows by a
  rank of 16 are far below what pays for a parallel region (a 32-row delta 0.1 ms on one
  thread, 9-45 ms on two with other work on the cores).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from iterserve.model.linear import Linear
from iterserve.model.lora_weights import LoRAModule

# Padding the rows of every adapter to the busiest one costs at most this many times the rows
# the step really has before the deltas are run adapter by adapter instead.
_MAX_PADDING = 2
# csrc/lora.cpp reads x and writes y 16 columns at a time.
_KERNEL_LANES = 16


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch's ops on one thread inside (setting the count is a sub-microsecond call)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The torch path's products: fp32 on a CPU (see above), the slots' dtype elsewhere."""
    return torch.float32 if device.type == "cpu" else dtype


# A fused projection's part as its delta reads it: its first output column, its B stack.
_PartB = tuple[int, torch.Tensor]


class LoRABatch:
    """Which rows of this step run which slot: per row for the C++ op, grouped for torch."""

    def __init__(self, token_slots: Sequence[int], device: torch.device) -> None:
        self.token_slots = list(token_slots)
        self.device = device
        self.row_slots = torch.tensor(self.token_slots, dtype=torch.int32, device=device)

    @functools.cached_property
    def _groups(self) -> tuple[list[int], list[list[int]]]:
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(self.token_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(row)
        slots = sorted(groups)
        return slots, [groups[s] for s in slots]

    @functools.cached_property
    def padded(self) -> _Padded | None:
        """The rows as one padded batch, or None when padding would waste too much."""
        slots, rows = self._groups
        longest = max(len(r) for r in rows)
        if len(rows) * longest > _MAX_PADDING * sum(len(r) for r in rows):
            return None
        return _Padded(slots, rows, len(self.token_slots), self.device)

    @functools.cached_property
    def segments(self) -> list[tuple[int, torch.Tensor]]:
        """Each slot and its rows."""
        slots, rows = self._groups
        return [(s, torch.tensor(r, device=self.device)) for s, r in zip(slots, rows, strict=True)]

    def add_delta(
        self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, parts: Sequence[_PartB]
    ) -> torch.Tensor:
        """y += each row's adapter's delta, in torch. `a` [slots, parts x rank, in]: the A
        stack; `parts`: each part's first output column and B stack [slots, rank, its
        columns]."""
        with _one_thread():
            dtype = _compute_dtype(y.device, a.dtype)
            padded = self.padded
            if padded is not None:
                return padded.add_delta(y, x, a, parts, dtype)
            for slot, rows in self.segments:
                shrunk = x.index_select(0, rows).to(dtype) @ a[slot].to(dtype).t()
                for p, (column, b) in enumerate(parts):
                    rank = b.shape[1]
                    delta = shrunk[:, p * rank : (p + 1) * rank] @ b[slot].to(dtype)
                    out = y[:, column : column + b.shape[2]]
                    out.index_add_(0, rows, delta.to(y.dtype))
            return y


class _Padded:
    """The step's adapter rows gathered into [adapters, most rows] (padding repeats a row and
    is masked), and where each row's delta comes back from."""

    def __init__(
        self, slots: list[int], rows: list[list[int]], num_rows: int, device: torch.device
    ) -> None:
        self.n = len(slots)
        self.longest = longest = max(len(r) for r in rows)
        padded = [r + [r[0]] * (longest - len(r)) for r in rows]
        self.gather = torch.tensor([i for r in padded for i in r], device=device)
        keep = [float(j < len(r)) for r in rows for j in range(longest)]
        self.keep = torch.tensor(keep, device=device).unsqueeze(1)
        # Each row of the step: where its delta lies in the padded batch, or the zero row past
        # its end (a base row). A delta comes back as one gather and one dense add:
        # index_add_ into the output's column slice (a scatter) took 4x the products.
        where = [self.n * longest] * num_rows
        for i, r in enumerate(rows):
            for j, row in enumerate(r):
                where[row] = i * longest + j
        self.scatter_back = torch.tensor(where, device=device)
        # The slots as one slice when they are 0..n-1 (the usual case: free slots are taken
        # lowest first), so the stacks are read in place, not gathered.
        dense = slots == list(range(self.n))
        self.slot_index = None if dense else torch.tensor(slots, device=device)

    def _stack(self, stack: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        picked = stack[: self.n] if self.slot_index is None else stack[self.slot_index]
        return picked.to(dtype)

    def add_delta(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        a: torch.Tensor,
        parts: Sequence[_PartB],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        xs = x.index_select(0, self.gather).to(dtype).mul_(self.keep.to(dtype))
        shrunk = torch.bmm(xs.view(self.n, self.longest, -1), self._stack(a, dtype).transpose(1, 2))
        for p, (column, b) in enumerate(parts):
            rank = b.shape[1]
            delta = torch.bmm(shrunk[:, :, p * rank : (p + 1) * rank], self._stack(b, dtype))
            delta = torch.cat(
                (delta.view(self.n * self.longest, -1), delta.new_zeros(1, b.shape[2]))
            )
            out = y[:, column : column + b.shape[2]]
            out += delta.index_select(0, self.scatter_back).to(y.dtype)
        return y


class LoRAState:
    """What every LoRA projection of a model reads: this step's batch (None: no adapter
    rows, the base products alone)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear:
    """A `Linear` and its LoRA slots; called like the Linear it wraps."""

    def __init__(
        self,
        base: Linear,
        parts: Sequence[tuple[str, int]],
        state: LoRAState,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`parts`: (HF module path, output rows) of each part of the fused projection."""
        self.base = base
        self.parts = list(parts)
        self.state = state
        self.max_rank = max_rank
        ranks = len(parts) * max_rank
        self.a = torch.zeros(max_loras, ranks, base.in_features, dtype=dtype, device=device)
        self.b_parts: list[_PartB] = []
        column = 0
        for _, rows in parts:
            b = torch.zeros(max_loras, max_rank, rows, dtype=dtype, device=device)
            self.b_parts.append((column, b))
            column += rows
        self.b_stacks = [b for _, b in self.b_parts]
        # The C++ op, where it takes these shapes: the base runs on the kernels (bf16).
        fits = base.in_features % _KERNEL_LANES == 0 and all(
            rows % _KERNEL_LANES == 0 for _, rows in parts
        )
        on_kernels = base.backend == "tiled" and fits and dtype == torch.bfloat16
        self.kernel_ops = base.ops if on_kernels else None

    def load_slot(self, slot: int, modules: dict[str, LoRAModule]) -> None:
        """Put an adapter's matrices for this projection's parts into `slot` (zeros for the
        parts it does not adapt)."""
        self.a[slot].zero_()
        for p, ((name, _), (_, b)) in enumerate(zip(self.parts, self.b_parts, strict=True)):
            b[slot].zero_()
            module = modules.get(name)
            if module is not None:
                lo = p * self.max_rank
                self.a[slot, lo : lo + module.rank].copy_(module.a)
                b[slot, : module.rank].copy_(module.b.t())

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp32_out: bool = False
    ) -> torch.Tensor:
        y = self.base(x, residual, fp32_out)
        batch = self.state.batch
        if batch is None:
            return y
        if self.kernel_ops is not None and x.dim() == 2 and x.stride(1) == 1 and not fp32_out:
            self.kernel_ops.lora_add_(y, x, self.a, self.b_stacks, batch.row_slots)
            return y
        return batch.add_delta(y, x, self.a, self.b_parts)

    def __getattr__(self, name: str) -> Any:  # backend, describe(), nbytes, ... of the base
        return getattr(self.base, name)
