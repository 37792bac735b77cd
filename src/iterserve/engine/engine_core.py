"""The loop every run shares, real or simulated: schedule -> execute -> update.

Torch-free: the executor is injected and follows executor/base.py's protocol. `LLMEngine`
puts tokenizing, detokenizing and stop strings around this loop and runs it with the
torch runner; `iterserve simulate` runs it with the simulated executor on a virtual
clock. So both make exactly the same scheduling decisions, step by step.

With asynchronous scheduling the loop runs one step ahead: each call plans step N+1 and
hands it to a worker thread (engine/step_pipeline.py), which runs it as soon as step N
is done, then takes step N's results. Everything on the engine thread between two
forwards (planning, update, and the caller's detokenizing and streaming) then happens
while a forward computes. The price: a request that ends in step N (an EOS, a stop
string, an abort) is computed once more in step N+1 for nothing
(Scheduler.num_discarded_tokens counts these tokens).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Self

from iterserve.config import EngineConfig
from iterserve.core.kv_cache import KVCacheManager
from iterserve.core.outputs import ModelOutput, RequestUpdate, SchedulerOutput
from iterserve.core.scheduler import Scheduler
from iterserve.core.speculation import Proposer
from iterserve.engine.step_pipeline import StepPipeline
from iterserve.executor.base import Executor


class StepFailedError(RuntimeError):
    """Running a planned step raised. `request_ids` are exactly the requests in that
    step: their KV (written or not) and bookkeeping may be half-updated, so they must
    end; requests outside the step were not touched and go on."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"a step of {len(request_ids)} requests failed: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


@dataclass
class StepStats:
    """Totals over the engine's life, for progress bars and metrics."""

    num_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0  # query tokens of decodes (speculative drafts not included)
    generated_tokens: int = 0  # tokens sampled and kept (with speculation, > decode steps)
    prefill_time: float = 0.0  # wall time of steps that computed prompt tokens
    busy_time: float = 0.0
    forward_time: float = 0.0  # of busy_time, in the network's forward


@dataclass
class CoreStep:
    """What one iteration of the loop did: the step whose results it took, and whether
    it computed or started anything (False: nothing was runnable yet)."""

    scheduled: SchedulerOutput
    updates: list[RequestUpdate]
    did_work: bool

    @property
    def request_ids(self) -> list[str]:
        return _request_ids(self.scheduled)


@dataclass
class _InFlight:
    scheduled: SchedulerOutput
    output: Future[ModelOutput]


class EngineCore:
    # What build() makes: a subclass may plan with a Scheduler subclass and keep its
    # blocks in a KVCacheManager subclass (sim/engine.py).
    scheduler_type: type[Scheduler] = Scheduler
    pool_type: type[KVCacheManager] = KVCacheManager

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        async_scheduling: bool = False,
        pipeline: StepPipeline | None = None,
    ) -> None:
        """`async_scheduling`: plan each step while the one before it runs (ignored with
        speculative decoding, whose guesses need the last step's accepted tokens), on
        `pipeline`'s thread if given (the one the executor was built on), else a new one."""
        self.scheduler = scheduler
        self.executor = executor
        self.stats = StepStats()
        self.async_scheduling = async_scheduling and scheduler.proposer is None
        self._pipeline = (pipeline or StepPipeline()) if self.async_scheduling else None
        self._in_flight: _InFlight | None = None

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        executor: Executor,
        num_blocks: int,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        proposer: Proposer | None = None,
        async_scheduling: bool = False,
        pipeline: StepPipeline | None = None,
    ) -> Self:
        """A scheduler over a block pool of `num_blocks`, driving `executor`; `proposer`
        makes speculative drafts if config.speculative asks for them (default: n-gram)."""
        cache = config.cache
        kv = cls.pool_type(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            cache.prefix_caching_hash_algo,
        )
        scheduler = cls.scheduler_type(
            config.scheduler,
            kv,
            max_model_len,
            clock,
            config.speculative,
            proposer,
            cache_reuse=cache.cache_reuse,
        )
        return cls(scheduler, executor, async_scheduling, pipeline)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self, no_more_arrivals: bool = False) -> CoreStep:
        """One iteration. Raises StepFailedError naming the step's requests when running
        the planned step fails (planning it is not covered: no request is named then).
        Their planned tokens are taken back, so ending them names nothing unwritten in
        the prefix cache."""
        if self._pipeline is not None:
            return self._step_ahead(self._pipeline, no_more_arrivals)
        start = time.perf_counter()
        scheduled = self.scheduler.schedule(no_more_arrivals)
        try:
            model_output = self.executor.execute(scheduled)
        except Exception as error:
            self.scheduler.unplan(scheduled)
            raise StepFailedError(_request_ids(scheduled), error) from error
        try:
            updates = self.scheduler.update(scheduled, model_output)
        except Exception as error:
            raise StepFailedError(_request_ids(scheduled), error) from error
        self._record(scheduled, model_output, updates, time.perf_counter() - start)
        return CoreStep(scheduled, updates, not scheduled.is_empty)

    def _step_ahead(self, pipeline: StepPipeline, no_more_arrivals: bool) -> CoreStep:
        """Plan and start the next step, then take the results of the one in flight."""
        start = time.perf_counter()
        previous, self._in_flight = self._in_flight, None
        scheduled = self.scheduler.schedule(no_more_arrivals)
        if not scheduled.is_empty or scheduled.finished_ids:
            self._in_flight = _InFlight(scheduled, pipeline.submit(self.executor, scheduled))
        if previous is None:
            return CoreStep(SchedulerOutput([]), [], self._in_flight is not None)
        model_output, updates = self._take_results(pipeline, previous)
        self._record(previous.scheduled, model_output, updates, time.perf_counter() - start)
        return CoreStep(previous.scheduled, updates, True)

    def _take_results(
        self, pipeline: StepPipeline, done: _InFlight
    ) -> tuple[ModelOutput, list[RequestUpdate]]:
        """Wait for step `done` and apply its samples. If it failed, the step planned on it
        (in flight, if any) is taken back as well, and StepFailedError names its requests."""
        try:
            model_output = done.output.result()
        except Exception as error:
            self._take_back_in_flight(pipeline)
            self.scheduler.unplan(done.scheduled)
            raise StepFailedError(_request_ids(done.scheduled), error) from error
        try:
            return model_output, self.scheduler.update(done.scheduled, model_output)
        except Exception as error:
            raise StepFailedError(_request_ids(done.scheduled), error) from error

    def _take_back_in_flight(self, pipeline: StepPipeline) -> None:
        """The step before the one in flight failed, so that one is skipped: take back its
        plan (its requests run again from where they stood) and let steps run again."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            with contextlib.suppress(Exception):  # skipped, as it should be
                in_flight.output.result()
            self.scheduler.unplan(in_flight.scheduled)
        pipeline.recover()

    def drain(self) -> list[RequestUpdate]:
        """Wait for the step in flight, if any, and take its results (an engine about to
        close, or a caller that wants every request's state settled)."""
        if self._pipeline is None or self._in_flight is None:
            return []
        in_flight, self._in_flight = self._in_flight, None
        return self._take_results(self._pipeline, in_flight)[1]

    def close(self) -> None:
        """Stop the step worker (after the step in flight, whose results are dropped)."""
        if self._pipeline is not None:
            self._pipeline.close()

    def _record(
        self,
        scheduled: SchedulerOutput,
        model_output: ModelOutput,
        updates: list[RequestUpdate],
        elapsed: float,
    ) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.prefill_tokens += scheduled.num_prefill_tokens
        stats.decode_tokens += scheduled.num_decode_tokens
        stats.generated_tokens += sum(len(u.new_token_ids) for u in updates)
        stats.busy_time += elapsed
        stats.forward_time += model_output.forward_time
        if scheduled.num_prefill_tokens:
            stats.prefill_time += elapsed


def _request_ids(scheduled: SchedulerOutput) -> list[str]:
    return [seq.request_id for seq in scheduled.seqs]
