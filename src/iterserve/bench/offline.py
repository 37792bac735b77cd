"""The same workloads in-process: requests go straight into an LLMEngine, on the wall clock.

Arrivals are honoured in real time: a request due at t is added with arrival_time = t even
when the engine was mid-step at t, which is when a server would have received it, so its
queue time and TTFT include the wait for that step. Per-request timings come from the
engine's own RequestTimings, so queue time (arrival -> first scheduled) is known here, which
an HTTP client cannot see.

For callers that compare engine settings (a sweep, `iterserve compare`):
`benchmark_config(EngineConfig(...), workload, ArrivalSpec(...))` -> BenchReport.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from tqdm import tqdm

from iterserve.bench.arrivals import ArrivalSpec, arrival_offsets
from iterserve.bench.metrics import compute_metrics
from iterserve.bench.records import RequestRecord, RunResult
from iterserve.bench.report import BenchReport
from iterserve.bench.workloads import Workload, WorkloadRequest
from iterserve.config import EngineConfig
from iterserve.sampling_params import InvalidRequestError, SamplingParams

# How long to nap when a step had nothing to compute (a static batch still filling up, a
# dynamic batch waiting out max_wait_ms): short against any step, long against a busy spin.
_IDLE_NAP = 0.002


@dataclass
class OfflineOptions:
    ignore_eos: bool = True  # exact output lengths
    temperature: float = 0.0
    num_warmups: int = 1
    progress: bool = True


def _params(request: WorkloadRequest, options: OfflineOptions) -> SamplingParams:
    return SamplingParams(
        max_tokens=request.output_len,
        temperature=options.temperature,
        ignore_eos=options.ignore_eos,
        seed=0 if options.temperature > 0 else None,
    )


def warm_up(engine: Any, workload: Workload, options: OfflineOptions) -> None:
    if workload.warmup is None:
        return
    for _ in range(options.num_warmups):
        engine.add_request(workload.warmup.prompt, _params(workload.warmup, options))
        while engine.has_unfinished():
            engine.step(no_more_arrivals=True)  # a static batch of one must not wait for more


def run_engine(
    engine: Any,
    workload: Workload,
    offsets: list[float],
    max_concurrency: int | None = None,
    options: OfflineOptions | None = None,
) -> RunResult:
    """Drive `engine` (an LLMEngine) through the workload; one RequestRecord per request."""
    options = options or OfflineOptions()
    requests = workload.requests
    records = [
        RequestRecord(f"bench-{i}", r.prompt_len, r.output_len, r.lane, offsets[i])
        for i, r in enumerate(requests)
    ]
    by_id = {record.request_id: record for record in records}
    arrivals = _Arrivals(offsets, max_concurrency)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not options.progress)
    origin = time.monotonic()
    try:
        while arrivals.pending or engine.has_unfinished():
            now = time.monotonic()
            for i, arrival in arrivals.due(origin, now):
                records[i].arrival_time = arrival - origin
                if not _add(engine, requests[i], records[i], arrival, options):
                    bar.update(1)
                    arrivals.free_seat(now)
            no_more_arrivals = arrivals.none_can_come()
            if not engine.has_unfinished():
                if arrivals.pending:
                    time.sleep(max(0.0, origin + arrivals.next_offset() - time.monotonic()))
                continue
            step = engine.step(no_more_arrivals)
            for output in step.outputs:
                if output.finished:
                    _fill(by_id[output.request_id], output, origin)
                    bar.update(1)
                    arrivals.free_seat(output.timings.finished or time.monotonic())
            if not step.did_work:
                time.sleep(_IDLE_NAP)
    finally:
        bar.close()
    return RunResult(records, getattr(engine, "model_name", ""))


class _Arrivals:
    """The requests not yet added, by arrival offset, and under a concurrency cap when each
    seat became free: a capped request arrives when it gets one."""

    def __init__(self, offsets: list[float], max_concurrency: int | None) -> None:
        self._offsets = offsets
        self.pending = sorted(range(len(offsets)), key=lambda i: offsets[i])
        self.pending.reverse()  # pop() from the end takes the earliest
        self._seats = [float("-inf")] * max_concurrency if max_concurrency else None

    def due(self, origin: float, now: float) -> Iterator[tuple[int, float]]:
        """(request index, arrival time) of each request due by `now` that has a seat."""
        while self.pending and origin + self._offsets[self.pending[-1]] <= now and self._seat():
            i = self.pending.pop()
            arrival = origin + self._offsets[i]
            if self._seats is not None:
                arrival = max(arrival, heapq.heappop(self._seats))
            yield i, arrival

    def free_seat(self, at: float) -> None:
        if self._seats is not None:
            heapq.heappush(self._seats, at)

    def none_can_come(self) -> bool:
        """Static batching may start a short batch only once nothing else will come: after
        the last arrival, or while the concurrency cap is full (nothing can arrive until a
        request finishes; a closed loop below the batch size would otherwise deadlock)."""
        return not self.pending or not self._seat()

    def next_offset(self) -> float:
        return self._offsets[self.pending[-1]]

    def _seat(self) -> bool:
        return self._seats is None or bool(self._seats)


def _add(
    engine: Any,
    request: WorkloadRequest,
    record: RequestRecord,
    arrival: float,
    options: OfflineOptions,
) -> bool:
    """Add the request; False, with the error on its record, if the engine refuses it."""
    try:
        engine.add_request(
            request.prompt,
            _params(request, options),
            request_id=record.request_id,
            lane=request.lane,
            arrival_time=arrival,
        )
    except InvalidRequestError as err:
        record.error = str(err)
        return False
    return True


def _fill(record: RequestRecord, output: Any, origin: float) -> None:
    timings = output.timings

    def rel(t: float | None) -> float | None:
        return None if t is None else t - origin

    record.first_scheduled_time = rel(timings.first_scheduled)
    record.first_token_time = rel(timings.first_token)
    record.token_times = [t - origin for t in timings.token_times]
    record.finish_time = rel(timings.finished)
    record.output_len = len(output.token_ids)
    record.num_cached_tokens = output.num_cached_tokens
    record.num_draft_tokens = output.num_draft_tokens
    record.num_accepted_tokens = output.num_accepted_tokens
    record.success = output.finish_reason in ("stop", "length") and bool(output.token_ids)
    if not record.success:
        record.error = f"finished with {output.finish_reason!r}"


def benchmark_engine(
    engine: Any,
    workload: Workload,
    arrival: ArrivalSpec,
    slos: dict[str, float] | None = None,
    options: OfflineOptions | None = None,
    label: str | None = None,
    seed: int = 0,
) -> BenchReport:
    """One full run of `workload` through an existing engine, warm-up included."""
    options = options or OfflineOptions()
    trace = [r.arrival or 0.0 for r in workload.requests] if workload.has_arrival_times else None
    offsets = arrival_offsets(arrival, len(workload.requests), seed, trace)
    warm_up(engine, workload, options)
    # Measured runs start cold, whatever earlier runs on this engine left in the cache.
    engine.reset_prefix_cache()
    result = run_engine(engine, workload, offsets, arrival.max_concurrency, options)
    config: EngineConfig = engine.config
    return BenchReport(
        label=label or f"iterserve offline ({config.scheduler.batching})",
        backend="offline",
        target=result.model or str(config.model),
        workload=workload.summary(),
        arrivals=arrival.describe(),
        metrics=compute_metrics(result.records, slos=slos),
        engine_config=asdict(config),
        notes=result.notes,
        records=result.records,
    )


def benchmark_config(
    config: EngineConfig, workload: Workload, arrival: ArrivalSpec, **run: Any
) -> BenchReport:
    """Build an engine from `config` and run `benchmark_engine` on it (same keywords)."""
    from iterserve.engine.llm_engine import LLMEngine  # torch: only when an engine is built

    return benchmark_engine(LLMEngine(config), workload, arrival, **run)
