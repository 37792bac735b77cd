"""Embedding requests' pools: which rows of a prompt chunk a pool reads, and the running
pool of a prompt computed over several chunks (chunked prefill).

A mean pool adds up every chunk's final-norm states and divides at the last chunk; a
last-token pool reads the last chunk's last row; a first-token (cls) pool keeps the first
chunk's first row. A chunk starting at position 0 starts the pool afresh: a request
preempted mid-prompt is recomputed from the start (mean and cls pools never take a cached
prefix, core/scheduler.py `_cached_prefix`). A scoring request's last-token pool goes
through the model's score head: its vector is the head's logits (one for a reranker).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from iterserve.core.outputs import ScheduledSeq


def hidden_rows(seq: ScheduledSeq) -> range:
    """The rows of `seq`'s chunk whose final-norm states its pool reads (none if it is not
    an embedding request)."""
    n = seq.num_new_tokens
    if seq.pooling == "mean":
        return range(n)
    if seq.pooling == "last" and seq.pool_now:
        return range(n - 1, n)
    if seq.pooling == "cls" and seq.num_computed_tokens == 0:
        return range(1)
    return range(0)


class Pooler:
    def __init__(self, score_head: torch.Tensor | None = None) -> None:
        # Per request whose prompt is part computed: the pool so far (fp32) and its count.
        self._partial: dict[str, tuple[torch.Tensor, int]] = {}
        # [labels, hidden] fp32, a reranker's or classifier's (model/score_head.py).
        self.score_head = score_head

    def take(
        self, seqs: Sequence[ScheduledSeq], hidden: torch.Tensor | None
    ) -> dict[str, list[float]]:
        """Fold a step's pooled rows (`hidden`: the rows of `hidden_rows`, sequence by
        sequence) into the pools; the vectors of the requests whose prompt ended."""
        vectors: dict[str, list[float]] = {}
        row = 0
        for seq in seqs:
            rows = len(hidden_rows(seq))
            if seq.pooling is None:
                continue
            assert hidden is not None or not rows
            part = hidden[row : row + rows].float() if rows and hidden is not None else None
            row += rows
            request_id = seq.request_id
            previous = None if seq.num_computed_tokens == 0 else self._partial.pop(request_id, None)
            if part is not None:
                pool = part.sum(0) if seq.pooling == "mean" else part[-1]
                count = rows if seq.pooling == "mean" else 1
                if previous is not None and seq.pooling == "mean":
                    pool, count = pool + previous[0], count + previous[1]
                elif previous is not None:  # cls: the first chunk's row stays
                    pool, count = previous
                previous = (pool, count)
            if not seq.pool_now:
                if previous is not None:
                    self._partial[request_id] = previous
                continue
            assert previous is not None, f"request {request_id}: nothing pooled"
            pool, count = previous
            if seq.score:
                assert self.score_head is not None, "a scoring request on a model without one"
                vectors[request_id] = (self.score_head @ pool).tolist()
            else:
                vectors[request_id] = (pool / count).tolist()
        return vectors

    def drop(self, request_id: str) -> None:
        self._partial.pop(request_id, None)
