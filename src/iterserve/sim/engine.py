"""The engine loop of a simulated replica: the core loop (engine/engine_core.py) with the
cohort scheduler (sim/cohort_scheduler.py) over the replay's block pool
(sim/replay_pool.py), and the cohort's glides run at once."""

from __future__ import annotations

from iterserve.core.request import Request
from iterserve.engine.engine_core import CoreStep, EngineCore
from iterserve.sim.cohort_scheduler import CohortScheduler, steady_part
from iterserve.sim.replay_pool import ReplayBlockPool


class SteadyEngineCore(EngineCore):
    scheduler_type = CohortScheduler
    scheduler: CohortScheduler
    pool_type = ReplayBlockPool

    def step(self, no_more_arrivals: bool = False) -> CoreStep:
        step = super().step(no_more_arrivals)
        steady = steady_part(step.scheduled)
        if steady is not None:  # their tokens are in no update: made all alike
            self.stats.generated_tokens += steady.num_seqs
        return step

    def run_steady(self, tokens: int, ends: list[float]) -> list[Request]:
        """Run the first len(ends) steps CohortScheduler.steady_outlook foresaw, `tokens`
        decodes in all, at once: the simulator prices them itself and jumps its clock to
        `ends[-1]`. Returns the requests that finished in them."""
        finished = self.scheduler.run_steady(ends)
        stats = self.stats
        stats.num_steps += len(ends)
        stats.decode_tokens += tokens
        stats.generated_tokens += tokens
        return finished
