"""A chat answer read in full: the thinking (chat/reasoning_parsers/) first, then tool calls
(chat/tool_parsers/) in what follows it, so a call or JSON the model only thought about is
never read as one. Whole (`read_answer`: the non-streamed response, `LLM.chat`) or as it
streams (`AnswerStream`), from the same scans: the streamed pieces add up to the whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from iterserve.chat.reasoning_parsers import ReasoningSplit, ReasoningStream, ThinkingReader
from iterserve.chat.tool_parsers import ParsedCall
from iterserve.chat.tool_parsers.streaming import ToolCallStream, parse_answer
from iterserve.chat.tools import ToolPlan


@dataclass(frozen=True)
class Answer:
    reasoning: str | None  # None: no thinking, or an empty one
    content: str | None  # None: nothing after the thinking, or only calls
    calls: list[ParsedCall]
    thought: bool  # whether the answer has a thinking part (for usage's reasoning tokens)


def read_answer(text: str, reasoning: ThinkingReader | None, plan: ToolPlan) -> Answer:
    split = reasoning.scan(text, final=True) if reasoning else ReasoningSplit(None, text)
    content: str | None = split.content
    calls: list[ParsedCall] = []
    if plan.reader is not None:
        parsed = parse_answer(plan.reader, split.content, plan.max_calls)
        content, calls = parsed.content, parsed.calls
    if split.reasoning is not None and not content:
        content = None  # the answer was all thinking (max_tokens ran out in it)
    return Answer(split.reasoning or None, content, calls, split.reasoning is not None)


@dataclass
class AnswerDelta:
    reasoning: str
    content: str
    new_calls: list[tuple[int, str, ParsedCall]] = field(default_factory=list)


@dataclass
class AnswerStream:
    """One choice's answer as it streams."""

    thinking: ReasoningStream | None
    calls: ToolCallStream | None

    @classmethod
    def of(cls, reasoning: ThinkingReader | None, plan: ToolPlan) -> AnswerStream:
        return cls(
            None if reasoning is None else ReasoningStream(reasoning),
            None if plan.reader is None else ToolCallStream(plan.reader, plan.max_calls),
        )

    def feed(self, delta_text: str, final: bool) -> AnswerDelta:
        """What `delta_text` (and, when `final`, the end of the answer) makes certain."""
        reasoning, content = "", delta_text
        if self.thinking is not None:
            reasoning, content = self.thinking.feed(delta_text, final)
        if self.calls is None:
            return AnswerDelta(reasoning, content)
        found = self.calls.feed(content, final)
        return AnswerDelta(reasoning, found.content, found.new_calls)

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.called

    @property
    def thought(self) -> bool:
        return self.thinking is not None and self.thinking.thought
