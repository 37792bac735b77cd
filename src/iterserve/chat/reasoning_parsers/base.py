"""The `<think>...</think>` format of Qwen3, DeepSeek-R1 and its distills, QwQ: where an
answer starts relative to the model's thinking, and how it is split into its reasoning
and its content.

Where an answer starts is read from its rendered prompt, which holds for every family:
a prompt ending with `<think>` (R1's template, Qwen3-2507 Thinking's) puts the answer
inside the thinking, with no opening tag; one ending with `</think>` (Qwen3's with
`enable_thinking: false`) has thinking off; any other prompt leaves the opening to the
model (Qwen3 writes `<think>` first, or answers at once; R1's template opens no thinking
after tool results). An answer inside a thinking it never ends (cut by max_tokens) is all
reasoning; an answer that never opened one is all content.

As with tool calls (chat/tool_parsers/base.py), one `scan(text, final)` serves both ways
an answer leaves the server: `final=True` splits the whole answer, and `final=False` says
what is certain about a streamed prefix, holding back what could still be the end of the
thinking (a partial end marker, whitespace that may precede it). A longer prefix's split
only extends a shorter one's, so the streamed deltas add up to the whole answer's split.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from iterserve.chat.tool_parsers.base import partial_marker_length


class ThinkingStart(Enum):
    """Where a request's answer starts, read from its rendered prompt."""

    INSIDE = "inside"  # the prompt opened the thinking: the answer starts in it
    MAY_OPEN = "may_open"  # the model opens it itself (with the start marker) or answers
    CLOSED = "closed"  # the prompt holds a closed thinking block: the answer is content


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: no thinking (yet); "" for an empty one
    content: str  # the answer after the thinking


@dataclass(frozen=True)
class ThinkingReader:
    """One request's answer read from where its prompt left the thinking. Whitespace
    around the thinking is the markers' layout (`<think>\\n...\\n</think>\\n\\n`): the
    reasoning is stripped and the content after it starts at its first other character;
    an answer without thinking is left as it is."""

    open_marker: str
    close_marker: str
    start: ThinkingStart

    def scan(self, text: str, final: bool) -> ReasoningSplit:
        if self.start is ThinkingStart.CLOSED:
            return ReasoningSplit(None, text)
        lead = len(text) - len(text.lstrip())
        opened = text.startswith(self.open_marker, lead)
        if not opened and not final and self.open_marker.startswith(text[lead:]):
            # Only whitespace or the start of the open marker so far: nothing is certain.
            return ReasoningSplit(None if self.start is ThinkingStart.MAY_OPEN else "", "")
        if not opened and self.start is ThinkingStart.MAY_OPEN:
            return ReasoningSplit(None, text)  # answered without thinking
        # A model may write the open marker the prompt already wrote: it is not reasoning.
        body = lead + len(self.open_marker) if opened else 0
        end = text.find(self.close_marker, body)
        if end < 0:  # still thinking, or cut by max_tokens while thinking: all reasoning
            thought = text[body:]
            if not final:
                thought = thought[
                    : len(thought) - partial_marker_length(thought, self.close_marker)
                ]
            return ReasoningSplit(thought.strip(), "")
        after = end + len(self.close_marker)
        return ReasoningSplit(text[body:end].strip(), text[after:].lstrip())


class ReasoningParser:
    """The thinking markers, and the reader of each request's answer. `name` is the one
    `--reasoning-parser` chose (vLLM's names for this one format: qwen3, deepseek_r1)."""

    open_marker: ClassVar[str] = "<think>"
    close_marker: ClassVar[str] = "</think>"

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"ReasoningParser({self.name!r})"

    @property
    def markers(self) -> tuple[str, str]:
        return self.open_marker, self.close_marker

    def start_of(self, prompt: str) -> ThinkingStart:
        """Where the answer to `prompt` (rendered) starts."""
        tail = prompt.rstrip()
        if tail.endswith(self.open_marker):
            return ThinkingStart.INSIDE
        if tail.endswith(self.close_marker):
            return ThinkingStart.CLOSED
        return ThinkingStart.MAY_OPEN

    def reader(self, prompt: str) -> ThinkingReader:
        return ThinkingReader(self.open_marker, self.close_marker, self.start_of(prompt))

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        """Whether a chat template writes the thinking markers (for `auto`)."""
        return cls.open_marker in chat_template or cls.close_marker in chat_template
