"""gpt-oss's Harmony format: answers as the model writes them split into reasoning,
content and calls, whole and streamed in pieces of every size (the pieces must add up to
the whole); what `auto` picks for gpt-oss's real chat template; how that template takes a
conversation back (earlier thinking, calls and their results, the effort); and what a
request's prompt decides (the grammar starts after the final message's header)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from iterserve.chat.answer import AnswerStream, read_answer
from iterserve.chat.harmony import read_messages
from iterserve.chat.reasoning import ReasoningSupport, thinking_template_kwargs
from iterserve.chat.reasoning_parsers import HarmonyParser, ThinkingStart, select_reasoning_parser
from iterserve.chat.tool_parsers import TOOL_PARSERS, ParsedCall, select_tool_parser
from iterserve.chat.tool_parsers.forced import ForcedCallReader
from iterserve.chat.tool_parsers.openai import OpenAIToolParser
from iterserve.chat.tool_protocol import NamedToolChoice
from iterserve.chat.tools import ToolPlan
from iterserve.engine.prompts import render_chat
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.structured_output import StructuredOutput, ThinkingMarkers
from thinking_models import GPT_OSS_TEMPLATE, harmony_tokenizer, ids

PROMPT = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
PARSER = HarmonyParser("openai_gptoss")
TOOLS = OpenAIToolParser()
PLAN = ToolPlan([], TOOLS, None, TOOLS)
ARGS = {"city": "Paris"}
THOUGHT = "The user wants the weather. I should call get_weather."
CALL_IN_ROLE = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
CALL_IN_CHANNEL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
CALL = ParsedCall("get_weather", json.dumps(ARGS))

# (answer text, reasoning, content, calls): as gpt-oss writes them, its end token cut off.
ANSWERS: list[tuple[str, str | None, str | None, list[ParsedCall]]] = [
    (
        f"{ANALYSIS}<|start|>assistant<|channel|>final<|message|>It is sunny.",
        THOUGHT,
        "It is sunny.",
        [],
    ),
    (ANALYSIS + CALL_IN_ROLE, THOUGHT, None, [CALL]),
    (ANALYSIS + CALL_IN_CHANNEL, THOUGHT, None, [CALL]),
    # The first message's recipient comes before its channel: the prompt wrote its role.
    (CALL_IN_ROLE.removeprefix("<|start|>assistant"), None, None, [CALL]),
    (
        f"{ANALYSIS}<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        + CALL_IN_ROLE,
        THOUGHT,
        "Checking.",
        [CALL],
    ),
    ("<|channel|>final<|message|>Hi!", None, "Hi!", []),
    (
        f"{ANALYSIS}<|start|>assistant<|channel|>analysis<|message|>More.<|end|>",
        THOUGHT + "\nMore.",
        None,
        [],
    ),
    ("<|channel|>analysis<|message|>Cut by max_tokens", "Cut by max_tokens", None, []),
    ("<|channel|>analysis<|message|>Cut<|end|><|start|>assistant<|chan", "Cut", None, []),
    # Arguments that are not an object, and a built-in tool's call, stay content.
    (
        f"{ANALYSIS}<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>[1]",
        THOUGHT,
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>[1]<|call|>",
        [],
    ),
    (
        "<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>analysis to=browser.search<|message|>{}",
        "Search.",
        "<|start|>assistant to=browser.search<|channel|>commentary json<|message|>{}<|call|>",
        [],
    ),
    # Text that is not Harmony is content, whole.
    ("Hello there, no channels.", None, "Hello there, no channels.", []),
    ("Hello\n<|channel|>final<|message|>x", None, "Hello\n<|channel|>final<|message|>x", []),
]


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), ANSWERS)
def test_answers_split_into_reasoning_content_and_calls(
    text: str, reasoning: str | None, content: str | None, calls: list[ParsedCall]
) -> None:
    answer = read_answer(text, PARSER.reader(PROMPT), PLAN)
    assert (answer.reasoning, answer.content, answer.calls) == (reasoning, content, calls)
    assert answer.thought == (reasoning is not None)


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), ANSWERS)
def test_streamed_answers_add_up_to_the_whole(
    text: str, reasoning: str | None, content: str | None, calls: list[ParsedCall]
) -> None:
    reader = PARSER.reader(PROMPT)
    rng = random.Random(len(text))
    for _ in range(8):
        stream, streamed, pos = AnswerStream.of(reader, PLAN), ["", "", []], 0
        while pos < len(text):
            step = rng.randint(1, 9)
            pos += step
            delta = stream.feed(text[pos - step : pos], final=pos >= len(text))
            streamed[0] += delta.reasoning
            streamed[1] += delta.content
            streamed[2] += [call for _, _, call in delta.new_calls]
        assert (streamed[0] or None, streamed[1] or None, streamed[2]) == (
            reasoning,
            content,
            calls,
        )


def test_a_streamed_prefix_holds_only_what_may_still_change() -> None:
    reader = PARSER.reader(PROMPT)
    assert reader.scan("<|channel|>analy", final=False).reasoning is None
    assert reader.scan("<|channel|>analysis<|message|>Hm<|en", final=False).reasoning == "Hm"
    split = reader.scan(f"{ANALYSIS}<|start|>assistant to=functions.get_weather<|chan", False)
    assert (split.reasoning, split.content) == (THOUGHT, "")  # a call only once it is whole
    messages = read_messages("<|channel|>final<|message|>Sunny", final=False)
    assert [(m.channel, m.body, m.complete) for m in messages] == [("final", "Sunny", False)]


def test_a_prompt_that_opened_the_final_message_is_answered_in_content() -> None:
    opened = PROMPT + "<|channel|>final<|message|>"
    assert PARSER.start_of(opened) is ThinkingStart.CLOSED
    assert PARSER.start_of(PROMPT) is ThinkingStart.INSIDE
    split = PARSER.reader(opened).scan("Sunny.", final=True)
    assert (split.reasoning, split.content) == (None, "Sunny.")
    thinking = PARSER.reader(PROMPT + "<|channel|>analysis<|message|>")
    assert thinking.scan("Hmm.<|end|>", final=True).reasoning == "Hmm."


def test_auto_picks_harmony_for_gpt_oss_and_nothing_else_reads_its_calls() -> None:
    parser = select_reasoning_parser("auto", GPT_OSS_TEMPLATE, lambda: None)
    assert isinstance(parser, HarmonyParser) and parser.name == "openai_gptoss"
    assert isinstance(select_tool_parser("auto", GPT_OSS_TEMPLATE), OpenAIToolParser)
    others = [name for name, cls in TOOL_PARSERS.items() if cls.detects(GPT_OSS_TEMPLATE)]
    assert others == ["openai"]


def _read(pieces: list[Any]) -> tuple[str, list[ParsedCall]]:
    """The content and the calls of a scan."""
    calls = [piece for piece in pieces if isinstance(piece, ParsedCall)]
    return "".join(piece for piece in pieces if isinstance(piece, str)), calls


def test_written_calls_read_back() -> None:
    written = TOOLS.write_call({"name": "get_weather", "arguments": ARGS})
    assert _read(TOOLS.scan(written, final=True)) == ("", [CALL])


# ---- the model's tokenizer and template ----------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    return harmony_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def support(tokenizer: Any) -> ReasoningSupport:
    found = ReasoningSupport.for_model("auto", tokenizer, GPT_OSS_TEMPLATE)
    assert found is not None
    return found


def test_the_markers_are_special_tokens_kept_in_the_text(
    tokenizer: Any, support: ReasoningSupport
) -> None:
    assert support.markers_are_special and support.switch is None and support.open_id is None
    assert support.end_ids == tuple(ids(tokenizer, "<|end|>"))
    assert support.grammar_ids == tuple(ids(tokenizer, "<|channel|>final<|message|>"))
    assert len(support.grammar_ids) == 3
    params = SamplingParams(structured_output=StructuredOutput(json_object=True))
    support.prepare(PROMPT, params)
    assert params.skip_special_tokens is False
    assert params.structured_output is not None
    assert params.structured_output.after_thinking == ThinkingMarkers(support.grammar_ids)
    end = list(support.end_ids)
    assert support.reasoning_tokens([5, 6, *end, 7], thought=True) == 3


def test_effort_is_the_templates_own(tokenizer: Any, support: ReasoningSupport) -> None:
    chat = [{"role": "user", "content": "Hi"}]
    for effort in ("low", "high"):
        kwargs = thinking_template_kwargs(support, None, effort)
        assert kwargs == {"reasoning_effort": effort}
        text = render_chat(tokenizer, GPT_OSS_TEMPLATE, chat, True, kwargs).text
        assert f"Reasoning: {effort}" in text and text.endswith("<|start|>assistant")
    assert "Reasoning: medium" in render_chat(tokenizer, GPT_OSS_TEMPLATE, chat).text
    for effort, given in (("none", None), ("minimal", None), ("high", {"reasoning_effort": "low"})):
        with pytest.raises(InvalidRequestError, match="low, medium, high|disagree") as error:
            thinking_template_kwargs(support, given, effort, "reasoning.effort")
        assert error.value.param == "reasoning.effort"


def test_a_tool_loop_renders_back_as_the_model_wrote_it(tokenizer: Any) -> None:
    """An agent sends the answer back as the server gave it: thinking in reasoning_content
    (gpt-oss's template reads `thinking`), a preamble in content, the call; then the result."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": ARGS},
    }
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": THOUGHT,
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    # No description: OpenAI's schema allows it, and the template joins it to text.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = render_chat(tokenizer, GPT_OSS_TEMPLATE, chat, True, None, tools).text
    assert f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>" in text
    assert TOOLS.write_call(call["function"]) in text
    assert (
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C, sunny"'
        in text
    )
    assert text.endswith("<|start|>assistant")
    # Thinking thrown away by a later final answer, as the template does.
    chat += [
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    later = render_chat(tokenizer, GPT_OSS_TEMPLATE, chat, True, None, tools).text
    assert THOUGHT not in later and "<|channel|>final<|message|>It is sunny.<|end|>" in later


def test_a_forced_call_written_in_harmony_is_read() -> None:
    """The grammar waits for the final message; gpt-oss may call in its own format instead."""
    native = TOOLS.write_call({"name": "get_weather", "arguments": ARGS})
    named = ForcedCallReader(_choice("get_weather"), TOOLS)
    assert _read(named.scan(native, final=True)) == ("", [CALL])
    assert named.scan(json.dumps(ARGS), final=True) == [CALL]  # as the grammar makes it
    other = ForcedCallReader(_choice("get_time"), TOOLS)
    assert other.scan(native, final=True) == [native]  # not the forced tool: content
    assert _read(ForcedCallReader("required", TOOLS).scan(native, final=True)) == ("", [CALL])


def _choice(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})
