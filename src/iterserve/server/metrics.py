"""Prometheus series for GET /metrics, all named `iterserve:...`.

Three sources feed it:
- the HTTP layer: API requests received and rejected (by status);
- the async engine, once per engine request that ends: finish reason, tokens,
  and latency histograms (TTFT, TBT, TPOT, E2E, queue time) from its timings;
- the engine snapshot, read at scrape time: running / waiting per lane, KV
  cache usage, prefix-cache hit rate, preemptions.

Units: an engine request is one choice, so a request with n=4 finishes 4.
Each server has its own registry, so several servers fit in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iterserve.core.speculation import SpecDecodeStats
from iterserve.engine.metrics import EngineSnapshot, RequestMetrics
from iterserve.engine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. Fine at the low end: a CPU decode step is milliseconds, a queue can be minutes.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
_REJECT_REASONS = {400: "invalid", 401: "unauthorized", 404: "not_found", 429: "overloaded"}


class _EngineCollector(Collector):
    """Gauges read from the latest engine snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield _per_lane("num_requests_running", "Requests running in the engine", snap.running)
        yield _per_lane("num_requests_waiting", "Requests waiting to run", snap.waiting)
        yield _gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use", snap.kv_cache_usage
        )
        yield _gauge(
            "kv_cache_used_blocks", "KV cache blocks held by requests", snap.num_used_kv_blocks
        )
        yield _gauge("kv_cache_total_blocks", "KV cache blocks in the pool", snap.num_kv_blocks)
        yield _gauge(
            "kv_cache_cached_blocks",
            "Blocks named in the prefix cache (free ones are reusable)",
            snap.num_cached_kv_blocks,
        )
        yield _gauge(
            "prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / prompt tokens looked up, at first admission",
            snap.prefix_hit_rate,
        )
        yield _counter("prefix_cache_queries", "Prompt tokens looked up", snap.prefix_queries)
        yield _counter("prefix_cache_hits", "Prompt tokens found in the cache", snap.prefix_hits)
        yield _counter(
            "prefix_cache_preempted_queries",
            "Tokens looked up when a preempted request was re-admitted (not in the hit rate)",
            snap.preempted_prefix_queries,
        )
        yield _counter(
            "prefix_cache_preempted_hits",
            "Of those, tokens found again in the cache (recompute saved)",
            snap.preempted_prefix_hits,
        )
        yield _counter(
            "num_preemptions", "Requests preempted to free KV memory", snap.num_preemptions
        )
        yield _counter("engine_steps", "Engine iterations run", snap.num_steps)
        yield _counter(
            "prefill_tokens_computed", "Prompt tokens run through the model", snap.prefill_tokens
        )
        yield _counter(
            "decode_tokens_computed", "Decode tokens run through the model", snap.decode_tokens
        )
        yield from _spec_decode_metrics(snap.spec)


def _spec_decode_metrics(spec: SpecDecodeStats) -> Iterator[Metric]:
    """Speculative decoding (vLLM's names): acceptance rate = accepted / draft tokens,
    mean accepted length = 1 + accepted / drafts."""
    yield _counter("spec_decode_num_drafts", "Steps in which a request speculated", spec.num_drafts)
    yield _counter("spec_decode_num_draft_tokens", "Draft tokens proposed", spec.num_draft_tokens)
    yield _counter(
        "spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens
    )
    per_position = CounterMetricFamily(
        "iterserve:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft",
        labels=["position"],
    )
    for position, count in enumerate(spec.accepted_per_position):
        per_position.add_metric([str(position)], count)
    yield per_position


def _per_lane(name: str, documentation: str, counts: Mapping[str, int]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(f"iterserve:{name}", documentation, labels=["lane"])
    for lane, count in counts.items():
        gauge.add_metric([lane], count)
    return gauge


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"iterserve:{name}", documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"iterserve:{name}", documentation, value=value)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_received = Counter(
            "iterserve:requests_received", "API requests received", ["endpoint"], registry=r
        )
        self.requests_rejected = Counter(
            "iterserve:requests_rejected",
            "API requests refused before running (invalid, unauthorized, overloaded...)",
            ["reason"],
            registry=r,
        )
        self.requests_finished = Counter(
            "iterserve:requests_finished",
            "Engine requests that ran to the end",
            ["finish_reason"],
            registry=r,
        )
        self.requests_aborted = Counter(
            "iterserve:requests_aborted",
            "Engine requests aborted (client gone, shutdown)",
            registry=r,
        )
        self.requests_failed = Counter(
            "iterserve:requests_failed", "Engine requests failed by an engine error", registry=r
        )
        self.prompt_tokens = Counter(
            "iterserve:prompt_tokens", "Prompt tokens of ended requests", registry=r
        )
        self.generation_tokens = Counter(
            "iterserve:generation_tokens", "Tokens generated", registry=r
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to first token")
        self.tbt = self._histogram("inter_token_latency_seconds", "Gap between consecutive tokens")
        self.tpot = self._histogram(
            "time_per_output_token_seconds", "Mean gap after the first token"
        )
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = self._histogram(
            "request_queue_time_seconds", "Arrival to first scheduled"
        )
        r.register(_EngineCollector(snapshot))

    def _histogram(self, name: str, documentation: str) -> Histogram:
        return Histogram(
            f"iterserve:{name}", documentation, buckets=_LATENCY_BUCKETS, registry=self.registry
        )

    def observe_http(self, endpoint: str, status: int) -> None:
        """One API request to a generation endpoint, with the status it got."""
        self.requests_received.labels(endpoint).inc()
        # 499 (client left) and 500 (our fault) are not refusals; 503 (shutting down) is.
        if 400 <= status < 500 and status != 499 or status == 503:
            reason = _REJECT_REASONS.get(status, "unavailable" if status == 503 else str(status))
            self.requests_rejected.labels(reason).inc()

    def observe_finished(self, output: RequestOutput | None, reason: str) -> None:
        """One engine request ended (called by the async engine on the event loop)."""
        if reason == "abort":
            self.requests_aborted.inc()
        elif reason == "error":
            self.requests_failed.inc()
        else:
            self.requests_finished.labels(reason).inc()
        if output is None:
            return
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(len(output.token_ids))
        if output.timings is None:
            return
        latency = RequestMetrics.from_timings(output.timings)
        for histogram, value in (
            (self.ttft, latency.ttft),
            (self.tpot, latency.tpot),
            (self.e2e, latency.e2e),
            (self.queue_time, latency.queue_time),
        ):
            if value is not None:
                histogram.observe(value)
        for gap in latency.tbt:
            self.tbt.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
