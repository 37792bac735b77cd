"""What every reasoning parser answers: where a request's answer starts relative to the
model's thinking (read from its rendered prompt), and how the answer splits into its
reasoning and its content.

As with tool calls (chat/tool_parsers/base.py), one `scan(text, final)` serves both ways
an answer leaves the server: `final=True` splits the whole answer, and `final=False` says
what is certain about a streamed prefix, holding back what could still turn out otherwise
(a partial end marker). A longer prefix's split only extends a shorter one's, so the
streamed deltas add up to the whole answer's split.

The formats: `<think>...</think>` (think_tags.py: Qwen3, DeepSeek-R1, QwQ) and gpt-oss's
Harmony channels (harmony.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar


class ThinkingStart(Enum):
    """Where a request's answer starts, read from its rendered prompt."""

    INSIDE = "inside"  # the prompt opened the thinking: the answer starts in it
    MAY_OPEN = "may_open"  # the model opens it itself (with the start marker) or answers
    CLOSED = "closed"  # the prompt holds a closed thinking block: the answer is content


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: no thinking (yet); "" for an empty one
    content: str  # the answer after the thinking (for the tool parser to read)


class ThinkingReader(ABC):
    """One request's answer, read from where its prompt left the thinking."""

    start: ThinkingStart

    @abstractmethod
    def scan(self, text: str, final: bool) -> ReasoningSplit:
        """What is certain of `text` (all of it when `final`); see the module doc."""


class ReasoningParser(ABC):
    """A thinking format: its markers, and the reader of each request's answer. `name`
    is the one `--reasoning-parser` chose (vLLM's names)."""

    # Text the answer must keep to be read; where the tokenizer makes any of it special
    # tokens, the server keeps special tokens in the answer's text.
    markers: ClassVar[tuple[str, ...]]
    # The token that opens thinking where the model may open it itself (None: it cannot).
    open_marker: ClassVar[str | None]
    # Where the thinking ends (usage's reasoning tokens run to it), and where the grammar
    # of structured output or a forced call starts.
    end_marker: ClassVar[str]
    grammar_marker: ClassVar[str]
    # The efforts the chat template takes as `reasoning_effort` itself; None: the template
    # only turns thinking on and off (chat/reasoning.py).
    effort_levels: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def budget_markers(self, start: ThinkingStart) -> tuple[str, str, str] | None:
        """For a thinking budget (thinking_budget.py), an answer starting at `start`: the
        text its thinking opens with, the text that ends it, and what is written to end it
        when the budget runs out. None: the answer has no thinking to cap."""
        if start is ThinkingStart.CLOSED:
            return None
        opener = self.open_marker if start is ThinkingStart.MAY_OPEN else ""
        if opener is None:
            return None  # it cannot open thinking itself
        return opener, self.end_marker, self.end_marker

    @abstractmethod
    def start_of(self, prompt: str) -> ThinkingStart:
        """Where the answer to `prompt` (rendered) starts."""

    @abstractmethod
    def reader(self, prompt: str) -> ThinkingReader:
        """The reader of the answer to `prompt` (rendered)."""

    @classmethod
    @abstractmethod
    def detects(cls, chat_template: str) -> bool:
        """Whether a chat template writes this format (for `auto`)."""
