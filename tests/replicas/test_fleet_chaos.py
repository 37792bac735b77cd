"""Chaos: a two-replica fleet (real Ray processes, tiny random Llama) under steady load,
one replica killed by signal twice, then one whose engine step raises. Every request must
end: finished whole, or failed cleanly (a 503, or an error event then [DONE], naming the
dead replica), never hung or cut off; no more fail than the dead replica had in flight;
the replica comes back and serves within a bound; both block pools are whole afterwards.

Replicas run at most 4 requests at once and queue the rest, so at a death some requests
have made tokens (they fail) and some have not (they move to the other replica). About a
minute and a half on a 2-core machine, most of it two replicas loading three times over.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from ray_processes import module_cluster  # noqa: F401 (the cluster fixture)

from server_fixtures import MODEL_NAME, RunningServer, engine_config, serving, wait_until

ray = pytest.importorskip("ray")

from ray.exceptions import RayActorError  # noqa: E402  (after the skip)

from iterserve.replicas import ray_cluster  # noqa: E402
from iterserve.replicas.data_parallel import DataParallelEngine  # noqa: E402
from iterserve.replicas.router import make_router  # noqa: E402

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

MAX_TOKENS = 12
CLIENTS = 12
# A death noticed, a back-off, a new process, the model loaded and warmed up: the bound on
# this machine, shared with other work (a restart took 10-20 s when it was measured).
RECOVERY_BOUND = 90.0
# Longest a request may go without a byte (a stream) or an answer: past it, "hung".
HUNG_AFTER = 60.0
PROMPTS = ["The capital of France is", "Once upon a time", "The quick brown fox", "In the"]


@pytest.fixture(scope="module")
def fleet(cluster: None, tiny_llama_dir: Path) -> Iterator[RunningServer]:
    engine = DataParallelEngine.launch(
        engine_config(tiny_llama_dir, max_num_seqs=4),
        2,
        make_router("least-tokens", 16),
        ray_cluster.connect(None, 2),  # the module's cluster: joined before, left running
        threads=1,
    )
    with serving(engine) as server:  # type: ignore[arg-type]
        assert wait_until(lambda: engine.is_ready, timeout=90), engine.replica_states()
        yield server


def _engine(fleet: RunningServer) -> DataParallelEngine:
    return fleet.async_engine  # type: ignore[return-value]


@dataclass
class Load:
    """CLIENTS clients sending completions back to back, every third one streamed, until
    `stop` is set; each request's end, classified."""

    base_url: str
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    ends: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # clean: the error messages
    defects: list[str] = field(default_factory=list)  # anything else that ended a request
    sent: int = 0
    streamed: int = 0
    longest: float = 0.0

    async def run(self) -> None:
        timeout = httpx.Timeout(HUNG_AFTER, connect=10.0)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=timeout) as client:
            await asyncio.gather(*(self._client(client) for _ in range(CLIENTS)))

    async def _client(self, client: httpx.AsyncClient) -> None:
        while not self.stop.is_set():
            number = self.sent
            self.sent += 1
            started = time.monotonic()
            kind, detail = await self._request(client, number)
            self.longest = max(self.longest, time.monotonic() - started)
            self.ends[kind] += 1
            if kind == "failed":
                self.failures.append(detail)
            elif kind != "ok":
                self.defects.append(f"{kind}: {detail}")

    async def _request(self, client: httpx.AsyncClient, number: int) -> tuple[str, str]:
        streamed = number % 3 == 0
        self.streamed += streamed
        body = {
            "model": MODEL_NAME, "prompt": f"{PROMPTS[number % 4]} {number}",
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, "stream": streamed,
        }  # fmt: skip
        try:
            if not streamed:
                response = await client.post("/v1/completions", json=body)
                if response.status_code == 200:
                    made = response.json()["usage"]["completion_tokens"]
                    return ("ok", "") if made == MAX_TOKENS else ("short", response.text)
                return _refusal(response.status_code, response.json(), response.headers)
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    return _refusal(response.status_code, response.json(), response.headers)
                return _read_stream([line async for line in response.aiter_lines()])
        except httpx.TimeoutException as error:
            return "hung", repr(error)
        except httpx.HTTPError as error:
            return "cut off", repr(error)


def _refusal(status: int, body: dict, headers: httpx.Headers) -> tuple[str, str]:
    """A clean failure is a 503 that names its cause and says when to retry."""
    error = body.get("error", {})
    if status == 503 and error.get("message") and "retry-after" in headers:
        return "failed", error["message"]
    return "unclean", f"{status} {body}"


def _read_stream(lines: list[str]) -> tuple[str, str]:
    """Whole: one chunk per token, the last with finish_reason "length", then [DONE]. Clean
    failure: an error event, then [DONE]."""
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "cut off", str(events[-3:])
    chunks = [json.loads(event) for event in events[:-1]]
    errors = [chunk["error"] for chunk in chunks if "error" in chunk]
    if errors:
        return "failed", errors[0]["message"]
    finish = chunks[-1]["choices"][0]["finish_reason"] if chunks else None
    if len(chunks) == MAX_TOKENS and finish == "length":
        return "ok", ""
    return "short", f"{len(chunks)} chunks, finish {finish}"


async def _until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `predicate` holds; fails the test past `timeout`."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"not within {timeout:.0f} s: {what}"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def _finished_on(fleet: RunningServer, replica: int) -> float:
    key = f'iterserve:requests_finished_total{{finish_reason="length",replica="{replica}"}}'
    return fleet.metrics().get(key, 0.0)


async def _break_and_recover(
    fleet: RunningServer, replica: int, break_it: Callable[[], None]
) -> float:
    """Break the replica; wait until the front end noticed, until it is back, and until it
    has finished requests again. Returns the seconds from breaking to serving again."""
    engine = _engine(fleet)
    broken = engine.replicas[replica]
    started = time.monotonic()
    await asyncio.to_thread(break_it)
    await _until(lambda: not broken.alive, 10, f"replica {replica}'s death noticed")
    await _until(
        lambda: engine.replica_states()[replica].state == "ok",
        RECOVERY_BOUND,
        f"replica {replica} back: {engine.replica_states()[replica]}",
    )
    recovered = time.monotonic() - started
    served = await asyncio.to_thread(_finished_on, fleet, replica)
    await _until(
        lambda: _finished_on(fleet, replica) >= served + 3, 30, f"replica {replica} serving"
    )
    return recovered


def _deaths(caplog: pytest.LogCaptureFixture, replica: int) -> list[tuple[str, int]]:
    """(cause, requests in flight) of each death of `replica` the front end logged."""
    pattern = re.compile(rf"replica {replica} died: (.*); it had (\d+) requests in flight")
    return [
        (match.group(1), int(match.group(2)))
        for record in caplog.records
        if (match := pattern.fullmatch(record.getMessage()))
    ]


def _settle_and_check_pools(fleet: RunningServer) -> None:
    """Once nothing is in flight, both block pools are whole and hold no block."""
    engine = _engine(fleet)
    assert wait_until(lambda: not any(r.num_live() for r in engine.replicas), timeout=30)
    held = ray.get([r.actor.test_only_check_kv_cache.remote() for r in engine.replicas])
    assert held == [0, 0]  # and check_invariants raised nothing on either


def _check_ends(load: Load, in_flight: int) -> None:
    assert load.defects == [], load.defects  # none hung, cut off, short or unclean
    assert sum(load.ends.values()) == load.sent  # every request sent has ended
    assert load.longest < HUNG_AFTER + RECOVERY_BOUND, load.longest
    # What fails is at most what the dead replica held: a request it had not started
    # moved to the other replica instead.
    assert len(load.failures) <= in_flight, (load.failures, in_flight)
    assert all(re.match(r"replica \d died \(", message) for message in load.failures), load.failures


def test_a_replica_killed_twice_under_load_comes_back_and_loses_only_its_own(
    fleet: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _engine(fleet)
    load = Load(fleet.base_url)
    pids: list[int] = []

    def kill_with(sig: signal.Signals) -> Callable[[], None]:
        def kill() -> None:
            pids.append(ray.get(engine.replicas[1].actor.test_only_pid.remote()))
            os.kill(pids[-1], sig)

        return kill

    async def chaos() -> list[float]:
        recoveries = []
        for sig in (signal.SIGKILL, signal.SIGTERM):
            await _until(lambda: load.sent >= 40 * (len(recoveries) + 1), 60, "load")
            recoveries.append(await _break_and_recover(fleet, 1, kill_with(sig)))
        await _until(lambda: load.sent >= 200, 120, "200 requests")
        load.stop.set()
        return recoveries

    async def main() -> list[float]:
        running = asyncio.ensure_future(load.run())
        try:
            return await chaos()
        finally:
            load.stop.set()
            await running

    with caplog.at_level(logging.INFO, logger="iterserve.data_parallel"):
        recoveries = asyncio.run(main())
    deaths = _deaths(caplog, 1)
    assert len(deaths) == 2, caplog.text
    for (cause, _), pid in zip(deaths, pids, strict=True):  # the log names the process
        assert f"its process (pid {pid} on " in cause, cause
    _check_ends(load, sum(count for _, count in deaths))
    assert load.sent >= 200 and load.streamed >= 60 and load.ends["ok"] >= 150, load.ends
    assert all(seconds < RECOVERY_BOUND for seconds in recoveries), recoveries
    states = engine.replica_states()
    assert [s.state for s in states] == ["ok", "ok"] and states[1].restarts == 2
    health = httpx.get(f"{fleet.base_url}/health").json()
    assert health["status"] == "ok" and health["replica_restarts"] == [0, 2], health
    metrics = fleet.metrics()
    assert metrics['iterserve:replica_restarts_total{replica="1"}'] == 2
    assert metrics['iterserve:replica_rerouted_requests_total{replica="1"}'] == states[1].rerouted
    _settle_and_check_pools(fleet)


def test_a_replica_whose_step_raises_is_restarted_and_loses_only_its_own(
    fleet: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    engine = _engine(fleet)
    load = Load(fleet.base_url)

    def fail_a_step() -> None:
        with contextlib.suppress(RayActorError):  # killed for a restart before it answered
            ray.get(engine.replicas[0].actor.test_only_fail_next_step.remote())

    async def main() -> float:
        running = asyncio.ensure_future(load.run())
        try:
            await _until(lambda: load.sent >= 30, 60, "load")
            return await _break_and_recover(fleet, 0, fail_a_step)
        finally:
            load.stop.set()
            await running

    with caplog.at_level(logging.INFO, logger="iterserve.data_parallel"):
        recovered = asyncio.run(main())
    deaths = _deaths(caplog, 0)
    assert len(deaths) == 1, caplog.text
    cause, in_flight = deaths[0]
    assert cause == (
        "its engine loop stopped: RuntimeError: a step failed outside any one request "
        "(injected by a test)"
    )
    _check_ends(load, in_flight)
    assert recovered < RECOVERY_BOUND
    assert engine.replica_states()[0].restarts == 1
    _settle_and_check_pools(fleet)
