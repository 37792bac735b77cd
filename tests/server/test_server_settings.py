"""Servers started with settings other than the shared one: an API key, static
batching, a tokenizer that adds BOS, the prefix cache's reporting, and overload.
Tiny random Llama (fp32), one server per test."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from iterserve import LLM, SamplingParams
from iterserve.bench.client import ClientConfig, reset_prefix_cache
from iterserve.engine.async_engine import AsyncEngine, EngineOverloadedError, GenerationRequest
from iterserve.engine.llm_engine import LLMEngine
from iterserve.server.app import ServerSettings
from server_fixtures import MODEL_NAME, engine_config, running_server, wait_until

pytestmark = pytest.mark.timeout(180)

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 8}


def greedy_params(max_tokens: int = 8, **extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)  # type: ignore[arg-type]


def test_chat_has_one_bos_like_offline_chat(tiny_llama_bos_dir: Path) -> None:
    # The template writes BOS and the tokenizer adds one to plain text: the chat prompt
    # must be encoded without the tokenizer's, on the server as offline.
    offline = LLM(config=engine_config(tiny_llama_bos_dir))
    bos = offline.tokenizer.bos_token_id
    assert offline.engine.tokenize("hi")[0] == bos, "the fixture's tokenizer adds BOS"
    expected = offline.chat(MESSAGES, greedy_params(), use_tqdm=False)[0]
    assert expected.prompt_token_ids[:2].count(bos) == 1
    with running_server(tiny_llama_bos_dir) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.choices[0].message.content == expected.text


def test_api_key_required(tiny_llama_dir: Path) -> None:
    settings = ServerSettings(served_model_names=[MODEL_NAME], api_key="s3cret")
    with running_server(tiny_llama_dir, settings) as server:
        url = f"{server.base_url}/v1"
        wrong = openai.OpenAI(base_url=url, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
        response = httpx.get(f"{url}/models")
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        right = openai.OpenAI(base_url=url, api_key="s3cret", max_retries=0)
        assert right.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2).choices
        assert httpx.get(f"{server.base_url}/health").status_code == 200  # probes need no key
        assert server.metrics()['iterserve:requests_rejected_total{reason="unauthorized"}'] == 1


def test_static_batching_behind_a_server_starts_a_partial_batch(tiny_llama_dir: Path) -> None:
    # One request and a batch of four: the server cannot know no more will come, so
    # the batch starts once the request has waited static_max_wait_ms.
    with running_server(
        tiny_llama_dir, batching="static", batch_size=4, static_max_wait_ms=300
    ) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        result = client.with_options(timeout=30).completions.create(
            model=MODEL_NAME, prompt=PROMPT, **GREEDY
        )
        assert result.choices[0].finish_reason in ("stop", "length")


def test_cached_tokens_in_usage_and_a_guarded_reset_prefix_cache(tiny_llama_dir: Path) -> None:
    settings = ServerSettings(served_model_names=[MODEL_NAME], api_key="k3y")
    with running_server(tiny_llama_dir, settings) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="k3y", max_retries=0)
        prompt = "A long shared system prompt that several requests begin with. " * 4
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}

        def cached() -> int:
            usage = client.completions.create(**body).usage  # type: ignore[arg-type]
            assert usage is not None and usage.prompt_tokens_details is not None
            return usage.prompt_tokens_details.cached_tokens or 0

        assert cached() == 0
        hit = cached()
        assert hit > 0 and hit % 16 == 0, "whole blocks of the repeated prompt"
        chunks = list(
            client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                stream=True, stream_options={"include_usage": True},
            )
        )  # fmt: skip
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details is not None

        assert httpx.post(f"{server.base_url}/reset_prefix_cache").status_code == 401
        assert reset_prefix_cache(ClientConfig(server.base_url, api_key="k3y"))
        assert cached() == 0, "the reset dropped the cached blocks"
        assert server.metrics()["iterserve:prefix_cache_hits_total"] == hit


# ---- overload --------------------------------------------------------------------------------


def test_overload_gets_429_and_nothing_else_degrades(tiny_llama_dir: Path) -> None:
    # Two seats and two waiting slots; 16 clients at once, half streaming. Nothing can
    # finish during the burst (200 tokens each), so at most 4 may be taken.
    seats, slots, clients = 2, 2, 16
    prompts = [f"Client {i} says" for i in range(clients)]
    offline = LLM(config=engine_config(tiny_llama_dir))
    expected = [
        o.text
        for o in offline.generate(prompts, greedy_params(200, ignore_eos=True), use_tqdm=False)
    ]
    with running_server(tiny_llama_dir, max_waiting_requests=slots, max_num_seqs=seats) as server:

        async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str, httpx.Headers]:
            body = {"prompt": prompts[i], "max_tokens": 200, "temperature": 0.0,
                    "ignore_eos": True, "stream": i % 2 == 1}  # fmt: skip
            async with http.stream("POST", "/v1/completions", json=body) as response:
                raw = (await response.aread()).decode()
            if response.status_code != 200:
                return response.status_code, raw, response.headers
            if not body["stream"]:
                return 200, httpx.Response(200, content=raw).json()["choices"][0]["text"], {}
            chunks = [line[6:] for line in raw.splitlines() if line.startswith("data: {")]
            text = "".join(httpx.Response(200, content=c).json()["choices"][0]["text"]
                           for c in chunks)  # fmt: skip
            return 200, text, response.headers

        async def burst() -> list[tuple[int, str, httpx.Headers]]:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
                results = asyncio.gather(*(one(http, i) for i in range(clients)))
                # Probes answer at once while the engine is saturated.
                health = await http.get("/health")
                assert health.status_code == 200
                assert (await http.get("/metrics")).status_code == 200
                return await results

        results = asyncio.run(burst())
        statuses = [status for status, _, _ in results]
        assert set(statuses) <= {200, 429}, statuses
        assert 1 <= statuses.count(200) <= seats + slots, statuses
        for i, (status, text, headers) in enumerate(results):
            if status == 200:
                assert text == expected[i], f"client {i} got a degraded answer"
            else:
                assert int(headers["Retry-After"]) >= 1
                error = httpx.Response(429, content=text).json()["error"]
                assert (
                    error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
                )
        metrics = server.metrics()
        assert metrics['iterserve:requests_rejected_total{reason="overloaded"}'] == statuses.count(
            429
        )

        def drained() -> bool:
            snap = server.async_engine.snapshot
            return snap.num_running == snap.num_waiting == snap.num_used_kv_blocks == 0

        assert wait_until(drained, timeout=10)
        after = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": PROMPT}, timeout=30)
        assert after.status_code == 200, "the server serves again once the burst is over"


def test_the_waiting_limit_holds_for_arrivals_between_steps(tiny_llama_dir: Path) -> None:
    # One seat, one waiting slot, adds arriving every half millisecond while nothing can
    # finish: an add must see the request accepted just before it, or a third gets in.
    engine = LLMEngine(engine_config(tiny_llama_dir, max_num_seqs=1))
    params = SamplingParams(temperature=0.0, max_tokens=490, ignore_eos=True)

    async def main() -> int:
        async_engine = AsyncEngine(engine, max_waiting_requests=1)
        async_engine.start()
        accepted = 0
        for i in range(300):
            try:
                await async_engine.add([GenerationRequest(PROMPT, params, f"r{i}")])
                accepted += 1
            except EngineOverloadedError:
                pass
            await asyncio.sleep(0.0005)
        assert engine.stats.decode_tokens < 490, "the first request is still running"
        await async_engine.shutdown(timeout=0.1)
        return accepted

    assert asyncio.run(main()) == 2
