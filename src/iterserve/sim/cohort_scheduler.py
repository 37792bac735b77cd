"""The core scheduler with steady decodes held aside in a decode cohort
(sim/decode_cohort.py): which decodes join it, when it gives them back, and the stretches
of steps it runs alone. It fills the hooks `Scheduler` offers for requests held aside
(its `_held` methods); every other decision is the core scheduler's own.
"""

from __future__ import annotations

import bisect

from iterserve.core.outputs import SchedulerOutput
from iterserve.core.policies import outranks_any
from iterserve.core.request import Request
from iterserve.core.scheduler import Scheduler
from iterserve.core.step_plan import StepPlan
from iterserve.sim.decode_cohort import DecodeCohort, SteadyDecodes, SteadyStep, steady_part
from iterserve.sim.replay_pool import ReplayBlockPool


class CohortScheduler(Scheduler):
    # Steady decodes held aside and advanced together, once advance_decodes_together().
    _cohort: DecodeCohort | None = None

    def advance_decodes_together(self, token_id: int) -> bool:
        """Keep steady decodes aside and advance them in aggregate (sim/decode_cohort.py):
        for an executor that samples `token_id` for every decode and prices a step without
        each decode's inputs (the simulator). Same decisions, same timings; steps whose
        plan depends on each request (speculation, prefill-first steps, static and
        dynamic batches) go on one by one. Returns whether it took effect."""
        config = self.config
        if self.proposer or config.batching != "continuous" or config.step_policy != "mixed":
            return False
        self._cohort = DecodeCohort(self.kv.block_size, token_id)
        return True

    def admit_to_group(self, request: Request, later_members: bool) -> None:
        """Tell the replay's block pool the group of a request just added, so its names
        stay out of the prefix cache's map while it is alone in it (sim/replay_pool.py)."""
        assert isinstance(self.kv, ReplayBlockPool), "built by SteadyEngineCore"
        self.kv.admit_to_group(request, later_members)

    def _schedule_steady_decodes(self, step: StepPlan) -> None:
        """The cohort's part of a step: running decodes with two or more left join, the
        members' new blocks are taken. Unless the step's decodes would not all fit the
        budget and the free blocks: then the cohort dissolves first, so the step goes by
        the book (the same, since decodes that all fit are planned alike in any order)."""
        cohort = self._cohort
        assert cohort is not None
        self._join_cohort(cohort)
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        new_blocks = cohort.num_new_blocks() + sum(
            1 for r in decoding if len(r.block_ids) < self.kv.blocks_needed(r.num_tokens)
        )
        if len(decoding) + len(cohort) > step.budget or new_blocks > self.kv.num_free_blocks:
            self._return_held(step=None)
            return
        cohort.blocks += self.kv.take_free_blocks(cohort.num_new_blocks())
        step.budget -= len(cohort)

    def _join_cohort(self, cohort: DecodeCohort) -> None:
        """Running decodes with two or more steps left join the cohort."""
        staying: list[Request] = []
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens != 1:
                staying.append(request)
                continue
            steps_left = self._decodes_left(request, cohort.token_id)
            computed = request.num_computed_tokens
            # A prompt's last token (one behind, nothing out yet) makes the first token:
            # update() times that one.
            if (
                steps_left > 1
                and request.num_output_tokens
                and len(request.block_ids) == self.kv.blocks_needed(computed)
            ):
                cohort.join(request, steps_left)
            else:
                staying.append(request)
        self.running = staying

    def steady_outlook(self, limit: int) -> list[SteadyDecodes]:
        """The next steps (at most `limit`) if they will be the cohort's decodes alone,
        should no request arrive: none other runs or waits, and each step's new blocks
        are free (counting none that finishing members give back: a glide that stops
        early only leaves the rest to steps by the book). Members leave after their last
        decode, the last one ending the outlook; empty when the next step is not such a
        step.

        Running decodes that the next step would let join the cohort join it first (they
        can: none is due its last decode in that step), so a request whose prompt was
        just computed does not hold a replica to one more step by the book."""
        cohort = self._cohort
        if cohort is not None and self.running:
            self._join_cohort(cohort)
        if (
            not cohort
            or self.running
            or self.waiting.count()
            or len(cohort) > self.config.max_num_batched_tokens
        ):
            return []
        free = self.kv.num_free_blocks
        steps = []
        for decodes, new_blocks in cohort.ahead(limit):
            free -= new_blocks
            if free < 0:
                break
            steps.append(decodes)
        return steps

    def run_steady(self, ends: list[float]) -> list[Request]:
        """Run the first len(ends) steps steady_outlook() foresaw, as schedule() and update()
        would have, the clock reading `ends[i]` after step i; returns the members that
        finished in them, in order."""
        cohort = self._cohort
        assert cohort is not None
        finished: list[Request] = []
        ran = 0
        # Steps up to the next in which members leave run together: until then nobody
        # frees blocks, so taking all their new blocks at once takes the same ones.
        while ran < len(ends):
            self._finished_ids.clear()  # the steps would have told the executor
            num_steps = cohort.quiet_steps(len(ends) - ran)
            num_new_blocks = cohort.num_new_blocks(num_steps)
            if num_new_blocks:
                cohort.blocks += self.kv.take_free_blocks(num_new_blocks)
            cohort.end_steps(ends[ran : ran + num_steps])
            ran += num_steps
            for request in cohort.done():
                self._finish_held(request, ends[ran - 1])
                finished.append(request)
        if self._debug_invariants:
            self.check_invariants()
        return finished

    def _decodes_left(self, request: Request, token_id: int) -> int:
        """Decodes until the request finishes if every one samples `token_id`: the core
        scheduler's stop rules (_stop_status), read ahead."""
        return 1 if self._stops_on(request, token_id) else self._tokens_left(request)

    # ---- the core scheduler's hooks for requests held aside ---------------------------

    def _num_held(self, lane: str | None = None) -> int:
        cohort = self._cohort
        return 0 if not cohort else len(cohort) if lane is None else cohort.lanes[lane]

    def _unlist(self, request: Request) -> None:
        if self._cohort is not None and request in self._cohort:
            self._cohort.release(request)
        else:
            super()._unlist(request)

    def _block_tables(self) -> list[list[int]]:
        tables = super()._block_tables()
        if self._cohort:
            tables.append(self._cohort.blocks)  # members' newest blocks, not yet in their tables
        return tables

    def _schedule_held(self, step: StepPlan) -> None:
        if self._cohort is not None:
            self._schedule_steady_decodes(step)

    def _end_held_step(self, scheduled: SchedulerOutput, now: float) -> list[Request]:
        cohort = self._cohort
        if cohort is None or steady_part(scheduled) is None:
            return []
        cohort.end_steps([now])
        return cohort.done()

    def _output(self, step: StepPlan, now: float) -> SchedulerOutput:
        plain = super()._output(step, now)
        cohort = self._cohort
        steady = cohort.decodes() if cohort else None
        return SteadyStep(
            seqs=plain.seqs,
            num_prefill_tokens=plain.num_prefill_tokens,
            num_decode_tokens=plain.num_decode_tokens + (steady.num_seqs if steady else 0),
            num_draft_tokens=plain.num_draft_tokens,
            finished_ids=plain.finished_ids,
            steady=steady,
        )

    def _return_held(self, step: StepPlan | None, outranking: Request | None = None) -> None:
        """Every member back in the running list, whole (with `outranking`, only if that
        request might outrank one of them). Mid-step (`step`), their decodes of this
        step, budget and blocks already taken, become ordinary ones."""
        cohort = self._cohort
        if not cohort:
            return
        if outranking is not None and not outranks_any(outranking, cohort.ranks):
            return
        members = cohort.members
        if step is not None:
            step.budget += len(members)
        for request in members:
            cohort.release(request, decoding=step is not None)
            self._run_again(request)
            if step is not None:
                step.add(request, 1)

    def _run_again(self, request: Request) -> None:
        """Back into the running list, which stays in admission order."""
        bisect.insort(self.running, request, key=lambda r: r.admission_seq)
