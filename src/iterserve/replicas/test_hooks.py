"""FOR TESTS ONLY: what the fleet's chaos tests (tests/replicas/test_fleet_chaos.py) ask
of a replica actor beside serving: its process id (to kill it by signal), a fault that
kills its engine loop as a step raising outside any one request would, and a check of
its KV block pool. Nothing in iterserve calls these; they change nothing until called.
"""

from __future__ import annotations

import os

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine


class ReplicaTestHooks:
    engine: AsyncEngine  # EngineReplica's

    def test_only_pid(self) -> int:
        return os.getpid()

    async def test_only_fail_next_step(self) -> None:
        """The engine's next step raises outside any one request, as a broken scheduler
        would: a replica's engine loop then stops (stop_on_step_error) while the process
        lives on."""

        def fail(*_: object, **__: object) -> None:
            raise RuntimeError("a step failed outside any one request (injected by a test)")

        # On the instance, between two steps (the loop thread runs calls between them).
        await self.engine.call(lambda engine: setattr(engine, "step", fail))

    async def test_only_check_kv_cache(self) -> int:
        """Raise KVCacheInvariantError unless the block pool agrees with itself and with
        the requests' block tables; return how many blocks requests hold."""

        def check(engine: LLMEngine) -> int:
            engine.scheduler.check_invariants()
            return engine.scheduler.kv_cache_stats().num_used_blocks

        return await self.engine.call(check)
