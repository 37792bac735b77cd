"""Data parallelism: two engine replicas on Ray behind one OpenAI front end.

One Ray cluster (2 CPUs, no dashboard; conftest.py) and one two-replica server serve the
module's first tests; the one that kills a replica (and sees it restarted) runs last of
them. Then the real
`iterserve serve --data-parallel-size 2` runs as a process, drains on SIGTERM, and takes
the Ray cluster it started with it; and the front end reroutes around a dead replica
over stand-in actors (no Ray processes). Tiny random Llama, fp32, greedy text compared
with the offline `LLM`. About a minute in all.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from ray_processes import module_cluster, ray_daemons, running  # noqa: F401 (the cluster fixture)

from iterserve import LLM, SamplingParams
from iterserve.replicas.router import RoundRobin, make_router
from server_fixtures import (
    MODEL_NAME,
    RunningServer,
    engine_config,
    free_port,
    is_healthy,
    serving,
    wait_until,
)

ray = pytest.importorskip("ray")

from ray.exceptions import ActorDiedError  # noqa: E402  (after the skip)

from iterserve.engine.kv_pool_ledger import live_lines  # noqa: E402
from iterserve.engine.outputs import RequestOutput  # noqa: E402
from iterserve.engine.request_stream import GenerationRequest  # noqa: E402
from iterserve.engine.serving_engine import ServedModel  # noqa: E402
from iterserve.replicas import ray_cluster  # noqa: E402
from iterserve.replicas.data_parallel import DataParallelEngine  # noqa: E402
from iterserve.replicas.events import ReplicaEvent  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # Ray clusters, real servers

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "The quick brown fox",
    "In the beginning",
]
# 8 blocks of 16 tokens and more: prefix-affinity routes by the first 4 blocks.
SHARED_PREFIX = "You are a helpful assistant who answers questions about geography. " * 6


@pytest.fixture(scope="module")
def fleet(cluster: None, tiny_llama_dir: Path) -> Iterator[RunningServer]:
    engine = DataParallelEngine.launch(
        engine_config(tiny_llama_dir),
        2,
        make_router("prefix-affinity", 16),
        ray_cluster.connect(None, 2),  # the module's cluster: joined before, left running
        threads=1,
    )
    with serving(engine) as server:  # type: ignore[arg-type]
        assert wait_until(lambda: engine.is_ready, timeout=60), engine.replica_states()
        yield server


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(config=engine_config(tiny_llama_dir))


def _engine(fleet: RunningServer) -> DataParallelEngine:
    return fleet.async_engine  # type: ignore[return-value]


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _replica_metric(fleet: RunningServer, name: str, replica: str, **labels: str) -> float:
    pairs = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "replica": replica}.items()))
    return fleet.metrics().get(f"iterserve:{name}{{{pairs}}}", 0.0)


async def _stream_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True
    )
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def test_concurrent_streams_give_a_single_engines_text_and_use_both_replicas(
    fleet: RunningServer, offline: LLM
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24)
    expected = [out.text for out in offline.generate(PROMPTS, params, use_tqdm=False)]
    messages: list = [{"role": "user", "content": "What is the capital of France?"}]
    chat_expected = offline.chat(messages, params, use_tqdm=False)[0].text

    async def main() -> tuple[list[str], str | None]:
        async with _client(fleet.base_url) as client:
            texts = await asyncio.gather(*(_stream_text(client, p, 24) for p in PROMPTS))
            chat = await client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,
                max_tokens=24,
                temperature=0.0,
            )
            return list(texts), chat.choices[0].message.content

    texts, chat = asyncio.run(main())
    assert texts == expected
    assert chat == chat_expected

    def both_served() -> bool:
        return all(
            _replica_metric(fleet, "requests_finished_total", r, finish_reason="length") >= 1
            for r in ("0", "1")
        )

    assert wait_until(both_served, timeout=5), fleet.metrics()
    m = fleet.metrics()
    assert m['iterserve:requests_finished_total{finish_reason="length",replica="all"}'] == 5
    assert m['iterserve:replica_up{replica="all"}'] == 2
    # The fleet's series sums the replicas' (gauges come from polls: wait for one).
    assert wait_until(
        lambda: (
            _replica_metric(fleet, "engine_steps_total", "all")
            == sum(_replica_metric(fleet, "engine_steps_total", r) for r in ("0", "1"))
            > 0
        ),
        timeout=5,
    )
    # Each replica's memory is read in its own process: its weights and more resident; the
    # fleet's is their sum.
    m = fleet.metrics()
    for replica in ("0", "1"):
        weights = m[f'iterserve:model_weights_bytes{{replica="{replica}"}}']
        assert 0 < weights < m[f'iterserve:process_resident_memory_bytes{{replica="{replica}"}}']
    peaks = [m[f'iterserve:process_peak_resident_memory_bytes{{replica="{r}"}}'] for r in "01"]
    assert m['iterserve:process_peak_resident_memory_bytes{replica="all"}'] == sum(peaks)
    health = httpx.get(f"{fleet.base_url}/health").json()
    assert health["status"] == "ok" and health["replicas"] == ["ok", "ok"]
    assert health["model"]["dtype"] in ("bfloat16", "float32")  # how the replicas compute


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(fleet: RunningServer) -> None:
    before = {r: _replica_metric(fleet, "prefix_cache_hits_total", r) for r in ("0", "1")}
    finished = {
        r: _replica_metric(fleet, "requests_finished_total", r, finish_reason="length")
        for r in ("0", "1")
    }

    async def main() -> None:
        async with _client(fleet.base_url) as client:
            for i in range(4):  # one after another: the fleet is idle, so affinity decides
                await client.completions.create(
                    model=MODEL_NAME, prompt=f"{SHARED_PREFIX}Question {i}:", max_tokens=4,
                    temperature=0.0, extra_body={"ignore_eos": True},
                )  # fmt: skip

    asyncio.run(main())

    def routed() -> dict[str, float]:
        return {
            r: _replica_metric(fleet, "requests_finished_total", r, finish_reason="length")
            - finished[r]
            for r in ("0", "1")
        }

    assert wait_until(lambda: sum(routed().values()) == 4, timeout=5), routed()
    home = max(routed(), key=routed().__getitem__)
    other = "1" if home == "0" else "0"
    assert routed() == {home: 4, other: 0}
    # Three of the four found the shared blocks (at least 4 blocks each) in the home's cache.

    def hits() -> float:
        return _replica_metric(fleet, "prefix_cache_hits_total", home) - before[home]

    assert wait_until(lambda: hits() >= 3 * 64, timeout=5), hits()
    assert _replica_metric(fleet, "prefix_cache_hits_total", other) == before[other]
    # Every replica forgets its cache on request (the home one had the prefix's blocks).
    reset = httpx.post(f"{fleet.base_url}/reset_prefix_cache").json()
    assert reset["num_blocks_dropped"] >= 4


def test_embeddings_route_through_the_replicas(fleet: RunningServer, offline: LLM) -> None:
    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model=MODEL_NAME, input=PROMPTS, encoding_format="float")
    want = offline.embed(PROMPTS, use_tqdm=False)
    for data, expected in zip(got.data, want, strict=True):
        assert (
            max(abs(a - b) for a, b in zip(data.embedding, expected.embedding, strict=True)) < 1e-5
        )
    assert fleet.metrics()['iterserve:embedding_requests_total{replica="all"}'] == len(PROMPTS)
    # /v1/score on an embedding server: the cosine of the replicas' embeddings.
    scores = httpx.post(
        f"{fleet.base_url}/v1/score", json={"text_1": PROMPTS[0], "text_2": PROMPTS[1:]}
    ).json()["data"]
    for data, expected in zip(scores, want[1:], strict=True):
        cosine = sum(a * b for a, b in zip(want[0].embedding, expected.embedding, strict=True))
        assert abs(data["score"] - cosine) < 1e-5


def test_a_cut_prompt_and_its_token_ids_cross_the_replicas(
    fleet: RunningServer, offline: LLM
) -> None:
    """truncate_prompt_tokens is applied where the fleet tokenizes (to route) and again on
    the replica, to no effect; the answer is a single engine's on the kept ids."""
    kept = offline.tokenizer.encode(PROMPTS[1])[-6:]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = offline.generate([kept], params, use_tqdm=False)[0]
    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0)
    choice = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0.0,
        extra_body={"truncate_prompt_tokens": 6, "return_token_ids": True},
    ).choices[0]  # fmt: skip
    assert choice.prompt_token_ids == kept  # type: ignore[attr-defined]
    assert choice.token_ids == expected.token_ids and choice.text == expected.text  # type: ignore[attr-defined]


def test_a_client_that_leaves_is_aborted_on_its_replica(fleet: RunningServer) -> None:
    aborted = _replica_metric(fleet, "requests_aborted_total", "all")
    with httpx.stream(
        "POST",
        f"{fleet.base_url}/v1/completions",
        json={"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True},
    ) as response:
        for _ in zip(range(3), response.iter_lines(), strict=False):
            pass

    def freed() -> bool:
        return (
            _replica_metric(fleet, "requests_aborted_total", "all") == aborted + 1
            and _replica_metric(fleet, "kv_cache_used_blocks", "all") == 0
        )

    assert wait_until(freed, timeout=10), fleet.metrics()


def test_the_fleets_waiting_bound_answers_429(
    fleet: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(fleet)
    # As if the replicas' queues together were full.
    monkeypatch.setattr(engine, "num_waiting_estimate", lambda: engine.max_waiting_requests)
    response = httpx.post(
        f"{fleet.base_url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2}
    )
    monkeypatch.undo()
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_killed_replica_fails_only_its_started_streams_and_comes_back(
    fleet: RunningServer,
) -> None:
    engine = _engine(fleet)
    engine.router = RoundRobin()  # streams 0 and 2 on replica 0, 1 and 3 on replica 1
    killed = engine.replicas[1]

    async def main() -> list[str]:
        async with _client(fleet.base_url) as client:
            streams = []
            for prompt in PROMPTS:  # in turn, so round-robin places them in this order
                stream = await client.completions.create(
                    model=MODEL_NAME, prompt=prompt, max_tokens=300, temperature=0.0,
                    stream=True, extra_body={"ignore_eos": True},
                )  # fmt: skip
                await stream.__anext__()
                streams.append(stream)
            ray.kill(killed.actor)

            async def finish(stream: openai.AsyncStream) -> str:
                try:
                    chunks = [chunk async for chunk in stream]
                except openai.APIError as error:
                    return f"error: {error.message}"
                return chunks[-1].choices[0].finish_reason or "none"

            # Sent at once, two new requests take the next turns, 0 and 1: the one routed to
            # the dead replica before the front end hears of its death is sent on to replica
            # 0 (it never ran), so both succeed whenever the death is noticed.
            return list(
                await asyncio.gather(
                    *(finish(s) for s in streams),
                    *(_stream_text(client, p, 4) for p in PROMPTS[:2]),
                )
            )

    outcomes = asyncio.run(main())
    assert outcomes[0] == outcomes[2] == "length", outcomes
    # Their tokens were out: a clean error naming the cause, not a replay elsewhere.
    assert all(o.startswith("error: replica 1 died (") for o in outcomes[1:4:2]), outcomes
    assert all(outcomes[4:]), outcomes
    assert not killed.alive
    # Restarted (a new actor, warmed up) and serving again; /health tells the story.
    assert wait_until(lambda: engine.replica_states()[1].state == "ok", timeout=90)
    assert engine.replicas[1] is not killed
    health = httpx.get(f"{fleet.base_url}/health").json()
    assert (health["status"], health["replicas"]) == ("ok", ["ok", "ok"])
    assert health["replica_restarts"] == [0, 1] and health["replica_last_death"][0] is None
    assert "ActorDiedError" in health["replica_last_death"][1], health  # Ray says little

    async def after() -> list[str]:
        async with _client(fleet.base_url) as client:
            return list(await asyncio.gather(*(_stream_text(client, p, 4) for p in PROMPTS)))

    served = _replica_metric(fleet, "requests_finished_total", "1", finish_reason="length")
    assert all(asyncio.run(after()))  # both serve: round-robin gives each two

    def restarted_one_served() -> bool:
        now = _replica_metric(fleet, "requests_finished_total", "1", finish_reason="length")
        return now == served + 2

    assert wait_until(restarted_one_served, timeout=5)
    m = fleet.metrics()
    assert m['iterserve:requests_failed_total{replica="1"}'] == 2
    assert m['iterserve:replica_restarts_total{replica="1"}'] == 1
    assert m['iterserve:replica_up{replica="all"}'] == 2
    assert m['iterserve:replicas{state="up"}'] == 2
    assert m['iterserve:replicas{state="restarting"}'] == 0


def test_serve_data_parallel_drains_on_sigterm_and_stops_its_cluster(
    tiny_llama_dir: Path, kv_pools_dir: Path
) -> None:
    port = free_port()
    command = [
        sys.executable, "-m", "iterserve.cli", "serve", "--model", str(tiny_llama_dir),
        "--port", str(port), "--served-model-name", MODEL_NAME, "--dtype", "float32",
        "--max-model-len", "512", "--num-kv-blocks", "256", "--enforce-eager",
        "--data-parallel-size", "2", "--router", "round-robin", "--log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: is_healthy(base), timeout=90, interval=0.3), "no server"
        daemons = ray_daemons(proc.pid)  # the local cluster it started
        assert daemons
        # Its replicas share this host's memory as one group (engine/kv_pool_ledger.py).
        lines = live_lines(kv_pools_dir)
        assert len(lines) == 2 and len({line.pid for line in lines}) == 2, lines
        assert lines[0].group == lines[1].group and str(lines[0].group).startswith("replicas-")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        streams = [
            client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=60,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for prompt in PROMPTS[:2]
        ]
        firsts = [next(iter(stream)) for stream in streams]
        text = httpx.get(f"{base}/metrics").text
        assert 'replica="1"' in text and 'replica="all"' in text
        proc.send_signal(signal.SIGTERM)
        for first, stream in zip(firsts, streams, strict=True):
            rest = list(stream)  # both replicas finish what they started
            assert rest[-1].choices[0].finish_reason == "length"
            assert len(rest) >= 59 and first.choices[0].text is not None
        # uvicorn re-raises the signal once shut down; Ray's handler (ray.init installs it
        # to stop the cluster it started) turns that into exit status 15.
        assert proc.wait(timeout=60) in (0, signal.SIGTERM, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    assert wait_until(lambda: not running(daemons), timeout=30), output


# ---- the front end's routing over stand-in actors (no Ray processes) ----------------------


class _Method:
    """`actor.method.options(...).remote(...)`, as a Ray actor handle offers it."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def options(self, **_: object) -> _Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)


class _StandInReplica:
    """A replica's actor handle: it answers each group with one token per request, or,
    dead, raises as Ray does for a dead actor's stream."""

    def __init__(self, dead: bool) -> None:
        self.dead = dead
        self.generate = _Method(self._generate)
        self.abort = _Method(lambda ids: None)

    async def _generate(self, requests: list[GenerationRequest], waited: float) -> Any:
        if self.dead:
            raise ActorDiedError()
        yield _ready(ReplicaEvent())  # taken
        outputs = [
            RequestOutput(r.request_id, list(r.prompt), "x", [7], "x", [7], "length")  # type: ignore[arg-type]
            for r in requests
        ]
        yield _ready(ReplicaEvent(list(enumerate(outputs))))


async def _ready(event: ReplicaEvent) -> ReplicaEvent:  # what awaiting an ObjectRef gives
    return event


def test_a_request_routed_to_a_replica_just_dead_goes_to_another() -> None:
    async def main() -> None:
        engine = DataParallelEngine(
            [_StandInReplica(dead=True), _StandInReplica(dead=False)],
            ServedModel("stand-in", None, None, 64),
            RoundRobin(),  # replica 0 first: the dead one, not yet known dead
            ray_cluster.RayCluster("none", connected_here=False, started_here=False),
        )
        finished: list[tuple[str, int]] = []
        engine.on_finished = lambda output, reason, replica: finished.append((reason, replica))
        params = SamplingParams(max_tokens=1)
        stream = await engine.add([GenerationRequest([1, 2, 3], params, "r-0")])
        outputs = [output async for _, output in stream]
        assert [o.finish_reason for o in outputs] == ["length"]
        assert [r.alive for r in engine.replicas] == [False, True]
        assert finished == [("length", 1)]
        assert all(not r.tracker.work for r in engine.replicas)  # loads back to zero

    asyncio.run(main())
