"""Timing contenders against each other: their calls alternate, so a noisy spell on a
shared machine hits every contender alike instead of the one that happened to run then."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def one_round(fns: dict[str, Callable[[], object]]) -> float:
    """Calls each contender once (a warm-up, or a probe to size the repeats); the seconds
    the round took."""
    start = time.perf_counter()
    for fn in fns.values():
        fn()
    return time.perf_counter() - start


def interleaved(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds per call of each contender over `repeats` alternating rounds, by
    `clock` (time.thread_time: the calling thread's CPU time, which other processes' load
    barely moves, for contenders that run on this thread alone)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            samples[name].append(clock() - start)
    return {name: statistics.median(times) for name, times in samples.items()}
