"""Data parallelism: N engine replicas, each a Ray actor with its own weights, KV cache and
scheduler, behind one front end that the server talks to as it would to one engine
(a ServingEngine).

The front end tokenizes each prompt (it renders chat templates anyway, and routing needs
the ids), picks a replica with the same router `iterserve simulate --replicas` uses
(replicas/router.py), on loads it keeps itself from what it sent and what came back, and
relays the replica's outputs into the request's stream (replica_client.py). A group (n
choices, or several prompts of one API request) goes whole to one replica.

Backpressure is the fleet's: beyond --max-waiting-requests waiting in all replicas
together, 429. A replica that dies fails its in-flight requests and is skipped from
then on; /health says "degraded" while at least one replica serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import RayActorError

from iterserve.config import EngineConfig
from iterserve.engine.metrics import EngineSnapshot
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.prompts import encode_prompt
from iterserve.engine.request_stream import (
    EngineStoppedError,
    GenerationRequest,
    RequestStream,
    check_group_size,
    check_room,
)
from iterserve.engine.serving_engine import FinishedCallback, ServedModel
from iterserve.replicas.actor import EngineReplica
from iterserve.replicas.client import ReplicaClient, ReplicaDiedError, awaited
from iterserve.replicas.ray_cluster import RayCluster, disconnect
from iterserve.replicas.router import Router

logger = logging.getLogger("iterserve.data_parallel")

# How often the front end reads each replica's gauges and readiness (what /metrics and
# /health show between requests; a request's own stream is not delayed by it).
_POLL_INTERVAL = 0.5
_POLL_TIMEOUT = 30.0
# A replica's whole start: load the weights (warm-up continues afterwards).
_LOAD_TIMEOUT = 900.0


class DataParallelEngine:
    def __init__(
        self,
        actors: list[Any],
        model: ServedModel,
        router: Router,
        cluster: RayCluster,
        max_waiting_requests: int = 256,
        retry_after: float = 1.0,
    ) -> None:
        if max_waiting_requests < 1:
            raise ValueError(
                f"--max-waiting-requests must be at least 1, got {max_waiting_requests}"
            )
        self.replicas = [ReplicaClient(i, actor, self._report) for i, actor in enumerate(actors)]
        self.replica_labels = tuple(str(replica.index) for replica in self.replicas)
        self.router = router
        self.max_waiting_requests = max_waiting_requests
        self.retry_after = retry_after
        self.on_finished: FinishedCallback | None = None
        self._model = model
        self._cluster = cluster
        self._accepting = True
        self._poller: asyncio.Task[None] | None = None

    @classmethod
    def launch(
        cls,
        config: EngineConfig,
        num_replicas: int,
        router: Router,
        cluster: RayCluster,
        max_waiting_requests: int = 256,
        threads: int = 1,
    ) -> DataParallelEngine:
        """Start `num_replicas` actors of `threads` CPUs each (Ray spreads them over the
        cluster's machines) and return once every one has its weights in."""
        config = replace(config, num_threads=threads).validate()
        actor_class = ray.remote(EngineReplica)
        actors = [
            actor_class.options(  # type: ignore[attr-defined]
                num_cpus=threads,
                scheduling_strategy="SPREAD",
                # One call per group streaming from it (waiting or running) and a few
                # more (status, aborts): Ray queues what goes beyond.
                max_concurrency=max_waiting_requests + config.scheduler.max_num_seqs + 64,
            ).remote(config, max_waiting_requests)
            for _ in range(num_replicas)
        ]
        try:
            # Every replica has the same model: the first one's name, tokenizer and
            # template serve the API (so this machine needs no copy of the model files).
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
        model = models[0]
        logger.info(
            "%d replicas of %s up, %d torch threads each", num_replicas, model.name, threads
        )
        return cls(actors, model, router, cluster, max_waiting_requests)

    # ---- state ---------------------------------------------------------------------

    @property
    def served_model(self) -> ServedModel:
        return self._model

    def _live(self) -> list[ReplicaClient]:
        return [replica for replica in self.replicas if replica.alive]

    @property
    def is_healthy(self) -> bool:
        return bool(self._live())

    @property
    def is_ready(self) -> bool:
        live = self._live()
        return bool(live) and all(replica.ready for replica in live)

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_healthy

    def replica_health(self) -> list[str]:
        return [replica.health for replica in self.replicas]

    def snapshots(self) -> list[EngineSnapshot]:
        return [replica.snapshot for replica in self.replicas]

    def num_waiting_estimate(self) -> int:
        return sum(replica.num_waiting_estimate() for replica in self.replicas)

    def check_group_size(self, count: int) -> None:
        check_group_size(count, self.max_waiting_requests)

    # ---- requests --------------------------------------------------------------------

    async def add(self, requests: list[GenerationRequest]) -> RequestStream:
        """Route a group to one replica; returns once that replica took it. Raises as
        AsyncEngine.add does."""
        if not self.is_accepting:
            raise EngineStoppedError(
                "the server is shutting down" if self.is_healthy else "every replica has died"
            )
        self.check_group_size(len(requests))
        # The fleet's queue, all replicas together: the bound a single engine keeps.
        check_room(
            self.num_waiting_estimate(), len(requests), self.max_waiting_requests, self.retry_after
        )
        # Tokenized here, on the event loop, as chat templates are rendered: the
        # tokenizer is only ever used from this one thread.
        sent = [replace(r, prompt=self._token_ids(r)) for r in requests]
        counts = [(len(r.prompt), self._most_tokens(r)) for r in sent]
        while True:
            live = self._live()
            if not live:
                raise EngineStoppedError("every replica has died")
            loads = [replica.tracker.load() for replica in live]
            target = live[self.router.route(sent[0].prompt, loads)]  # type: ignore[arg-type]
            try:
                return await target.submit(sent, counts)
            except ReplicaDiedError:
                # Died before taking the group (the router had not heard yet): nothing of
                # it ran, so the next live replica gets it; the dead one is skipped now.
                logger.warning(
                    "replica %d died before taking a request: routing it again", target.index
                )

    def _token_ids(self, request: GenerationRequest) -> list[int]:
        if isinstance(request.prompt, list):
            return request.prompt  # the replica checks the ids against its vocabulary
        return encode_prompt(self._model.tokenizer, request.prompt)

    def _most_tokens(self, request: GenerationRequest) -> int:
        if request.fill_context:  # the replica settles it; this is its upper bound
            return max(1, self._model.max_model_len - len(request.prompt))
        return request.params.max_tokens

    def _report(self, output: RequestOutput | None, reason: str, replica: int) -> None:
        if self.on_finished is None:
            return
        try:
            self.on_finished(output, reason, replica)
        except Exception:  # a metrics bug must not lose outputs
            logger.exception("on_finished callback failed")

    async def reset_prefix_cache(self) -> int:
        """Forget every live replica's unused cached blocks; returns how many in all (a
        replica that dies meanwhile has none left to forget)."""
        live = self._live()
        dropped = await asyncio.gather(
            *(awaited(replica.actor.reset_prefix_cache.remote()) for replica in live),
            return_exceptions=True,
        )
        for replica, result in zip(live, dropped, strict=True):
            if isinstance(result, RayActorError):
                replica.actor_died(result)
            elif isinstance(result, BaseException):
                raise result
        return sum(n for n in dropped if isinstance(n, int))

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(replica.poll(_POLL_TIMEOUT) for replica in self.replicas))
            await asyncio.sleep(_POLL_INTERVAL)

    def stop_accepting(self) -> None:
        self._accepting = False

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish on every replica for up to
        `timeout` seconds, abort the rest, then stop the actors (and the cluster, if this
        front end started it)."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(r.num_live() for r in self._live()):
            await asyncio.sleep(0.05)
        live = self._live()
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
