"""Reasoning parsers on answers as thinking models write them, whole and streamed in
token-sized pieces; the choice `auto` makes from real chat templates; what a request's
prompt decides (where its answer starts, where its grammar starts, the thinking switch a
`reasoning_effort` sets); and the thinking read before tool calls."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from iterserve.chat.answer import AnswerStream, read_answer
from iterserve.chat.reasoning import ReasoningSupport, thinking_template_kwargs
from iterserve.chat.reasoning_parsers import (
    ReasoningStream,
    ThinkingStart,
    ThinkTagParser,
    select_reasoning_parser,
)
from iterserve.chat.reasoning_parsers.think_tags import Gemma4ThoughtParser, ThinkTagReader
from iterserve.chat.tool_parsers import ParsedCall
from iterserve.chat.tool_parsers.hermes import HermesToolParser
from iterserve.chat.tools import ToolPlan
from iterserve.engine.prompts import render_chat
from iterserve.model.tokenizer import load_hf_tokenizer
from iterserve.sampling_params import InvalidRequestError, SamplingParams
from iterserve.structured_output import StructuredOutput, ThinkingMarkers
from thinking_models import QWEN3_TEMPLATE, R1_TEMPLATE, ids, thinking_tokenizer

QWEN_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
QWEN_OFF_PROMPT = QWEN_PROMPT + "<think>\n\n</think>\n\n"  # enable_thinking false
R1_PROMPT = "<｜User｜>Hi<｜Assistant｜><think>\n"
UNMARKED_PROMPT = "User: Hi\nAssistant:"
GEMMA4_PROMPT = "<|turn>user\nHi<turn|>\n<|turn>model\n"
GEMMA4_OFF_PROMPT = GEMMA4_PROMPT + "<|channel>thought\n<channel|>"  # enable_thinking false
GEMMA4_TEMPLATE = Path(__file__).parents[1] / "server" / "chat_templates" / "gemma_4_31b_it.jinja"

QWEN3, R1 = ThinkTagParser("qwen3"), ThinkTagParser("deepseek_r1")
GEMMA4 = Gemma4ThoughtParser("gemma4")
# (parser, prompt, answer, reasoning, content)
ANSWERS: list[tuple[ThinkTagParser, str, str, str | None, str]] = [
    (
        QWEN3,
        QWEN_PROMPT,
        "<think>\nThe user greets me.\n</think>\n\nHello!",
        "The user greets me.",
        "Hello!",
    ),
    (QWEN3, QWEN_PROMPT, "Hello!", None, "Hello!"),  # answered without thinking
    (QWEN3, QWEN_PROMPT, "\n\nHello!", None, "\n\nHello!"),  # left as it is
    (QWEN3, QWEN_PROMPT, "I write <think> tags too.", None, "I write <think> tags too."),
    (QWEN3, QWEN_PROMPT, "<think>\nStill going when max_tokens", "Still going when max_tokens", ""),
    (QWEN3, QWEN_PROMPT, "<think>\n\n</think>\n\nHello!", "", "Hello!"),  # an empty thinking
    (QWEN3, QWEN_OFF_PROMPT, "Hello!", None, "Hello!"),
    (QWEN3, QWEN_OFF_PROMPT, "<think>x</think>y", None, "<think>x</think>y"),
    (QWEN3, R1_PROMPT, "Opened by the prompt.</think>Hi", "Opened by the prompt.", "Hi"),
    (R1, R1_PROMPT, "Greeting.\n</think>\n\nHello!", "Greeting.", "Hello!"),
    (R1, R1_PROMPT, "Thinking until max_tokens", "Thinking until max_tokens", ""),
    (R1, R1_PROMPT, "<think>\nWritten again.\n</think>\n\nHello!", "Written again.", "Hello!"),
    (R1, R1_PROMPT, "a < b and </thin is not it</think>c", "a < b and </thin is not it", "c"),
    (R1, R1_PROMPT, "A</think>B</think>C", "A", "B</think>C"),  # the first end ends it
    # A prompt that opens no thinking (R1's template after tool results): the model may.
    (R1, UNMARKED_PROMPT, "<think>R1 opens it.</think>Hi", "R1 opens it.", "Hi"),
    (R1, UNMARKED_PROMPT, "Sunny.", None, "Sunny."),
    (QWEN3, UNMARKED_PROMPT, "Plain.", None, "Plain."),
    (R1, QWEN_OFF_PROMPT, "Off.", None, "Off."),
    # Gemma 4's thought channel: opened by the model, closed by the prompt when off.
    (
        GEMMA4,
        GEMMA4_PROMPT,
        "<|channel>thought\nThe user greets me.\n<channel|>Hello!",
        "The user greets me.",
        "Hello!",
    ),
    (GEMMA4, GEMMA4_PROMPT, "Hello!", None, "Hello!"),
    (GEMMA4, GEMMA4_PROMPT, "<|channel>thought\nCut by max_tokens", "Cut by max_tokens", ""),
    (GEMMA4, GEMMA4_OFF_PROMPT, "Hello!", None, "Hello!"),
]


@pytest.mark.parametrize(("parser", "prompt", "answer", "reasoning", "content"), ANSWERS)
def test_parsers_split_model_answers(
    parser: ThinkTagParser, prompt: str, answer: str, reasoning: str | None, content: str
) -> None:
    split = parser.reader(prompt).scan(answer, final=True)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize(("parser", "prompt", "answer", "reasoning", "content"), ANSWERS)
def test_streamed_splits_reassemble_to_the_whole_answers(
    parser: ThinkTagParser, prompt: str, answer: str, reasoning: str | None, content: str
) -> None:
    reader = parser.reader(prompt)
    rng = random.Random(len(answer))
    for _ in range(10):
        stream, got_reasoning, got_content, pos = ReasoningStream(reader), "", "", 0
        while pos < len(answer):
            step = rng.randint(1, 5)  # token-sized pieces, cut anywhere
            pos += step
            piece = answer[pos - step : pos]
            more_reasoning, more_content = stream.feed(piece, final=pos >= len(answer))
            got_reasoning += more_reasoning
            got_content += more_content
            # Never sent and taken back: what went out is the start of the whole split.
            assert (reasoning or "").startswith(got_reasoning)
            assert content.startswith(got_content)
        assert (got_reasoning, got_content) == (reasoning or "", content)
        assert stream.thought is (reasoning is not None)


def test_a_partial_end_marker_is_held_back() -> None:
    stream = ReasoningStream(R1.reader(R1_PROMPT))
    assert stream.feed("Hmm.\n</th", final=False) == ("Hmm.", "")
    assert stream.feed("ink>\n\nYes", final=False) == ("", "Yes")
    stream = ReasoningStream(QWEN3.reader(QWEN_PROMPT))
    assert stream.feed("<thi", final=False) == ("", "")  # may open the thinking
    assert stream.feed("s is not", final=True) == ("", "<this is not")


def test_the_prompt_says_where_the_answer_starts(tokenizer_dir: Path) -> None:
    """Rendered by the real templates: Qwen3's leaves the opening to the model, or closes
    an empty block when thinking is off; R1's opens it."""
    tokenizer = thinking_tokenizer(tokenizer_dir, QWEN3_TEMPLATE)
    chat = [{"role": "user", "content": "Hi"}]
    qwen = render_chat(tokenizer, QWEN3_TEMPLATE, chat).text
    qwen_off = render_chat(tokenizer, QWEN3_TEMPLATE, chat, True, {"enable_thinking": False}).text
    r1 = render_chat(tokenizer, R1_TEMPLATE, chat).text
    assert QWEN3.start_of(qwen) is ThinkingStart.MAY_OPEN
    assert QWEN3.start_of(qwen_off) is ThinkingStart.CLOSED
    assert R1.start_of(r1) is ThinkingStart.INSIDE
    assert QWEN3.start_of(r1) is ThinkingStart.INSIDE  # the prompt decides, whatever the parser
    assert R1.start_of(qwen_off) is ThinkingStart.CLOSED
    # After tool results R1's template writes no generation prompt: no thinking opened.
    results = [
        *chat,
        {"role": "assistant", "content": "Checking."},
        {"role": "tool", "content": "18 C"},
    ]
    after_tools = render_chat(tokenizer, R1_TEMPLATE, results).text
    assert after_tools.endswith("<｜tool▁outputs▁end｜>")
    assert R1.start_of(after_tools) is ThinkingStart.MAY_OPEN


def test_auto_picks_the_parser_by_template() -> None:
    def probe(text: str | None) -> Any:
        return lambda: text

    qwen = select_reasoning_parser("auto", QWEN3_TEMPLATE, probe(QWEN_PROMPT))
    r1 = select_reasoning_parser("auto", R1_TEMPLATE, probe(R1_PROMPT))
    assert qwen is not None and qwen.name == "qwen3"
    assert r1 is not None and r1.name == "deepseek_r1"
    qwen25 = Path(__file__).parents[1] / "server" / "chat_templates" / "qwen2_5_tools.jinja"
    assert select_reasoning_parser("auto", qwen25.read_text(), probe(QWEN_PROMPT)) is None
    assert select_reasoning_parser("auto", None, probe(None)) is None

    def never() -> str:
        raise AssertionError("a template without thinking markers is not rendered")

    assert select_reasoning_parser("auto", "{{ messages }}", never) is None
    assert select_reasoning_parser("none", R1_TEMPLATE, never) is None
    named = select_reasoning_parser("deepseek_r1", "", never)
    assert named is not None and named.name == "deepseek_r1"
    with pytest.raises(ValueError, match="qwen3, deepseek_r1, openai_gptoss"):
        select_reasoning_parser("granite", QWEN3_TEMPLATE, never)


# ---- a request's reasoning: grammar start, effort, usage -----------------------------------


@pytest.fixture(scope="module")
def qwen_support(tokenizer_dir: Path) -> ReasoningSupport:
    tokenizer = thinking_tokenizer(tokenizer_dir, QWEN3_TEMPLATE)
    support = ReasoningSupport.for_model("auto", tokenizer, QWEN3_TEMPLATE)
    assert support is not None
    return support


@pytest.fixture(scope="module")
def r1_support(tokenizer_dir: Path) -> ReasoningSupport:
    tokenizer = thinking_tokenizer(tokenizer_dir, R1_TEMPLATE)
    support = ReasoningSupport.for_model("auto", tokenizer, R1_TEMPLATE)
    assert support is not None
    return support


def test_the_models_markers_and_switch_are_found(
    tokenizer_dir: Path, qwen_support: ReasoningSupport, r1_support: ReasoningSupport
) -> None:
    tokenizer = thinking_tokenizer(tokenizer_dir, QWEN3_TEMPLATE)
    assert (
        qwen_support.end_ids == tuple(ids(tokenizer, "</think>")) and len(qwen_support.end_ids) == 1
    )
    assert qwen_support.open_id == ids(tokenizer, "<think>")[0]
    assert qwen_support.switch == "enable_thinking" and r1_support.switch is None
    assert not qwen_support.markers_are_special
    # A tokenizer without the markers as tokens: the end marker is several, none opens.
    plain = load_hf_tokenizer(tokenizer_dir)
    several = ReasoningSupport.for_model("qwen3", plain, QWEN3_TEMPLATE)
    assert several is not None and several.end_ids == tuple(ids(plain, "</think>"))
    assert len(several.end_ids) > 1 and several.open_id is None


def test_deepseek_v31s_thinking_switch_is_found(tokenizer_dir: Path) -> None:
    """DeepSeek-V3.1's template closes the thinking unless its switch is on (llama.cpp's
    copy takes `enable_thinking` for its own `thinking`; either turns it on)."""
    template = Path(__file__).parents[1] / "server" / "chat_templates" / "deepseek_v3_1.jinja"
    text = template.read_text()
    tokenizer = thinking_tokenizer(tokenizer_dir, text)
    support = ReasoningSupport.for_model("auto", tokenizer, text)
    assert support is not None and support.switch in ("enable_thinking", "thinking")
    chat = [{"role": "user", "content": "Hi"}]
    for switch in ("enable_thinking", "thinking"):
        on = render_chat(tokenizer, text, chat, True, {switch: True}).text
        assert support.parser.start_of(on) is ThinkingStart.INSIDE
    off = render_chat(tokenizer, text, chat).text
    assert support.parser.start_of(off) is ThinkingStart.CLOSED
    effort_off = thinking_template_kwargs(support, None, "none")
    assert support.parser.start_of(render_chat(tokenizer, text, chat, True, effort_off).text) is (
        ThinkingStart.CLOSED
    )


def test_the_grammar_starts_after_the_thinking_the_prompt_leaves_open(
    qwen_support: ReasoningSupport, r1_support: ReasoningSupport
) -> None:
    shared = StructuredOutput(json_object=True, param="response_format")
    end, opener = qwen_support.end_ids, qwen_support.open_id
    for support, prompt, expected in (
        (r1_support, R1_PROMPT, ThinkingMarkers(end)),  # starts inside: wait for the end
        (qwen_support, QWEN_PROMPT, ThinkingMarkers(end, opener)),  # may open it first
        (qwen_support, QWEN_OFF_PROMPT, None),  # closed: the grammar starts at once
    ):
        params = SamplingParams(structured_output=shared)
        support.prepare(prompt, params)
        assert params.structured_output is not None
        assert params.structured_output.after_thinking == expected
    assert shared.after_thinking is None  # the request's own copy was changed, not this
    # Where the open marker is not one token the model cannot open thinking under a grammar.
    several = replace(qwen_support, open_id=None)
    params = SamplingParams(structured_output=shared)
    several.prepare(QWEN_PROMPT, params)
    assert params.structured_output is shared


def test_special_markers_are_kept_in_the_text(tokenizer_dir: Path) -> None:
    tokenizer = thinking_tokenizer(tokenizer_dir, R1_TEMPLATE, special=True)
    support = ReasoningSupport.for_model("auto", tokenizer, R1_TEMPLATE)
    assert support is not None and support.markers_are_special
    params = SamplingParams()
    support.prepare(R1_PROMPT, params)
    assert params.skip_special_tokens is False


@pytest.mark.parametrize(
    ("effort", "given", "expected"),
    [
        ("none", None, {"enable_thinking": False}),
        ("minimal", {"x": 1}, {"x": 1, "enable_thinking": False}),
        ("low", None, {"enable_thinking": True}),
        ("high", {"enable_thinking": True}, {"enable_thinking": True}),
        (None, {"enable_thinking": False}, {"enable_thinking": False}),
    ],
)
def test_effort_sets_the_templates_thinking_switch(
    qwen_support: ReasoningSupport, effort: str | None, given: Any, expected: Any
) -> None:
    assert thinking_template_kwargs(qwen_support, given, effort) == expected


def test_effort_that_cannot_be_honoured_is_refused_naming_it(
    qwen_support: ReasoningSupport, r1_support: ReasoningSupport
) -> None:
    # R1's template always opens the thinking: effort can keep it, not turn it off.
    assert thinking_template_kwargs(r1_support, None, "high") is None
    for support, given, effort in (
        (r1_support, None, "none"),
        (qwen_support, {"enable_thinking": True}, "none"),  # disagrees with the kwargs
        (None, None, "low"),  # a model whose thinking is not read
    ):
        with pytest.raises(InvalidRequestError) as error:
            thinking_template_kwargs(support, given, effort, "reasoning.effort")
        assert error.value.param == "reasoning.effort"
    assert thinking_template_kwargs(None, None, "none") is None  # no thinking: honoured


def test_reasoning_tokens_run_to_the_end_marker(r1_support: ReasoningSupport) -> None:
    end = list(r1_support.end_ids)
    assert r1_support.reasoning_tokens([5, 6, *end, 7, 8], thought=True) == 2 + len(end)
    assert r1_support.reasoning_tokens([5, 6, 7], thought=True) == 3  # cut while thinking
    assert r1_support.reasoning_tokens([5, *end], thought=False) == 0


# ---- the thinking, then the calls -------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
PLAN = ToolPlan([], HermesToolParser(), None, HermesToolParser())


def test_calls_are_read_after_the_thinking_only() -> None:
    """A call the model only thought about is not made; the one after the thinking is."""
    reader = QWEN3.reader(QWEN_PROMPT)
    thought = f"Maybe {CALL}, or not."
    answer = read_answer(f"<think>\n{thought}\n</think>\n\n{CALL}", reader, PLAN)
    assert answer.reasoning == thought and answer.content is None
    assert answer.calls == [ParsedCall("get_time", json.dumps({"tz": "UTC"}))]
    only_thought = read_answer(f"<think>\n{CALL}", reader, PLAN)  # cut by max_tokens
    assert only_thought.calls == [] and only_thought.content is None and only_thought.thought


@pytest.mark.parametrize(
    "text",
    [
        f"<think>\nMaybe {CALL}\n</think>\n\nSure.\n{CALL}",
        "<think>\nNo call needed.\n</think>\n\nIt is noon.",
        "No thinking, no call.",
        f"<think>\n{CALL}",
    ],
)
def test_streamed_answers_reassemble_to_the_whole(text: str) -> None:
    reader = QWEN3.reader(QWEN_PROMPT)
    whole = read_answer(text, reader, PLAN)
    rng = random.Random(len(text))
    for _ in range(5):
        stream, reasoning, content, calls, pos = AnswerStream.of(reader, PLAN), "", "", [], 0
        while pos < len(text):
            step = rng.randint(1, 6)
            pos += step
            delta = stream.feed(text[pos - step : pos], final=pos >= len(text))
            reasoning, content = reasoning + delta.reasoning, content + delta.content
            calls += [call for _, _, call in delta.new_calls]
        assert (reasoning or None, content or None, calls) == (
            whole.reasoning,
            whole.content,
            whole.calls,
        )
        assert stream.thought is whole.thought


def test_a_reader_of_a_closed_prompt_reads_content_only() -> None:
    reader = ThinkTagReader(ThinkingStart.CLOSED)
    assert reader.scan("<think>", final=False).reasoning is None


def test_gemma4s_template_picks_its_parser_and_says_where_answers_start(
    tokenizer_dir: Path,
) -> None:
    """Gemma 4's real template: `auto` reads its thought channel; with `enable_thinking` the
    model opens the channel, without it the generation prompt closes an empty one; the switch
    is found."""
    text = GEMMA4_TEMPLATE.read_text()
    tokenizer = load_hf_tokenizer(tokenizer_dir)
    special = ["<|channel>", "<channel|>", "<|turn>", "<turn|>", "<|think|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = text
    chat = [{"role": "user", "content": "Hi"}]
    on = render_chat(tokenizer, text, chat, True, {"enable_thinking": True}).text
    off = render_chat(tokenizer, text, chat, True, {"enable_thinking": False}).text
    assert (GEMMA4.start_of(on), GEMMA4.start_of(off)) == (
        ThinkingStart.MAY_OPEN,
        ThinkingStart.CLOSED,
    )
    support = ReasoningSupport.for_model("auto", tokenizer, text)
    assert support is not None and support.parser.name == "gemma4"
    assert support.switch == "enable_thinking" and support.markers_are_special
    assert support.open_id == tokenizer.convert_tokens_to_ids("<|channel>")
