"""POST /v1/messages (Anthropic's Messages API) through the official anthropic client against
a real server: the same answer as the equivalent chat completion, a stream that rebuilds it
(the SDK's own accumulator), stop sequences, a tool loop with tool_use and tool_result
blocks, forced tools, prefill, count_tokens, max_tokens past the context and max_tokens 0,
the API key in Anthropic's header, and bad requests refused in Anthropic's error shape,
naming the Messages field. The tiny Llama carries Qwen 2.5's tool-calling template;
tool-call answers are scripted (a random model writes none)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from iterserve.server.app import ServerSettings
from server_fixtures import (
    MODEL_NAME,
    TWO_WEATHER_CALLS,
    RunningServer,
    answer_tokens,
    anthropic_prompt_tokens,
    running_server,
    scripted_tokens,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
HELLO = [{"role": "user", "content": "Hello"}]
# The anthropic SDK (2.x) no longer takes sampling settings as arguments; clients that send
# them (Claude Code, LangChain's, older SDKs) put them in the body, as here.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tools_llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(tools_llama_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def _chat(server: RunningServer, **request: Any) -> Any:
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    return chat.chat.completions.create(model=MODEL_NAME, **request)


def _blocks(message: Any) -> list[dict[str, Any]]:
    """The content as JSON, whatever classes the SDK built it of."""
    return [
        block.model_dump(include={"type", "text", "name", "input"}) for block in message.content
    ]


def test_answer_is_the_equivalent_chat_completion(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    message = client.messages.create(
        model=MODEL_NAME,
        system="Answer briefly.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
        max_tokens=6,
        extra_body=GREEDY,
    )
    chat = _chat(
        server,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a colour."},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL_NAME
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert anthropic_prompt_tokens(message) == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens == 6


def test_stream_rebuilds_the_message(client: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": HELLO,
        "max_tokens": 8,
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == whole.content[0].text  # type: ignore[union-attr]
    assert _blocks(final) == _blocks(whole)
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 8)
    assert anthropic_prompt_tokens(final) == anthropic_prompt_tokens(whole)
    events = list(client.messages.create(**request, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}


def test_stop_sequence_is_named(client: anthropic.Anthropic, server: RunningServer) -> None:
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": HELLO,
        "max_tokens": 40,
        "stop_sequences": ["never", "STOP"],
    }
    with scripted_tokens(server, answer_tokens(server, "Hello there. STOP and more")):
        whole = client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            final = stream.get_final_message()
    for message in (whole, final):
        assert message.content[0].text == "Hello there. "  # type: ignore[union-attr]
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "STOP")
    with scripted_tokens(server, answer_tokens(server, "Done.")):
        ended = client.messages.create(**request)
    assert (ended.stop_reason, ended.stop_sequence) == ("end_turn", None)


def test_tool_loop_with_tool_use_and_tool_result(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    question = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": question,
        "tools": [WEATHER],
        "max_tokens": 200,
    }
    with scripted_tokens(server, answer_tokens(server, TWO_WEATHER_CALLS)):
        message = client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            streamed = stream.get_final_message()
    assert message.stop_reason == streamed.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[0].text == "I'll check."  # type: ignore[union-attr]
    uses = [block for block in message.content if block.type == "tool_use"]
    assert [(use.name, use.input) for use in uses] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Lyon"}),
    ]
    assert _blocks(streamed) == _blocks(message)

    # The calls and their results go back as an agent loop sends them; the prompt is the
    # one the same history renders to as a chat.
    history: list[Any] = [
        *question,
        {"role": "assistant", "content": message.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": f"{i} C"}
                for i, use in enumerate(uses)
            ],
        },
    ]
    with scripted_tokens(server, answer_tokens(server, "Sunny.")):
        final = client.messages.create(**{**request, "messages": history, "max_tokens": 20})
        chat = _chat(
            server,
            messages=[
                *question,
                {
                    "role": "assistant",
                    "content": "I'll check.",
                    "tool_calls": [
                        {
                            "id": use.id,
                            "type": "function",
                            "function": {"name": use.name, "arguments": json.dumps(use.input)},
                        }
                        for use in uses
                    ],
                },
                *[
                    {"role": "tool", "tool_call_id": use.id, "content": f"{i} C"}
                    for i, use in enumerate(uses)
                ],
            ],
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": WEATHER["name"],
                        "description": WEATHER["description"],
                        "parameters": WEATHER["input_schema"],
                    },
                }
            ],
            max_tokens=20,
        )
    assert final.content[0].text == "Sunny." and final.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert anthropic_prompt_tokens(final) == chat.usage.prompt_tokens
    counted = client.messages.count_tokens(
        model=MODEL_NAME,
        messages=history,
        tools=[WEATHER],  # type: ignore[arg-type]
    )
    assert counted.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_tool_choice_forces_a_call(client: anthropic.Anthropic, choice: dict[str, Any]) -> None:
    """The random model's answer is held to the tool's schema: a tool_use block. The
    schema is closed and its string bounded: a random model would never end an open one."""
    closed = {
        **WEATHER,
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    message = client.messages.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[closed],  # type: ignore[list-item]
        tool_choice={**choice, "disable_parallel_tool_use": True},  # type: ignore[typeddict-item]
        max_tokens=60,
        extra_body=GREEDY,
    )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use", message
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert isinstance(uses[0].input, dict) and isinstance(uses[0].input["city"], str)


def test_prefill_continues_the_assistant_turn(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    """A conversation ending with an assistant's text: the answer goes on from it, greedy
    as the same text sent as a plain prompt."""
    prefill = "The colour is"
    turns = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": prefill},
    ]
    message = client.messages.create(
        model=MODEL_NAME,
        messages=turns,
        max_tokens=6,
        extra_body=GREEDY,  # type: ignore[arg-type]
    )
    tokenizer = server.engine.tokenizer
    rendered = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False)
    prompt = rendered[: rendered.rindex(prefill) + len(prefill)]
    completions = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    plain = completions.completions.create(
        model=MODEL_NAME,
        prompt=tokenizer.encode(prompt, add_special_tokens=False),
        max_tokens=6,
        temperature=0,
    )
    assert message.content[0].text == plain.choices[0].text  # type: ignore[union-attr]
    assert anthropic_prompt_tokens(message) == plain.usage.prompt_tokens  # type: ignore[union-attr]
    # vLLM's continue_final_message on a chat completion is the same prompt.
    chat = _chat(
        server,
        messages=turns,
        max_tokens=6,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]


def test_max_tokens_past_the_context_stops_at_its_end(client: anthropic.Anthropic) -> None:
    """max_tokens is a bound: where the context window (512 here) ends first, the answer
    stops there, as Anthropic's API does, instead of being refused."""
    with client.messages.stream(
        model=MODEL_NAME,
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=32_000,  # what Claude Code asks for
        extra_body={"ignore_eos": True},  # vLLM's extension, passed on to the chat path
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "model_context_window_exceeded"
    assert anthropic_prompt_tokens(message) + message.usage.output_tokens == 512


def test_max_tokens_zero_fills_the_prefix_cache(client: anthropic.Anthropic) -> None:
    system = "You are a careful assistant. " * 12  # a few blocks of 16 tokens
    request: dict[str, Any] = {"model": MODEL_NAME, "system": system, "messages": HELLO}
    warmed = client.messages.create(**request, max_tokens=0)
    assert warmed.content == [] and warmed.stop_reason == "max_tokens"
    assert warmed.usage.output_tokens == 0
    with client.messages.stream(**request, max_tokens=0) as stream:
        streamed = stream.get_final_message()
    assert streamed.content == [] and streamed.usage.output_tokens == 0
    after = client.messages.create(**request, max_tokens=1)
    assert after.usage.cache_read_input_tokens >= 16 * (anthropic_prompt_tokens(after) // 16) - 16
    assert after.usage.cache_read_input_tokens > 0


def test_api_key_in_anthropic_header(tiny_llama_dir: Path) -> None:
    settings = ServerSettings(served_model_names=[MODEL_NAME], api_key="s3cret")
    with running_server(tiny_llama_dir, settings) as running:
        good = anthropic.Anthropic(base_url=running.base_url, api_key="s3cret", max_retries=0)
        message = good.messages.create(model=MODEL_NAME, messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
        assert message.usage.output_tokens == 2
        bad = anthropic.Anthropic(base_url=running.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model=MODEL_NAME, messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
        body = caught.value.body
        assert isinstance(body, dict) and body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages.0.content.0.text",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
                        ],
                    },
                ]
            },
            "messages.1",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools.0.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.budget_tokens"),
        ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
        (
            {"context_management": {"edits": [{"type": "compact_20260112"}]}},
            "context_management.edits.0.type",
        ),
        (
            {
                "context_management": {
                    "edits": [
                        {
                            "type": "clear_tool_uses_20250919",
                            "keep": {"type": "tool_uses", "value": -1},
                        }
                    ]
                }
            },
            "context_management.edits.0.keep.value",
        ),
        (  # the edits run before the blocks are read: a bad one is still named
            {
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": [], "name": "f", "input": {}}],
                    },
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": []}]},
                ],
                "context_management": {
                    "edits": [
                        {
                            "type": "clear_tool_uses_20250919",
                            "trigger": {"type": "tool_uses", "value": 0},
                            "keep": {"type": "tool_uses", "value": 0},
                        }
                    ]
                },
            },
            "messages.1.content.0.id",
        ),
        ({"n": 2}, "n"),
        ({"stop_sequences": "STOP"}, "stop_sequences"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": "many"}, "top_k"),
    ],
)
def test_bad_requests_name_the_field(
    server: RunningServer, change: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 4, **change}
    body = {key: value for key, value in body.items() if value is not None}
    reply = httpx.post(f"{server.base_url}/v1/messages", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["param"] == param, error
    fine = {"model": MODEL_NAME, "messages": HELLO, "max_tokens": 1}
    assert httpx.post(f"{server.base_url}/v1/messages", json=fine).status_code == 200


def test_unknown_model_is_anthropic_not_found(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-opus-4", messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
    body = caught.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "not_found_error"
    assert body["error"]["param"] == "model"
