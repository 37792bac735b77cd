"""Ollama's API (/api/chat, /api/generate, the listings) over a real server through the
official `ollama` client: its answers are the engine's (the same greedy text as the OpenAI
routes on the same prompt, Ollama's default sampling as offline generate with those
settings), a tool loop as Ollama's clients run it, thinking apart, `format`, generate's
raw, templated and `context` forms, the NDJSON stream, and Ollama's errors naming the field.

A tiny Llama with Qwen 2.5's tool-calling template; the answers of the tool loop are
scripted (a random model writes no calls), and a tiny Qwen3 with `<think>` for thinking."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from iterserve.server.ollama_protocol import OllamaMessage, chat_messages
from server_fixtures import (
    MODEL_NAME,
    RunningServer,
    answer_tokens,
    running_server,
    scripted_tokens,
)
from thinking_models import forced_tokens, thinking_answer

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

QUESTION = [{"role": "user", "content": "Say something about the sea."}]
GREEDY = {"temperature": 0, "num_predict": 8, "repeat_penalty": 1.0}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string"} for key in keys},
                "required": list(keys),
            },
        },
    }
    for name, description, keys in (
        ("get_weather", "The weather in a city", ("city", "unit")),
        ("get_time", "The time in a time zone", ("tz",)),
    )
]
TWO_CALLS = (
    "I'll check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
    "</tool_call>"
)


@pytest.fixture(scope="module")
def server(tools_llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(tools_llama_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.base_url)


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], **template: Any) -> list[int]:
    """The conversation's prompt as the chat route tokenizes it (transformers' rendering)."""
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **template
    )
    return tokenizer.encode(text, add_special_tokens=False)


def openai_chat(server: RunningServer, messages: list[dict[str, Any]], **more: Any) -> Any:
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    return chat.chat.completions.create(model=MODEL_NAME, messages=messages, **more)  # type: ignore[arg-type]


def test_chat_is_the_chat_completions_answer(client: ollama.Client, server: RunningServer) -> None:
    expected = openai_chat(server, QUESTION, max_tokens=8, temperature=0)
    answer = client.chat(model=MODEL_NAME, messages=QUESTION, options=GREEDY, stream=False)
    assert answer.message.content == expected.choices[0].message.content
    assert answer.message.role == "assistant" and answer.message.tool_calls is None
    assert answer.done and answer.done_reason == "length" and answer.model == MODEL_NAME
    assert answer.eval_count == 8
    assert answer.prompt_eval_count == expected.usage.prompt_tokens
    assert answer.total_duration and answer.eval_duration and answer.prompt_eval_duration
    assert answer.total_duration >= answer.eval_duration
    # Streamed (Ollama's default): the same text in pieces, then the statistics.
    parts = list(
        client.chat(model=f"{MODEL_NAME}:latest", messages=QUESTION, options=GREEDY, stream=True)
    )
    assert all(not part.done for part in parts[:-1]) and parts[-1].done
    assert "".join(part.message.content or "" for part in parts) == answer.message.content
    assert parts[-1].message.content == "" and parts[-1].eval_count == 8
    assert parts[-1].done_reason == "length" and parts[0].created_at


def test_ollamas_default_sampling_is_its_documented_one(
    client: ollama.Client, server: RunningServer
) -> None:
    """Left out, the options are Ollama's (the tiny model gives none): temperature 0.8,
    top_k 40, top_p 0.9, repeat_penalty 1.1 over the last 64 tokens. A seeded draw is the
    OpenAI route's with those settings (prompt and answer within 64 tokens, so the penalty's
    window is all of them), and not the one without them."""
    prompt_tokens = len(chat_ids(server.engine.tokenizer, QUESTION))
    assert prompt_tokens + 24 <= 64
    seeded = {"seed": 7, "num_predict": 24}
    answer = client.chat(model=MODEL_NAME, messages=QUESTION, options=seeded)
    expected = openai_chat(server, QUESTION, max_tokens=24, seed=7, temperature=0.8, top_p=0.9,
                           extra_body={"top_k": 40, "min_p": 0, "repetition_penalty": 1.1})  # fmt: skip
    assert answer.message.content == expected.choices[0].message.content
    plain = {**seeded, "temperature": 1, "top_k": 0, "top_p": 1, "repeat_penalty": 1}
    other = client.chat(model=MODEL_NAME, messages=QUESTION, options=plain)
    assert other.message.content != answer.message.content


def test_tool_loop_through_the_ollama_client(client: ollama.Client, server: RunningServer) -> None:
    question = [{"role": "user", "content": "Weather and time in Paris?"}]
    with scripted_tokens(server, answer_tokens(server, TWO_CALLS)):
        answer = client.chat(model=MODEL_NAME, messages=question, tools=TOOLS, stream=False)
        parts = list(client.chat(model=MODEL_NAME, messages=question, tools=TOOLS, stream=True))
    message = answer.message
    assert message.content == "I'll check both." and answer.done_reason == "stop"
    calls = [(c.function.name, dict(c.function.arguments)) for c in message.tool_calls or []]
    assert calls == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    streamed = [c for part in parts for c in part.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == calls
    assert "".join(part.message.content or "" for part in parts) == message.content

    # The results go back as Ollama's clients send them: the assistant's message as it came,
    # a tool message each, named by `tool_name`. The template sees what the OpenAI route's
    # history with call ids renders.
    history = [
        *question,
        message,
        {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"},
        {"role": "tool", "content": "14:05", "tool_name": "get_time"},
    ]
    with scripted_tokens(server, answer_tokens(server, "Sunny, 18 C; it is 14:05.")):
        final = client.chat(model=MODEL_NAME, messages=history, tools=TOOLS)
    assert final.message.content == "Sunny, 18 C; it is 14:05."
    openai_history = [
        *question,
        {
            "role": "assistant",
            "content": message.content,
            "tool_calls": [
                {
                    "id": f"call_1_{k}",
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }  # fmt: skip
                for k, (name, arguments) in enumerate(calls)
            ],
        },
        {"role": "tool", "tool_call_id": "call_1_0", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "call_1_1", "content": "14:05"},
    ]
    rendered = chat_ids(server.engine.tokenizer, openai_history, tools=TOOLS)
    assert final.prompt_eval_count == len(rendered)


def test_the_listings_describe_the_served_model(
    client: ollama.Client, server: RunningServer
) -> None:
    listed = client.list().models
    assert [m.model for m in listed] == [f"{MODEL_NAME}:latest"]
    details = listed[0].details
    assert details is not None and details.family == "llama" and details.format == "safetensors"
    assert details.quantization_level == "F32" and details.parameter_size
    assert listed[0].size and listed[0].size > 0
    shown = client.show(MODEL_NAME)
    # The tiny model embeds beside generating (/v1/embeddings, /api/embed), as any does here.
    assert shown.capabilities == ["completion", "tools", "embedding"]
    assert shown.template == server.engine.chat_template
    assert shown.modelinfo and shown.modelinfo["llama.context_length"] == 512
    assert shown.modelinfo["general.parameter_count"] > 0
    running = client.ps().models
    assert [m.model for m in running] == [f"{MODEL_NAME}:latest"] and running[0].context_length
    base = server.base_url
    # Ollama reads bodies as JSON whatever their type, and its docs send them by `curl -d`.
    form = {"content-type": "application/x-www-form-urlencoded"}
    body = json.dumps({"model": MODEL_NAME, "messages": QUESTION, "stream": False})
    curl = httpx.post(f"{base}/api/chat", content=body, headers=form, timeout=60)
    assert curl.status_code == 200 and curl.json()["done"]
    assert httpx.get(f"{base}/api/version").json()["version"]
    assert httpx.get(f"{base}/").text == "iterserve is running"
    assert httpx.head(f"{base}/").status_code == 200


def test_generate_raw_templated_and_with_context(
    client: ollama.Client, server: RunningServer
) -> None:
    text = "The sea is"
    raw = client.generate(model=MODEL_NAME, prompt=text, raw=True, options=GREEDY, stream=False)
    completions = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    expected = completions.completions.create(
        model=MODEL_NAME, prompt=text, max_tokens=8, temperature=0
    )
    assert raw.response == expected.choices[0].text and raw.context is None
    # Templated: a one-turn chat, answered with the tokens of the whole exchange.
    templated = client.generate(model=MODEL_NAME, prompt=QUESTION[0]["content"], options=GREEDY)
    parts = list(
        client.generate(
            model=MODEL_NAME, prompt=QUESTION[0]["content"], options=GREEDY, stream=True
        )
    )
    chat = client.chat(model=MODEL_NAME, messages=QUESTION, options=GREEDY, stream=False)
    assert templated.response == chat.message.content  # type: ignore[union-attr]
    assert "".join(p.response for p in parts) == templated.response  # type: ignore[union-attr]
    context = templated.context  # type: ignore[union-attr]
    assert context is not None and parts[-1].context == context
    tokenizer = server.engine.tokenizer
    assert tokenizer.decode(context[-8:]) == templated.response  # type: ignore[union-attr]
    # The next prompt after that context: its tokens, then the new turn's.
    follow = client.generate(
        model=MODEL_NAME, prompt="And the sky?", context=context, options=GREEDY, stream=False
    )
    turn = chat_ids(tokenizer, [{"role": "user", "content": "And the sky?"}])
    assert follow.prompt_eval_count == len(context) + len(turn)
    assert follow.context is not None and follow.context[: len(context)] == context
    # An empty prompt only loads the model (keep_alive 0: unloads, which it does not here).
    loaded = client.generate(model=MODEL_NAME, prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert client.chat(model=MODEL_NAME, messages=[], keep_alive=0).done_reason == "unload"


def test_format_constrains_the_answer(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"sunny": {"type": "boolean"}},
        "required": ["sunny"],
        "additionalProperties": False,
    }
    answer = client.chat(
        model=MODEL_NAME, messages=QUESTION, format=schema, options={"num_predict": 40}
    )
    assert set(json.loads(answer.message.content or "")) == {"sunny"}
    loose = client.generate(model=MODEL_NAME, prompt="JSON please", format="json",
                            options={"num_predict": 300, "seed": 3})  # fmt: skip
    if loose.done_reason == "stop":
        assert isinstance(json.loads(loose.response), dict)


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("chat", {"options": {"temperature": -1}}, "options.temperature"),
        ("chat", {"options": {"typical_p": 0.5}}, "options.typical_p"),
        ("chat", {"options": {"mirostat": 2}}, "options.mirostat"),
        ("chat", {"think": True}, "think"),
        ("generate", {"prompt": "x", "think": "high"}, "think"),
        ("chat", {"messages": [{"role": "user", "content": "x", "images": ["AA=="]}]},
         "messages.0.images"),
        ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ("chat", {"format": "xml"}, "format"),
        ("generate", {"prompt": "x", "template": "{{ .Prompt }}"}, "template"),
        ("generate", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("pull", {"model": "llama3.2"}, "model"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    server: RunningServer, path: str, body: dict[str, Any], named: str
) -> None:
    request = {"model": MODEL_NAME, "messages": QUESTION, "stream": False, **body}
    reply = httpx.post(f"{server.base_url}/api/{path}", json=request, timeout=30)
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"]


def test_unknown_models_and_runner_options(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="llama3.2:3b", messages=QUESTION)
    assert missing.value.status_code == 404 and "llama3.2:3b" in missing.value.error
    with pytest.raises(ollama.ResponseError) as pulled:
        client.pull("llama3.2")
    assert pulled.value.status_code == 400
    # The runner's options configure how Ollama loads a model: accepted, changing nothing.
    runner = {"num_ctx": 8192, "num_thread": 2, "num_gpu": 0, "use_mmap": True, **GREEDY}
    assert (
        client.chat(model=MODEL_NAME, messages=QUESTION, options=runner).message.content
        == client.chat(model=MODEL_NAME, messages=QUESTION, options=GREEDY).message.content
    )


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> Iterator[RunningServer]:
    with running_server(qwen3_dir) as running:
        yield running


def test_thinking_comes_apart_and_think_false_turns_it_off(qwen3: RunningServer) -> None:
    client = ollama.Client(host=qwen3.base_url)
    tokenizer = qwen3.engine.tokenizer
    script = thinking_answer(tokenizer, "\nThe user greets me.\n", "\n\nHello there!")
    hi = [{"role": "user", "content": "Hi"}]
    with forced_tokens(qwen3.engine, script) as refused:
        answer = client.chat(model=MODEL_NAME, messages=hi, think=True, options={"num_predict": 60})
        parts = list(
            client.chat(model=MODEL_NAME, messages=hi, options={"num_predict": 60}, stream=True)
        )
    assert not refused
    assert answer.message.thinking == "The user greets me."
    assert answer.message.content == "Hello there!"
    assert "".join(p.message.thinking or "" for p in parts) == answer.message.thinking
    assert "".join(p.message.content or "" for p in parts) == answer.message.content
    # think false: the template's switch off (Qwen3 writes an empty thinking block).
    off = client.chat(model=MODEL_NAME, messages=hi, think=False, options={"num_predict": 1})
    assert off.prompt_eval_count == len(chat_ids(tokenizer, hi, enable_thinking=False))
    shown = client.show(MODEL_NAME).capabilities
    assert shown == ["completion", "tools", "thinking", "embedding"]


def test_tool_messages_answer_the_calls_they_name() -> None:
    """Ollama's tool messages carry no call id: each answers the call its `tool_name` names
    (templates such as Mistral's write the ids), else the first unanswered one."""
    calls = [{"function": {"name": name, "arguments": {}}} for name in ("a", "b", "a")]
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "content": "B", "tool_name": "b"},
        {"role": "tool", "content": "A"},
        {"role": "tool", "content": "A again", "tool_name": "a"},
    ]
    chat = chat_messages([OllamaMessage.model_validate(m) for m in history])
    ids = [c.id for c in chat[1].tool_calls or []]
    assert [m.tool_call_id for m in chat[2:]] == [ids[1], ids[0], ids[2]]
    assert json.loads((chat[1].tool_calls or [])[0].function.arguments) == {}


def test_ollamas_default_tag_names_the_model_on_every_api(server: RunningServer) -> None:
    """Clients moved from Ollama keep `NAME:latest` in their settings (Ollama's own /v1 takes
    it): the OpenAI routes take it too, and answer with the served name."""
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    answer = chat.chat.completions.create(
        model=f"{MODEL_NAME}:latest",
        messages=QUESTION,
        max_tokens=2,  # type: ignore[arg-type]
    )
    assert answer.model == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        chat.chat.completions.create(model=f"{MODEL_NAME}:q8", messages=QUESTION, max_tokens=2)  # type: ignore[arg-type]
