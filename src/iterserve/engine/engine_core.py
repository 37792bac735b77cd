"""The loop every run shares, real or simulated: schedule -> execute -> update.

Torch-free: the executor is injected and follows executor/base.py's protocol. `LLMEngine`
puts tokenizing, detokenizing and stop strings around this loop and runs it with the
torch runner; `iterserve simulate` runs it with the simulated executor on a virtual
clock. So both make exactly the same scheduling decisions, step by step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

from iterserve.config import CacheConfig, EngineConfig
from iterserve.core.kv_cache import KVCacheManager
from iterserve.core.outputs import RequestUpdate, SchedulerOutput
from iterserve.core.scheduler import Scheduler
from iterserve.core.speculation import Proposer
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
    """What one iteration of the loop did."""

    scheduled: SchedulerOutput
    updates: list[RequestUpdate]

    @property
    def did_work(self) -> bool:
        """Whether any token was computed (False: nothing was runnable yet)."""
        return not self.scheduled.is_empty

    @property
    def request_ids(self) -> list[str]:
        return [seq.request_id for seq in self.scheduled.seqs]


def num_kv_blocks(cache: CacheConfig, kv_bytes_per_token: float, memory_bytes: float) -> int:
    """KV blocks for a cache: the config's exact count, else as many as fit in
    `memory_bytes` (0 when not even one does)."""
    if cache.num_kv_blocks:
        return cache.num_kv_blocks
    return max(0, int(memory_bytes // (kv_bytes_per_token * cache.block_size)))


class EngineCore:
    # What build() makes: a subclass may plan with a Scheduler subclass (sim/engine.py).
    scheduler_type: type[Scheduler] = Scheduler

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.stats = StepStats()

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        executor: Executor,
        num_blocks: int,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        proposer: Proposer | None = None,
    ) -> Self:
        """A scheduler over a block pool of `num_blocks`, driving `executor`; `proposer`
        makes speculative drafts if config.speculative asks for them (default: n-gram)."""
        cache = config.cache
        kv = KVCacheManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            cache.prefix_caching_hash_algo,
        )
        scheduler = cls.scheduler_type(
            config.scheduler, kv, max_model_len, clock, config.speculative, proposer
        )
        return cls(scheduler, executor)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self, no_more_arrivals: bool = False) -> CoreStep:
        """One iteration. Raises StepFailedError naming the step's requests when running
        the planned step fails (planning it is not covered: no request is named then)."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule(no_more_arrivals)
        try:
            model_output = self.executor.execute(scheduled)
            updates = self.scheduler.update(scheduled, model_output)
        except Exception as error:
            raise StepFailedError([seq.request_id for seq in scheduled.seqs], error) from error
        elapsed = time.perf_counter() - start
        stats = self.stats
        stats.num_steps += 1
        stats.prefill_tokens += scheduled.num_prefill_tokens
        stats.decode_tokens += scheduled.num_decode_tokens
        stats.generated_tokens += sum(len(u.new_token_ids) for u in updates)
        stats.busy_time += elapsed
        stats.forward_time += model_output.forward_time
        if scheduled.num_prefill_tokens:
            stats.prefill_time += elapsed
        return CoreStep(scheduled, updates)
