"""Runs planned steps on one worker thread, in order, so that the engine thread can plan
the next step, and detokenize and stream the last one's tokens, while a step computes
(asynchronous scheduling; vLLM's --async-scheduling, SGLang's overlap scheduler).

The scheduler plans step N+1 before step N's samples are known: a decode whose last token
is step N's sample carries a placeholder (ScheduledSeq.last_token_in_flight). The worker
runs the steps one after the other, so it has step N's samples when step N+1 starts, and
writes them in there; no step waits for the engine thread. Torch-free: the simulator's
executor can run behind it as well as the model.

On a CPU every torch op of the engine, its loading and warm-up included, must run on this
one thread (`call`): torch's parallel regions run on OpenMP, which keeps a team of threads
per thread that ever entered one; once the process holds more such threads than cores,
libgomp stops spinning between regions for every team, and a decode step, made of many
short regions, takes twice as long (measured: benchmarks/async_scheduling.py, and
docs/async_scheduling.md).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from iterserve.core.outputs import ModelOutput, SampledToken, SchedulerOutput
from iterserve.executor.base import Executor

T = TypeVar("T")


class StepSkippedError(RuntimeError):
    """A step queued behind one that failed: it never ran."""


class StepPipeline:
    def __init__(self) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="iterserve-step")
        # The samples of the last step run: where the next step's placeholders come from.
        self._last_sampled: dict[str, list[SampledToken]] = {}
        # Set by a step that raised; the steps queued behind it are skipped, since they
        # were planned on top of its results. Cleared by recover().
        self._failed = False

    def submit(self, executor: Executor, scheduled: SchedulerOutput) -> Future[ModelOutput]:
        """Run the step after those submitted before it; its future holds its output."""
        return self._worker.submit(self._run, executor, scheduled)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the step thread, after what was submitted, and wait for it."""
        return self._worker.submit(fn, *args).result()

    def recover(self) -> None:
        """After a failed step's future was read and every step behind it was too: run
        the steps submitted from now on again."""
        self._failed = False
        self._last_sampled = {}

    def close(self) -> None:
        """Finish what was submitted, then stop the worker thread."""
        self._worker.shutdown(wait=True)

    def _run(self, executor: Executor, scheduled: SchedulerOutput) -> ModelOutput:
        if self._failed:
            raise StepSkippedError("the step before this one failed")
        try:
            write_in_flight_tokens(scheduled, self._last_sampled)
            output = executor.execute(scheduled)
        except BaseException:
            self._failed = True
            raise
        self._last_sampled = output.sampled
        return output


def write_in_flight_tokens(
    scheduled: SchedulerOutput, sampled: dict[str, list[SampledToken]]
) -> None:
    """Put into each decode planned on a step still in flight the token that step sampled
    for it (its last), in the step's inputs and in the history its controls read."""
    for seq in scheduled.seqs:
        if not seq.last_token_in_flight:
            continue
        token_id = sampled[seq.request_id][-1].token_id
        seq.token_ids[len(seq.token_ids) - len(seq.draft_token_ids) - 1] = token_id
        if seq.context is not None:
            seq.context.output_token_ids.append(token_id)
