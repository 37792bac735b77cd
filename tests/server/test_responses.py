"""POST /v1/responses through the official openai client against a real server: the same
answer as the equivalent chat completion, streamed events that rebuild it, the output
text's logprobs as chat's, a tool loop with function calls and their outputs sent back as
input items, a text format enforced, and bad requests refused naming the Responses field.
The tiny Llama carries Qwen 2.5's tool-calling template; tool-call answers are scripted
(a random model writes none)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from iterserve.server import serving
from server_fixtures import (
    MODEL_NAME,
    TWO_WEATHER_CALLS,
    RunningServer,
    answer_tokens,
    running_server,
    scripted_tokens,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(tools_llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(tools_llama_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_answer_is_the_equivalent_chat_completion(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL_NAME,
        instructions="Answer briefly.",
        input="Name a colour.",
        max_output_tokens=6,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a colour."},
        ],
        max_completion_tokens=6,
        temperature=0,
    )
    choice = chat.choices[0]
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == choice.message.content
    assert [item.type for item in response.output] == ["message"]
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 6
    assert choice.finish_reason == "length"
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("keep_alive", [None, 0.0005])
def test_streamed_events_rebuild_the_response(
    client: openai.OpenAI, keep_alive: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also with SSE keep-alive comments between the events (every half millisecond
    without one): the SDK skips them."""
    if keep_alive is not None:
        monkeypatch.setattr(serving, "KEEP_ALIVE_AFTER", keep_alive)
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
        "max_output_tokens": 8,
        "temperature": 0,
    }
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    # Every item added is done, in output order, with its final content.
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == list(range(len(final.output)))


def test_logprobs_are_the_chat_completions(client: openai.OpenAI) -> None:
    """include=["message.output_text.logprobs"]: the output text's token logprobs, as the
    same chat completion gives them; streamed, each delta carries its tokens'."""
    request: dict[str, Any] = {
        "model": MODEL_NAME,
        "input": "Name a colour.",
        "max_output_tokens": 6,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    response = client.responses.create(**request)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_completion_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    expected = chat.choices[0].logprobs
    assert expected is not None and expected.content is not None

    def rows(logprobs: Any) -> list[tuple[str, float, list[str]]]:
        return [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in logprobs]

    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert [row[::2] for row in rows(part.logprobs)] == [row[::2] for row in rows(expected.content)]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx(
        [lp.logprob for lp in expected.content], abs=1e-4
    )
    assert response.usage is not None and len(part.logprobs) == response.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    events = list(client.responses.create(**request, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1
    assert rows(streamed) == rows(done[0].logprobs) == rows(part.logprobs)
    # Without the logprobs include, none are computed or sent. A stateless client's
    # include of reasoning content (there is none to add) changes nothing.
    plain = client.responses.create(
        **{k: v for k, v in request.items() if k not in ("include", "top_logprobs")},
        include=["reasoning.encrypted_content"],
    )
    assert [item.type for item in plain.output] == ["message"]
    assert plain.output_text == response.output_text
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


def test_tool_loop_with_function_call_items(client: openai.OpenAI, server: RunningServer) -> None:
    question = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
    with scripted_tokens(server, answer_tokens(server, TWO_WEATHER_CALLS)):
        response = client.responses.create(
            model=MODEL_NAME, input=question, tools=[WEATHER], max_output_tokens=200
        )
        events = list(
            client.responses.create(
                model=MODEL_NAME,
                input=question,
                tools=[WEATHER],
                max_output_tokens=200,
                stream=True,
            )
        )
    assert response.status == "completed"
    assert [tool.name for tool in response.tools] == ["get_weather"]  # type: ignore[union-attr]
    assert response.tool_choice == "auto"
    assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
    assert response.output_text == "I'll check."
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Lyon"}),
    ]
    assert all(c.call_id.startswith("call_") for c in calls)
    streamed = events[-1].response  # type: ignore[union-attr]
    assert [(i.type, getattr(i, "arguments", None)) for i in streamed.output] == [
        (i.type, getattr(i, "arguments", None)) for i in response.output
    ]
    arguments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert arguments == [c.arguments for c in calls]

    # The calls and their outputs go back as input items, as an agent loop sends them; the
    # prompt is the one the same history renders to as a chat.
    history: list[Any] = [*question, *response.output]
    history += [
        {"type": "function_call_output", "call_id": c.call_id, "output": f"{i} C"}
        for i, c in enumerate(calls)
    ]
    with scripted_tokens(server, answer_tokens(server, "Sunny.")):
        final = client.responses.create(
            model=MODEL_NAME, input=history, tools=[WEATHER], max_output_tokens=20
        )
        chat = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[
                *question,
                {
                    "role": "assistant",
                    "content": "I'll check.",
                    "tool_calls": [
                        {
                            "id": c.call_id,
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                        }
                        for c in calls
                    ],
                },
                *[
                    {"role": "tool", "tool_call_id": c.call_id, "content": f"{i} C"}
                    for i, c in enumerate(calls)
                ],
            ],
            tools=[
                {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
            ],
            max_tokens=20,
        )
    assert final.output_text == "Sunny." and final.status == "completed"
    assert final.usage is not None and chat.usage is not None
    assert final.usage.input_tokens == chat.usage.prompt_tokens


def test_text_format_json_schema_is_enforced(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL_NAME,
        input="Is it ok?",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        max_output_tokens=40,
    )
    assert response.status == "completed"
    assert json.loads(response.output_text)["ok"] in (True, False)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"  # the request's settings, repeated


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "image", "url": "x"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0.call_id"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"top_k": "many"}, "top_k"),
        ({"include": ["message.output_text.tokens"]}, "include"),
        ({"top_logprobs": 1000}, "top_logprobs"),
    ],
)
def test_bad_requests_name_the_responses_field(
    server: RunningServer, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL_NAME, "input": "Hi", **extra}
    reply = httpx.post(f"{server.base_url}/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
