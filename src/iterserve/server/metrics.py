"""Prometheus series for GET /metrics, named `iterserve:...`, and the standard `process_*`
ones of the server's process (prometheus_client's ProcessCollector).

Three sources feed the engine's:
- the HTTP layer: API requests received and rejected (by status);
- the async engine, once per engine request that ends: finish reason, tokens,
  and latency histograms (TTFT, TBT, TPOT, E2E, queue time) from its timings;
- the engine snapshot, read at scrape time: running / waiting per lane, KV
  cache usage, prefix-cache hit rate, preemptions; memory: the weights, the KV pool's
  reservation, and the engine process's resident memory now and at its peak (a replica's
  read in its own process).

Behind a data-parallel front end the engine series come per replica and for the fleet
(see ServerMetrics).

Units: an engine request is one choice, so a request with n=4 finishes 4.
Each server has its own registry, so several servers fit in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iterserve.engine.metrics import (
    EngineSnapshot,
    RequestMetrics,
    merge_snapshots,
    with_process_memory,
)
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.serving_engine import (
    REPLICA_GIVEN_UP,
    REPLICA_RESTARTING,
    ReplicaState,
    ServingEngine,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds. Fine at the low end: a CPU decode step is milliseconds, a queue can be minutes.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
# The `replica` label value of a fleet's own series (its sums, its ratios).
FLEET = "all"
M = TypeVar("M", Counter, Histogram)
_REJECT_REASONS = {400: "invalid", 401: "unauthorized", 404: "not_found", 429: "overloaded"}


class _Families:
    """Metric families filled sample by sample: a fleet adds each replica's samples, and
    the fleet's, under a `replica` label; a single engine adds its own without one."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def add(
        self,
        kind: type[GaugeMetricFamily | CounterMetricFamily],
        name: str,
        documentation: str,
        value: float,
        replica: str | None,
        **extra: str,
    ) -> None:
        family = self.declare(kind, name, documentation, replica, *extra)
        family.add_metric([*extra.values(), *([replica] if replica is not None else [])], value)

    def declare(
        self,
        kind: type[GaugeMetricFamily | CounterMetricFamily],
        name: str,
        documentation: str,
        replica: str | None,
        *extra: str,
    ) -> GaugeMetricFamily | CounterMetricFamily:
        """The family, made if new: declared even before its first sample, so its name is
        always on /metrics (a dashboard query checked against it finds it)."""
        family = self._families.get(name)
        if family is None:
            labels = [*extra, *(["replica"] if replica is not None else [])]
            family = self._families[name] = kind(f"iterserve:{name}", documentation, labels=labels)
        return family  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._families.values())


class _EngineCollector(Collector):
    """Gauges read from the engines' latest snapshots at scrape time."""

    def __init__(self, engine: ServingEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine, out = self._engine, _Families()
        snaps = engine.snapshots()
        if not engine.replica_labels:  # the engine runs in this process
            snap = with_process_memory(snaps[0])
            _engine_metrics(out, snap, None, 1.0 if engine.is_healthy else 0.0)
            yield from out
            return
        states = engine.replica_states()
        up = [1.0 if state.serving else 0.0 for state in states]
        for label, snap, alive in zip(engine.replica_labels, snaps, up, strict=True):
            _engine_metrics(out, snap, label, alive)
        _engine_metrics(out, merge_snapshots(snaps), FLEET, sum(up))
        _fleet_metrics(out, engine.replica_labels, states)
        yield from out


# A replica's state on /metrics: `up` is serving (or warming up after the server's start).
_STATE_LABELS = {REPLICA_RESTARTING: "restarting", REPLICA_GIVEN_UP: "given_up"}


def _fleet_metrics(out: _Families, labels: tuple[str, ...], states: list[ReplicaState]) -> None:
    """How many replicas are up, restarting, given up; each one's restarts and requests
    sent elsewhere when it died (and the fleet's, replica="all")."""
    documentation = "Replicas by state: up (serving), restarting, given_up (out of restarts)"
    for name in ("up", *_STATE_LABELS.values()):
        count = sum(_STATE_LABELS.get(s.state, "up") == name for s in states)
        out.add(_G, "replicas", documentation, count, None, state=name)
    for label, state in [*zip(labels, states, strict=True), (FLEET, None)]:
        restarts = state.restarts if state else sum(s.restarts for s in states)
        rerouted = state.rerouted if state else sum(s.rerouted for s in states)
        out.add(_C, "replica_restarts", "New processes started for a replica that died",
                restarts, label)  # fmt: skip
        out.add(_C, "replica_rerouted_requests",
                "Requests sent to another replica when this one died before taking them or "
                "before their first token",
                rerouted, label)  # fmt: skip


_Kind = type[GaugeMetricFamily | CounterMetricFamily]
_G, _C = GaugeMetricFamily, CounterMetricFamily
# What a snapshot says beyond its per-lane counts: (kind, name, documentation, value).
# Speculative decoding has vLLM's names: acceptance rate = accepted / draft tokens, mean
# accepted length = 1 + accepted / drafts.
_SNAPSHOT_SERIES: tuple[tuple[_Kind, str, str, Callable[[EngineSnapshot], float]], ...] = (
    (_G, "kv_cache_usage_perc", "Fraction of KV cache blocks in use", lambda s: s.kv_cache_usage),
    (_G, "kv_cache_used_blocks", "KV cache blocks held by requests", lambda s: s.num_used_kv_blocks),
    (_G, "kv_cache_total_blocks", "KV cache blocks in the pool", lambda s: s.num_kv_blocks),
    (_G, "kv_cache_cached_blocks", "Blocks named in the prefix cache (free ones are reusable)",
     lambda s: s.num_cached_kv_blocks),
    (_G, "prefix_cache_hit_rate",
     "Prompt tokens found in the prefix cache / prompt tokens looked up, at first admission",
     lambda s: s.prefix_hit_rate),
    (_C, "prefix_cache_queries", "Prompt tokens looked up", lambda s: s.prefix_queries),
    (_C, "prefix_cache_hits", "Prompt tokens found in the cache", lambda s: s.prefix_hits),
    (_C, "prefix_cache_preempted_queries",
     "Tokens looked up when a preempted request was re-admitted (not in the hit rate)",
     lambda s: s.preempted_prefix_queries),
    (_C, "prefix_cache_preempted_hits", "Of those, tokens found again in the cache (recompute saved)",
     lambda s: s.preempted_prefix_hits),
    (_C, "cache_reuse_tokens",
     "Prompt tokens whose K/V was copied from a recent sequence at a shifted position "
     "(--cache-reuse) rather than computed", lambda s: s.reused_tokens),
    (_C, "num_preemptions", "Requests preempted to free KV memory", lambda s: s.num_preemptions),
    (_C, "discarded_tokens",
     "Tokens computed for requests that had ended: asynchronous scheduling plans a step "
     "before the last one's stop tokens and strings are known", lambda s: s.num_discarded_tokens),
    (_C, "engine_steps", "Engine iterations run", lambda s: s.num_steps),
    (_G, "lora_resident_adapters", "LoRA adapters in the model's slots (at most --max-loras)",
     lambda s: s.num_resident_loras),
    (_C, "images_encoded", "Images the vision tower encoded", lambda s: s.images_encoded),
    (_C, "image_encode_seconds", "Seconds the vision tower spent encoding images",
     lambda s: s.image_encode_seconds),
    (_C, "images_reused",
     "Images found already encoded (a chat's earlier turn sent them): encodes saved",
     lambda s: s.images_reused),
    (_C, "prefill_tokens_computed", "Prompt tokens run through the model",
     lambda s: s.prefill_tokens),
    (_C, "decode_tokens_computed", "Decode tokens run through the model",
     lambda s: s.decode_tokens),
    (_C, "spec_decode_num_drafts", "Steps in which a request speculated",
     lambda s: s.spec.num_drafts),
    (_C, "spec_decode_num_draft_tokens", "Draft tokens proposed",
     lambda s: s.spec.num_draft_tokens),
    (_C, "spec_decode_num_accepted_tokens", "Draft tokens accepted",
     lambda s: s.spec.num_accepted_tokens),
    (_G, "model_weights_bytes", "Bytes of the served model's weights, as held",
     lambda s: s.weights_bytes),
    (_G, "kv_cache_memory_bytes",
     "Bytes reserved for the KV cache pool (resident only as blocks are written)",
     lambda s: s.kv_cache_bytes),
    (_G, "kv_cache_written_bytes",
     "Bytes of the KV cache pool written at least once: the part of its reservation that is "
     "resident",
     lambda s: s.kv_cache_written_bytes),
    (_G, "process_resident_memory_bytes", "Resident memory of the engine's process (VmRSS)",
     lambda s: s.resident_bytes),
    (_G, "process_peak_resident_memory_bytes",
     "The most memory the engine's process has held resident at once (VmHWM)",
     lambda s: s.peak_resident_bytes),
)  # fmt: skip
_PER_LANE = (
    ("num_requests_running", "Requests running in the engine", "running"),
    ("num_requests_waiting", "Requests waiting to run", "waiting"),
)
_PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position")


def _engine_metrics(out: _Families, snap: EngineSnapshot, replica: str | None, up: float) -> None:
    up_help = f"1 while the engine serves (replica={FLEET!r}: how many do)"
    out.add(_G, "replica_up", up_help, up, replica)
    for name, documentation, attribute in _PER_LANE:
        for lane, count in getattr(snap, attribute).items():
            out.add(_G, name, documentation, count, replica, lane=lane)
    for kind, name, documentation, value in _SNAPSHOT_SERIES:
        out.add(kind, name, documentation, value(snap), replica)
    out.declare(_C, *_PER_POSITION, replica, "position")
    for position, count in enumerate(snap.spec.accepted_per_position):
        out.add(_C, *_PER_POSITION, count, replica, position=str(position))


class ServerMetrics:
    """The server's registry. Over a fleet (`engine.replica_labels` not empty) every engine
    series carries a `replica` label: one series per replica and one, replica="all", for
    the fleet (ratios such as the prefix hit rate computed from the fleet's sums). Sum
    across replicas with `replica!="all"`. The HTTP series stay unlabelled: there is one
    front end."""

    def __init__(self, engine: ServingEngine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # The standard process_* series (process_resident_memory_bytes, ...) of this process.
        ProcessCollector(registry=r)
        self._replica_labels = engine.replica_labels
        per = ["replica"] if engine.replica_labels else []
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
            ["finish_reason", *per],
            registry=r,
        )
        self.requests_aborted = Counter(
            "iterserve:requests_aborted",
            "Engine requests aborted (client gone, shutdown)",
            per,
            registry=r,
        )
        self.requests_failed = Counter(
            "iterserve:requests_failed",
            "Engine requests failed by an engine error (or their replica's death)",
            per,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "iterserve:prompt_tokens", "Prompt tokens of ended requests", per, registry=r
        )
        self.generation_tokens = Counter(
            "iterserve:generation_tokens", "Tokens generated", per, registry=r
        )
        self.embedding_requests = Counter(
            "iterserve:embedding_requests",
            "Embedding requests (one per /v1/embeddings input) that ran to the end",
            per,
            registry=r,
        )
        self.embedding_prompt_tokens = Counter(
            "iterserve:embedding_prompt_tokens",
            "Prompt tokens of embedding requests that ran to the end (in prompt_tokens too)",
            per,
            registry=r,
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to first token", per)
        self.tbt = self._histogram(
            "inter_token_latency_seconds", "Gap between consecutive tokens", per
        )
        self.tpot = self._histogram(
            "time_per_output_token_seconds", "Mean gap after the first token", per
        )
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish", per)
        self.queue_time = self._histogram(
            "request_queue_time_seconds", "Arrival to first scheduled", per
        )
        # Per LoRA adapter ("" for the base model), counted once for a fleet.
        self.lora_requests = Counter(
            "iterserve:lora_requests",
            "Engine requests ended, by LoRA adapter",
            ["adapter"],
            registry=r,
        )
        self.lora_prompt_tokens = Counter(
            "iterserve:lora_prompt_tokens",
            "Prompt tokens of ended requests, by LoRA adapter",
            ["adapter"],
            registry=r,
        )
        self.lora_generation_tokens = Counter(
            "iterserve:lora_generation_tokens",
            "Tokens generated, by LoRA adapter",
            ["adapter"],
            registry=r,
        )
        r.register(_EngineCollector(engine))

    def _histogram(self, name: str, documentation: str, labels: list[str]) -> Histogram:
        return Histogram(
            f"iterserve:{name}",
            documentation,
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe_http(self, endpoint: str, status: int) -> None:
        """One API request to a generation endpoint, with the status it got."""
        self.requests_received.labels(endpoint).inc()
        # 499 (client left) and 500 (our fault) are not refusals; 503 (shutting down) is.
        if 400 <= status < 500 and status != 499 or status == 503:
            reason = _REJECT_REASONS.get(status, "unavailable" if status == 503 else str(status))
            self.requests_rejected.labels(reason).inc()

    def observe_finished(self, output: RequestOutput | None, reason: str, replica: int) -> None:
        """One engine request ended on engine `replica` (called on the event loop): counted
        for that replica and for the fleet, or once for a single engine."""
        if output is not None:
            adapter = output.lora_name or ""
            self.lora_requests.labels(adapter).inc()
            self.lora_prompt_tokens.labels(adapter).inc(len(output.prompt_token_ids))
            self.lora_generation_tokens.labels(adapter).inc(len(output.token_ids))
        if self._replica_labels:
            self._observe(output, reason, (self._replica_labels[replica],))
            self._observe(output, reason, (FLEET,))
        else:
            self._observe(output, reason, ())

    def _observe(self, output: RequestOutput | None, reason: str, labels: tuple[str, ...]) -> None:
        if reason == "abort":
            _child(self.requests_aborted, labels).inc()
        elif reason == "error":
            _child(self.requests_failed, labels).inc()
        else:
            self.requests_finished.labels(reason, *labels).inc()
        if output is None:
            return
        _child(self.prompt_tokens, labels).inc(len(output.prompt_token_ids))
        if output.embedding is not None:
            # No tokens come out of it: the latency histograms are the generations' alone.
            _child(self.embedding_requests, labels).inc()
            _child(self.embedding_prompt_tokens, labels).inc(len(output.prompt_token_ids))
            return
        _child(self.generation_tokens, labels).inc(len(output.token_ids))
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
                _child(histogram, labels).observe(value)
        tbt = _child(self.tbt, labels)
        for gap in latency.tbt:
            tbt.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _child(metric: M, labels: tuple[str, ...]) -> M:
    """The series of `metric` under `labels` (itself when it has no labels)."""
    return metric.labels(*labels) if labels else metric
