"""The running server's own OpenAPI schema, fuzzed with schemathesis.

Every generated request, valid by the schema or deliberately not, must get
either an answer or a 4xx in its API's error shape (OpenAI's; Anthropic's under
/v1/messages; Ollama's under /api); never a 5xx, never an error event inside a 200 stream. Three kinds of examples per generation
endpoint: raw (as the schema allows), tamed (raw, with what is refused at once
fixed up and sampling settings drawn in range, so requests reach the engine and
the sampler) and negative (violating the schema). Bounded for CI: a fixed
number of examples and a fixed seed, on the tiny model with a short context
(so a chat asking for "all the context leaves" stays short); about 65 s on 2 cores.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from conftest import VOCAB
from server_fixtures import MODEL_NAME, RunningServer, running_server, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SEED = 20250610
GENERATION = (
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /completion",  # llama-server's own
    "POST /api/chat",  # Ollama's
)
ANTHROPIC = "POST /v1/messages"  # and its count_tokens
OLLAMA = " /api/"
LLAMA_SERVER = ("POST /completion", "POST /completions", "POST /infill")
# Examples per generation endpoint and kind; the other operations take no input to vary.
# 125 an endpoint over six (Ollama's /api/chat the sixth) keeps the 750 five had at 150.
EXAMPLES = {"raw": 38, "tamed": 66, "negative": 21}
# A raw example nearly always holds one field the server refuses outright (a penalty, a
# role no template knows, token ids outside the vocabulary, a prompt longer than the
# context), and the request ends there with a 400. Tamed examples fix those up and keep
# every other generated value.
REFUSED = (
    "suffix",
    "best_of",
    "model",
    "previous_response_id",
    "reasoning",
    "reasoning_effort",  # the tiny model does not think
    "include",
    "truncation",
    "thinking",  # the tiny model does not think
    "think",  # Ollama's: likewise
    "output_config",
)
# The sampling settings as Ollama's `options` name them (the others by the same name).
OLLAMA_OPTIONS = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}
ROLES = ("user", "assistant", "system", "tool")
# The sampling settings Ollama's `options` have.
OLLAMA_KEYS = ("temperature", "top_p", "min_p", "top_k", "seed", "stop", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "max_tokens")  # fmt: skip
ANTHROPIC_ROLES = ("user", "assistant")


def _short(prompt: object) -> object:
    """A prompt that fits the short context and the vocabulary, empty ones filled in."""
    if isinstance(prompt, str):
        return prompt[:60] or "Hello"
    if isinstance(prompt, int):
        return abs(prompt) % VOCAB
    if isinstance(prompt, list):
        return [_short(part) for part in prompt[:20]] or "Hello"
    return prompt


# Sampling settings within their documented ranges, with hypothesis' taste for extremes
# (5e-324, 1e308, 2**64): a raw example rarely gets one past the other fields.
SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0, 1e308),
        "top_p": st.floats(0, 1, exclude_min=True),
        "min_p": st.floats(0, 1),
        "top_k": st.integers(-1, 2**70),
        "seed": st.integers(-(2**70), 2**70),
        "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0, 1e308, exclude_min=True),
        "logit_bias": st.dictionaries(
            st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3
        ),
        "min_tokens": st.integers(0, 2**70),
        "bad_words": st.lists(st.text(min_size=1, max_size=4).filter(str.strip), max_size=2),
        "echo": st.booleans(),
        "prompt_logprobs": st.integers(-2, 25),
        "return_token_ids": st.booleans(),
        "return_tokens_as_token_ids": st.booleans(),
        "truncate_prompt_tokens": st.integers(-2, 100),
    },
)


def tame(drawn: tuple[schemathesis.Case, dict[str, object]]) -> schemathesis.Case:
    case, sampling = drawn
    body = case.body
    if not isinstance(body, dict):
        return case
    for name in REFUSED:
        body.pop(name, None)
    if OLLAMA in case.operation.label:  # Ollama's: the model named, sampling as `options`
        options = {OLLAMA_OPTIONS.get(k, k): v for k, v in sampling.items() if k in OLLAMA_KEYS}
        options["num_predict"] = 1 + abs(int(options.get("num_predict", 16))) % 24
        body.update(model=MODEL_NAME, options=options)
        sampling = {}
        for message in body.get("messages") or []:
            if isinstance(message, dict):
                message.pop("images", None)
    body.update(sampling)
    for name, low, high in (("n", 1, 3), ("max_tokens", 1, 24), ("max_completion_tokens", 1, 24),
                            ("max_output_tokens", 1, 24), ("n_predict", -1, 24), ("logprobs", 0, 5),
                            ("top_logprobs", 0, 5)):  # fmt: skip
        if isinstance(body.get(name), int) and not isinstance(body[name], bool):
            body[name] = low + abs(body[name]) % (high - low + 1)
    if isinstance(body.get("min_tokens"), int):  # at most max_tokens (16 when unset)
        limit = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        body["min_tokens"] = body["min_tokens"] % (limit + 1) if isinstance(limit, int) else 0
    if case.operation.label in LLAMA_SERVER:
        body.setdefault("prompt", "Hello")  # optional there, and empty is refused
    for name in ("prompt", "input", "instructions"):
        if name in body:
            body[name] = _short(body[name])
    if "messages" in body:
        messages = [m for m in body["messages"] or [] if isinstance(m, dict)][:4]
        roles = ANTHROPIC_ROLES if case.operation.label.startswith(ANTHROPIC) else ROLES
        for message in messages:
            # Any generated role becomes a known one (unknown roles are refused, tested raw).
            message["role"] = roles[len(str(message.get("role"))) % len(roles)]
            message["content"] = _short(message.get("content") or "Hello")
        body["messages"] = messages or [{"role": "user", "content": "Hello"}]
    return case


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(tiny_llama_dir, max_waiting_requests=8, max_model_len=64) as running:
        yield running


def check_response(label: str, curl: str, response: schemathesis.Response) -> None:
    status, text = response.status_code, response.text
    where = f"{label}\n{curl}\n-> {status} {text[:600]}"
    assert status < 500, where
    anthropic = label.startswith(ANTHROPIC)
    ollama = OLLAMA in label
    if label.startswith("HEAD "):  # a status without a body
        return
    if status >= 400:
        body = json.loads(text)
        error = body["error"]
        if ollama:  # a message alone
            assert set(body) == {"error"} and isinstance(error, str) and error, where
            return
        if anthropic:
            assert body["type"] == "error", where
            assert set(error) == {"message", "type", "param"}, where
        else:
            assert set(error) == {"message", "type", "param", "code"}, where
        assert error["message"] and error["type"], where
        return
    content_type = (response.headers.get("content-type") or [""])[0]
    if content_type.startswith("application/x-ndjson"):  # Ollama's: ends on `done`
        lines = [json.loads(line) for line in text.splitlines() if line]
        assert lines and lines[-1].get("done") is True, where
        assert not any("error" in line for line in lines), where
        return
    if content_type.startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if anthropic:  # Anthropic's events, ending on message_stop
            kinds = [json.loads(event)["type"] for event in events]
            assert kinds and kinds[-1] == "message_stop" and "error" not in kinds, where
            return
        if label == "POST /v1/responses":  # ends on its own last event, not [DONE]
            last = json.loads(events[-1])["type"] if events else None
            assert last in ("response.completed", "response.incomplete"), where
        elif label in LLAMA_SERVER:  # each prompt's last event says stop, no [DONE]
            assert events and json.loads(events[-1])["stop"] is True, where
        else:
            assert events and events.pop() == "[DONE]", where
        for event in events:
            assert "error" not in json.loads(event), where  # a 5xx told after the 200


def fuzz(operation: schemathesis.APIOperation, kind: str, base: str) -> None:
    mode = GenerationMode.NEGATIVE if kind == "negative" else GenerationMode.POSITIVE
    strategy = operation.as_strategy(generation_mode=mode)

    @seed(SEED)
    @settings(
        max_examples=EXAMPLES[kind],
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: the failing curl is printed
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.tuples(strategy, SAMPLING).map(tame) if kind == "tamed" else strategy)
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=base, timeout=60)
        check_response(operation.label, case.as_curl_command(), response)

    run()


def test_fuzzed_requests_get_an_answer_or_an_openai_4xx(server: RunningServer) -> None:
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    schema.config.max_stream_events = 10_000  # read whole streams (default: the first 20)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "GET /v1/models",
    }
    for operation in operations:
        kinds = list(EXAMPLES) if operation.label in GENERATION else ["raw"]
        for kind in kinds:
            fuzz(operation, kind, server.base_url)

    # Afterwards: nothing stuck, no block held, and a plain request still works.
    def drained() -> bool:
        snap = server.async_engine.snapshot
        return snap.num_running == snap.num_waiting == snap.num_used_kv_blocks == 0

    assert wait_until(drained, timeout=30), server.async_engine.snapshot
    body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200 and response.json()["choices"][0]["text"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
