"""A fleet that heals, over stand-in actors (no Ray processes, no model): what a replica's
death does to each request on it, restarts with back-off up to the bound, and waiting
for a replica when none serves. The same over real Ray replicas under load:
test_fleet_chaos.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from iterserve import SamplingParams
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.request_stream import (
    EngineStoppedError,
    GenerationRequest,
    ReplicaLostError,
    RequestStream,
)
from iterserve.engine.serving_engine import (
    REPLICA_GIVEN_UP,
    REPLICA_OK,
    REPLICA_RESTARTING,
    ServedModel,
)
from iterserve.replicas.router import RoundRobin
from iterserve.server.errors import as_api_error

ray = pytest.importorskip("ray")

from ray.exceptions import ActorDiedError  # noqa: E402  (after the skip)

from iterserve.replicas import data_parallel, ray_cluster  # noqa: E402
from iterserve.replicas.data_parallel import DataParallelEngine  # noqa: E402
from iterserve.replicas.events import ReplicaEvent, ReplicaStatus  # noqa: E402
from iterserve.replicas.supervisor import RestartPolicy  # noqa: E402

pytestmark = pytest.mark.timeout(30)

MODEL = ServedModel("stand-in", None, None, 64)


@pytest.fixture(autouse=True)
def _stand_in_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    """ray.kill of a stand-in kills it (Ray's own would start a Ray cluster to look for it)."""
    monkeypatch.setattr(ray, "kill", lambda actor: actor.kill())


QUICK = RestartPolicy(max_restarts=2, backoff=0.01)


class _Method:
    """`actor.method.options(...).remote(...)`, as a Ray actor handle offers it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def options(self, **_: object) -> _Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)


class _Replica:
    """A replica's actor handle whose requests advance when the test says: each group is
    taken at once; `tokens` lets every request (or, `first_only`, the group's first) make
    one token, `finish` ends them all. `kill()` kills its process; `break_loop()` stops
    its engine loop with the process alive, as a step raising outside a request does."""

    def __init__(
        self,
        first_only: bool = False,
        loads: asyncio.Event | None = None,
        model: ServedModel = MODEL,
    ) -> None:
        self.first_only = first_only
        self.model = model
        self.tokens, self.finish = asyncio.Event(), asyncio.Event()
        self.loaded = loads  # served_model waits for it: a slow restart
        self.taken: list[str] = []
        self.aborted: list[str] = []
        self._gone = asyncio.Event()
        self._loop_failure: str | None = None
        self.generate = _Method(self._generate)
        self.abort = _Method(self.aborted.extend)
        self.status = _Method(self._status)
        self.served_model = _Method(self._served_model)

    def kill(self) -> None:
        self._gone.set()

    def break_loop(self) -> None:
        self._loop_failure = "RuntimeError: injected"
        self._gone.set()

    async def _served_model(self) -> ServedModel:
        if self.loaded is not None:
            await self.loaded.wait()
        return self.model

    async def _status(self) -> ReplicaStatus:
        if self._gone.is_set() and self._loop_failure is None:
            raise ActorDiedError()
        return ReplicaStatus(True, self._loop_failure is None, _snapshot(), self._loop_failure)

    async def _until(self, gate: asyncio.Event) -> bool:
        """Wait for `gate`; False if the replica dies first."""
        waits = {asyncio.ensure_future(gate.wait()), asyncio.ensure_future(self._gone.wait())}
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return not self._gone.is_set()

    async def _generate(self, requests: list[GenerationRequest], waited: float) -> Any:
        if self._gone.is_set():
            raise ActorDiedError()
        self.taken += [r.request_id for r in requests]
        yield _ready(ReplicaEvent())
        making = requests[:1] if self.first_only else requests
        if await self._until(self.tokens):
            yield _ready(ReplicaEvent([(i, _output(r, 1, None)) for i, r in enumerate(making)]))
            if await self._until(self.finish):
                outputs = [(i, _output(r, 2, "length")) for i, r in enumerate(requests)]
                yield _ready(ReplicaEvent(outputs))
                return
        if self._loop_failure is not None:  # the engine's way of saying its loop died
            yield _ready(ReplicaEvent(died=self._loop_failure))
            return
        raise ActorDiedError()


def _snapshot() -> Any:
    from iterserve.engine.metrics import EngineSnapshot

    return EngineSnapshot()


def _output(request: GenerationRequest, tokens: int, finish: str | None) -> RequestOutput:
    ids = [7] * tokens
    return RequestOutput(request.request_id, list(request.prompt), "x" * tokens, ids, "x", [7], finish)  # type: ignore[arg-type]  # fmt: skip


async def _ready(event: ReplicaEvent) -> ReplicaEvent:  # what awaiting an ObjectRef gives
    return event


def _fleet(
    replicas: list[_Replica], spawn: Callable[[], _Replica] | None = None, policy: RestartPolicy = QUICK
) -> DataParallelEngine:  # fmt: skip
    cluster = ray_cluster.RayCluster("none", connected_here=False, started_here=False)
    engine = DataParallelEngine(
        replicas, MODEL, RoundRobin(), cluster, spawn=spawn, restarts=policy
    )
    engine.on_finished = lambda output, reason, replica: None
    return engine


def _group(name: str, size: int = 1) -> list[GenerationRequest]:
    params = SamplingParams(max_tokens=2)
    return [GenerationRequest([1, 2, 3], params, f"{name}-{i}") for i in range(size)]


async def _outcomes(stream: RequestStream) -> list[str]:
    """Each request's end: its finish reason, or "lost: " and the error that ended it."""
    ends: dict[int, str] = {}
    while len(ends) < len(stream.request_ids):
        for index, item in await stream.next_batch():
            if isinstance(item, ReplicaLostError):
                ends[index] = f"lost: {item}"
            elif isinstance(item, RequestOutput) and item.finished:
                ends[index] = item.finish_reason or ""
    return [ends[i] for i in range(len(ends))]


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


@pytest.mark.parametrize("death", ["process killed", "engine loop stopped"])
def test_a_request_without_tokens_moves_and_one_with_tokens_fails_retryably(death: str) -> None:
    async def main() -> None:
        dying, survivor = _Replica(first_only=True), _Replica()
        engine = _fleet([dying, survivor])
        stream = await engine.add(_group("g", 2))  # round-robin: replica 0 first
        dying.tokens.set()  # the group's first request makes a token, the second none
        await _until(lambda: not stream._queue.empty())  # the token is out
        if death == "process killed":
            dying.kill()
        else:
            dying.break_loop()
        survivor.tokens.set()
        survivor.finish.set()
        ends = await _outcomes(stream)
        assert ends[1] == "length"  # moved to replica 1, finished there: only latency
        assert ends[0].startswith("lost: replica 0 died (")  # its token was out already
        assert "retry" in ends[0]
        if death == "engine loop stopped":
            assert "its engine loop stopped: RuntimeError: injected" in ends[0]
        assert survivor.taken == ["g-1"]
        states = engine.replica_states()
        assert (states[0].state, states[0].rerouted) == (REPLICA_GIVEN_UP, 1)  # no spawn
        assert states[0].last_death and states[1].serving
        assert all(not replica.tracker.work for replica in engine.replicas)  # loads zero
        error = as_api_error(ReplicaLostError(ends[0]))
        assert (error.status, error.headers) == (503, {"Retry-After": "1"})

    asyncio.run(main())


def test_an_abort_follows_a_request_to_the_replica_it_moved_to() -> None:
    async def main() -> None:
        dying, survivor = _Replica(), _Replica()
        engine = _fleet([dying, survivor])
        stream = await engine.add(_group("m"))
        dying.kill()
        await _until(lambda: survivor.taken == ["m-0"])
        stream.abort()
        assert survivor.aborted == ["m-0"] and dying.aborted == []

    asyncio.run(main())


def test_a_dead_replica_restarts_with_back_off_and_gives_up_past_the_bound() -> None:
    async def main() -> None:
        spawned: list[_Replica] = []

        def spawn() -> _Replica:
            spawned.append(_Replica())
            return spawned[-1]

        first, other = _Replica(), _Replica()
        engine = _fleet([first, other], spawn)
        for kill in range(QUICK.max_restarts + 1):
            victim = engine.slots[0].client
            victim.actor.kill()
            await engine.slots[0].client.poll(1.0)  # the poller's way of noticing
            if kill == QUICK.max_restarts:
                break
            assert engine.replica_states()[0].state == REPLICA_RESTARTING
            assert not engine.slots[0].serving
            await _until(lambda: engine.replica_states()[0].state == REPLICA_OK)
            assert engine.slots[0].client.actor is spawned[-1]  # a new actor, serving
            # Back in routing: round-robin gives it its turns again.
            turns = [await engine.add(_group(f"t{kill}-{i}")) for i in range(2)]
            assert spawned[-1].taken and other.taken
            for replica in (spawned[-1], other):
                replica.tokens.set()
                replica.finish.set()
            assert [await _outcomes(s) for s in turns] == [["length"], ["length"]]
        state = engine.replica_states()[0]
        assert (state.state, state.restarts) == (REPLICA_GIVEN_UP, QUICK.max_restarts)
        assert "ActorDiedError" in (state.last_death or "")
        assert engine.is_healthy  # replica 1 serves on

    asyncio.run(main())


def test_a_restart_that_fails_counts_against_the_bound() -> None:
    async def main() -> None:
        def spawn() -> _Replica:
            broken = _Replica()
            broken.served_model = _Method(_fail_to_load)
            return broken

        engine = _fleet([_Replica(), _Replica()], spawn)
        engine.slots[0].client.actor.kill()
        await engine.slots[0].client.poll(1.0)
        await _until(lambda: engine.replica_states()[0].state == REPLICA_GIVEN_UP)
        state = engine.replica_states()[0]
        assert state.restarts == QUICK.max_restarts
        assert (
            state.last_death == "its restart failed: RuntimeError: it could not start: no weights"
        )

    asyncio.run(main())


async def _fail_to_load() -> str:
    return "no weights"


def test_a_restart_that_holds_shorter_sequences_than_the_fleet_serves_is_refused() -> None:
    # Its auto KV pool found less memory than its predecessor's: requests the front end
    # takes (up to the fleet's 64 tokens) could not all run on it.
    async def main() -> None:
        short = replace(MODEL, max_model_len=MODEL.max_model_len - 1)
        engine = _fleet([_Replica(), _Replica()], lambda: _Replica(model=short))
        engine.slots[0].client.actor.kill()
        await engine.slots[0].client.poll(1.0)
        await _until(lambda: engine.replica_states()[0].state == REPLICA_GIVEN_UP)
        assert engine.replica_states()[0].last_death == (
            "its restart failed: RuntimeError: it holds sequences of 63 tokens, fewer than "
            "the 64 the fleet serves (its KV cache found less memory; --kv-cache-memory GiB "
            "sizes every replica alike)"
        )
        # One that holds longer ones serves: the fleet still promises 64.
        engine = _fleet([_Replica(), _Replica()], lambda: _Replica(model=replace(MODEL, max_model_len=99)))  # fmt: skip
        engine.slots[0].client.actor.kill()
        await engine.slots[0].client.poll(1.0)
        await _until(lambda: engine.replica_states()[0].state == REPLICA_OK)
        assert engine.served_model.max_model_len == MODEL.max_model_len

    asyncio.run(main())


def test_the_fleet_serves_the_shortest_context_its_replicas_hold(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lengths = [replace(MODEL, max_model_len=n) for n in (4096, 1000, 2048)]
    with caplog.at_level("WARNING", logger="iterserve.data_parallel"):
        served = data_parallel.fleet_model(lengths)
    assert served == replace(MODEL, max_model_len=1000)
    assert (
        "different lengths (4096, 1000, 2048 tokens): the fleet serves the shortest, 1000"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="iterserve.data_parallel"):
        assert data_parallel.fleet_model([MODEL, MODEL]) == MODEL
    assert not caplog.text


def test_with_no_replica_serving_requests_wait_for_the_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        loaded = asyncio.Event()
        restarted = _Replica(loads=loaded)
        only = _Replica()
        engine = _fleet([only], lambda: restarted)
        queued = await engine.add(_group("q"))  # taken, no token yet
        only.kill()
        await _until(lambda: engine.replica_states()[0].state == REPLICA_RESTARTING)
        new = asyncio.ensure_future(engine.add(_group("n")))  # arrives during the outage
        await asyncio.sleep(0.05)
        assert not new.done() and not restarted.taken  # both wait: nowhere to go yet
        loaded.set()
        await _until(lambda: sorted(restarted.taken) == ["n-0", "q-0"])
        restarted.tokens.set()
        restarted.finish.set()
        assert await _outcomes(queued) == ["length"]
        assert await _outcomes(await new) == ["length"]

        # Past the bound a request fails with a 503 naming the cause.
        monkeypatch.setattr(data_parallel, "_WAIT_FOR_REPLICA", 0.05)
        never = _Replica(loads=asyncio.Event())
        engine = _fleet([_Replica()], lambda: never)
        engine.slots[0].client.actor.kill()
        await engine.slots[0].client.poll(1.0)
        with pytest.raises(EngineStoppedError, match="none came back within .*ActorDiedError"):
            await engine.add(_group("late"))

    asyncio.run(main())
