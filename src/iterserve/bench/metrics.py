"""The metric math: RequestRecords -> a throughput block, a latency block, goodput.

Throughput and latency stay separate: a fast server that makes every user wait shows high
tok/s *and* high TTFT, never one blended score. Latency percentiles use linear interpolation
between order statistics (numpy's default, the same as `vllm bench serve`), so p50 of
[1, 2, 3, 4] is 2.5. Failed requests count in `failed` and nowhere else.
"""

from __future__ import annotations

import math
import re
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from iterserve.bench.records import RequestRecord
from iterserve.core.kv_cache import hit_rate

PERCENTILES = (50, 90, 99)

# Pooled token times go through numpy this many at a time: a fresh array of a large
# simulation's 2e8 floats is 1.6 GB of new pages to fault in; a 32 MB buffer used again
# costs none.
_CHUNK = 1 << 22

# SLO name -> how to read the request's value for it (seconds). `tbt` is the request's worst
# gap: one long stall is what a reader of a stream notices, however smooth the rest was.
_SLO_METRICS: dict[str, Callable[[RequestRecord], float | None]] = {
    "ttft": lambda r: r.ttft,
    "tpot": lambda r: r.tpot,
    "tbt": lambda r: r.max_itl,
    "e2e": lambda r: r.e2e,
    "queue": lambda r: r.queue_time,
}
_SLO_ALIASES = {"itl": "tbt", "e2el": "e2e", "queue_time": "queue"}
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass
class Distribution:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    std: float
    median: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(
        cls, seconds: Sequence[float] | np.ndarray, in_place: bool = False
    ) -> Distribution | None:
        """`in_place`: `seconds` is a float64 array no one needs after: it is scaled and
        partially sorted where it lies (no copy of a large simulation's 2e8 gaps)."""
        if len(seconds) == 0:
            return None
        if in_place:
            assert isinstance(seconds, np.ndarray) and seconds.dtype == np.float64
            ms = np.multiply(seconds, 1e3, out=seconds)
        else:
            ms = np.asarray(seconds, dtype=float) * 1e3
        mean = float(ms.mean())
        std = float(ms.std()) if len(ms) <= _CHUNK else _chunked_std(ms, mean)
        # One partition for the three, not three; in place if the caller allows.
        p50, p90, p99 = np.percentile(ms, PERCENTILES, overwrite_input=in_place).tolist()
        return cls(mean, std, p50, p90, p99, len(ms))


def _chunked_std(values: np.ndarray, mean: float) -> float:
    """np.std without its temporary array of deviations (equal up to rounding)."""
    deviations = np.empty(_CHUNK)
    total = 0.0
    for start in range(0, len(values), _CHUNK):
        chunk = values[start : start + _CHUNK]
        d = np.subtract(chunk, mean, out=deviations[: len(chunk)])
        total += float(np.dot(d, d))
    return math.sqrt(total / len(values))


@dataclass
class ThroughputBlock:
    duration: float  # seconds, run origin -> last request finished
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    input_throughput: float  # tok/s
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float  # busiest one-second window
    max_concurrent_requests: int
    request_goodput: float | None = None  # req/s meeting every SLO; None when none given


@dataclass
class LatencyBlock:
    ttft: Distribution | None
    itl: Distribution | None  # TBT: every gap between consecutive tokens, all requests pooled
    tpot: Distribution | None
    e2el: Distribution | None
    queue: Distribution | None  # None when the runner cannot see admission (an HTTP client)

    def items(self) -> list[tuple[str, Distribution | None]]:
        return [
            ("ttft", self.ttft),
            ("itl", self.itl),
            ("tpot", self.tpot),
            ("e2el", self.e2el),
            ("queue", self.queue),
        ]


@dataclass
class Goodput:
    slos_ms: dict[str, float]
    num_met: int
    request_goodput: float  # req/s

    @property
    def description(self) -> str:
        return ",".join(f"{name}<={value:g}ms" for name, value in self.slos_ms.items())


@dataclass
class BenchMetrics:
    throughput: ThroughputBlock
    latency: LatencyBlock
    goodput: Goodput | None = None
    # Per-lane latency when a workload mixes lanes (interactive chats vs batch documents).
    lanes: dict[str, LatencyBlock] = field(default_factory=dict)
    prefix_cache_hit_rate: float | None = None  # cached / total prompt tokens, when reported
    # Speculative decoding: accepted / proposed draft tokens, when any were proposed.
    spec_acceptance_rate: float | None = None
    # Why requests failed: each distinct error with its count, most frequent first.
    failure_reasons: dict[str, int] = field(default_factory=dict)


# ---- SLOs ----------------------------------------------------------------------------


def parse_slos(text: str | None) -> dict[str, float]:
    """ "ttft=500ms,tpot=100ms" -> {"ttft": 0.5, "tpot": 0.1} (seconds).

    Units us, ms or s; a bare number is milliseconds (as in `vllm bench serve --goodput`).
    """
    slos: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"SLO {part!r} is not name=value (e.g. ttft=500ms)")
        name = _SLO_ALIASES.get(name.strip().lower(), name.strip().lower())
        if name not in _SLO_METRICS:
            raise ValueError(f"unknown SLO {name!r}; know {', '.join(_SLO_METRICS)}")
        match = re.fullmatch(r"\s*([0-9.]+(?:e-?[0-9]+)?)\s*(us|ms|s)?\s*", value)
        if not match:
            raise ValueError(f"SLO value {value!r} is not a time such as 500ms or 0.5s")
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "ms"]
        if seconds <= 0:
            raise ValueError(f"SLO {name} must be positive")
        slos[name] = seconds
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A successful request meets an SLO unless its value exceeds the bound.

    A request without a value (TPOT of a one-token answer) has nothing that could violate it.
    """
    if not record.success:
        return False
    for name, bound in slos.items():
        value = _SLO_METRICS[name](record)
        if value is not None and value > bound:
            return False
    return True


# ---- the blocks ----------------------------------------------------------------------


@dataclass(frozen=True)
class TokenTimes:
    """Every record's token times end to end, with where each record's start and how many
    it has: joined in C rather than a Python loop per token (a simulated million requests
    have ~2e8), once for the figures that need them."""

    times: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> TokenTimes:
        lengths = np.fromiter((len(r.token_times) for r in records), np.int64, len(records))
        # The simulator's float arrays join as bytes in one call; a client's lists convert.
        chunks = (
            r.token_times if isinstance(r.token_times, array) else array("d", r.token_times)
            for r in records
        )
        # A bytearray, so the array is writable (inter_token_gaps may reuse it).
        times = np.frombuffer(bytearray().join(chunks), np.float64)
        return cls(times, np.cumsum(lengths) - lengths, lengths)


def peak_output_throughput(
    records: Sequence[RequestRecord], window: float = 1.0, pooled: TokenTimes | None = None
) -> float:
    """Most output tokens finished in any one `window`-second bucket, per second, over the
    successful records (`pooled`: their TokenTimes, if already built).

    Tokens a server reported (usage) beyond the chunks it streamed are counted with the last
    chunk: they arrived no later than it.
    """
    ok = [r for r in records if r.success]
    pooled = TokenTimes.of(ok) if pooled is None else pooled
    times = pooled.times
    if not len(times):
        return 0.0

    def buckets(instants: np.ndarray, out: np.ndarray) -> np.ndarray:
        np.divide(instants, window, out=out)
        return np.floor(out, out=out).astype(np.int64) - first

    first = math.floor(times.min() / window)  # the earliest bucket, counted as 0
    tokens = np.zeros(0, np.int64)  # one per token time, then the unstreamed ones
    scratch = np.empty(min(_CHUNK, len(times)))
    for start in range(0, len(times), _CHUNK):
        chunk = times[start : start + _CHUNK]
        counts = np.bincount(buckets(chunk, scratch[: len(chunk)]))
        if len(counts) > len(tokens):
            tokens = np.concatenate([tokens, np.zeros(len(counts) - len(tokens), np.int64)])
        tokens[: len(counts)] += counts
    streamed = pooled.lengths > 0
    unstreamed = np.fromiter((r.output_len for r in ok), np.int64, len(ok)) - pooled.lengths
    ends = (pooled.starts + pooled.lengths - 1)[streamed]
    extra = np.maximum(0, unstreamed[streamed])
    if extra.any():  # bincount, not np.add.at (an unbuffered loop an element)
        last = buckets(times[ends], np.empty(len(ends)))
        tokens += np.bincount(last, extra, len(tokens)).astype(np.int64)
    return float(tokens.max()) / window


def inter_token_gaps(
    records: Sequence[RequestRecord], pooled: TokenTimes | None = None, reuse: bool = False
) -> np.ndarray:
    """Every gap between consecutive tokens of one request, over all records (`pooled`:
    their TokenTimes, if already built). `reuse`: in pooled.times' own buffer, which the
    gaps overwrite (a large simulation's 2e8 of them, without a fresh array)."""
    pooled = TokenTimes.of(records) if pooled is None else pooled
    times, starts = pooled.times, pooled.starts
    if len(times) < 2:
        return np.empty(0)
    first_of_record = starts[(starts > 0) & (starts < len(times))]
    keep = np.ones(len(times) - 1, dtype=bool)
    keep[first_of_record - 1] = False  # the step from one record's last to the next's first
    gaps = times if reuse else np.empty(len(times) - 1)
    kept = 0
    # Chunk by chunk, each gap written at or before its own index: a chunk's later times
    # are read before any write reaches them.
    for start in range(0, len(times) - 1, _CHUNK):
        stop = min(start + _CHUNK, len(times) - 1)
        chunk = np.diff(times[start : stop + 1])[keep[start:stop]]
        gaps[kept : kept + len(chunk)] = chunk
        kept += len(chunk)
    return gaps[:kept]


def max_concurrency(records: Iterable[RequestRecord]) -> int:
    done = [r for r in records if r.finish_time is not None]
    arrivals = np.fromiter((r.arrival_time for r in done), np.float64, len(done))
    finishes = np.fromiter((r.finish_time for r in done), np.float64, len(done))
    times = np.concatenate([arrivals, finishes])
    deltas = np.concatenate([np.ones(len(done)), -np.ones(len(done))])
    order = np.lexsort((deltas, times))  # a finish at t frees its seat before t's arrival
    return int(np.cumsum(deltas[order]).max(initial=0))


def latency_block(
    records: Sequence[RequestRecord], pooled: TokenTimes | None = None
) -> LatencyBlock:
    """`pooled`: the successful records' TokenTimes, if already built; its times are
    used up (the TBT gaps are computed where they lie)."""
    ok = [r for r in records if r.success]

    def dist(values: Iterable[float | None]) -> Distribution | None:
        return Distribution.of([v for v in values if v is not None])

    return LatencyBlock(
        ttft=dist(r.ttft for r in ok),
        itl=Distribution.of(inter_token_gaps(ok, pooled, reuse=True), in_place=True),
        tpot=dist(r.tpot for r in ok),
        e2el=dist(r.e2e for r in ok),
        queue=dist(r.queue_time for r in ok),
    )


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float | None = None,
    slos: dict[str, float] | None = None,
) -> BenchMetrics:
    """Both blocks (and goodput when SLOs are given) from one run's records.

    `duration` defaults to the run origin -> the last finish, so a tail of slow requests
    lowers throughput the way it would on a real server.
    """
    ok = [r for r in records if r.success]
    pooled = TokenTimes.of(ok)  # for the peak, then the TBT gaps (computed where it lies)
    if duration is None:
        duration = max((r.finish_time or 0.0 for r in records), default=0.0)
    per_s = 1.0 / duration if duration > 0 else 0.0
    goodput = None
    if slos:
        met = sum(meets_slos(r, slos) for r in ok)
        goodput = Goodput({k: v * 1e3 for k, v in slos.items()}, met, met * per_s)
    throughput = _throughput_block(records, ok, pooled, duration, goodput)

    lanes = sorted({r.lane for r in records})
    per_lane = (
        {lane: latency_block([r for r in records if r.lane == lane]) for lane in lanes}
        if len(lanes) > 1
        else {}
    )
    cached = [r for r in ok if r.num_cached_tokens is not None]
    prefix_hit_rate = (
        hit_rate(sum(r.num_cached_tokens or 0 for r in cached), sum(r.prompt_len for r in cached))
        if cached
        else None
    )
    drafted = sum(r.num_draft_tokens or 0 for r in ok)
    accepted = sum(r.num_accepted_tokens or 0 for r in ok)
    reasons = Counter(r.error or "no error recorded" for r in records if not r.success)
    return BenchMetrics(
        throughput,
        latency_block(records, pooled),
        goodput,
        per_lane,
        prefix_hit_rate,
        spec_acceptance_rate=accepted / drafted if drafted else None,
        failure_reasons=dict(reasons.most_common()),
    )


def _throughput_block(
    records: Sequence[RequestRecord],
    ok: list[RequestRecord],
    pooled: TokenTimes,
    duration: float,
    goodput: Goodput | None,
) -> ThroughputBlock:
    """Counts and rates over `duration`; only the successful requests' tokens count."""
    per_s = 1.0 / duration if duration > 0 else 0.0
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    return ThroughputBlock(
        duration=duration,
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) * per_s,
        input_throughput=input_tokens * per_s,
        output_throughput=output_tokens * per_s,
        total_token_throughput=(input_tokens + output_tokens) * per_s,
        max_output_tokens_per_s=peak_output_throughput(ok, pooled=pooled),
        max_concurrent_requests=max_concurrency(records),
        request_goodput=goodput.request_goodput if goodput else None,
    )
