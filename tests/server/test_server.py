"""The OpenAI-compatible server over real sockets, driven by the official openai client.

A tiny random Llama (fp32) keeps it fast; greedy output is compared with the
offline `LLM` on the same checkpoint, so the server adds nothing and loses nothing.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from iterserve import LLM, SamplingParams
from server_fixtures import (
    MODEL_NAME,
    RunningServer,
    engine_config,
    running_server,
    scripted_tokens,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 8}


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(tiny_llama_dir, max_num_seqs=64) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: Path) -> LLM:
    return LLM(config=engine_config(tiny_llama_dir))


def greedy_params(max_tokens: int = 8, **extra: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)  # type: ignore[arg-type]


# ---- completions and chat ------------------------------------------------------------------


def test_completion_matches_offline_generate(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPT, greedy_params(), use_tqdm=False)[0]

    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    assert result.object == "text_completion" and result.model == MODEL_NAME
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == expected.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == result.usage


def test_chat_matches_offline_chat(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.chat(MESSAGES, greedy_params(), use_tqdm=False)[0]

    result = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.choices[0].finish_reason == expected.finish_reason
    assert result.usage is not None and result.usage.prompt_tokens == len(expected.prompt_token_ids)

    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            max_completion_tokens=8,
            temperature=0.0,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(
        expected.token_ids
    )


def test_prompt_batch_n_and_seed(client: openai.OpenAI, offline: LLM) -> None:
    prompts = ["Once upon a time", "1 2 3 4"]
    params = {"n": 2, "seed": 7, "temperature": 1.0, "max_tokens": 6, "ignore_eos": True}
    first = client.completions.create(model=MODEL_NAME, prompt=prompts, extra_body=params)
    again = client.completions.create(model=MODEL_NAME, prompt=prompts, extra_body=params)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded
    assert all(c.finish_reason == "length" for c in first.choices)
    # A prompt counts once however many choices it has.
    prompt_lengths = [len(offline.tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    assert first.usage is not None
    assert first.usage.prompt_tokens == sum(prompt_lengths)
    assert first.usage.completion_tokens == 4 * 6

    (seeded,) = offline.generate(prompts[0], SamplingParams(**params), use_tqdm=False)  # type: ignore[arg-type]
    assert [o.text for o in seeded.outputs] == [c.text for c in first.choices[:2]]


def test_chat_stream_with_n_lane_and_priority(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            stream=True,
            n=2,
            seed=3,
            max_tokens=5,
            extra_body={"lane": "batch", "priority": 1, "ignore_eos": True},
        )
    )
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks}
    assert sorted(roles) == [0, 1] and finished == {0: "length", 1: "length"}


def test_a_chunk_per_token_even_without_text(
    client: openai.OpenAI, server: RunningServer, offline: LLM
) -> None:
    # A lama split over three byte tokens (no text until the third) and two special tokens
    # (no text at all): each still gets its chunk, so a client's TBT sees every token.
    tokenizer = offline.tokenizer
    hi, there = (tokenizer.encode(t, add_special_tokens=False) for t in (" Hi", " there"))
    lama = tokenizer.encode("🦙", add_special_tokens=False)
    special = [tokenizer.bos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    script = hi + lama + special + there
    assert len(lama) == 3 and len(hi) == len(there) == 1
    args = {"model": MODEL_NAME, "max_tokens": len(script), "stream": True}
    extra = {"extra_body": {"ignore_eos": True}}
    with scripted_tokens(server, script):
        completion = list(client.completions.create(prompt=PROMPT, **args, **extra))
        chat = list(client.chat.completions.create(messages=MESSAGES, **args, **extra))
    assert [c.choices[0].text for c in completion] == [" Hi", "", "", "🦙", "", "", " there"]
    assert completion[-1].choices[0].finish_reason == "length"
    contents = [c.choices[0].delta.content for c in chat[1:]]  # after the role chunk
    assert contents == [" Hi", "", "", "🦙", "", "", " there"]


def test_stop_strings(client: openai.OpenAI, offline: LLM) -> None:
    text = offline.generate(PROMPT, greedy_params(12, ignore_eos=True), use_tqdm=False)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, stop=[stop], temperature=0.0, max_tokens=12,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert result.choices[0].text == text[: text.index(stop)]
    assert result.choices[0].finish_reason == "stop"
    assert result.model_extra is not None  # vLLM's stop_reason: what ended it
    assert result.choices[0].model_extra == {"stop_reason": stop}
    # vLLM's include_stop_str_in_output: the stop string ends the text; streamed the same.
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    args = {"model": MODEL_NAME, "prompt": PROMPT, "stop": [stop], "temperature": 0.0,
            "max_tokens": 12, "extra_body": extra}  # fmt: skip
    included = client.completions.create(**args)
    assert included.choices[0].text == text[: text.index(stop) + len(stop)]
    streamed = client.completions.create(**args, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == included.choices[0].text


def test_include_stop_str_in_output_keeps_the_stop_token_s_text(offline: LLM) -> None:
    ids = offline.generate(PROMPT, greedy_params(8, ignore_eos=True), use_tqdm=False)[0].token_ids
    stop_id = ids[3]
    cut = ids[: ids.index(stop_id) + 1]
    params = greedy_params(8, ignore_eos=True, stop_token_ids=[stop_id])
    without = offline.generate(PROMPT, params, use_tqdm=False)[0]
    params.include_stop_str_in_output = True
    included = offline.generate(PROMPT, params, use_tqdm=False)[0]
    assert without.token_ids == included.token_ids == cut
    assert without.text == offline.tokenizer.decode(cut[:-1], skip_special_tokens=True)
    assert included.text == offline.tokenizer.decode(cut, skip_special_tokens=True)
    assert included.text != without.text


def test_stop_reason_names_the_stop_token(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.generate(PROMPT, greedy_params(8, ignore_eos=True), use_tqdm=False)[0].token_ids
    stop_id = ids[3]
    cut = ids[: ids.index(stop_id) + 1]
    args = {"model": MODEL_NAME, "temperature": 0.0, "max_tokens": 8}
    extra = {"ignore_eos": True, "stop_token_ids": [stop_id]}
    whole = client.completions.create(prompt=PROMPT, **args, extra_body=extra)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.completion_tokens == len(cut)
    assert whole.choices[0].model_extra == {"stop_reason": stop_id}
    streamed = list(client.completions.create(prompt=PROMPT, stream=True, **args, extra_body=extra))
    reasons = [chunk.choices[0].model_extra for chunk in streamed]
    assert reasons[-1] == {"stop_reason": stop_id}
    assert all(reason == {"stop_reason": None} for reason in reasons[:-1])
    answer = offline.chat(MESSAGES, greedy_params(8, ignore_eos=True), use_tqdm=False)[0]
    extra["stop_token_ids"] = [answer.token_ids[2]]
    chat = client.chat.completions.create(messages=MESSAGES, **args, extra_body=extra)
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].model_extra == {"stop_reason": answer.token_ids[2]}
    # Neither EOS nor max_tokens is a stop reason.
    plain = client.chat.completions.create(messages=MESSAGES, **args)
    assert plain.choices[0].model_extra == {"stop_reason": None}


def test_text_parts_are_one_text_a_line_apart(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]
    as_parts = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": parts}], **GREEDY
    )
    as_text = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is\nthe capital?"}], **GREEDY
    )
    assert as_parts.usage is not None and as_text.usage is not None
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content


def test_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=2, **GREEDY)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and result.usage is not None
    assert len(logprobs.tokens or []) == result.usage.completion_tokens
    assert "".join(logprobs.tokens or []) == result.choices[0].text
    for token, logprob, top in zip(
        logprobs.tokens or [],
        logprobs.token_logprobs or [],
        logprobs.top_logprobs or [],
        strict=True,
    ):
        assert logprob <= 0 and top is not None and top[token] == logprob  # greedy: the best
        assert max(top.values()) == logprob and 1 <= len(top) <= 3

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.top_logprobs[0].logprob == entry.logprob for entry in content)


def test_models_and_health(client: openai.OpenAI, server: RunningServer) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/no-such-model")
    assert missing.value.body["param"] == "model"  # type: ignore[index]
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 200
    # Which path serves, and why: dtype, kernels and their ISA.
    model = health.json()["model"]
    assert model["dtype"] in ("bfloat16", "float32") and model["dtype_reason"]
    assert {"kernels", "kernels_isa", "attention", "weights", "step"} <= model.keys()


# ---- bad input ------------------------------------------------------------------------------

BAD_INPUTS = [
    ("/v1/completions", b'{"prompt": "hi", ', 400, None),  # malformed JSON
    ("/v1/completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    (
        "/v1/completions",
        {"model": "gpt-17", "prompt": "hi"},
        404,
        "model",
    ),  # model_not_found, as OpenAI
    ("/v1/completions", {"prompt": list(range(100, 700))}, 400, "prompt"),  # over 512 tokens
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    # -1 is llama-server's "no limit" (test_llama_server_api.py); below it, refused.
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": -2}, 400, "max_tokens"),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
    ),
    ("/v1/completions", {"prompt": "hi", "n": 10**12}, 400, "n"),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "lane": "vip"}, 400, "lane"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "hi"}]}, 400, "messages.0.role"),
    # A value that fits no member of a union is about the field, not pydantic's member.
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": 5.5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"Str": "x"}}, 400, "logit_bias.Str"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages.0.content",
    ),
    ("/v1/nothing-here", {}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_openai_error(
    server: RunningServer, path: str, body: object, status: int, param: str | None
) -> None:
    url = f"{server.base_url}{path}"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(url, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and len(error["message"]) > 10


@pytest.mark.parametrize(
    "extra",
    [{"top_p": 1e-85}, {"top_p": 1e-85, "top_k": 5}, {"seed": 2**70}, {"seed": -(2**70)}],
)
def test_values_that_once_crashed_the_server_now_work(server: RunningServer, extra: dict) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, **extra}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def test_bad_input_raises_typed_client_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)


# ---- engine-facing behaviour -----------------------------------------------------------------


def test_metrics_parse_and_counters_move(
    client: openai.OpenAI, server: RunningServer, offline: LLM
) -> None:
    prompt_tokens = len(offline.tokenizer.encode(PROMPT, add_special_tokens=False))
    before = server.metrics()
    client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, **GREEDY, extra_body={"ignore_eos": True}
    )
    after = server.metrics()

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved('iterserve:requests_received_total{endpoint="/v1/completions"}') == 1
    assert moved('iterserve:requests_finished_total{finish_reason="length"}') == 1
    assert moved("iterserve:generation_tokens_total") == 8
    assert moved("iterserve:prompt_tokens_total") == prompt_tokens
    assert moved("iterserve:time_to_first_token_seconds_count") == 1
    assert moved("iterserve:inter_token_latency_seconds_count") == 7
    assert moved("iterserve:e2e_request_latency_seconds_count") == 1
    assert moved("iterserve:request_queue_time_seconds_count") == 1
    assert moved("iterserve:engine_steps_total") >= 8
    for gauge in (
        'iterserve:num_requests_running{lane="interactive"}',
        'iterserve:num_requests_waiting{lane="batch"}',
        "iterserve:kv_cache_usage_perc",
        "iterserve:prefix_cache_hit_rate",
    ):
        assert gauge in after


def test_metrics_report_the_engines_memory(client: openai.OpenAI, server: RunningServer) -> None:
    """The weights and the KV pool as the engine holds them (its reservation, and the part
    written so far), and the process's resident memory now and at its peak, beside the
    standard process_* series of the same process."""
    client.completions.create(model=MODEL_NAME, prompt="The pool is written", max_tokens=4)
    m = server.metrics()
    engine = server.engine
    weights = m["iterserve:model_weights_bytes"]
    assert weights == engine.model_plan.weight_bytes > 0
    assert m["iterserve:kv_cache_memory_bytes"] == engine.kv_pool.bytes > 0
    written = engine.scheduler.kv_cache_stats().num_written_blocks
    assert written > 0  # the request's blocks, at least
    block_bytes = engine.kv_pool.bytes / engine.kv_pool.num_blocks
    assert m["iterserve:kv_cache_written_bytes"] == pytest.approx(written * block_bytes, abs=1)
    resident = m["iterserve:process_resident_memory_bytes"]
    assert weights < resident <= m["iterserve:process_peak_resident_memory_bytes"]
    # prometheus_client's own reading of the same process, a moment apart.
    assert abs(m["process_resident_memory_bytes"] - resident) < 0.1 * resident


def test_concurrent_streams_with_disconnects(server: RunningServer, offline: LLM) -> None:
    prompts = [f"Request number {i} asks about" for i in range(32)]
    expected = [
        o.text
        for o in offline.generate(prompts, greedy_params(12, ignore_eos=True), use_tqdm=False)
    ]
    rng = random.Random(4)
    leavers = set(rng.sample(range(32), 11))  # a third of the clients go away mid-stream
    aborted_before = server.metrics().get("iterserve:requests_aborted_total", 0.0)

    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompts[i],
            stream=True,
            temperature=0.0,
            # Leavers ask for far more than they read, so they are surely mid-run when they go.
            max_tokens=200 if i in leavers else 12,
            extra_body={"ignore_eos": True},
        )
        if i in leavers:
            stop_after = rng.randint(0, 5)
            async for n, _ in aiter_enumerate(stream):
                if n >= stop_after:
                    break
            await stream.close()  # drops the connection: the server sees the disconnect
            return None
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def main() -> list[str | None]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i not in leavers:
            assert text == expected[i], f"stream {i}"

    def drained() -> bool:
        m = server.metrics()
        return (
            m['iterserve:num_requests_running{lane="interactive"}'] == 0
            and m['iterserve:num_requests_waiting{lane="interactive"}'] == 0
            and m["iterserve:kv_cache_used_blocks"] == 0
            and m["iterserve:requests_aborted_total"] - aborted_before == len(leavers)
        )

    assert wait_until(drained, timeout=10), server.metrics()
    # The engine agrees with its metrics: nothing left, no block held (ref-0 cached ones are free).
    assert server.async_engine.snapshot.num_used_kv_blocks == 0


async def aiter_enumerate(stream: openai.AsyncStream) -> object:
    n = 0
    async for item in stream:
        yield n, item
        n += 1


def test_engine_error_fails_the_request_and_keeps_serving(
    client: openai.OpenAI, server: RunningServer
) -> None:
    executor = server.engine.executor
    original = executor.execute

    def fail_once(*args: object, **kwargs: object) -> object:
        executor.execute = original  # type: ignore[method-assign]
        raise RuntimeError("injected failure")

    executor.execute = fail_once  # type: ignore[method-assign]
    try:
        with pytest.raises(openai.InternalServerError, match="engine failed"):
            client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    finally:
        executor.execute = original  # type: ignore[method-assign]
    result = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    assert result.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert server.metrics()["iterserve:requests_failed_total"] >= 1
    assert server.async_engine.snapshot.num_used_kv_blocks == 0


def test_keep_alives_in_a_quiet_stream_change_nothing(
    client: openai.OpenAI, server: RunningServer, offline: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream that has nothing to send for KEEP_ALIVE_AFTER seconds (a long prefill; here
    any half millisecond) sends an SSE comment, which the SDK skips: the same text."""
    from iterserve.server import serving

    monkeypatch.setattr(serving, "KEEP_ALIVE_AFTER", 0.0005)
    prompt = "The quick brown fox. " * 40
    expected = offline.generate(prompt, greedy_params(16, ignore_eos=True), use_tqdm=False)[0]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as reply:
        lines = list(reply.iter_lines())
    assert ": keep-alive" in lines and lines[-2:] == ["data: [DONE]", ""]
    args = {k: v for k, v in body.items() if k != "ignore_eos"}
    chunks = client.completions.create(**args, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    assert "".join(chunk.choices[0].text for chunk in chunks) == expected.text
    offline_chat = offline.chat(MESSAGES, greedy_params(8), use_tqdm=False)[0]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == offline_chat.text
