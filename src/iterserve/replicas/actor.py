"""One data-parallel replica: a whole engine (weights, KV cache, scheduler, loop) in a Ray
actor's process, driven by the same AsyncEngine the single-engine server uses.

The front end (data_parallel.py) sends token ids, never text, and reads each group's
outputs back through a Ray streaming generator: one Ray object per batch of outputs,
where a batch is everything the group got since the front end last read (so a slow
reader costs fewer, larger objects rather than one per token).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from iterserve.config import EngineConfig
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.metrics import with_process_memory
from iterserve.engine.request_stream import (
    EngineDiedError,
    EngineOverloadedError,
    EngineStoppedError,
    GenerationRequest,
)
from iterserve.engine.serving_engine import ServedModel
from iterserve.replicas.events import Refusal, ReplicaEvent, ReplicaFailure, ReplicaStatus
from iterserve.replicas.test_hooks import ReplicaTestHooks
from iterserve.sampling_params import InvalidRequestError


class EngineReplica(ReplicaTestHooks):
    """Made a Ray actor by `ray.remote(EngineReplica)` in the front end (its async methods
    make it an async actor: many groups stream from it at once)."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int) -> None:
        # config.num_threads is this replica's share of the cores; Ray already set
        # OMP_NUM_THREADS to the CPUs the actor asked for, before torch loaded here.
        self.start_error: str | None = None
        try:
            self.engine = AsyncEngine.launch(
                lambda: LLMEngine(config, warm_up=False),
                freeze_heap=True,  # the actor's process serves this engine until it ends
                max_waiting_requests=max_waiting_requests,
                stop_on_step_error=True,  # the fleet restarts this replica (client.py)
            )
        except (ValueError, OSError) as error:
            # A setting (a model path missing on this machine, say): said to the front
            # end in a sentence, as a single engine says it, not as an actor's traceback.
            self.start_error = str(error)

    def served_model(self) -> ServedModel | str:
        """The model, once loaded; or why it could not be."""
        return self.start_error or self.engine.served_model

    def status(self) -> ReplicaStatus:
        engine = self.engine
        # The memory figures are this replica's process's, read here, where it runs.
        snapshot = with_process_memory(engine.snapshot)
        return ReplicaStatus(engine.is_ready, engine.is_healthy, snapshot, engine.failure)

    async def generate(
        self, requests: list[GenerationRequest], waited: float
    ) -> AsyncIterator[ReplicaEvent]:
        """Run a group: first an empty event once the engine took it (or its refusal), then
        its outputs in batches until every request of the group has ended.

        `waited`: seconds since the group arrived at the front end; arrival times are
        re-stamped on this process's clock, which another machine's need not match."""
        arrival = time.monotonic() - waited
        requests = [replace(request, arrival_time=arrival) for request in requests]
        try:
            stream = await self.engine.add(requests)
        except (InvalidRequestError, EngineOverloadedError, EngineStoppedError) as error:
            if failure := self.engine.failure:  # not a refusal: this replica is dead
                yield ReplicaEvent(died=failure)
            else:
                yield ReplicaEvent(num_waiting=self._waiting(), refused=Refusal.of(error))
            return
        yield ReplicaEvent(num_waiting=self._waiting())
        async with stream:  # leaving early (cancelled) aborts what is unfinished
            while not stream.finished:
                batch = await stream.next_batch()
                died = [item for _, item in batch if isinstance(item, EngineDiedError)]
                deliveries = [
                    (index, item if not isinstance(item, BaseException) else _failure(item))
                    for index, item in batch
                    if not isinstance(item, EngineDiedError)
                ]
                if died:  # the rest of the group is the front end's to place again
                    why = self.engine.failure or str(died[0])
                    yield ReplicaEvent(deliveries, self._waiting(), died=why)
                    return
                yield ReplicaEvent(deliveries, self._waiting())

    def abort(self, request_ids: list[str]) -> None:
        self.engine.abort(request_ids)

    async def reset_prefix_cache(self) -> int:
        return await self.engine.reset_prefix_cache()

    async def shutdown(self, timeout: float) -> None:
        """Let running requests finish for up to `timeout` seconds, abort the rest, and
        release the engine's own workers (tensor parallelism) before Ray ends us."""
        await self.engine.shutdown(timeout)
        await asyncio.to_thread(self.engine.close)

    def _waiting(self) -> int:
        return self.engine.num_waiting_estimate()


def _failure(error: BaseException) -> ReplicaFailure:
    return ReplicaFailure(str(error), getattr(error, "output", None))
