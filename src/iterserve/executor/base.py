"""What the engine needs of an executor: turn a step plan into sampled tokens.

The real executor runs the model; the simulated one runs a cost model on a
virtual clock. Both are driven by the same loop (engine/engine_core.py) and scheduler.
"""

from __future__ import annotations

from typing import Protocol

from iterserve.core.outputs import ModelOutput, SchedulerOutput


class Executor(Protocol):
    def execute(self, scheduled: SchedulerOutput) -> ModelOutput: ...
