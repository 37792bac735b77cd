"""Who waits in which order, who is admitted when, and who gives way.

The scheduler asks these questions every step; the answers depend on the
batching mode (continuous / static / dynamic) and on lanes and priorities.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterator

from iterserve.config import SchedulerConfig
from iterserve.core.request import LANES, Request

_LANE_RANK = {lane: rank for rank, lane in enumerate(LANES)}


def admission_key(request: Request) -> tuple[int, float]:
    """Lower runs first: priority, then arrival (FCFS among equals)."""
    return (request.priority, request.arrival_time)


def victim_key(request: Request) -> tuple[int, int, int]:
    """Higher gives way first: batch lane, then low priority, then the latest admitted."""
    return (_LANE_RANK[request.lane], request.priority, request.admission_seq)


def _rank(lane: str, priority: int) -> tuple[int, int]:
    """Higher yields memory to lower."""
    return _LANE_RANK[lane], priority


def outranks(candidate: Request, victim: Request) -> bool:
    """Whether a waiting request may take a running one's memory."""
    return _rank(victim.lane, victim.priority) > _rank(candidate.lane, candidate.priority)


def outranks_any(candidate: Request, ranks: Counter[tuple[str, int]]) -> bool:
    """Whether a waiting request outranks any running one of these (lane, priority)
    ranks (counted; a rank with count 0 has no request left)."""
    mine = _rank(candidate.lane, candidate.priority)
    return any(n and _rank(*rank) > mine for rank, n in ranks.items())


class WaitingQueues:
    """One queue per lane, each kept in admission order."""

    def __init__(self) -> None:
        self._queues: dict[str, list[tuple[tuple[int, float, int], Request]]] = {
            lane: [] for lane in LANES
        }
        self._tiebreak = itertools.count()

    def push(self, request: Request) -> None:
        key = (*admission_key(request), next(self._tiebreak))
        bisect.insort(self._queues[request.lane], (key, request), key=lambda item: item[0])

    def remove(self, request: Request) -> bool:
        queue = self._queues[request.lane]
        for index, (_, queued) in enumerate(queue):
            if queued is request:
                del queue[index]
                return True
        return False

    def lane(self, lane: str) -> Iterator[Request]:
        """The lane's requests in admission order (a snapshot: safe to remove while iterating)."""
        return iter([request for _, request in self._queues[lane]])

    def count(self, lane: str | None = None) -> int:
        if lane is not None:
            return len(self._queues[lane])
        return sum(len(queue) for queue in self._queues.values())

    def __len__(self) -> int:
        return self.count()

    def all_in_order(self) -> list[Request]:
        """Every waiting request, interactive lane first."""
        return [req for lane in LANES for _, req in self._queues[lane]]


def form_batch(
    config: SchedulerConfig, waiting: WaitingQueues, now: float, no_more_arrivals: bool
) -> list[Request]:
    """Static and dynamic batching: the requests of the next batch, or [] to keep waiting.

    Both start when `batch_size` requests wait, when no more will come (an
    offline run knows; a server never does), or when the oldest has waited
    long enough. The difference is that wait: dynamic batching's
    `max_wait_ms` is short, trading batch size for latency; static batching's
    `static_max_wait_ms` is long, a backstop that keeps batches full whenever
    the load allows yet never lets a request wait for ever.
    When more wait than fit, the batch is the oldest request plus those closest to it
    in prompt length, which cuts the work spent on padding-like imbalance
    (short prompts finishing early while long ones hold the batch).
    """
    queued = waiting.all_in_order()
    if not queued:
        return []
    full = len(queued) >= config.batch_size
    wait_ms = config.max_wait_ms if config.batching == "dynamic" else config.static_max_wait_ms
    timed_out = now - min(r.arrival_time for r in queued) >= wait_ms / 1000.0
    if not (full or timed_out or no_more_arrivals):
        return []
    if len(queued) <= config.batch_size:
        return queued
    head, rest = queued[0], queued[1:]
    rest.sort(key=lambda r: abs(r.num_tokens - head.num_tokens))
    return [head, *rest[: config.batch_size - 1]]
