"""Projections with LoRA slots: the base product, plus each row's adapter's delta.

    y = x @ W.T (+ residual) + scale * (x @ A.T) @ B.T      for rows of an adapter

Every adapted projection holds `max_loras` slots of A and B, stacked (loading an adapter is a
copy into its slot, model/lora_weights.py folds the scale into B). A fused projection (q/k/v,
gate/up) holds its parts' A's side by side, so one product shrinks x for all its parts, and one
B per part (part p's output columns read part p's ranks only: a block-diagonal B would read
zeros, and at decode the deltas' cost is reading these stacks); a part an adapter leaves alone
has zeros there. Ranks below --max-lora-rank are padded with zeros.

The step's rows are grouped by slot once (`LoRABatch`), and each projection then computes the
deltas per adapter, never per row:

- `bmm`: the rows gathered into one zero-padded [adapters, most rows, in] batch, batched
  products against the slots' stacks (one shrink, one expand per part), added back where the
  rows came from. A handful of ops per projection whatever the mix: the decode case (a few
  rows per adapter).
- `segments`: per adapter, its rows' products; for a step whose rows are unevenly spread
  (a long prompt beside a few decodes), where padding every adapter to the longest would
  multiply zeros.

On a CPU the slots and the delta are fp32 whatever the model's dtype: torch's bf16 batched
products there ran 1.5-2x slower than fp32 ones at these shapes (no bf16 arithmetic on the
machine measured; docs/lora.md), and the slots are small beside the weights. The deltas run
on one thread: products of a few rows by a rank of 16 are far below what pays for a parallel
region, and with other work on the cores each region's barrier waits for a descheduled thread
(measured: a 32-row delta 0.1 ms on one thread, 9-45 ms on two, machine loaded).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from iterserve.model.linear import Linear
from iterserve.model.lora_weights import LoRAModule

# Padding the rows of every adapter to the busiest one costs at most this many times the rows
# the step really has before the deltas are run adapter by adapter instead.
_MAX_PADDING = 2


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch's ops on one thread inside (setting the count is a sub-microsecond call)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def slot_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The slots' and the deltas' dtype: fp32 on a CPU (see above), the model's elsewhere."""
    return torch.float32 if device.type == "cpu" else dtype


# A fused projection's part as its delta reads it: its first output column, its B stack.
_PartB = tuple[int, torch.Tensor]


class LoRABatch:
    """Which rows of this step run which slot, in the two forms the deltas use."""

    def __init__(self, token_slots: Sequence[int], device: torch.device) -> None:
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(row)
        self.slots = sorted(groups)
        rows = [groups[s] for s in self.slots]
        longest = max(len(r) for r in rows)
        total = sum(len(r) for r in rows)
        self.bmm = len(rows) * longest <= _MAX_PADDING * total
        self.longest = longest
        if self.bmm:
            padded = [r + [r[0]] * (longest - len(r)) for r in rows]
            self.gather = torch.tensor([i for r in padded for i in r], device=device)
            keep = [float(j < len(r)) for r in rows for j in range(longest)]
            self.keep = torch.tensor(keep, device=device).unsqueeze(1)
            # Each row of the step: where its delta lies in the padded batch, or the zero
            # row past its end (a base row). A delta comes back as one gather and one dense
            # add: index_add_ into the output's column slice (a scatter) took 4x the products.
            where = [len(padded) * longest] * len(token_slots)
            for i, r in enumerate(rows):
                for j, row in enumerate(r):
                    where[row] = i * longest + j
            self.scatter_back = torch.tensor(where, device=device)
            # The slots as one slice when they are 0..n-1 (the usual case: free slots are
            # taken lowest first), so the stacks are read in place, not gathered.
            dense = self.slots == list(range(len(self.slots)))
            self.slot_index = None if dense else torch.tensor(self.slots, device=device)
        else:
            self.segments = [
                (s, torch.tensor(r, device=device)) for s, r in zip(self.slots, rows, strict=True)
            ]

    def add_delta(
        self, y: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, parts: Sequence[_PartB]
    ) -> torch.Tensor:
        """y += each row's adapter's delta. `a_t` [slots, in, parts x rank]: the A stack,
        transposed for the product; `parts`: each part's first output column and B stack
        [slots, rank, its columns]."""
        with _one_thread():
            return self._add_delta(y, x, a_t, parts)

    def _add_delta(
        self, y: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, parts: Sequence[_PartB]
    ) -> torch.Tensor:
        dtype = a_t.dtype
        if self.bmm:
            n = len(self.slots)
            index = self.slot_index
            xs = x.index_select(0, self.gather).to(dtype).mul_(self.keep.to(dtype))
            a = a_t[:n] if index is None else a_t.index_select(0, index)
            shrunk = torch.bmm(xs.view(n, self.longest, -1), a)
            for p, (column, b_t) in enumerate(parts):
                rank = b_t.shape[1]
                b = b_t[:n] if index is None else b_t.index_select(0, index)
                delta = torch.bmm(shrunk[:, :, p * rank : (p + 1) * rank], b)
                delta = torch.cat((delta.view(n * self.longest, -1), self._zero_row(delta)))
                out = y[:, column : column + b_t.shape[2]]
                out += delta.index_select(0, self.scatter_back).to(y.dtype)
            return y
        for slot, rows in self.segments:
            shrunk = x.index_select(0, rows).to(dtype) @ a_t[slot]
            for p, (column, b_t) in enumerate(parts):
                rank = b_t.shape[1]
                delta = shrunk[:, p * rank : (p + 1) * rank] @ b_t[slot]
                out = y[:, column : column + b_t.shape[2]]
                out.index_add_(0, rows, delta.to(y.dtype))
        return y


    @staticmethod
    def _zero_row(delta: torch.Tensor) -> torch.Tensor:
        return delta.new_zeros(1, delta.shape[-1])


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
        self.a_t = torch.zeros(max_loras, base.in_features, ranks, dtype=dtype, device=device)
        self.b_parts: list[_PartB] = []
        column = 0
        for _, rows in parts:
            b_t = torch.zeros(max_loras, max_rank, rows, dtype=dtype, device=device)
            self.b_parts.append((column, b_t))
            column += rows

    def load_slot(self, slot: int, modules: dict[str, LoRAModule]) -> None:
        """Put an adapter's matrices for this projection's parts into `slot` (zeros for the
        parts it does not adapt)."""
        self.a_t[slot].zero_()
        for p, ((name, _), (_, b_t)) in enumerate(zip(self.parts, self.b_parts, strict=True)):
            b_t[slot].zero_()
            module = modules.get(name)
            if module is not None:
                lo = p * self.max_rank
                self.a_t[slot, :, lo : lo + module.rank].copy_(module.a.t())
                b_t[slot, : module.rank].copy_(module.b.t())

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, fp32_out: bool = False
    ) -> torch.Tensor:
        y = self.base(x, residual, fp32_out)
        batch = self.state.batch
        return y if batch is None else batch.add_delta(y, x, self.a_t, self.b_parts)

    def __getattr__(self, name: str) -> Any:  # backend, describe(), nbytes, ... of the base
        return getattr(self.base, name)
