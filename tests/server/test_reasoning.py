"""Thinking models through a real server and the official openai client: the thinking in
`reasoning_content` (Responses: a reasoning item), the answer in `content`, streamed and
not; tool calls and structured output read and constrained after the thinking only;
the templates' thinking switch (`chat_template_kwargs`, `reasoning_effort`,
`reasoning.effort`); and `LLM.chat` offline.

Tiny random Qwen3 and DeepSeek-R1-distill (Qwen2) models with their families' real chat
templates and `<think>`/`</think>` as single tokens (tests/thinking_models.py). A random
model writes no thinking, so each answer's first tokens are forced where the sampler draws
(after the grammar's mask, which may refuse them: the tests check it did not, or did);
what follows a forced prefix under a grammar is the model's own, masked, greedy draw.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from iterserve import LLM, SamplingParams
from iterserve.server.app import ServerSettings
from iterserve.structured_output import StructuredOutput
from server_fixtures import MODEL_NAME, RunningServer, reassembled, running_server
from thinking_models import (
    CLOSE,
    OPEN,
    QWEN3_TEMPLATE,
    R1_TEMPLATE,
    forced_tokens,
    ids,
    thinking_answer,
    thinking_checkpoint,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

HI = [{"role": "user", "content": "Hi"}]
THOUGHT = "The user greets me, so I greet back."
ANSWER = "Hello there!"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def r1_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_checkpoint(tokenizer_dir, tmp_path_factory.mktemp("tiny-r1"), "deepseek_r1")


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> Iterator[RunningServer]:
    with running_server(qwen3_dir) as running:
        yield running


@pytest.fixture(scope="module")
def r1(r1_dir: Path) -> Iterator[RunningServer]:
    with running_server(r1_dir) as running:
        yield running


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _chat(server: RunningServer, **request: Any) -> tuple[Any, list[Any]]:
    """The answer to `request`, whole and streamed (with usage)."""
    client = _client(server)
    request = {"model": MODEL_NAME, "messages": HI, "max_tokens": 80, **request}
    whole = client.chat.completions.create(**request)
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    return whole, chunks


def _reassembled(chunks: list[Any]) -> tuple[str | None, str | None, list[Any], str | None]:
    """Reasoning, content, calls (name, arguments) and finish reason as a client builds
    them from a stream; the thinking must all come before the answer."""
    reasoning, answered = "", False
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        more_reasoning = getattr(delta, "reasoning_content", None) or ""
        assert not (more_reasoning and answered), "thinking after the answer began"
        reasoning += more_reasoning
        answered = answered or bool(delta.content or delta.tool_calls)
    content, calls, finish = reassembled(chunks)
    return reasoning or None, content or None, calls, finish


def _message(whole: Any) -> tuple[str | None, str | None, list[Any], str | None]:
    choice = whole.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    reasoning = getattr(choice.message, "reasoning_content", None)
    return reasoning, choice.message.content, calls, choice.finish_reason


def _prompt_length(server: RunningServer, **template_kwargs: Any) -> int:
    tokenizer = server.engine.tokenizer
    text = tokenizer.apply_chat_template(
        HI, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---- the thinking and the answer ----------------------------------------------------------


def test_r1_answers_start_inside_the_thinking(r1: RunningServer) -> None:
    tokenizer = r1.engine.tokenizer
    script = thinking_answer(tokenizer, THOUGHT, "\n\n" + ANSWER, opened=True)
    with forced_tokens(r1.engine, script) as refused:
        whole, chunks = _chat(r1)
    assert not refused
    assert _message(whole) == (THOUGHT, ANSWER, [], "stop")
    assert _reassembled(chunks) == _message(whole)
    thinking_tokens = len(ids(tokenizer, THOUGHT)) + 1  # and the end marker
    assert whole.usage.completion_tokens_details.reasoning_tokens == thinking_tokens
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking_tokens


def test_qwen3_opens_its_thinking_or_answers_at_once(qwen3: RunningServer) -> None:
    tokenizer = qwen3.engine.tokenizer
    thinking = thinking_answer(tokenizer, "\n" + THOUGHT + "\n", "\n\n" + ANSWER)
    with forced_tokens(qwen3.engine, thinking):
        whole, chunks = _chat(qwen3)
    assert _message(whole) == (THOUGHT, ANSWER, [], "stop")
    assert _reassembled(chunks) == _message(whole)
    with forced_tokens(qwen3.engine, [*ids(tokenizer, ANSWER), tokenizer.eos_token_id]):
        whole, chunks = _chat(qwen3)
        raw = httpx.post(
            f"{qwen3.base_url}/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": HI, "max_tokens": 20},
        ).json()
    assert _message(whole) == (None, ANSWER, [], "stop")
    assert _reassembled(chunks) == _message(whole)
    assert "reasoning_content" not in raw["choices"][0]["message"]  # no thinking: no field
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0


def test_thinking_cut_by_max_tokens_is_all_reasoning(r1: RunningServer) -> None:
    tokenizer = r1.engine.tokenizer
    script = ids(tokenizer, "Let me think about this for a very long while indeed.")
    with forced_tokens(r1.engine, script):
        whole, chunks = _chat(r1, max_tokens=6)
    expected = tokenizer.decode(script[:6]).strip()
    assert _message(whole) == (expected, None, [], "length")
    assert _reassembled(chunks) == _message(whole)
    assert whole.usage.completion_tokens_details.reasoning_tokens == 6


# ---- the thinking switch -------------------------------------------------------------------


def test_the_thinking_switch_reaches_the_real_template(qwen3: RunningServer) -> None:
    """`enable_thinking: false` renders Qwen3's empty thinking block into the prompt, and
    the answer is then all content, even one that writes the markers."""
    off, on = _prompt_length(qwen3, enable_thinking=False), _prompt_length(qwen3)
    assert off == on + len(ids(qwen3.engine.tokenizer, "<think>\n\n</think>\n\n"))
    client = _client(qwen3)
    tokenizer = qwen3.engine.tokenizer
    written = [*ids(tokenizer, f"{OPEN}x{CLOSE}y"), tokenizer.eos_token_id]
    with forced_tokens(qwen3.engine, written):
        whole, chunks = _chat(
            qwen3, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
    assert whole.usage.prompt_tokens == off
    assert _message(whole) == (None, f"{OPEN}x{CLOSE}y", [], "stop")
    assert _reassembled(chunks) == _message(whole)
    for effort, length in (("none", off), ("minimal", off), ("low", on), ("high", on)):
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=HI, max_tokens=1, reasoning_effort=effort
        )
        assert answer.usage is not None and answer.usage.prompt_tokens == length, effort
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=HI,
            max_tokens=1,
            reasoning_effort="none",
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
    assert error.value.body["param"] == "reasoning_effort"  # type: ignore[index]


def test_the_servers_default_template_kwargs_yield_to_a_requests_own(qwen3_dir: Path) -> None:
    """`--default-chat-template-kwargs '{"enable_thinking": false}'`: a chat that names no
    switch renders without thinking (and /tokenize as chat does); a request's own
    chat_template_kwargs or reasoning_effort sets it still, and only its own kwargs can
    contradict its effort."""
    settings = ServerSettings(
        served_model_names=[MODEL_NAME], default_chat_template_kwargs={"enable_thinking": False}
    )
    with running_server(qwen3_dir, settings) as server:
        off, on = _prompt_length(server, enable_thinking=False), _prompt_length(server)
        assert off != on
        client = _client(server)

        def prompt_tokens(**request: Any) -> int:
            answer = client.chat.completions.create(
                model=MODEL_NAME, messages=HI, max_tokens=1, **request
            )
            assert answer.usage is not None
            return answer.usage.prompt_tokens

        assert prompt_tokens() == off
        assert prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == on
        assert prompt_tokens(reasoning_effort="high") == on
        assert prompt_tokens(reasoning_effort="none") == off
        tokenized = httpx.post(f"{server.base_url}/tokenize", json={"messages": HI})
        assert tokenized.json()["count"] == off
        with pytest.raises(openai.BadRequestError) as error:
            prompt_tokens(
                reasoning_effort="high",
                extra_body={"chat_template_kwargs": {"enable_thinking": False}},
            )
        assert error.value.body["param"] == "reasoning_effort"  # type: ignore[index]


def test_effort_r1_cannot_honour_is_a_400(r1: RunningServer) -> None:
    client = _client(r1)
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=HI, max_tokens=1, reasoning_effort="high"
    )
    assert answer.usage is not None and answer.usage.prompt_tokens == _prompt_length(r1)
    with pytest.raises(openai.BadRequestError) as error:  # its template always thinks
        client.chat.completions.create(
            model=MODEL_NAME, messages=HI, max_tokens=1, reasoning_effort="none"
        )
    assert error.value.body["param"] == "reasoning_effort"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL_NAME, input="Hi", reasoning={"effort": "minimal"})
    assert error.value.body["param"] == "reasoning.effort"  # type: ignore[index]


# ---- structured output and tool calls after the thinking ----------------------------------


@pytest.mark.parametrize("family", ["r1", "qwen3"])
def test_structured_output_starts_after_the_thinking(
    family: str, r1: RunningServer, qwen3: RunningServer
) -> None:
    """The forced thinking is never refused (the grammar waits), and the JSON after it is
    the model's own draw under the schema: valid whatever a random model would write."""
    server = r1 if family == "r1" else qwen3
    tokenizer = server.engine.tokenizer
    script = [] if family == "r1" else ids(tokenizer, OPEN)
    script += [*ids(tokenizer, "\n" + THOUGHT + "\n"), *ids(tokenizer, CLOSE)]
    with forced_tokens(server.engine, script) as refused:
        whole, chunks = _chat(server, response_format=RESPONSE_FORMAT, temperature=0.0)
    assert not refused
    reasoning, content, calls, finish = _message(whole)
    assert (reasoning, calls, finish) == (THOUGHT, [], "stop")
    jsonschema.validate(json.loads(content or ""), SCHEMA)
    assert _reassembled(chunks) == _message(whole)


def test_without_thinking_the_grammar_starts_at_once(qwen3: RunningServer) -> None:
    """The control: with thinking off the grammar masks from the first token, so a forced
    `<think>` is refused there; and an answer that does not open thinking is JSON from its
    first token (the model was kept from `<think>` by a bias)."""
    tokenizer = qwen3.engine.tokenizer
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    with forced_tokens(qwen3.engine, ids(tokenizer, OPEN)) as refused:
        whole, _ = _chat(qwen3, response_format=RESPONSE_FORMAT, temperature=0.0, extra_body=off)
    assert refused and refused[0][1:] == (0, ids(tokenizer, OPEN)[0])
    reasoning, content, _, _ = _message(whole)
    assert reasoning is None
    jsonschema.validate(json.loads(content or ""), SCHEMA)
    bias = {str(ids(tokenizer, OPEN)[0]): -100}
    whole, _ = _chat(qwen3, response_format=RESPONSE_FORMAT, temperature=0.0, logit_bias=bias)
    reasoning, content, _, _ = _message(whole)
    assert reasoning is None
    jsonschema.validate(json.loads(content or ""), SCHEMA)


def test_tool_calls_are_read_after_the_thinking(qwen3: RunningServer) -> None:
    tokenizer = qwen3.engine.tokenizer
    thought = "Maybe <tool_call> the weather, once I know the city."
    script = thinking_answer(tokenizer, "\n" + thought + "\n", "\n\n" + CALL)
    with forced_tokens(qwen3.engine, script):
        whole, chunks = _chat(qwen3, tools=[WEATHER_TOOL])
    expected_call = ("get_weather", json.dumps({"city": "Paris"}))
    assert _message(whole) == (thought, None, [expected_call], "tool_calls")
    assert _reassembled(chunks) == _message(whole)


def test_a_forced_call_is_made_after_the_thinking(qwen3: RunningServer) -> None:
    tokenizer = qwen3.engine.tokenizer
    script = [*ids(tokenizer, OPEN), *ids(tokenizer, "\nI must call it.\n"), *ids(tokenizer, CLOSE)]
    with forced_tokens(qwen3.engine, script) as refused:
        whole, chunks = _chat(  # one call: a random model would not end a list of them
            qwen3,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0.0,
        )
    assert not refused
    reasoning, content, calls, finish = _message(whole)
    assert (reasoning, content, finish) == ("I must call it.", None, "tool_calls")
    assert [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), WEATHER_TOOL["function"]["parameters"])
    assert _reassembled(chunks) == _message(whole)


# ---- Responses -----------------------------------------------------------------------------


def test_responses_put_the_thinking_in_a_reasoning_item(r1: RunningServer) -> None:
    tokenizer = r1.engine.tokenizer
    client = _client(r1)
    script = thinking_answer(tokenizer, THOUGHT, "\n\n" + ANSWER, opened=True)
    with forced_tokens(r1.engine, script):
        response = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=60)
        events = list(
            client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=60, stream=True)
        )
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [part.text for part in reasoning.content or []] == [THOUGHT]
    assert reasoning.status == "completed"
    assert message.type == "message" and response.output_text == ANSWER
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == len(ids(tokenizer, THOUGHT)) + 1

    kinds = [event.type for event in events]
    thinking_deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(thinking_deltas) == THOUGHT
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.done") < first_text
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert done.text == THOUGHT and done.output_index == 0
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER
    assert final.usage.output_tokens_details.reasoning_tokens == (
        response.usage.output_tokens_details.reasoning_tokens
    )

    # The output goes back as input, reasoning item and all (skipped: templates drop it).
    history = [
        {"role": "user", "content": "Hi"},
        *[item.model_dump(exclude_none=True) for item in response.output],
        {"role": "user", "content": "And now?"},
    ]
    with forced_tokens(r1.engine, thinking_answer(tokenizer, "Hm.", "Fine.", opened=True)):
        again = client.responses.create(model=MODEL_NAME, input=history, max_output_tokens=20)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ANSWER}]
    expected = tokenizer.apply_chat_template(
        [*chat, {"role": "user", "content": "And now?"}], tokenize=False, add_generation_prompt=True
    )
    assert again.usage is not None
    assert again.usage.input_tokens == len(tokenizer.encode(expected, add_special_tokens=False))
    assert again.output_text == "Fine."
    # The same through the stored response: its reasoning item is skipped there too.
    with forced_tokens(r1.engine, thinking_answer(tokenizer, "Hm.", "Fine.", opened=True)):
        chained = client.responses.create(
            model=MODEL_NAME,
            previous_response_id=response.id,
            input="And now?",
            max_output_tokens=20,
        )
    assert chained.usage is not None and chained.usage.input_tokens == again.usage.input_tokens
    assert [item.type for item in chained.output] == ["reasoning", "message"]


def test_responses_thinking_cut_short_is_a_reasoning_item_alone(r1: RunningServer) -> None:
    tokenizer = r1.engine.tokenizer
    script = ids(tokenizer, "A long thought that max_output_tokens cuts short")
    with forced_tokens(r1.engine, script):
        response = _client(r1).responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=5)
        events = list(
            _client(r1).responses.create(
                model=MODEL_NAME, input="Hi", max_output_tokens=5, stream=True
            )
        )
    assert response.status == "incomplete" and [i.type for i in response.output] == ["reasoning"]
    assert response.output[0].status == "incomplete"
    final = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert [(i.type, i.status) for i in final.output] == [("reasoning", "incomplete")]


def test_responses_reasoning_effort_sets_the_switch(qwen3: RunningServer) -> None:
    client = _client(qwen3)
    off, on = _prompt_length(qwen3, enable_thinking=False), _prompt_length(qwen3)
    for request, length in (
        ({"reasoning": {"effort": "none"}}, off),
        ({"reasoning": {"effort": "high", "summary": "auto"}}, on),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}, off),
    ):
        response = client.responses.create(
            model=MODEL_NAME, input="Hi", max_output_tokens=1, **request
        )
        assert response.usage is not None and response.usage.input_tokens == length, request
        if "reasoning" in request:
            assert response.reasoning is not None
            assert response.reasoning.effort == request["reasoning"]["effort"]
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(
            model=MODEL_NAME, input="Hi", max_output_tokens=1, reasoning={"mode": "pro"}
        )
    assert error.value.body["param"] == "reasoning.mode"  # type: ignore[index]


# ---- offline ----------------------------------------------------------------------------


def test_offline_chat_returns_the_thinking_and_the_answer(qwen3_dir: Path) -> None:
    llm = LLM(str(qwen3_dir), dtype="float32", compile=False)
    model = SimpleNamespace(engine=llm.engine)
    tokenizer = llm.tokenizer
    script = thinking_answer(tokenizer, "\n" + THOUGHT + "\n", "\n\n" + ANSWER)
    with forced_tokens(model.engine, script):
        out = llm.chat(HI, SamplingParams(max_tokens=80), use_tqdm=False)[0]
    assert (out.reasoning_content, out.content) == (THOUGHT, ANSWER)
    assert out.text.startswith(OPEN) and out.tool_calls is None
    thinking = [*ids(tokenizer, OPEN), *ids(tokenizer, "\nA city.\n"), *ids(tokenizer, CLOSE)]
    constrained = SamplingParams(
        max_tokens=80, temperature=0.0, structured_output=StructuredOutput.from_json_schema(SCHEMA)
    )
    with forced_tokens(model.engine, thinking) as refused:
        out = llm.chat(HI, constrained, use_tqdm=False)[0]
    assert not refused and out.reasoning_content == "A city."
    jsonschema.validate(json.loads(out.content or ""), SCHEMA)
    off = llm.chat(
        HI,
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        chat_template_kwargs={"enable_thinking": False},
    )[0]
    rendered = tokenizer.apply_chat_template(
        HI, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert off.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    plain = llm.chat(HI, SamplingParams(max_tokens=4), use_tqdm=False, reasoning_parser="none")[0]
    assert plain.reasoning_content is None and plain.content is None


def test_the_templates_are_the_families_own() -> None:
    # What the tests rely on: Qwen3's switch and R1's opened generation prompt.
    assert "enable_thinking is defined and enable_thinking is false" in QWEN3_TEMPLATE
    assert "{{'<｜Assistant｜><think>\\n'}}" in R1_TEMPLATE
