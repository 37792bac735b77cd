"""Steady decodes advanced together: a step's cost stays flat in the requests decoding.

A running request one token behind decodes one token a step until it finishes; when the
executor samples a token known in advance (the simulator's placeholder) and nothing
forces the scheduler to look at it, every such step is the same few updates: one more
computed token, one more output token, one more token time, a new KV block every
`block_size` tokens. The cohort keeps those requests aside and does that bookkeeping in
aggregate: per step it needs only how many members there are, their summed context, and
how many cross into a new block (members are bucketed by position modulo block size).
A member's own fields catch up (`release`) when the scheduler needs it whole: on its
last decode (done explicitly, so it finishes the ordinary way), or when the cohort
dissolves (preemption, abort). So `iterserve simulate` pays per arrival and per finish,
not per request per step; tests/test_fleet.py checks the results are identical to
stepping every request (`--step-by-step`).

The real engine never uses it: its executor needs each request's inputs every step.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import Counter
from dataclasses import dataclass

from iterserve.core.request import Request


@dataclass
class _Member:
    joined: int  # cohort step at which it joined
    offset: int  # computed tokens at joining, minus `joined`: position = offset + step
    last: int  # cohort step of its final decode, which it makes outside the cohort


class DecodeCohort:
    def __init__(self, block_size: int, token_id: int) -> None:
        self.block_size = block_size
        self.token_id = token_id  # what the executor samples for every decode
        self.step = 0  # cohort steps run so far
        self._step_times = array("d")  # when each cohort step ended (its token time)
        self._members: dict[Request, _Member] = {}
        # Heap of (last, admission order, join number, member, request); entries of members
        # released early stay until they surface.
        self._last_steps: list[tuple[int, int, int, _Member, Request]] = []
        self._joins = itertools.count()
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

    def total_context(self, ahead: int = 0) -> int:
        """Tokens the members attend over this step (each its own new one included), or
        `ahead` steps later if none leaves meanwhile."""
        return self._offset_sum + len(self._members) * (self.step + ahead + 1)

    def num_new_blocks(self, ahead: int = 0) -> int:
        """Members whose token this step (or `ahead` steps later) starts a new KV block."""
        return self._phases[-(self.step + ahead) % self.block_size]

    def steps_before_last_decode(self) -> int:
        """Steps from this one before the first that holds a member's last decode."""
        heap = self._last_steps
        while heap and self._members.get(heap[0][4]) is not heap[0][3]:
            heapq.heappop(heap)  # a member that left early
        return heap[0][0] - self.step if heap else 0

    def last_decodes(self) -> list[Request]:
        """Members whose final decode is this step, in admission order."""
        due: list[Request] = []
        while self._last_steps and self._last_steps[0][0] <= self.step:
            *_, member, request = heapq.heappop(self._last_steps)
            if self._members.get(request) is member:
                due.append(request)
        return due

    def end_step(self, now: float) -> None:
        self._step_times.append(now)
        self.step += 1

    # ---- membership ------------------------------------------------------------

    def join(self, request: Request, steps_left: int) -> None:
        """Take a decoding request whose next `steps_left` decodes end with its last one;
        its block table must hold exactly its computed tokens."""
        offset = request.num_computed_tokens - self.step
        member = _Member(self.step, offset, self.step + steps_left - 1)
        self._members[request] = member
        entry = (member.last, request.admission_seq, next(self._joins), member, request)
        heapq.heappush(self._last_steps, entry)
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
            tokens = [self.token_id] * steps
            request.output_token_ids += tokens
            request.all_token_ids += tokens
            request.timings.token_times += self._step_times[member.joined : self.step]
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
