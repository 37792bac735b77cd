"""The front end's side of one replica actor: the actor handle, the load routing sees, its
latest gauges, and the relay that carries each dispatch's outputs from the actor into the
server's RequestStream.

One ReplicaClient is one actor's life. Once that actor dies (its process, or only its
engine loop) the client is dead for good, and the replica's slot (supervisor.py) starts a
new actor behind a new client. Everything here runs on the front end's event loop.

What a death does to the requests on the replica is decided here, where the relay knows
what each request has delivered:
- not yet taken by the replica: `submit` raises ReplicaDiedError, and the fleet sends the
  group to another replica;
- taken, but no token out yet: handed to the fleet (`on_orphans`), which sends it to
  another replica, into the same stream: the client sees only latency;
- tokens out already: they cannot be taken back, nor resumed on an engine that never
  saw them, so the request ends with ReplicaLostError (a retryable 503 naming the cause,
  or an error event in a stream already started).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from iterserve.engine.metrics import EngineSnapshot, idle_snapshot
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.request_stream import ReplicaLostError, RequestFailedError
from iterserve.engine.serving_engine import FinishedCallback
from iterserve.replicas.dispatch import Dispatch
from iterserve.replicas.events import ReplicaEvent, ReplicaFailure, ReplicaStatus
from iterserve.replicas.router import ReplicaLoadTracker

logger = logging.getLogger("iterserve.data_parallel")


class ReplicaDiedError(RequestFailedError):
    """The replica died before it took the group: nothing ran, another replica may."""


# (the requests to send again elsewhere, the index of the replica that died, why it died)
OrphansCallback = Callable[[Dispatch, int, str], None]
DeathCallback = Callable[["ReplicaClient", str], None]


class ReplicaClient:
    def __init__(
        self,
        index: int,
        actor: Any,
        report: FinishedCallback,
        on_orphans: OrphansCallback,
        on_death: DeathCallback,
    ) -> None:
        self.index = index
        self.actor = actor  # a Ray ActorHandle of EngineReplica
        self.tracker = ReplicaLoadTracker()
        self.snapshot = EngineSnapshot()
        self.ready = False
        self.death: str | None = None  # why it died, once it has
        self._report = report  # (output, reason, replica index) for every request that ends
        self._on_orphans = on_orphans
        self._on_death = on_death
        self._pending = 0  # requests sent and not yet taken or refused
        self._num_waiting = 0  # the replica's queue, as its latest event or status said
        self._relays: set[asyncio.Task[None]] = set()

    @property
    def alive(self) -> bool:
        return self.death is None

    def num_waiting_estimate(self) -> int:
        return self._pending + self._num_waiting if self.alive else 0

    def num_live(self) -> int:
        """Requests routed here and not ended."""
        return len(self.tracker.work)

    async def submit(self, dispatch: Dispatch) -> None:
        """Send a dispatch (prompts as token ids); returns once the replica took it, raises
        what a single engine's add would, or ReplicaDiedError."""
        accepted: asyncio.Future[None] = dispatch.stream.loop.create_future()
        for request, (prompt, most) in zip(dispatch.requests, dispatch.counts, strict=True):
            self.tracker.take(request.request_id, prompt, most)
        self._pending += len(dispatch.requests)
        first = dispatch.requests[0].arrival_time
        waited = time.monotonic() - (first or time.monotonic())
        relay = asyncio.ensure_future(self._relay(dispatch, waited, accepted))
        self._relays.add(relay)
        relay.add_done_callback(self._relays.discard)
        try:
            await accepted
        except asyncio.CancelledError:  # the caller gave up: the add's abort follows it
            self.abort(dispatch.request_ids)
            raise
        finally:
            self._pending -= len(dispatch.requests)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests on the replica (returns at once); their abort outputs come back
        through their dispatch's relay like any other."""
        if request_ids and self.alive:
            self.actor.abort.remote(list(request_ids))

    async def _relay(
        self, dispatch: Dispatch, waited: float, accepted: asyncio.Future[None]
    ) -> None:
        # Each unfinished request's output tokens still to come, by position in the
        # dispatch (what its load is less when it ends), and which have made a token.
        left = {position: most for position, (_, most) in enumerate(dispatch.counts)}
        produced: set[int] = set()
        try:
            events = self.actor.generate.options(num_returns="streaming").remote(
                dispatch.requests, waited
            )
            async for ref in events:
                event: ReplicaEvent = await ref
                self._num_waiting = event.num_waiting
                if event.refused is not None:
                    _settle(accepted, event.refused.error())
                    return  # never ran: nothing to report
                if event.died is None:
                    _settle(accepted, None)
                for position, item in event.deliveries:
                    self._deliver(dispatch, position, item, left, produced)
                if event.died is not None:
                    self.mark_dead(f"its engine loop stopped: {event.died}")
                    self._orphan(dispatch, left, produced, accepted)
                    return
        except RayActorError as error:
            self.mark_dead(actor_death_cause(error))
            self._orphan(dispatch, left, produced, accepted)
        except Exception as error:  # a bug or a lost object: this dispatch only
            logger.exception("replica %d: relaying a group failed", self.index)
            message = f"replica {self.index}: {error}"
            if not accepted.done():
                _settle(accepted, RequestFailedError(message))
            else:
                self._fail(dispatch, list(left), RequestFailedError(message))
        finally:
            for position, unmade in left.items():  # refused, failed, or gone elsewhere
                self.tracker.finish(dispatch.requests[position].request_id, unmade)
            if not accepted.done():  # the stream ended before saying anything
                _settle(accepted, RequestFailedError(f"replica {self.index} sent nothing"))

    def _deliver(
        self,
        dispatch: Dispatch,
        position: int,
        item: RequestOutput | ReplicaFailure,
        left: dict[int, int],
        produced: set[int],
    ) -> None:
        request_id = dispatch.requests[position].request_id
        index = dispatch.indices[position]
        if isinstance(item, ReplicaFailure):
            self.tracker.finish(request_id, left.pop(position))
            dispatch.stream._push(index, item.error())
            self._report(item.output, "error", self.index)
            return
        if item.delta_token_ids or item.finished:
            produced.add(position)
        new = min(len(item.delta_token_ids), left[position])
        self.tracker.progress(request_id, new)
        left[position] -= new
        dispatch.stream._push(index, item)
        if item.finished:
            self.tracker.finish(request_id, left.pop(position))
            self._report(item, item.finish_reason or "stop", self.index)

    def _orphan(
        self,
        dispatch: Dispatch,
        left: dict[int, int],
        produced: set[int],
        accepted: asyncio.Future[None],
    ) -> None:
        """The replica died under this dispatch: what it never took goes back to the fleet
        (ReplicaDiedError), as does what it took but made no token of (`on_orphans`); what
        had made tokens ends with ReplicaLostError."""
        cause = f"replica {self.index} died ({self.death})"
        if not accepted.done():
            _settle(accepted, ReplicaDiedError(cause))
            return
        started = [position for position in left if position in produced]
        message = (
            f"{cause} after this request had produced tokens, which cannot be resumed on "
            "another replica; retry the request"
        )
        self._fail(dispatch, started, ReplicaLostError(message))
        unstarted = [position for position in left if position not in produced]
        if unstarted:
            self._on_orphans(dispatch.part(unstarted), self.index, self.death or "?")

    def _fail(self, dispatch: Dispatch, positions: list[int], error: RequestFailedError) -> None:
        for position in positions:
            dispatch.stream._push(dispatch.indices[position], error)
            self._report(None, "error", self.index)

    def mark_dead(self, reason: str) -> None:
        """This actor is done for (`reason` says why, for the log and /health); its slot
        hears of it, once, and restarts it or gives it up."""
        if self.death is not None:
            return
        self.death = reason
        self.snapshot = idle_snapshot(self.snapshot)
        logger.error(
            "replica %d died: %s; it had %d requests in flight", self.index, reason, self.num_live()
        )
        self._on_death(self, reason)

    async def poll(self, timeout: float) -> None:
        """Refresh readiness and gauges from the actor; notice its death, or that it hangs."""
        if not self.alive:
            return
        try:
            status: ReplicaStatus = await asyncio.wait_for(
                awaited(self.actor.status.remote()), timeout
            )
        except RayActorError as error:
            self.mark_dead(actor_death_cause(error))
            return
        except TimeoutError:
            if self.ready:  # warmed up, yet silent: hung (a compile may take long, first)
                self.mark_dead(f"it answered no status call for {timeout:.0f} s (hung)")
            else:
                logger.warning(
                    "replica %d did not answer a status call in %.0f s", self.index, timeout
                )
            return
        except Exception:  # keep polling: the next call may do better
            logger.exception("replica %d: reading its status failed", self.index)
            return
        if not self.alive:  # died while the call was out
            return
        self.snapshot = status.snapshot
        self.ready = status.ready
        if status.healthy:
            self._num_waiting = status.snapshot.num_waiting
        else:
            self.mark_dead(f"its engine loop stopped: {status.failure}")

    async def drain(self, timeout: float) -> None:
        """Wait for the relays of this replica's dispatches to end (after an abort or a
        shutdown every one ends)."""
        if self._relays:
            await asyncio.wait(set(self._relays), timeout=timeout)

    def kill(self, reason: str = "shut down") -> None:
        """End the actor's process (a shutdown, or a dead replica's leftovers before its
        restart); the slot is not told: whoever kills knows."""
        self.death = self.death or reason
        ray.kill(self.actor)


def actor_death_cause(error: RayActorError) -> str:
    """Ray's account of an actor's death in one line: the process (pid, machine) and Ray's
    exit type and detail. Ray does not report the signal: a SIGKILL, the kernel's OOM
    killer and a segfault all read "exits with a connection error"."""
    text = str(error)
    found = {
        key: match.group(1)
        for key, pattern in (
            ("pid", r"\bpid: (\d+)"),
            ("ip", r"\bip: (\S+)"),
            ("type", r"Worker exit type: (\S+)"),
            ("detail", r"Worker exit detail: (.+?\.)(?:\s|$)"),
        )
        if (match := re.search(pattern, text))
    }
    if "type" not in found:  # not a process death Ray explains: its own first line
        return f"its actor died ({type(error).__name__}: {text.strip().splitlines()[0]})"
    where = f"pid {found.get('pid', '?')} on {found.get('ip', '?')}"
    return f"its process ({where}) exited: {found['type']}, {found.get('detail', '').rstrip('.')}"


async def awaited(ref: Any) -> Any:
    """A Ray ObjectRef as a coroutine (what asyncio.wait_for and gather take)."""
    return await ref


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
