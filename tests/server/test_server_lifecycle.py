"""The server's edges in time: clients that leave, SIGTERM, shutdown deadlines,
and an engine loop that dies. Tiny random Llama, fp32."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from iterserve.core.outputs import ModelOutput, SchedulerOutput
from iterserve.engine.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    GenerationRequest,
    RequestFailedError,
)
from iterserve.engine.llm_engine import LLMEngine
from iterserve.sampling_params import SamplingParams
from server_fixtures import (
    MODEL_NAME,
    engine_config,
    free_port,
    is_healthy,
    running_server,
    serving,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

PROMPT = "The capital of France is"
LONG = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0.0, "ignore_eos": True}


def test_non_streaming_client_that_leaves_frees_its_blocks(tiny_llama_dir: Path) -> None:
    with running_server(tiny_llama_dir) as server:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.base_url}/v1/completions", json=LONG, timeout=0.3)

        def aborted() -> bool:
            m = server.metrics()
            return (
                m["iterserve:requests_aborted_total"] == 1
                and m["iterserve:kv_cache_used_blocks"] == 0
                and m['iterserve:num_requests_running{lane="interactive"}'] == 0
            )

        assert wait_until(aborted, timeout=10), server.metrics()


@pytest.mark.slow
def test_sigterm_lets_in_flight_requests_finish_then_exits(tiny_llama_dir: Path) -> None:
    port = free_port()
    command = [
        sys.executable, "-m", "iterserve.cli", "serve", str(tiny_llama_dir),
        "--port", str(port), "--served-model-name", MODEL_NAME, "--dtype", "float32",
        "--max-model-len", "512", "--num-kv-blocks", "256", "--shutdown-timeout", "30",
        "--enforce-eager",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: is_healthy(base), timeout=90, interval=0.2), "no server"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=120, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        first = next(chunks)
        proc.send_signal(signal.SIGTERM)

        def refusing() -> bool:
            try:
                httpx.get(f"{base}/health", timeout=1)
            except httpx.TransportError:
                return True
            return False

        assert wait_until(refusing, timeout=10), "still taking new connections after SIGTERM"
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        assert len(rest) >= 119 and text
        # uvicorn re-raises the signal once it has shut down cleanly, as a supervisor expects.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate()[0]
    access = [
        json.loads(line[line.index("{") :])
        for line in output.splitlines()
        if "iterserve.access" in line
    ]
    assert any(
        entry["status"] == 200
        and entry["completion_tokens"] == 120
        and entry["ttft_ms"] is not None
        for entry in access
    ), output


# ---- the async engine on its own ---------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine(engine_config(tiny_llama_dir))


def _request(request_id: str, max_tokens: int = 400) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerationRequest(PROMPT, params, request_id)


def test_shutdown_deadline_aborts_what_is_left(engine: LLMEngine) -> None:
    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        stream = await async_engine.add([_request("slow")])
        start = time.monotonic()
        await async_engine.shutdown(timeout=0.2)
        assert time.monotonic() - start < 5
        outputs = [output async for _, output in stream]
        assert outputs[-1].finish_reason == "abort"
        with pytest.raises(EngineStoppedError):
            await async_engine.add([_request("late")])
        assert not engine.has_unfinished()
        assert engine.scheduler.kv_cache_stats().num_used_blocks == 0

    asyncio.run(main())


def test_cancelled_generate_aborts_its_request(engine: LLMEngine) -> None:
    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()

        async def consume() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            async for _ in async_engine.generate(PROMPT, params, "cancel-me"):
                pass

        task = asyncio.create_task(consume())
        while not async_engine.snapshot.num_running:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if async_engine.snapshot.num_running == 0:
                break
            await asyncio.sleep(0.01)
        snap = async_engine.snapshot
        assert snap.num_running == 0 and snap.num_used_kv_blocks == 0
        await async_engine.shutdown(timeout=1)

    asyncio.run(main())


def test_a_failed_step_fails_exactly_its_requests(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # prefill-first: the new request's prompt runs in a step of its own, without the
    # running request's decode; only the new one may fail with that step.
    engine = LLMEngine(engine_config(tiny_llama_dir, step_policy="prefill-first"))
    executor = engine.executor
    original = executor.execute

    def fail_with_doomed(scheduled: SchedulerOutput) -> ModelOutput:
        if any(seq.request_id == "doomed" for seq in scheduled.seqs):
            raise RuntimeError("injected model failure")
        return original(scheduled)

    executor.execute = fail_with_doomed  # type: ignore[method-assign]

    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        survivor = await async_engine.add([_request("survivor", max_tokens=40)])
        _, first = await survivor.__anext__()  # decoding by now
        assert first.token_ids
        doomed = await async_engine.add([_request("doomed", max_tokens=5)])
        with pytest.raises(RequestFailedError):
            async for _ in doomed:
                pass
        outputs = [output async for _, output in survivor]
        assert outputs[-1].finish_reason == "length" and len(outputs[-1].token_ids) == 40
        after = await async_engine.add([_request("after", max_tokens=3)])
        assert [o async for _, o in after][-1].finish_reason == "length"
        assert async_engine.num_step_errors == 1
        assert engine.scheduler.kv_cache_stats().num_used_blocks == 0
        await async_engine.shutdown(timeout=1)

    with caplog.at_level(logging.ERROR, logger="iterserve.engine"):
        asyncio.run(main())
    failures = [r for r in caplog.records if "step failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].getMessage().endswith(": doomed")
    assert failures[0].exc_info is not None  # the model's own traceback is in the log


def test_a_dead_loop_fails_waiting_clients_and_health(tiny_llama_dir: Path) -> None:
    with running_server(tiny_llama_dir) as server:

        def explode() -> bool:
            raise SystemError("the loop itself broke")

        server.engine.has_unfinished = explode  # type: ignore[method-assign]
        response = httpx.post(f"{server.base_url}/v1/completions", json=LONG, timeout=10)
        assert response.status_code in (500, 503), response.text
        assert response.json()["error"]["message"]
        assert wait_until(lambda: httpx.get(f"{server.base_url}/health").status_code == 503)
        again = httpx.post(f"{server.base_url}/v1/completions", json=LONG, timeout=10)
        assert again.status_code == 503 and again.json()["error"]["code"] == "service_unavailable"


def test_health_says_warming_up_until_the_engine_thread_has_warmed_up(
    tiny_llama_dir: Path,
) -> None:
    """`iterserve serve` builds and warms the engine on its own thread (one OpenMP pool for
    every kernel) and opens the port before compiling is done: /health says so, requests
    sent meanwhile wait rather than fail, and everything runs once warm."""
    release = threading.Event()
    built_on: list[str] = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        engine = LLMEngine(engine_config(tiny_llama_dir), warm_up=False)
        warm_up = engine.warm_up

        def held_warm_up() -> float:
            release.wait(30)
            return warm_up()

        engine.warm_up = held_warm_up  # type: ignore[method-assign]
        return engine

    async_engine = AsyncEngine.launch(build)
    assert built_on == ["iterserve-engine"]
    with serving(async_engine) as server:
        health = httpx.get(f"{server.base_url}/health", timeout=5)
        assert (health.status_code, health.json()["status"]) == (503, "warming up")
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            early = pool.submit(
                httpx.post, f"{server.base_url}/v1/completions", json=body, timeout=30
            )
            time.sleep(0.3)
            assert not early.done()  # queued behind the warm-up, not refused
            release.set()
            assert early.result().status_code == 200
        assert wait_until(lambda: httpx.get(f"{server.base_url}/health").status_code == 200)
        assert async_engine.engine.warm_up_seconds > 0
