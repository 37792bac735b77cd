"""Data parallelism: N engine replicas, each a Ray actor with its own weights, KV cache and
scheduler, behind one front end that the server talks to as it would to one engine
(a ServingEngine).

The front end tokenizes each prompt (it renders chat templates anyway, and routing needs
the ids; a prompt with images goes as it is, routed by its text with each image's marker,
for the replica to encode and lay out), picks a replica with the same router `iterserve
simulate --replicas` uses (replicas/router.py), on loads it keeps itself from what it sent
and what came back, and
relays the replica's outputs into the request's stream (client.py). A group (n choices,
or several prompts of one API request) goes whole to one replica.

Backpressure is the fleet's: beyond --max-waiting-requests waiting in all replicas
together, 429.

A fleet that heals: a replica that dies is restarted by its slot (supervisor.py) and
meanwhile left out of routing. What it had not started runs on another replica, into the
same stream (the client sees only latency); what had produced tokens fails with a
retryable 503 naming the cause. When no replica serves, a request waits up to
`_WAIT_FOR_REPLICA` seconds for one to come back, then fails with that 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import RayActorError

from iterserve.config import EngineConfig
from iterserve.engine.images import ImagesPrompt
from iterserve.engine.kv_pool_ledger import PoolGroup
from iterserve.engine.metrics import EngineSnapshot
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import RenderedChat, encode_prompt
from iterserve.engine.request_stream import (
    EngineStoppedError,
    GenerationRequest,
    ReplicaLostError,
    RequestStream,
    check_group_size,
    check_room,
)
from iterserve.engine.serving_engine import FinishedCallback, ReplicaState, ServedModel
from iterserve.replicas.actor import EngineReplica
from iterserve.replicas.client import (
    ReplicaClient,
    ReplicaDiedError,
    actor_death_cause,
    awaited,
)
from iterserve.replicas.dispatch import Dispatch
from iterserve.replicas.ray_cluster import RayCluster, disconnect
from iterserve.replicas.router import NoReplicaError, Router
from iterserve.replicas.supervisor import ReplicaSlot, RestartPolicy

logger = logging.getLogger("iterserve.data_parallel")

# How often the front end reads each replica's gauges and readiness (what /metrics and
# /health show between requests; a request's own stream is not delayed by it).
_POLL_INTERVAL = 0.5
# A warmed-up replica silent this long is taken for hung: killed and restarted.
_POLL_TIMEOUT = 30.0
# A replica's whole start: load the weights (warm-up continues afterwards).
_LOAD_TIMEOUT = 900.0
# Longest a request waits for a replica to serve when none does (all restarting): past
# it, a 503. Time enough for a restart's back-off and a small model's load; a client
# retries a 503 sooner than it would wait on a bigger model's load.
_WAIT_FOR_REPLICA = 60.0


class DataParallelEngine:
    def __init__(
        self,
        actors: list[Any],
        model: ServedModel,
        router: Router,
        cluster: RayCluster,
        max_waiting_requests: int = 256,
        retry_after: float = 1.0,
        spawn: Any = None,
        restarts: RestartPolicy | None = None,
    ) -> None:
        """`spawn()`, if given, starts one more actor with the replicas' settings: how a dead
        replica is restarted (without it, a dead replica stays down)."""
        if max_waiting_requests < 1:
            raise ValueError(
                f"--max-waiting-requests must be at least 1, got {max_waiting_requests}"
            )
        policy = restarts or RestartPolicy()
        self.slots = [
            ReplicaSlot(
                i,
                self._client(i, actor),
                spawn,
                functools.partial(self._client, i),
                self._availability_changed,
                policy,
                model.max_model_len,
            )
            for i, actor in enumerate(actors)
        ]
        self.replica_labels = tuple(str(slot.index) for slot in self.slots)
        self.router = router
        self.max_waiting_requests = max_waiting_requests
        self.retry_after = retry_after
        self.on_finished: FinishedCallback | None = None
        self._model = model
        self._cluster = cluster
        self._accepting = True
        self._poller: asyncio.Task[None] | None = None
        self._reroutes: set[asyncio.Task[None]] = set()
        # Set (and replaced) whenever a replica leaves routing or comes back: what a
        # request waiting for a serving replica waits on.
        self._changed = asyncio.Event()

    def _client(self, index: int, actor: Any) -> ReplicaClient:
        return ReplicaClient(index, actor, self._report, self._orphaned, self._died)

    def _died(self, client: ReplicaClient, reason: str) -> None:
        self.slots[client.index].died(client, reason)

    @classmethod
    def launch(
        cls,
        config: EngineConfig,
        num_replicas: int,
        router: Router,
        cluster: RayCluster,
        max_waiting_requests: int = 256,
        threads: int = 1,
        restarts: RestartPolicy | None = None,
    ) -> DataParallelEngine:
        """Start `num_replicas` actors of `threads` CPUs each (Ray spreads them over the
        cluster's machines) and return once every one has its weights in."""
        config = replace(config, num_threads=threads).validate()
        actor_class = ray.remote(EngineReplica)
        # On a cluster started here every replica shares this host's memory: their auto KV
        # pools split one share evenly (engine/kv_pool_ledger.py), where in turn the first
        # would take half of what was available, the second a quarter...
        group = PoolGroup(f"replicas-{uuid.uuid4().hex[:12]}", num_replicas)
        runtime_env = {"env_vars": group.env()} if cluster.started_here else None
        options = actor_class.options(  # type: ignore[attr-defined]
            num_cpus=threads,
            scheduling_strategy="SPREAD",
            # One call per group streaming from it (waiting or running) and a few
            # more (status, aborts): Ray queues what goes beyond.
            max_concurrency=max_waiting_requests + config.scheduler.max_num_seqs + 64,
            runtime_env=runtime_env,
        )

        def spawn() -> Any:  # a replica, first or restarted: the same settings
            return options.remote(config, max_waiting_requests)

        actors = [spawn() for _ in range(num_replicas)]
        try:
            # Every replica has the same model: the first one's name, tokenizer and
            # template serve the API (so this machine needs no copy of the model files),
            # with the shortest context length any of them holds (fleet_model).
            models = ray.get(
                [actor.served_model.remote() for actor in actors], timeout=_LOAD_TIMEOUT
            )
            failures = [(i, model) for i, model in enumerate(models) if isinstance(model, str)]
            if failures:
                raise ValueError(f"replica {failures[0][0]} could not start: {failures[0][1]}")
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            disconnect(cluster)
            raise
        model = fleet_model(models)
        logger.info(
            "%d replicas of %s up, %d torch threads each", num_replicas, model.name, threads
        )
        return cls(actors, model, router, cluster, max_waiting_requests, spawn=spawn, restarts=restarts)  # fmt: skip

    # ---- state ---------------------------------------------------------------------

    @property
    def served_model(self) -> ServedModel:
        return self._model

    @property
    def replicas(self) -> list[ReplicaClient]:
        """Each slot's current client (a restarted replica has a new one)."""
        return [slot.client for slot in self.slots]

    def _serving(self) -> list[ReplicaClient]:
        return [slot.client for slot in self.slots if slot.serving]

    @property
    def is_healthy(self) -> bool:
        return bool(self._serving())

    @property
    def is_ready(self) -> bool:
        serving = self._serving()
        return bool(serving) and all(replica.ready for replica in serving)

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_healthy

    def replica_states(self) -> list[ReplicaState]:
        return [slot.report() for slot in self.slots]

    @property
    def image_inputs(self) -> None:
        return None  # the replicas hold the towers

    def snapshots(self) -> list[EngineSnapshot]:
        return [slot.client.snapshot for slot in self.slots]

    def num_waiting_estimate(self) -> int:
        return sum(slot.client.num_waiting_estimate() for slot in self.slots)

    def check_group_size(self, count: int) -> None:
        check_group_size(count, self.max_waiting_requests)

    def _availability_changed(self, slot: ReplicaSlot) -> None:
        self.router.set_available(slot.index, slot.serving)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # ---- requests --------------------------------------------------------------------

    async def add(self, requests: list[GenerationRequest]) -> RequestStream:
        """Route a group to one replica; returns once a replica took it. Raises as
        AsyncEngine.add does; waits (bounded) while every replica is restarting."""
        if not self._accepting:
            raise EngineStoppedError("the server is shutting down")
        self.check_group_size(len(requests))
        # The fleet's queue, all replicas together: the bound a single engine keeps.
        check_room(
            self.num_waiting_estimate(), len(requests), self.max_waiting_requests, self.retry_after
        )
        # Tokenized here, on the event loop, as chat templates are rendered: the
        # tokenizer is only ever used from this one thread.
        routes = [self._token_ids(r) for r in requests]
        # A prompt with images goes as it is: the replica encodes them and lays them out.
        sent = [
            r if isinstance(r.prompt, ImagesPrompt) else replace(r, prompt=ids)
            for r, ids in zip(requests, routes, strict=True)
        ]
        counts = [
            (len(ids), self._most_tokens(r, ids)) for r, ids in zip(sent, routes, strict=True)
        ]
        # Where each request runs now, for its aborts (a re-sent one moves).
        homes: dict[str, ReplicaClient] = {}
        stream = RequestStream([r.request_id for r in sent], functools.partial(_abort, homes))
        dispatch = Dispatch.whole(stream, sent, counts, routes, homes)
        try:
            await self._place(dispatch, time.monotonic() + _WAIT_FOR_REPLICA)
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    async def _place(self, dispatch: Dispatch, deadline: float) -> None:
        """Send the dispatch to a serving replica; returns once one took it. A replica that
        dies before taking it is skipped for the next."""
        while True:
            target = await self._choose(dispatch, deadline)
            for request_id in dispatch.request_ids:
                dispatch.homes[request_id] = target
            try:
                await target.submit(dispatch)
                return
            except ReplicaDiedError:
                # Died before taking the group (the router had not heard yet): nothing of
                # it ran, so the next serving replica gets it.
                self.slots[target.index].rerouted += len(dispatch.requests)
                logger.info(
                    "replica %d died before taking a request: routing it again", target.index
                )

    async def _choose(self, dispatch: Dispatch, deadline: float) -> ReplicaClient:
        """The router's pick among the serving replicas; while none serves, wait for one
        to come back, up to `deadline`."""
        while True:
            loads = [slot.client.tracker.load() for slot in self.slots]
            try:
                return self.slots[self.router.route(dispatch.routes[0], loads)].client
            except NoReplicaError:
                pass
            if all(slot.given_up for slot in self.slots):
                raise EngineStoppedError(
                    f"every replica has died and stays down ({self._deaths()})"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineStoppedError(
                    f"no replica is serving: none came back within {_WAIT_FOR_REPLICA:.0f} s "
                    f"({self._deaths()})"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    def _deaths(self) -> str:
        return "; ".join(
            f"replica {slot.index} {slot.state}: {slot.last_death}"
            for slot in self.slots
            if slot.last_death is not None
        )

    def _orphaned(self, dispatch: Dispatch, dead: int, reason: str) -> None:
        """Requests a dead replica had taken but not started: sent to another replica, into
        the same stream."""
        self.slots[dead].rerouted += len(dispatch.requests)
        task = asyncio.ensure_future(self._reroute(dispatch, dead, reason))
        self._reroutes.add(task)
        task.add_done_callback(self._reroutes.discard)

    async def _reroute(self, dispatch: Dispatch, dead: int, reason: str) -> None:
        stream = dispatch.stream
        wanted = [p for p, index in enumerate(dispatch.indices) if stream.wants(index)]
        if not wanted:  # aborted meanwhile
            return
        if len(wanted) < len(dispatch.requests):
            dispatch = dispatch.part(wanted)
        logger.info(
            "replica %d died with %d requests of a group that had not started: sending them "
            "to another replica", dead, len(dispatch.requests),
        )  # fmt: skip
        try:
            await self._place(dispatch, time.monotonic() + _WAIT_FOR_REPLICA)
        except (Exception, asyncio.CancelledError) as error:  # a shutdown cancels
            why = "the server shut down" if isinstance(error, asyncio.CancelledError) else error
            message = f"replica {dead} died before this request started ({reason}), and {why}"
            for index in dispatch.indices:
                stream._push(index, ReplicaLostError(message))
                self._report(None, "error", dead)
            if isinstance(error, asyncio.CancelledError):
                raise

    def _token_ids(self, request: GenerationRequest) -> list[int]:
        """The ids a replica runs (sent in its place), or, for a prompt with images, those
        the front end routes and counts it by: its text, each image its marker (the
        replica, which holds the tower, lays the images out and refuses a cut)."""
        if isinstance(request.prompt, ImagesPrompt):
            text = request.prompt.text
            rendered = request.prompt.rendered
            return encode_prompt(self._model.tokenizer, RenderedChat(text) if rendered else text)
        if isinstance(request.prompt, list):
            token_ids = request.prompt  # the replica checks the ids against its vocabulary
        else:
            token_ids = encode_prompt(self._model.tokenizer, request.prompt)
        # Routed by the prefix the replica will run (which cuts again, to no effect).
        pooling = request.pooling
        truncation = pooling.truncation if pooling is not None else request.params.truncation
        if truncation is None:
            return token_ids
        return truncation.apply(token_ids, self._model.max_model_len)

    def _most_tokens(self, request: GenerationRequest, token_ids: list[int]) -> int:
        if request.fill_context:  # the replica settles it; this is its upper bound
            room = self._model.max_model_len - len(token_ids)
            return max(1, min(request.params.max_tokens, room))
        return request.params.max_tokens

    def _report(self, output: RequestOutput | None, reason: str, replica: int) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(output, reason, replica)
        except Exception:  # a metrics bug must not lose outputs
            logger.exception("on_finished callback failed")

    async def reset_prefix_cache(self) -> int:
        """Forget every serving replica's unused cached blocks; returns how many in all (a
        replica that dies meanwhile has none left to forget)."""
        serving = self._serving()
        dropped = await asyncio.gather(
            *(awaited(replica.actor.reset_prefix_cache.remote()) for replica in serving),
            return_exceptions=True,
        )
        for replica, result in zip(serving, dropped, strict=True):
            if isinstance(result, RayActorError):
                replica.mark_dead(actor_death_cause(result))
            elif isinstance(result, BaseException):
                raise result
        return sum(n for n in dropped if isinstance(n, int))

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(slot.client.poll(_POLL_TIMEOUT) for slot in self.slots))
            await asyncio.sleep(_POLL_INTERVAL)

    def stop_accepting(self) -> None:
        self._accepting = False

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish on every replica for up to
        `timeout` seconds, abort the rest, then stop the actors (and the cluster, if this
        front end started it). No replica is restarted from here on."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (
            self._reroutes or any(r.num_live() for r in self._serving())
        ):
            await asyncio.sleep(0.05)
        for slot in self.slots:
            await slot.stop()
        live = [replica for replica in self.replicas if replica.alive]
        if any(replica.num_live() for replica in live):
            logger.warning(
                "shutdown deadline reached: aborting %d requests",
                sum(replica.num_live() for replica in live),
            )
        # Each replica aborts what is left; the relays then end with those aborts.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*(awaited(r.actor.shutdown.remote(0.0)) for r in live)), 10.0
            )
        for replica in self.replicas:
            await replica.drain(5.0)
        for task in list(self._reroutes):
            task.cancel()
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                replica.kill()
        disconnect(self._cluster)

    def close(self) -> None:
        """Nothing left: each replica closed its engine at shutdown, and is gone."""


def _abort(homes: dict[str, ReplicaClient], request_ids: list[str]) -> None:
    """A stream's abort: each request on the replica it runs on now."""
    by_home: dict[int, tuple[ReplicaClient, list[str]]] = {}
    for request_id in request_ids:
        home = homes.get(request_id)
        if home is not None:
            by_home.setdefault(id(home), (home, []))[1].append(request_id)
    for home, ids in by_home.values():
        home.abort(ids)


def fleet_model(models: list[ServedModel]) -> ServedModel:
    """What the front end serves of its replicas' models: the first one's name, tokenizer
    and template (every replica has the same model) and the shortest context length among
    them, which every replica holds. A replica's auto KV pool is sized from the memory its
    own host has, and can cut its context length; replicas on different machines (a joined
    Ray cluster) can then hold different lengths, and a request longer than one replica
    holds must not reach it."""
    shortest = min(model.max_model_len for model in models)
    if any(model.max_model_len != shortest for model in models):
        logger.warning(
            "the replicas hold sequences of different lengths (%s tokens): the fleet serves "
            "the shortest, %d (--kv-cache-memory GiB or --max-model-len sizes every replica "
            "alike)",
            ", ".join(str(model.max_model_len) for model in models),
            shortest,
        )
    return replace(models[0], max_model_len=shortest)
