"""Steady decodes advanced together: a step's cost stays flat in the requests decoding.

A running request one token behind decodes one token a step until it finishes; when the
executor samples a token known in advance (the simulator's placeholder) and nothing
forces the scheduler to look at it, every such step is the same few updates: one more
computed token, one more output token, one more token time, a new KV block every
`block_size` tokens. The cohort keeps those requests aside and does that bookkeeping in
aggregate: per step it needs only how many members there are, their summed context, and
how many cross into a new block (members are bucketed by position modulo block size).
A member makes its last decode in the cohort too, and then the scheduler finishes it
the ordinary way (`done` after the step); its own fields catch up (`release`) then, or
whenever the scheduler needs it whole: when the cohort dissolves (preemption, abort). So
`iterserve simulate` pays per arrival and per finish, not per request per step;
tests/sim/test_fleet.py checks the results are identical to stepping every request
(`--step-by-step`).

The real engine never uses it: its executor needs each request's inputs every step.
The scheduler's side, which decides who joins and when the cohort gives them back, is
sim/cohort_scheduler.py.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from iterserve.core.outputs import SchedulerOutput
from iterserve.core.request import Request


class SteadyDecodes(NamedTuple):
    """A step's decodes by the cohort's members, not listed one by one: each computes one
    token and samples the executor's known token (sim/executor.py prices them). A tuple:
    the fleet makes ~8 a request ahead (sim/fleet.py), and a frozen dataclass's
    __init__ costs several times a tuple's."""

    num_seqs: int
    total_context: int  # tokens they attend over, each its new one included
    num_last: int = 0  # of them, decodes that end their request (known ahead: max_tokens)


@dataclass
class SteadyStep(SchedulerOutput):
    """A step with the cohort's decodes: only the simulated executor is given these."""

    steady: SteadyDecodes | None = None  # counted in num_decode_tokens too

    @property
    def is_empty(self) -> bool:
        return not self.seqs and self.steady is None


def steady_part(scheduled: SchedulerOutput) -> SteadyDecodes | None:
    """A step's decodes by the cohort, if any (a plain step, the real engine's, has none)."""
    return scheduled.steady if isinstance(scheduled, SteadyStep) else None


@dataclass
class _Member:
    joined: int  # cohort step at which it joined
    offset: int  # computed tokens at joining, minus `joined`: position = offset + step
    last: int  # cohort step of its final decode


class DecodeCohort:
    def __init__(self, block_size: int, token_id: int) -> None:
        self.block_size = block_size
        self.token_id = token_id  # what the executor samples for every decode
        self.step = 0  # cohort steps run so far
        self._step_times = array("d")  # when each cohort step ended (its token time)
        self._members: dict[Request, _Member] = {}
        # Members by the cohort step of their last decode; entries of members released
        # early stay until their step comes (a member is live while _members maps it).
        self._last_steps: dict[int, list[tuple[_Member, Request]]] = {}
        # Members by position modulo block size: those at 0 need a new block this step.
        self._phases = [0] * block_size
        self._offset_sum = 0
        self.lanes: Counter[str] = Counter()
        self.ranks: Counter[tuple[str, int]] = Counter()  # (lane, priority) of members
        # Blocks taken for members' new KV blocks, not yet in their block tables.
        self.blocks: list[int] = []

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, request: Request) -> bool:
        return request in self._members

    @property
    def members(self) -> list[Request]:
        return list(self._members)

    # ---- this step -------------------------------------------------------------

    def num_new_blocks(self, num_steps: int = 1) -> int:
        """Members whose token this step starts a new KV block; with `num_steps`, summed
        over this step and the next ones (steps in which no member leaves: quiet_steps)."""
        phases, size, step = self._phases, self.block_size, self.step
        if num_steps == 1:
            return phases[-step % size]
        return sum(phases[-(step + k) % size] for k in range(num_steps))

    def quiet_steps(self, limit: int) -> int:
        """How many of the next `limit` steps run up to the first in which a member makes
        its last decode, that one included (all `limit` if there is none): steps a
        scheduler may run at once, as nobody leaves or gives blocks back between them."""
        last_steps, step = self._last_steps, self.step
        for n in range(1, limit):
            if step + n - 1 in last_steps:
                return n
        return limit

    def decodes(self) -> SteadyDecodes:
        """This step's decodes (the cohort must not be empty)."""
        return next(self.ahead(1))[0]

    def ahead(self, limit: int) -> Iterator[tuple[SteadyDecodes, int]]:
        """For each of the next `limit` steps while any member is left: its decodes, and
        how many of them start a new KV block; as members leave after their last decode
        and no one joins."""
        count, offset_sum, phases = len(self._members), self._offset_sum, self._phases
        for step in range(self.step, self.step + limit):
            if not count:
                return
            entries = self._last_steps.get(step)
            leaving = self._live(entries) if entries else ()
            context = offset_sum + count * (step + 1)
            yield SteadyDecodes(count, context, len(leaving)), phases[-step % self.block_size]
            if leaving:
                phases = phases.copy()
                for member, _ in leaving:
                    count -= 1
                    offset_sum -= member.offset
                    phases[member.offset % self.block_size] -= 1

    def done(self) -> list[Request]:
        """Members whose last decode was the step just ended, in admission order: they
        leave the cohort caught up, for the scheduler to finish."""
        entries = self._last_steps.pop(self.step - 1, None)
        if not entries:
            return []
        leaving = self._live(entries)
        leaving.sort(key=lambda entry: entry[1].admission_seq)
        for _, request in leaving:
            self.release(request)
        return [request for _, request in leaving]

    def end_steps(self, ends: list[float]) -> None:
        """Steps run, each ending at its time in `ends` (its members' token time)."""
        self._step_times.extend(ends)
        self.step += len(ends)

    # ---- membership ------------------------------------------------------------

    def join(self, request: Request, steps_left: int) -> None:
        """Take a decoding request whose next `steps_left` decodes end with its last one;
        its block table must hold exactly its computed tokens."""
        offset = request.num_computed_tokens - self.step
        member = _Member(self.step, offset, self.step + steps_left - 1)
        self._members[request] = member
        self._last_steps.setdefault(member.last, []).append((member, request))
        self._phases[offset % self.block_size] += 1
        self._offset_sum += offset
        self.lanes[request.lane] += 1
        self.ranks[request.lane, request.priority] += 1

    def release(self, request: Request, decoding: bool = False) -> None:
        """Bring a member's fields up to date and hand it back to the scheduler; with
        `decoding`, also the block its token of this step (already taken) goes in."""
        member = self._members.pop(request)
        self._phases[member.offset % self.block_size] -= 1
        self._offset_sum -= member.offset
        self.lanes[request.lane] -= 1
        self.ranks[request.lane, request.priority] -= 1
        steps = self.step - member.joined
        if steps:
            times = self._step_times[member.joined : self.step]
            request.append_output_tokens([self.token_id] * steps, times)
            request.num_computed_tokens += steps
        covered = request.num_computed_tokens + decoding
        owed = -(-covered // self.block_size) - len(request.block_ids)
        if owed:
            request.block_ids += self.blocks[-owed:]
            del self.blocks[-owed:]
        if not self._members:  # start afresh: the step times served their last member
            assert not self.blocks, "blocks taken for members are left over"
            del self._step_times[:]
            self._last_steps.clear()
            self.step = 0

    def _live(self, entries: Iterable[tuple[_Member, Request]]) -> list[tuple[_Member, Request]]:
        members = self._members
        return [(member, request) for member, request in entries if members.get(request) is member]
