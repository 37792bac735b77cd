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

A replica can be taken out of routing and put back (`set_available`): the data-parallel
front end does so while a dead replica restarts, the simulator's fleet while a simulated
one is down. Each policy then chooses among the others as it would among all: round-robin
skips its turn, prefix-affinity sends a prefix to the replica its hashing ranks next (only
the absent replica's prefixes move), and back again when it returns. No policy keeps a
belief about what a replica has cached, so a replica that comes back with an empty cache
leaves nothing to forget: its prefixes return to it and are computed there once more.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


@dataclass(frozen=True)
class ReplicaLoad:
    """What a router knows of one replica when a request arrives."""

    outstanding_tokens: int  # prompt tokens still to compute + output tokens still to make
    num_requests: int  # requests sent to it and not yet finished


class ReplicaLoadTracker:
    """One replica's load as its router's caller sees it: what was sent, less what came back.

    Both callers keep it the same way (the simulator's fleet and the data-parallel front
    end), so a policy sees the same figures in simulation as when deployed. `work` holds
    each routed, unfinished request's prompt tokens until its first token (then 0);
    `outstanding` is those plus the output tokens still to come.
    """

    __slots__ = ("work", "outstanding", "num_routed")

    def __init__(self) -> None:
        self.work: dict[str, int] = {}
        self.outstanding = 0
        self.num_routed = 0

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.outstanding, len(self.work))

    def take(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        self.work[request_id] = prompt_tokens
        self.outstanding += prompt_tokens + max_tokens
        self.num_routed += 1

    def progress(self, request_id: str, new_tokens: int) -> None:
        """`new_tokens` more output tokens of a request came back (its prompt is done)."""
        if new_tokens:
            self.outstanding -= self.work[request_id] + new_tokens
            self.work[request_id] = 0

    def finish(self, request_id: str, unmade: int) -> None:
        """A request ended (done, aborted or failed) with `unmade` of its output tokens
        never made: they, and a prompt never started, no longer count."""
        self.outstanding -= self.work.pop(request_id) + unmade


class Router(Protocol):
    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        """The index in `loads` of the replica that takes this request."""
        ...

    def prepare(self, prompt_token_ids: Sequence[int], num_replicas: int) -> object:
        """What the policy reads from the prompt alone: pure, so a caller may work it out
        ahead, elsewhere (the fleet simulator does, on its other core)."""
        ...

    def choose(self, prepared: object, loads: Sequence[ReplicaLoad]) -> int:
        """route(), given prepare()'s answer for the prompt."""
        ...

    def set_available(self, index: int, available: bool) -> None:
        """Take replica `index` out of routing, or put it back. `loads` keeps listing
        every replica; one out of routing is never chosen (while none is in, choosing
        raises NoReplicaError)."""
        ...


class NoReplicaError(RuntimeError):
    """Every replica is out of routing: the caller must wait for one, or give up."""


class _Policy:
    """route() is prepare() then choose(); most policies read nothing from the prompt.
    `out` holds the replicas out of routing: empty but for an outage, so each policy's
    common path only tests it for emptiness."""

    out: frozenset[int] = frozenset()

    def set_available(self, index: int, available: bool) -> None:
        self.out = self.out - {index} if available else self.out | {index}

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[ReplicaLoad]) -> int:
        return self.choose(self.prepare(prompt_token_ids, len(loads)), loads)

    def prepare(self, prompt_token_ids: Sequence[int], num_replicas: int) -> object:
        return None

    def choose(self, prepared: object, loads: Sequence[ReplicaLoad]) -> int:
        raise NotImplementedError


def _least_loaded(loads: Sequence[ReplicaLoad], out: frozenset[int]) -> int:
    if not out:
        tokens = [load.outstanding_tokens for load in loads]
        return tokens.index(min(tokens))  # the first of equals
    return min(_available(len(loads), out), key=lambda i: (loads[i].outstanding_tokens, i))


def _available(num_replicas: int, out: frozenset[int]) -> list[int]:
    available = [i for i in range(num_replicas) if i not in out]
    if not available:
        raise NoReplicaError(f"all {num_replicas} replicas are out of routing")
    return available


class RoundRobin(_Policy):
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, prepared: object, loads: Sequence[ReplicaLoad]) -> int:
        if self.out:
            _available(len(loads), self.out)  # raises if there is none to take a turn
        while True:
            choice = self._turn % len(loads)
            self._turn += 1
            if choice not in self.out:
                return choice


class LeastOutstandingTokens(_Policy):
    def choose(self, prepared: object, loads: Sequence[ReplicaLoad]) -> int:
        return _least_loaded(loads, self.out)


class PowerOfTwoChoices(_Policy):
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, prepared: object, loads: Sequence[ReplicaLoad]) -> int:
        candidates: Sequence[int] = range(len(loads))
        if self.out:
            candidates = _available(len(loads), self.out)
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return min((a, b), key=lambda i: (loads[i].outstanding_tokens, i))


class PrefixHome(NamedTuple):
    """What prefix-affinity reads from a prompt."""

    home: int | None  # the replica its prefix belongs to; None: shorter than a block
    prompt_len: int
    prefix: int = 0  # the hash of its affinity blocks: ranks the others when home is out


class PrefixAffinity(_Policy):
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

    def prepare(self, prompt_token_ids: Sequence[int], num_replicas: int) -> PrefixHome:
        full_blocks = min(len(prompt_token_ids) // self.block_size, self.affinity_blocks)
        if full_blocks == 0:
            return PrefixHome(None, len(prompt_token_ids))
        prefix = hash(tuple(prompt_token_ids[: full_blocks * self.block_size]))
        # Rendezvous hashing: each prefix ranks the replicas its own way, so adding or
        # losing one moves only the prefixes it ranked first.
        ranks = [hash((prefix, i)) for i in range(num_replicas)]
        return PrefixHome(ranks.index(max(ranks)), len(prompt_token_ids), prefix)

    def choose(self, prepared: object, loads: Sequence[ReplicaLoad]) -> int:
        assert isinstance(prepared, PrefixHome)
        home, prompt_len, prefix = prepared
        least = _least_loaded(loads, self.out)
        if home is None:
            return least
        if home in self.out:  # the next in this prefix's ranking takes it meanwhile
            home = max(_available(len(loads), self.out), key=lambda i: hash((prefix, i)))
        allowed = self.balance_factor * loads[least].outstanding_tokens + prompt_len
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
