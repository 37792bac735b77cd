"""gpt-oss through a real server and the official openai client: its Harmony answer split
into `reasoning_content`, `content` and `tool_calls` (Responses: reasoning, message and
function_call items), streamed and not; its turn's two end tokens kept out of the text;
a tool loop sent back as an agent sends it; structured output and forced calls constrained
after the final message's header only; `reasoning_effort` as its template takes it.

A tiny random gpt-oss with Harmony's special tokens and gpt-oss's real chat template
(tests/thinking_models.py). A random model writes no Harmony, so each answer's first
tokens are forced where the sampler draws (after the grammar's mask, which may refuse
them: the tests check it did not); what follows a forced prefix under a grammar is the
model's own, masked, greedy draw.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from test_reasoning import (
    HI,
    RESPONSE_FORMAT,
    SCHEMA,
    WEATHER_TOOL,
    _chat,
    _client,
    _message,
    _reassembled,
)

from server_fixtures import MODEL_NAME, RunningServer, running_server
from thinking_models import forced_tokens, gpt_oss_checkpoint, ids

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

THOUGHT = "The user greets me, so I greet back."
ANSWER = "Hello there!"
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
PARIS = ("get_weather", json.dumps({"city": "Paris"}))
# The call and the tool as the template gets them (arguments as an object; a description).
TEMPLATE_CALL = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
TEMPLATE_TOOLS = [{**WEATHER_TOOL, "function": {"description": "", **WEATHER_TOOL["function"]}}]


@pytest.fixture(scope="module")
def gpt_oss(
    tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    checkpoint = gpt_oss_checkpoint(tokenizer_dir, tmp_path_factory.mktemp("tiny-gpt-oss"))
    with running_server(checkpoint) as running:
        yield running


def _script(server: RunningServer, text: str, end: str | None) -> list[int]:
    """`text`'s tokens, then the end token that stops the turn."""
    tokenizer = server.engine.tokenizer
    ending = [] if end is None else [tokenizer.convert_tokens_to_ids(end)]
    return [*ids(tokenizer, text), *ending]


def _prompt_tokens(server: RunningServer, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    tokenizer = server.engine.tokenizer
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_the_answer_is_split_by_channel(gpt_oss: RunningServer) -> None:
    script = _script(gpt_oss, ANALYSIS + FINAL + ANSWER, "<|return|>")
    with forced_tokens(gpt_oss.engine, script) as refused:
        whole, chunks = _chat(gpt_oss)
    assert not refused
    assert _message(whole) == (THOUGHT, ANSWER, [], "stop")
    assert _reassembled(chunks) == _message(whole)
    thinking_tokens = len(ids(gpt_oss.engine.tokenizer, ANALYSIS))  # through its <|end|>
    assert whole.usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    assert whole.usage.completion_tokens == len(script)  # the end token counts, unshown
    with forced_tokens(gpt_oss.engine, _script(gpt_oss, "Hi<|end|>", "<|return|>")):
        raw = _client(gpt_oss).completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=80, extra_body={"skip_special_tokens": False}
        )
    assert raw.choices[0].text == "Hi<|end|>"  # special tokens shown, but not the stop token


def test_a_tool_loop(gpt_oss: RunningServer) -> None:
    """A preamble and the call, then the conversation sent back as the openai client
    builds it: the template gets the thinking and the call (it has no place for the
    preamble beside the thinking), then the tool's result."""
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    script = _script(gpt_oss, ANALYSIS + preamble + CALL, "<|call|>")
    with forced_tokens(gpt_oss.engine, script):
        whole, chunks = _chat(gpt_oss, tools=[WEATHER_TOOL])
    assert _message(whole) == (THOUGHT, "Checking.", [PARIS], "tool_calls")
    assert _reassembled(chunks) == _message(whole)

    message = whole.choices[0].message
    call = message.tool_calls[0]
    sent_back = [
        *HI,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    with forced_tokens(gpt_oss.engine, _script(gpt_oss, FINAL + "Sunny.", "<|return|>")):
        again = _client(gpt_oss).chat.completions.create(
            model=MODEL_NAME, messages=sent_back, tools=[WEATHER_TOOL], max_tokens=20
        )
    assert again.choices[0].message.content == "Sunny."
    rendered = [
        *HI,
        {"role": "assistant", "thinking": THOUGHT, "tool_calls": [TEMPLATE_CALL]},
        {"role": "tool", "content": "18 C"},
    ]
    assert again.usage is not None
    assert again.usage.prompt_tokens == _prompt_tokens(gpt_oss, rendered, tools=TEMPLATE_TOOLS)


def test_structured_output_starts_after_the_final_header(gpt_oss: RunningServer) -> None:
    with forced_tokens(gpt_oss.engine, _script(gpt_oss, ANALYSIS + FINAL, None)) as refused:
        whole, chunks = _chat(gpt_oss, response_format=RESPONSE_FORMAT, temperature=0.0)
    assert not refused
    reasoning, content, calls, finish = _message(whole)
    assert (reasoning, calls, finish) == (THOUGHT, [], "stop")
    jsonschema.validate(json.loads(content or ""), SCHEMA)
    assert _reassembled(chunks) == _message(whole)


def test_a_forced_call_is_made_after_the_thinking(gpt_oss: RunningServer) -> None:
    with forced_tokens(gpt_oss.engine, _script(gpt_oss, ANALYSIS + FINAL, None)) as refused:
        whole, chunks = _chat(
            gpt_oss,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0.0,
        )
    assert not refused
    reasoning, content, calls, finish = _message(whole)
    assert (reasoning, content, finish) == (THOUGHT, None, "tool_calls")
    assert [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), WEATHER_TOOL["function"]["parameters"])
    assert _reassembled(chunks) == _message(whole)
    # gpt-oss may call in its own format instead of reaching the final message.
    with forced_tokens(gpt_oss.engine, _script(gpt_oss, ANALYSIS + CALL, "<|call|>")):
        whole, _ = _chat(gpt_oss, tools=[WEATHER_TOOL], tool_choice="required")
    assert _message(whole) == (THOUGHT, None, [PARIS], "tool_calls")


def test_effort_is_the_templates_reasoning_level(gpt_oss: RunningServer) -> None:
    client = _client(gpt_oss)
    for effort in ("low", "high"):
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=HI, max_tokens=1, reasoning_effort=effort
        )
        expected = _prompt_tokens(gpt_oss, HI, reasoning_effort=effort)
        assert answer.usage is not None and answer.usage.prompt_tokens == expected
    for effort in ("none", "minimal"):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(
                model=MODEL_NAME, messages=HI, max_tokens=1, reasoning_effort=effort
            )
        assert error.value.body["param"] == "reasoning_effort"  # type: ignore[index]
    response = client.responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=1, reasoning={"effort": "high"}
    )
    assert response.usage is not None
    assert response.usage.input_tokens == _prompt_tokens(gpt_oss, HI, reasoning_effort="high")


def test_responses_items(gpt_oss: RunningServer) -> None:
    client = _client(gpt_oss)
    with forced_tokens(gpt_oss.engine, _script(gpt_oss, ANALYSIS + CALL, "<|call|>")):
        response = client.responses.create(
            model=MODEL_NAME,
            input="Weather in Paris?",
            tools=[{"type": "function", **WEATHER_TOOL["function"]}],
            max_output_tokens=80,
        )
    reasoning, call = response.output
    assert reasoning.type == "reasoning"
    assert [part.text for part in reasoning.content or []] == [THOUGHT]
    assert call.type == "function_call" and (call.name, call.arguments) == PARIS

    # An agent sends the output back with the call's result: the template shows the thinking
    # before the call, as gpt-oss wrote it within this turn.
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in response.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
    ]
    with forced_tokens(gpt_oss.engine, _script(gpt_oss, FINAL + "Sunny.", "<|return|>")):
        again = client.responses.create(
            model=MODEL_NAME,
            input=history,
            tools=[{"type": "function", **WEATHER_TOOL["function"]}],
            max_output_tokens=20,
        )
    assert again.output_text == "Sunny."
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": THOUGHT, "tool_calls": [TEMPLATE_CALL]},
        {"role": "tool", "content": "18 C"},
    ]
    expected = _prompt_tokens(gpt_oss, chat, tools=TEMPLATE_TOOLS)
    assert again.usage is not None and again.usage.input_tokens == expected
