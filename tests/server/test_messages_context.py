"""What a long agent session sends the Messages API, through the official anthropic client's
beta surface: context editing (`context_management`: old tool results and thinking cleared
before the prompt is rendered, the edits reported), deferred tools that join the prompt once
a `tool_reference` names them, and a prompt past the context refused in Anthropic's words
(on which Claude Code compacts). Every count is checked against the prompt the edited
conversation renders to when sent as it is."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from iterserve.server.context_edits import CLEARED_RESULT
from server_fixtures import (
    MODEL_NAME,
    RunningServer,
    answer_tokens,
    anthropic_prompt_tokens,
    running_server,
    scripted_tokens,
    wait_until,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

CONTEXT_MANAGEMENT = "context-management-2025-06-27"
GREEDY = {"temperature": 0}
SEARCH = {
    "name": "search",
    "description": "Search the files",
    "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}},
}
DEPLOY = {
    "name": "deploy",
    "description": "Deploy the service to production",
    "input_schema": {"type": "object", "properties": {"target": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server(tools_llama_dir: Path) -> Iterator[RunningServer]:
    with running_server(tools_llama_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def _session(uses: int, result: str = "line one of a long listing, " * 6) -> list[dict[str, Any]]:
    """A user's question, then `uses` rounds of one search call (with thinking) and its result."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Find the config files."}]
    for i in range(uses):
        messages += [
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": f"Look in place {i}.", "signature": "s"},
                    {
                        "type": "tool_use",
                        "id": f"use{i}",
                        "name": "search",
                        "input": {"query": f"q{i}"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"use{i}", "content": f"{i}: {result}"}
                ],
            },
        ]
    return messages


def _cleared(
    messages: list[dict[str, Any]], ids: set[str], inputs: bool = False
) -> list[dict[str, Any]]:
    """`messages` as the edit should leave them: those uses' results (and inputs) cleared."""
    edited = []
    for message in messages:
        blocks = []
        for block in message["content"] if isinstance(message["content"], list) else []:
            if block["type"] == "tool_result" and block["tool_use_id"] in ids:
                block = {**block, "content": CLEARED_RESULT}
            elif block["type"] == "tool_use" and block["id"] in ids and inputs:
                block = {**block, "input": {}}
            blocks.append(block)
        edited.append({**message, "content": blocks or message["content"]})
    return edited


def _count(client: anthropic.Anthropic, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.beta.messages.count_tokens(
        model=MODEL_NAME,
        messages=messages,
        tools=[SEARCH],
        **extra,  # type: ignore[arg-type]
    )


def test_clear_tool_uses_keeps_the_last_and_reports_what_it_cleared(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    session = _session(4)
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "tool_uses", "value": 3},
        "keep": {"type": "tool_uses", "value": 1},
        "clear_tool_inputs": ["search"],
    }
    whole = _count(client, session).input_tokens
    expected = _count(client, _cleared(session, {"use0", "use1", "use2"}, inputs=True)).input_tokens
    assert expected < whole
    counted = _count(
        client, session, context_management={"edits": [edit]}, betas=[CONTEXT_MANAGEMENT]
    )
    assert counted.input_tokens == expected
    assert counted.context_management.original_input_tokens == whole  # type: ignore[union-attr]

    request = {
        "model": MODEL_NAME,
        "messages": session,
        "tools": [SEARCH],
        "max_tokens": 8,
        "context_management": {"edits": [edit]},
        "betas": [CONTEXT_MANAGEMENT],
    }
    with scripted_tokens(server, answer_tokens(server, "Found them.")):
        message = client.beta.messages.create(**request)
        with client.beta.messages.stream(**request) as stream:
            streamed = stream.get_final_message()
    assert anthropic_prompt_tokens(message) == expected
    applied = [edit.model_dump() for edit in message.context_management.applied_edits]  # type: ignore[union-attr]
    assert applied == [
        {
            "type": "clear_tool_uses_20250919",
            "cleared_tool_uses": 3,
            "cleared_input_tokens": whole - expected,
        }
    ]
    assert [e.model_dump() for e in streamed.context_management.applied_edits] == applied  # type: ignore[union-attr]
    assert message.content[0].text == streamed.content[0].text == "Found them."  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("edit", "cleared"),
    [
        # Under its trigger (four tool uses are far from 100,000 tokens): nothing.
        ({"type": "clear_tool_uses_20250919"}, set()),
        # Triggered, but clearing would save fewer tokens than asked: nothing.
        (
            {
                "type": "clear_tool_uses_20250919",
                "trigger": {"type": "input_tokens", "value": 10},
                "clear_at_least": {"type": "input_tokens", "value": 100_000},
            },
            set(),
        ),
        # Triggered by tokens, keeping the default 3: the first use; `search` excluded: none.
        (
            {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 10}},
            {"use0"},
        ),
        (
            {
                "type": "clear_tool_uses_20250919",
                "trigger": {"type": "input_tokens", "value": 10},
                "exclude_tools": ["search"],
            },
            set(),
        ),
    ],
)
def test_clear_tool_uses_trigger_threshold_and_exclusions(
    client: anthropic.Anthropic, edit: dict[str, Any], cleared: set[str]
) -> None:
    session = _session(4)
    counted = _count(
        client, session, context_management={"edits": [edit]}, betas=[CONTEXT_MANAGEMENT]
    )
    assert counted.input_tokens == _count(client, _cleared(session, cleared)).input_tokens


def test_clear_thinking_keeps_the_last_turns(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    """Claude Code sends `keep: "all"` with every request: nothing is cleared, and the answer
    says so. Keeping one turn clears the others' thinking; this template shows none of it,
    so the turns are cleared and no tokens with them."""
    session = _session(3)
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    message = client.beta.messages.create(
        model=MODEL_NAME,
        messages=session,  # type: ignore[arg-type]
        max_tokens=1,
        tools=[SEARCH],  # type: ignore[list-item]
        context_management=keep_all,  # type: ignore[arg-type]
        betas=[CONTEXT_MANAGEMENT],
    )
    assert message.context_management is not None
    assert message.context_management.applied_edits == []
    keep_one = {"edits": [{"type": "clear_thinking_20251015"}]}
    reply = httpx.post(
        f"{server.base_url}/v1/messages",
        json={"model": MODEL_NAME, "messages": session, "tools": [SEARCH], "max_tokens": 1,
              "context_management": keep_one},
    )  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert reply.json()["context_management"]["applied_edits"] == [
        {"type": "clear_thinking_20251015", "cleared_thinking_turns": 2, "cleared_input_tokens": 0}
    ]


def test_deferred_tool_joins_the_prompt_once_referenced(client: anthropic.Anthropic) -> None:
    question = [{"role": "user", "content": "Ship it."}]
    deferred = {**DEPLOY, "defer_loading": True}
    without = client.messages.count_tokens(model=MODEL_NAME, messages=question, tools=[SEARCH])  # type: ignore[arg-type, list-item]
    hidden = client.messages.count_tokens(
        model=MODEL_NAME, messages=question, tools=[SEARCH, deferred]
    )  # type: ignore[arg-type, list-item]
    assert hidden.input_tokens == without.input_tokens

    found = [
        *question,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "s1", "name": "search", "input": {"query": "deploy"}}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "s1",
                 "content": [{"type": "tool_reference", "tool_name": "deploy"}]},
            ],
        },
    ]  # fmt: skip
    shown = [
        {**found[-1], "content": [{**found[-1]["content"][0], "content": "Tool loaded: deploy"}]}
    ]
    loaded = client.messages.count_tokens(
        model=MODEL_NAME, messages=found, tools=[SEARCH, deferred]
    )  # type: ignore[arg-type, list-item]
    plain = client.messages.count_tokens(
        model=MODEL_NAME, messages=[*found[:2], *shown], tools=[SEARCH, DEPLOY]
    )  # type: ignore[arg-type, list-item]
    assert loaded.input_tokens == plain.input_tokens > hidden.input_tokens

    with pytest.raises(anthropic.BadRequestError) as caught:
        unknown = [
            *found[:2],
            {
                **found[2],
                "content": [
                    {
                        **found[2]["content"][0],
                        "content": [{"type": "tool_reference", "tool_name": "nope"}],
                    }
                ],
            },
        ]
        client.messages.count_tokens(model=MODEL_NAME, messages=unknown, tools=[SEARCH, deferred])  # type: ignore[arg-type, list-item]
    assert caught.value.body["error"]["param"] == "messages.2.content.0.content.0.tool_name"  # type: ignore[index]


def test_prompt_past_the_context_is_too_long_in_anthropic_words(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    long = [{"role": "user", "content": "word " * 600}]
    tokens = client.messages.count_tokens(model=MODEL_NAME, messages=long).input_tokens  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_NAME, messages=long, max_tokens=100)  # type: ignore[arg-type]
    error = caught.value.body["error"]  # type: ignore[index]
    assert error["message"] == f"prompt is too long: {tokens} tokens > 511 maximum"
    assert error["param"] == "messages"
    # OpenAI's route: OpenAI's code and wording.
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        chat.chat.completions.create(model=MODEL_NAME, messages=long, max_tokens=4)  # type: ignore[arg-type]
    assert refused.value.code == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in refused.value.message


def test_what_claude_code_sends_runs_on_a_model_that_does_not_think(
    client: anthropic.Anthropic,
) -> None:
    """Claude Code's request fields (v2.1.332, whatever the model): adaptive thinking with
    its display omitted, an effort, thinking kept, metadata, system blocks with cache
    breakpoints. On a model that does not think they change nothing: the same prompt."""
    system = [
        {"type": "text", "text": "You are a coding agent."},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
    ]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]
    plain = client.messages.create(
        model=MODEL_NAME,
        system=system,
        messages=messages,
        max_tokens=4,
        tools=[SEARCH],
        extra_body=GREEDY,  # type: ignore[arg-type, list-item]
    )
    agent = client.beta.messages.create(
        model=MODEL_NAME,
        system=system,  # type: ignore[arg-type]
        messages=messages,  # type: ignore[arg-type]
        max_tokens=32_000,
        stream=True,
        tools=[SEARCH],  # type: ignore[list-item]
        thinking={"type": "adaptive", "display": "omitted"},  # type: ignore[typeddict-item]
        output_config={"effort": "high"},  # type: ignore[typeddict-item]
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        metadata={"user_id": '{"device_id": "d", "session_id": "s"}'},
        betas=["claude-code-20250219", "interleaved-thinking-2025-05-14", CONTEXT_MANAGEMENT],
        extra_body=GREEDY,
    )
    events = list(agent)
    start, delta = events[0], events[-2]
    assert start.type == "message_start" and delta.type == "message_delta"
    assert anthropic_prompt_tokens(start.message) == anthropic_prompt_tokens(plain)
    assert delta.context_management.applied_edits == []  # type: ignore[union-attr]
    with pytest.raises(anthropic.BadRequestError) as caught:  # thinking asked for outright
        client.messages.create(
            model=MODEL_NAME, messages=messages, max_tokens=4,  # type: ignore[arg-type]
            thinking={"type": "enabled", "budget_tokens": 1024},
        )  # fmt: skip
    assert caught.value.body["error"]["param"] == "thinking"  # type: ignore[index]


def test_a_system_instruction_mid_conversation_is_a_system_message_there(
    client: anthropic.Anthropic, server: RunningServer
) -> None:
    """Anthropic's `system` entries among the messages (Claude Code's first request has one
    after the user's): this template writes system messages anywhere, so it is one there."""
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "From now on, answer in French."},
        {"role": "user", "content": "How are you?"},
    ]
    counted = client.messages.count_tokens(model=MODEL_NAME, system="Be brief.", messages=turns)  # type: ignore[arg-type]
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    answer = chat.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": "Be brief."}, *turns],  # type: ignore[list-item]
        max_tokens=1,
    )
    assert answer.usage is not None and counted.input_tokens == answer.usage.prompt_tokens
    message = client.messages.create(
        model=MODEL_NAME,
        system="Be brief.",
        messages=turns,
        max_tokens=1,  # type: ignore[arg-type]
    )
    assert anthropic_prompt_tokens(message) == answer.usage.prompt_tokens


def test_pings_keep_a_slow_stream_alive_and_change_nothing(
    client: anthropic.Anthropic, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While nothing else is sent (a long prefill: here, any gap of half a millisecond),
    the stream sends Anthropic's `ping`, message_start first; the SDK builds the same
    message from it, and message_delta brings the usage message_start could not know."""
    from iterserve.server import serving

    request = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "The quick brown fox. " * 40}],
               "max_tokens": 12, "temperature": 0, "stream": True}  # fmt: skip
    sdk = {k: v for k, v in request.items() if k not in ("stream", "temperature")}
    whole = client.messages.create(**sdk, extra_body=GREEDY)  # type: ignore[arg-type]
    monkeypatch.setattr(serving, "KEEP_ALIVE_AFTER", 0.0005)
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json=request) as reply:
        kinds = [line[7:] for line in reply.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and "ping" in kinds and kinds[-1] == "message_stop"
    with client.messages.stream(**sdk, extra_body=GREEDY) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    assert [block.model_dump(include={"type", "text"}) for block in streamed.content] == [
        block.model_dump(include={"type", "text"}) for block in whole.content
    ]
    assert streamed.stop_reason == whole.stop_reason
    assert anthropic_prompt_tokens(streamed) == anthropic_prompt_tokens(whole)
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_a_client_that_leaves_a_pinged_stream_frees_its_blocks(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from iterserve.server import serving

    monkeypatch.setattr(serving, "KEEP_ALIVE_AFTER", 0.0005)
    aborted = server.metrics().get("iterserve:requests_aborted_total", 0.0)
    request = {"model": MODEL_NAME, "max_tokens": 300, "stream": True,
               "messages": [{"role": "user", "content": "Tell a long story."}],
               "ignore_eos": True}  # fmt: skip

    async def leave_after(events: int) -> None:
        async with (
            httpx.AsyncClient(base_url=server.base_url) as http,
            http.stream("POST", "/v1/messages", json=request) as reply,
        ):
            seen = 0
            async for line in reply.aiter_lines():
                seen += line.startswith("event: ")
                if seen >= events:
                    break  # the connection closes with the block

    async def main() -> None:
        await asyncio.gather(*(leave_after(n) for n in (1, 3, 8)))

    asyncio.run(main())

    def drained() -> bool:
        m = server.metrics()
        return (
            m["iterserve:kv_cache_used_blocks"] == 0
            and m["iterserve:requests_aborted_total"] - aborted == 3
        )

    assert wait_until(drained, timeout=10), server.metrics()
