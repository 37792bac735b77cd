"""Requests that real agent frameworks send and that this server once refused, reproduced
with the official openai client against a real server (the frameworks themselves run in
benchmarks/agent_frameworks/, docs/agent_frameworks.md). The tiny Llama carries Qwen 2.5's
tool-calling template; constrained decoding makes its calls whatever the random model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from iterserve.chat.tool_parsers.hermes import HermesToolParser
from iterserve.chat.tool_protocol import NamedToolChoice, ToolDefinition
from iterserve.chat.tools import plan_tools
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.structured_output import StructuredOutput
from server_fixtures import (
    MODEL_NAME,
    QWEN_TOOLS_TEMPLATE,
    RunningServer,
    running_server,
)

pytestmark = pytest.mark.timeout(180)

# instructor's schema of `class CityInfo(BaseModel): city: str; country: str` in its
# RESPONSES_TOOLS mode, with the strings bounded: a random tiny model would not end an
# open-ended string before max_tokens.
CITY_INFO: dict[str, Any] = {
    "description": "A city and the country it is in.",
    "properties": {
        "city": {"description": "the city's name", "title": "City", "type": "string",
                 "maxLength": 12},
        "country": {"description": "the country the city is in", "title": "Country",
                    "type": "string", "maxLength": 12},
    },
    "required": ["city", "country"],
    "title": "CityInfo",
    "type": "object",
    "additionalProperties": False,
}  # fmt: skip
PROMPT = "Paris is the capital of France. Extract the city and its country."


@pytest.fixture(scope="module")
def server(tools_llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(tools_llama_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_instructor_responses_tools_request_gets_the_forced_call(client: openai.OpenAI) -> None:
    """instructor's Mode.RESPONSES_TOOLS sends the output schema twice: as the text
    format and as the one tool, forced. The answer is the call (it was a 400)."""
    jsonschema = pytest.importorskip("jsonschema")
    response = client.responses.create(
        model=MODEL_NAME,
        input=[{"role": "user", "content": PROMPT}],
        max_output_tokens=60,
        temperature=0.0,
        text={
            "format": {
                "type": "json_schema",
                "name": "CityInfo",
                "strict": True,
                "schema": CITY_INFO,
            }
        },  # fmt: skip
        tool_choice={"type": "function", "name": "CityInfo"},
        tools=[
            {
                "type": "function",
                "name": "CityInfo",
                "parameters": CITY_INFO,
                "strict": True,
                "description": "A city and the country it is in.",
            }
        ],  # fmt: skip
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["CityInfo"]
    jsonschema.validate(json.loads(calls[0].arguments), CITY_INFO)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"  # the request's settings, repeated


def test_chat_response_format_beside_a_forced_call_gets_the_call(client: openai.OpenAI) -> None:
    """The same on chat completions: `response_format` and a named `tool_choice`."""
    jsonschema = pytest.importorskip("jsonschema")
    tool = {"type": "function", "function": {"name": "CityInfo", "parameters": CITY_INFO}}
    for stream in (False, True):
        request: dict[str, Any] = dict(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=60,
            temperature=0.0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "CityInfo", "schema": CITY_INFO, "strict": True},
            },
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "CityInfo"}},
        )
        if stream:
            chunks = list(client.chat.completions.create(**request, stream=True))
            arguments = "".join(
                call.function.arguments or ""
                for chunk in chunks
                if chunk.choices
                for call in chunk.choices[0].delta.tool_calls or []
                if call.function is not None
            )
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            answer = client.chat.completions.create(**request)
            calls = answer.choices[0].message.tool_calls or []
            assert [call.function.name for call in calls] == ["CityInfo"]  # type: ignore[union-attr]
            arguments = calls[0].function.arguments  # type: ignore[union-attr]
            finish = answer.choices[0].finish_reason
        assert finish == "tool_calls"
        jsonschema.validate(json.loads(arguments), CITY_INFO)


def test_a_guided_field_beside_a_forced_call_is_still_a_400(server: RunningServer) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": PROMPT}],
        "tools": [{"type": "function", "function": {"name": "CityInfo", "parameters": CITY_INFO}}],
        "tool_choice": "required",
        "guided_json": CITY_INFO,
    }
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tool_choice"


@pytest.mark.parametrize("choice", ["required", "named"])
def test_the_forced_call_replaces_a_response_format_constraint(choice: str) -> None:
    tools = [
        ToolDefinition.model_validate({"function": {"name": "CityInfo", "parameters": CITY_INFO}})
    ]
    tool_choice = (
        "required" if choice == "required"
        else NamedToolChoice.model_validate({"function": {"name": "CityInfo"}})
    )  # fmt: skip
    params = SamplingParams(
        structured_output=StructuredOutput.from_json_schema(CITY_INFO, "response_format")
    )
    plan_tools(tools, tool_choice, True, QWEN_TOOLS_TEMPLATE, HermesToolParser(), params, set())
    assert params.structured_output is not None
    assert params.structured_output.param == "tool_choice"
    guided = SamplingParams(
        structured_output=StructuredOutput.from_json_schema(CITY_INFO, "guided_json")
    )
    with pytest.raises(InvalidRequestError) as refused:
        plan_tools(tools, tool_choice, True, QWEN_TOOLS_TEMPLATE, HermesToolParser(), guided, set())
    assert refused.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("conversation", "conv_123", openai.NotFoundError),
        ("conversation", {"id": "conv_123"}, openai.NotFoundError),
        ("prompt", {"id": "pmpt_1"}, openai.BadRequestError),
    ],
)
def test_objects_this_server_does_not_keep_are_refused_by_name(
    client: openai.OpenAI, field: str, value: Any, error: type[openai.APIStatusError]
) -> None:
    """The OpenAI Agents SDK sends `conversation` when a run is given a conversation_id:
    one this server does not keep is a 404 naming it (tests/server/test_conversations.py
    has those it keeps); a stored prompt, which it never keeps, a 400. Ignored, the answer
    would silently lack them."""
    with pytest.raises(error) as refused:
        client.responses.create(
            model=MODEL_NAME, input="Hi", max_output_tokens=4, extra_body={field: value}
        )
    assert refused.value.body["param"] == field  # type: ignore[index]
