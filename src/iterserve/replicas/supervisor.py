"""One replica's place in the fleet for the server's whole life, and its restarts.

A slot holds the client of the replica's current actor (client.py). When that actor dies
(its process killed or out of memory, its engine loop stopped by a step that raised
outside any one request, or hung), the slot takes the replica out of routing, waits a
back-off, starts a new actor with the same settings, waits until it has loaded and warmed
up, and puts it back into routing: a fresh engine, with an empty prefix cache. The fleet
(data_parallel.py) has meanwhile sent elsewhere what the dead one had not started.

Restarts are bounded (RestartPolicy): at most `max_restarts` in a row, a row being broken
by a spell of serving `stable_after` seconds without dying; back-off 1, 2, 4 s, ... Past
the bound the replica stays down ("given up" on /health), rather than a replica that dies
at every start (a bad model path on one machine, memory it can never have) loading
weights forever.

Why Ray's own `max_restarts` is not used: Ray would bring the actor back, but the front
end must learn of it anyway (to re-route, to reset the router and the load figures, to
say so on /health), and Ray restarts with no back-off the front end controls and no wait
for warm-up before traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from iterserve.engine.serving_engine import (
    REPLICA_GIVEN_UP,
    REPLICA_OK,
    REPLICA_RESTARTING,
    REPLICA_WARMING,
    ReplicaState,
    ServedModel,
)
from iterserve.replicas.client import ReplicaClient, awaited
from iterserve.replicas.events import ReplicaStatus

logger = logging.getLogger("iterserve.data_parallel")

# How often a restarting replica is asked whether it has warmed up.
_READY_POLL = 0.25


@dataclass(frozen=True)
class RestartPolicy:
    # Default 3: enough to ride out the deaths that pass (an OOM kill in a burst, a node
    # hiccup) at 1 + 2 + 4 s of back-off, few enough that a replica dying at every start
    # gives up after three loads (--replica-max-restarts).
    max_restarts: int = 3
    backoff: float = 1.0  # before the first restart of a row; doubled for each next one
    max_backoff: float = 30.0
    stable_after: float = 60.0  # serving this long without dying starts a new row
    load_timeout: float = 900.0  # a new actor's whole start: weights in, warmed up

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"--replica-max-restarts must be 0 or more, got {self.max_restarts}")

    def delay(self, attempt: int) -> float:
        """Back-off before restart `attempt` (0-based) of a row."""
        return min(self.max_backoff, self.backoff * 2**attempt)


class ReplicaSlot:
    def __init__(
        self,
        index: int,
        client: ReplicaClient,
        spawn: Callable[[], Any] | None,
        make_client: Callable[[Any], ReplicaClient],
        on_change: Callable[[ReplicaSlot], None],
        policy: RestartPolicy,
        max_model_len: int,
    ) -> None:
        """`spawn()` starts a new actor with the replica's settings (None: this fleet cannot
        restart, as with stand-in actors); `make_client(actor)` wraps one; `on_change` is
        called when the replica leaves routing or comes back (or is given up).
        `max_model_len` is the fleet's: a restarted replica must hold sequences that long."""
        self.index = index
        self.client = client
        self.policy = policy
        self.max_model_len = max_model_len
        self.restarts = 0  # actors started after the first
        self.rerouted = 0  # requests sent elsewhere when it died (not taken, or no token)
        self.last_death: str | None = None
        self._spawn = spawn
        self._make_client = make_client
        self._on_change = on_change
        self._in_a_row = 0  # restarts since it last served `stable_after` without dying
        self._up_since = time.monotonic()
        self._restarting = False
        self._given_up = False
        self._task: asyncio.Task[None] | None = None

    @property
    def state(self) -> str:
        if self._given_up:
            return REPLICA_GIVEN_UP
        if self._restarting or not self.client.alive:
            return REPLICA_RESTARTING
        return REPLICA_OK if self.client.ready else REPLICA_WARMING

    def report(self) -> ReplicaState:
        return ReplicaState(self.state, self.restarts, self.rerouted, self.last_death)

    @property
    def serving(self) -> bool:
        return not self._given_up and not self._restarting and self.client.alive

    @property
    def given_up(self) -> bool:
        return self._given_up

    def died(self, client: ReplicaClient, reason: str) -> None:
        """The death callback of this slot's clients: restart, or give up."""
        if client is not self.client or self._given_up or self._restarting:
            return  # an old actor's leftovers, or a shutdown
        self.last_death = reason
        if time.monotonic() - self._up_since >= self.policy.stable_after:
            self._in_a_row = 0
        if self._spawn is None:
            self._give_up("this fleet cannot start replicas")
            return
        if self._in_a_row >= self.policy.max_restarts:
            self._give_up(self._out_of_restarts())
            return
        self._restarting = True
        self._on_change(self)
        self._task = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        assert self._spawn is not None
        with contextlib.suppress(Exception):  # its process may live on (a dead engine loop)
            self.client.kill(self.client.death or "died")
        while self._in_a_row < self.policy.max_restarts:
            delay = self.policy.delay(self._in_a_row)
            self._in_a_row += 1
            logger.warning(
                "replica %d: restarting it in %.0f s (restart %d of at most %d in a row)",
                self.index, delay, self._in_a_row, self.policy.max_restarts,
            )  # fmt: skip
            await asyncio.sleep(delay)
            started = time.monotonic()
            self.restarts += 1
            actor = None
            try:
                actor = self._spawn()  # (raises if Ray itself is gone)
                await asyncio.wait_for(
                    _until_ready(actor, self.max_model_len), self.policy.load_timeout
                )
            except asyncio.CancelledError:  # a shutdown: the new actor goes too
                _kill(actor)
                raise
            except Exception as error:
                reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
                self.last_death = f"its restart failed: {reason}"
                logger.error("replica %d: restart failed: %s", self.index, reason)
                _kill(actor)
                continue
            self.client = self._make_client(actor)
            self.client.ready = True
            self._up_since = time.monotonic()
            self._restarting = False
            logger.warning(
                "replica %d is back after %.1f s: loaded and warmed up in %.1f s, serving again",
                self.index, self._up_since - started + delay, self._up_since - started,
            )  # fmt: skip
            self._on_change(self)
            return
        self._restarting = False
        self._give_up(self._out_of_restarts())

    def _out_of_restarts(self) -> str:
        return f"{self._in_a_row} restarts in a row are all --replica-max-restarts allows"

    def _give_up(self, why: str) -> None:
        self._given_up = True
        logger.error("replica %d stays down: %s (last death: %s)", self.index, why, self.last_death)
        self._on_change(self)

    async def stop(self) -> None:
        """No more restarts (a shutdown): one under way is cancelled, its actor killed."""
        self._given_up = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _kill(actor: Any) -> None:
    if actor is not None:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(actor)


async def _until_ready(actor: Any, max_model_len: int) -> None:
    """Wait until a new actor has loaded its weights (or says why it could not) and warmed
    up; raise if it dies or its engine stops meanwhile, or if it holds shorter sequences
    than the fleet serves (its auto KV pool, sized from the memory it found, may be smaller
    than its predecessor's): the front end has promised `max_model_len` to every request."""
    model: ServedModel | str = await awaited(actor.served_model.remote())
    if isinstance(model, str):
        raise RuntimeError(f"it could not start: {model}")
    if model.max_model_len < max_model_len:
        raise RuntimeError(
            f"it holds sequences of {model.max_model_len} tokens, fewer than the "
            f"{max_model_len} the fleet serves (its KV cache found less memory; "
            "--kv-cache-memory GiB sizes every replica alike)"
        )
    while True:
        status: ReplicaStatus = await awaited(actor.status.remote())
        if not status.healthy:
            raise RuntimeError(f"its engine loop stopped: {status.failure}")
        if status.ready:
            return
        await asyncio.sleep(_READY_POLL)
