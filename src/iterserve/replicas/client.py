"""The front end's side of one replica: its Ray actor, the load routing sees, its latest
gauges, and the relay that carries each group's outputs from the actor into the
RequestStream the server reads.

Everything here runs on the front end's event loop; only Ray's own threads touch the
actor handle. When the actor dies, every group streaming from it ends with an error
(RequestFailedError: a 500, or an error event in a stream already started) and the
replica is marked dead so the router skips it; the other replicas are untouched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from iterserve.engine.metrics import EngineSnapshot, idle_snapshot
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.request_stream import (
    GenerationRequest,
    RequestFailedError,
    RequestStream,
    accepted_stream,
)
from iterserve.engine.serving_engine import (
    REPLICA_DEAD,
    REPLICA_OK,
    REPLICA_WARMING,
    FinishedCallback,
)
from iterserve.replicas.events import ReplicaEvent, ReplicaFailure, ReplicaStatus
from iterserve.replicas.router import ReplicaLoadTracker

logger = logging.getLogger("iterserve.data_parallel")


class ReplicaDiedError(RequestFailedError):
    """The replica died before it took the group: nothing ran, another replica may."""


class ReplicaClient:
    def __init__(self, index: int, actor: Any, report: FinishedCallback) -> None:
        self.index = index
        self.actor = actor  # a Ray ActorHandle of EngineReplica
        self.tracker = ReplicaLoadTracker()
        self.snapshot = EngineSnapshot()
        self.ready = False
        self.death: str | None = None  # why it died, once it has
        self._report = report  # (output, reason, replica index) for every request that ends
        self._pending = 0  # requests sent and not yet taken or refused
        self._num_waiting = 0  # the replica's queue, as its latest event or status said
        self._relays: set[asyncio.Task[None]] = set()

    @property
    def alive(self) -> bool:
        return self.death is None

    @property
    def health(self) -> str:
        if not self.alive:
            return REPLICA_DEAD
        return REPLICA_OK if self.ready else REPLICA_WARMING

    def num_waiting_estimate(self) -> int:
        return self._pending + self._num_waiting if self.alive else 0

    def num_live(self) -> int:
        """Requests routed here and not ended."""
        return len(self.tracker.work)

    async def submit(
        self, requests: list[GenerationRequest], token_counts: list[tuple[int, int]]
    ) -> RequestStream:
        """Send a group (prompts as token ids) and return its stream once the replica took
        it; raises what a single engine's add would. `token_counts`: (prompt tokens, most
        output tokens) per request, for the load the router sees."""
        stream = RequestStream([r.request_id for r in requests], self.abort)
        accepted: asyncio.Future[None] = stream.loop.create_future()
        for request, (prompt, most) in zip(requests, token_counts, strict=True):
            self.tracker.take(request.request_id, prompt, most)
        self._pending += len(requests)
        waited = time.monotonic() - (requests[0].arrival_time or time.monotonic())
        mosts = [most for _, most in token_counts]
        relay = asyncio.ensure_future(self._relay(requests, mosts, waited, stream, accepted))
        self._relays.add(relay)
        relay.add_done_callback(self._relays.discard)
        try:
            return await accepted_stream(stream, accepted)
        finally:
            self._pending -= len(requests)

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests on the replica (returns at once); their abort outputs come back
        through their group's relay like any other."""
        if request_ids and self.alive:
            self.actor.abort.remote(list(request_ids))

    async def _relay(
        self,
        requests: list[GenerationRequest],
        mosts: list[int],
        waited: float,
        stream: RequestStream,
        accepted: asyncio.Future[None],
    ) -> None:
        # Each unfinished request's output tokens still to come, by index in the group:
        # what its load is less when it ends.
        left = dict(enumerate(mosts))
        try:
            events = self.actor.generate.options(num_returns="streaming").remote(requests, waited)
            async for ref in events:
                event: ReplicaEvent = await ref
                self._num_waiting = event.num_waiting
                if event.refused is not None:
                    _settle(accepted, event.refused.error())
                    return  # never ran: nothing to report
                _settle(accepted, None)
                for index, item in event.deliveries:
                    self._deliver(stream, requests[index].request_id, index, item, left)
        except RayActorError as error:
            self.actor_died(error)
            message = f"replica {self.index} died"
            self._fail(stream, left, accepted, ReplicaDiedError(message), message)
        except Exception as error:  # a bug or a lost object: this group only
            logger.exception("replica %d: relaying a group failed", self.index)
            message = f"replica {self.index}: {error}"
            self._fail(stream, left, accepted, RequestFailedError(message), message)
        finally:
            for index, unmade in left.items():  # refused, or failed with its replica
                self.tracker.finish(requests[index].request_id, unmade)
            if not accepted.done():  # the stream ended before saying anything
                _settle(accepted, RequestFailedError(f"replica {self.index} sent nothing"))

    def _deliver(
        self,
        stream: RequestStream,
        request_id: str,
        index: int,
        item: RequestOutput | ReplicaFailure,
        left: dict[int, int],
    ) -> None:
        if isinstance(item, ReplicaFailure):
            self.tracker.finish(request_id, left.pop(index))
            stream._push(index, item.error())
            self._report(item.output, "error", self.index)
            return
        new = min(len(item.delta_token_ids), left[index])
        self.tracker.progress(request_id, new)
        left[index] -= new
        stream._push(index, item)
        if item.finished:
            self.tracker.finish(request_id, left.pop(index))
            self._report(item, item.finish_reason or "stop", self.index)

    def _fail(
        self,
        stream: RequestStream,
        left: dict[int, int],
        accepted: asyncio.Future[None],
        refusal: RequestFailedError,
        message: str,
    ) -> None:
        """End the group's unfinished requests with `message`; or, if the replica never
        took the group, fail its add with `refusal`."""
        if not accepted.done():
            _settle(accepted, refusal)
            return
        for index in left:
            stream._push(index, RequestFailedError(message))
            self._report(None, "error", self.index)

    def actor_died(self, error: RayActorError) -> None:
        self.mark_dead(f"its actor died ({type(error).__name__})")

    def mark_dead(self, reason: str) -> None:
        if self.death is not None:
            return
        self.death = reason
        self.snapshot = idle_snapshot(self.snapshot)
        logger.error(
            "replica %d is dead (%s): failing its %d in-flight requests; the other replicas "
            "go on serving", self.index, reason, self.num_live(),
        )  # fmt: skip

    async def poll(self, timeout: float) -> None:
        """Refresh readiness and gauges from the actor; notice its death."""
        if not self.alive:
            return
        try:
            status: ReplicaStatus = await asyncio.wait_for(
                awaited(self.actor.status.remote()), timeout
            )
        except RayActorError as error:
            self.actor_died(error)
            return
        except TimeoutError:
            logger.warning("replica %d did not answer a status call in %.0f s", self.index, timeout)
            return
        except Exception:  # keep polling: the next call may do better
            logger.exception("replica %d: reading its status failed", self.index)
            return
        self.snapshot = status.snapshot
        self.ready = status.ready
        if status.healthy:
            self._num_waiting = status.snapshot.num_waiting
        else:
            self.mark_dead("its engine loop stopped")

    async def drain(self, timeout: float) -> None:
        """Wait for the relays of this replica's groups to end (after an abort or a
        shutdown every group ends)."""
        if self._relays:
            await asyncio.wait(set(self._relays), timeout=timeout)

    def kill(self) -> None:
        ray.kill(self.actor)
        self.death = self.death or "shut down"


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
