"""Latency of one request from its timings, and a snapshot of the engine's gauges.

Vocabulary (docs/architecture.md): queue time is arrival -> first scheduled; TTFT is
arrival -> first token, queueing included; TBT (a.k.a. ITL) are the gaps
between consecutive tokens; TPOT is their mean, i.e. the time per output token
after the first; E2E is arrival -> finished. No HTTP here: the server turns
these numbers into Prometheus series, the benchmark into reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from iterserve.core.kv_cache import hit_rate
from iterserve.core.request import LANES, RequestTimings
from iterserve.core.speculation import SpecDecodeStats
from iterserve.engine.process_memory import process_memory

if TYPE_CHECKING:  # the engine pulls in torch; these numbers need none of it
    from iterserve.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class RequestMetrics:
    """Latencies of one request, in seconds; None where the request never got that far."""

    queue_time: float | None
    ttft: float | None
    tbt: list[float]
    tpot: float | None
    e2e: float | None
    num_output_tokens: int

    @classmethod
    def from_timings(cls, timings: RequestTimings) -> RequestMetrics:
        arrival = timings.arrival
        # Copied once: the engine thread may still append to a live request's times.
        times = list(timings.token_times)
        gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        return cls(
            queue_time=_since(arrival, timings.first_scheduled),
            ttft=_since(arrival, timings.first_token),
            tbt=gaps,
            tpot=(times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            e2e=_since(arrival, timings.finished),
            num_output_tokens=len(times),
        )


def _since(start: float, end: float | None) -> float | None:
    return None if end is None else max(0.0, end - start)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's gauges at one instant, taken on the engine's own thread.

    The engine is not thread-safe, so readers on other threads (a metrics
    scrape, a health check) read the latest snapshot instead of the engine.
    """

    running: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LANES, 0))
    waiting: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LANES, 0))
    num_kv_blocks: int = 0
    num_used_kv_blocks: int = 0
    num_cached_kv_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preempted_prefix_queries: int = 0
    preempted_prefix_hits: int = 0
    reused_tokens: int = 0  # prompt tokens copied at shifted positions (--cache-reuse)
    num_preemptions: int = 0
    num_discarded_tokens: int = 0
    num_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    num_resident_loras: int = 0  # LoRA adapters in the model's slots
    # Images (engine/images.py): encoded by the tower and its seconds; found kept encoded.
    images_encoded: int = 0
    image_encode_seconds: float = 0.0
    images_reused: int = 0
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    # Memory, in bytes: the served model's weights as held, the KV pool's reservation and
    # the part of it written so far (resident: its blocks taken at least once), and the
    # engine process's resident memory now and at its peak: read at scrape time
    # (`with_process_memory`), not every step.
    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    kv_cache_written_bytes: int = 0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0

    @property
    def num_running(self) -> int:
        return sum(self.running.values())

    @property
    def num_waiting(self) -> int:
        return sum(self.waiting.values())

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return hit_rate(self.prefix_hits, self.prefix_queries)


def snapshot_engine(engine: LLMEngine) -> EngineSnapshot:
    """Read an LLMEngine's gauges; call it only from the thread that steps the engine."""
    scheduler = engine.scheduler
    kv = scheduler.kv_cache_stats()
    stats = engine.stats
    return EngineSnapshot(
        running={lane: scheduler.num_running(lane) for lane in LANES},
        waiting={lane: scheduler.num_waiting(lane) for lane in LANES},
        num_kv_blocks=kv.num_blocks,
        num_used_kv_blocks=kv.num_used_blocks,
        num_cached_kv_blocks=kv.num_cached_blocks,
        prefix_queries=kv.prefix_queries,
        prefix_hits=kv.prefix_hits,
        preempted_prefix_queries=kv.preempted_queries,
        preempted_prefix_hits=kv.preempted_hits,
        reused_tokens=scheduler.reuse.num_reused_tokens if scheduler.reuse else 0,
        num_preemptions=scheduler.num_preemptions,
        num_discarded_tokens=scheduler.num_discarded_tokens,
        num_steps=stats.num_steps,
        prefill_tokens=stats.prefill_tokens,
        decode_tokens=stats.decode_tokens,
        num_resident_loras=len(scheduler.lora_slots.resident),
        images_encoded=engine.images.num_encoded if engine.images else 0,
        image_encode_seconds=engine.images.encode_seconds if engine.images else 0.0,
        images_reused=engine.images.num_reused if engine.images else 0,
        spec=replace(
            scheduler.spec_stats,
            accepted_per_position=list(scheduler.spec_stats.accepted_per_position),
        ),
        weights_bytes=engine.model_plan.weight_bytes,
        kv_cache_bytes=engine.kv_pool.bytes,
        kv_cache_written_bytes=engine.kv_pool.bytes * kv.num_written_blocks // kv.num_blocks,
    )


def with_process_memory(snapshot: EngineSnapshot) -> EngineSnapshot:
    """The snapshot with this process's resident memory read now: call it in the process
    that runs the engine (a replica's own, for a fleet), when the figures are wanted."""
    memory = process_memory()
    if memory is None:
        return snapshot
    return replace(snapshot, resident_bytes=memory.resident, peak_resident_bytes=memory.peak)


def merge_snapshots(snapshots: Sequence[EngineSnapshot]) -> EngineSnapshot:
    """A fleet's gauges as one engine's: counts summed per lane and overall, so the ratios
    (KV usage, prefix hit rate, acceptance) come out as the fleet's, not a mean of ratios."""
    spec = SpecDecodeStats()
    for snap in snapshots:
        spec.num_drafts += snap.spec.num_drafts
        spec.num_draft_tokens += snap.spec.num_draft_tokens
        spec.num_accepted_tokens += snap.spec.num_accepted_tokens
        for position, count in enumerate(snap.spec.accepted_per_position):
            if position == len(spec.accepted_per_position):
                spec.accepted_per_position.append(0)
            spec.accepted_per_position[position] += count
    sums = {name: sum(getattr(snap, name) for snap in snapshots) for name in _COUNTS}
    return EngineSnapshot(
        running={lane: sum(s.running.get(lane, 0) for s in snapshots) for lane in LANES},
        waiting={lane: sum(s.waiting.get(lane, 0) for s in snapshots) for lane in LANES},
        spec=spec,
        **sums,
    )


_COUNTS = tuple(
    f.name for f in fields(EngineSnapshot) if f.name not in ("running", "waiting", "spec")
)


def idle_snapshot(snapshot: EngineSnapshot) -> EngineSnapshot:
    """What a dead engine still counts for: its counters (they must not go back), with
    nothing running, waiting, holding KV blocks or memory any more."""
    return replace(
        snapshot,
        running=dict.fromkeys(LANES, 0),
        waiting=dict.fromkeys(LANES, 0),
        num_used_kv_blocks=0,
        weights_bytes=0,
        kv_cache_bytes=0,
        kv_cache_written_bytes=0,
        resident_bytes=0,
        peak_resident_bytes=0,
    )
