"""Which replica serves a request: the routing policies of a fleet of engines.

Pure Python, no torch: the simulator's fleet (`iterserve simulate --replicas N`) routes
with these, and a real front end over several engines is meant to route with the same
ones, so a policy evaluated in simulation is the one deployed.

The caller owns the load figures (it knows what it sent each replica and what came back),
keeps them with a `ReplicaLoadTracker` per replica and hands them in; a router keeps only
its policy's own state (a turn counter, a seeded generator). Policies (`--router`):

- ``round-robin``: replicas in turn, blind to load.
- ``least-tokens``: the replica with the fewest outstanding tokens (prompt tokens not yet
  computed plus output tokens not yet generated), ties to the lowest index.
- ``power-of-two``: two replicas drawn at random, the less loaded of them (Mitzenmacher's
  power of two choices: most of least-tokens' balance from two load reads).
- ``prefix-affinity``: requests whose prompts share their first `affinity_blocks` KV
  blocks go to the same replica (rendezvous hashing of those blocks' tokens), so its
  prefix cache holds them; unless that replica carries more than `balance_factor` times
  the least loaded one's outstanding tokens (plus one request's worth), when the request
  goes to the least loaded instead (SGLang's cache-aware router escapes hot spots the
  same way). Prompts shorter than one block have no prefix to share: least-tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router knows of one replica when a request arrives."""

    outstanding_tokens: int  # prompt tokens still to compute + output tokens still to make
    num_requests: int  # requests sent to it and not yet finished


class ReplicaLoadTracker:
    """One replica's load as its router's caller sees it: what was sent, less what came back.

    Both callers keep it the same way (the simulator's fleet and the data-parallel front
    end), so a policy sees the same figures in simulation as when deployed. Each routed,
    unfinished request is [prompt tokens, until its first token; output tokens still to
    come]; `outstanding` is their running sum.
    """

    def __init__(self) -> None:
        self.work: dict[str, list[int]] = {}
        self.outstanding = 0
        self.num_routed = 0

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.outstanding, len(self.work))

    def take(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        self.work[request_id] = [prompt_tokens, max_tokens]
        self.outstanding += prompt_tokens + max_tokens
        self.num_routed += 1

    def progress(self, request_id: str, new_tokens: int, finished: bool) -> None:
        """`new_tokens` more output tokens came back; `finished`: the request ended (done,
        aborted or failed), whatever it had left no longer counts. Unknown ids are ignored
        (a request forgotten already, e.g. its replica died)."""
        work = self.work.get(request_id)
        if work is None:
            return
        if new_tokens:
            self.outstanding -= work[0] + min(new_tokens, work[1])
            work[0] = 0
            work[1] = max(0, work[1] - new_tokens)
        if finished:
            self.outstanding -= sum(self.work.pop(request_id))

    def forget_all(self) -> list[str]:
        """Drop every request (its replica is gone); returns their ids."""
        ids = list(self.work)
        self.work.clear()
        self.outstanding = 0
        return ids


class Router(Protocol):
    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        """The index in `loads` of the replica that takes this request."""
        ...


def _least_loaded(loads: Sequence[ReplicaLoad]) -> int:
    return min(range(len(loads)), key=lambda i: (loads[i].outstanding_tokens, i))


class RoundRobin:
    def __init__(self) -> None:
        self._turn = 0

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        choice = self._turn % len(loads)
        self._turn += 1
        return choice


class LeastOutstandingTokens:
    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        return _least_loaded(loads)


class PowerOfTwoChoices:
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        if len(loads) == 1:
            return 0
        a, b = self._rng.sample(range(len(loads)), 2)
        return min((a, b), key=lambda i: (loads[i].outstanding_tokens, i))


class PrefixAffinity:
    def __init__(
        self, block_size: int, affinity_blocks: int = 4, balance_factor: float = 2.0
    ) -> None:
        if block_size < 1 or affinity_blocks < 1 or balance_factor < 1.0:
            raise ValueError(
                "prefix-affinity routing needs block_size >= 1, affinity_blocks >= 1 and "
                f"balance_factor >= 1, got {block_size}, {affinity_blocks}, {balance_factor}"
            )
        self.block_size = block_size
        self.affinity_blocks = affinity_blocks
        self.balance_factor = balance_factor

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        full_blocks = min(len(prompt_token_ids) // self.block_size, self.affinity_blocks)
        least = _least_loaded(loads)
        if full_blocks == 0:
            return least
        prefix = hash(tuple(prompt_token_ids[: full_blocks * self.block_size]))
        # Rendezvous hashing: each prefix ranks the replicas its own way, so adding or
        # losing one moves only the prefixes it ranked first.
        home = max(range(len(loads)), key=lambda i: hash((prefix, i)))
        allowed = self.balance_factor * loads[least].outstanding_tokens + len(prompt_token_ids)
        return home if loads[home].outstanding_tokens <= allowed else least


ROUTERS = ("round-robin", "least-tokens", "power-of-two", "prefix-affinity")


def make_router(name: str, block_size: int, seed: int = 0) -> Router:
    """The policy called `name` (one of ROUTERS)."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-tokens":
        return LeastOutstandingTokens()
    if name == "power-of-two":
        return PowerOfTwoChoices(seed)
    if name == "prefix-affinity":
        return PrefixAffinity(block_size)
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
