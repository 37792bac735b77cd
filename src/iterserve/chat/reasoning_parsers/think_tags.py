"""The `<think>...</think>` format of Qwen3, DeepSeek-R1 and its distills, QwQ, and Gemma 4's
thought channel, `<|channel>thought\n...<channel|>`, which reads the same with other markers.

Where an answer starts is read from its rendered prompt, which holds for every family:
a prompt ending with `<think>` (R1's template, Qwen3-2507 Thinking's) puts the answer
inside the thinking, with no opening tag; one ending with `</think>` (Qwen3's with
`enable_thinking: false`) has thinking off; any other prompt leaves the opening to the
model (Qwen3 writes `<think>` first, or answers at once; R1's template opens no thinking
after tool results). An answer inside a thinking it never ends (cut by max_tokens) is all
reasoning; an answer that never opened one is all content. While streaming, a partial end
marker and whitespace that may precede it are held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from iterserve.chat.reasoning_parsers.base import (
    ReasoningParser,
    ReasoningSplit,
    ThinkingReader,
    ThinkingStart,
)
from iterserve.chat.streamed_text import partial_marker_length

OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkTagReader(ThinkingReader):
    """Whitespace around the thinking is the markers' layout (`<think>\\n...\\n</think>\\n\\n`):
    the reasoning is stripped and the content after it starts at its first other
    character; an answer without thinking is left as it is."""

    start: ThinkingStart
    open: str = OPEN
    close: str = CLOSE

    def scan(self, text: str, final: bool) -> ReasoningSplit:
        if self.start is ThinkingStart.CLOSED:
            return ReasoningSplit(None, text)
        open_, close = self.open, self.close
        lead = len(text) - len(text.lstrip())
        opened = text.startswith(open_, lead)
        if not opened and not final and open_.startswith(text[lead:]):
            # Only whitespace or the start of the open marker so far: nothing is certain.
            return ReasoningSplit(None if self.start is ThinkingStart.MAY_OPEN else "", "")
        if not opened and self.start is ThinkingStart.MAY_OPEN:
            return ReasoningSplit(None, text)  # answered without thinking
        # A model may write the open marker the prompt already wrote: it is not reasoning.
        body = lead + len(open_) if opened else 0
        end = text.find(close, body)
        if end < 0:  # still thinking, or cut by max_tokens while thinking: all reasoning
            thought = text[body:]
            if not final:
                thought = thought[: len(thought) - partial_marker_length(thought, close)]
            return ReasoningSplit(thought.strip(), "")
        return ReasoningSplit(text[body:end].strip(), text[end + len(close) :].lstrip())


class ThinkTagParser(ReasoningParser):
    """vLLM's names for this one format: qwen3, deepseek_r1."""

    # The text that opens the thinking and the text that ends it.
    OPEN: ClassVar[str] = OPEN
    CLOSE: ClassVar[str] = CLOSE
    markers = (OPEN, CLOSE)
    open_marker = OPEN
    end_marker = grammar_marker = CLOSE

    def start_of(self, prompt: str) -> ThinkingStart:
        tail = prompt.rstrip()
        if tail.endswith(self.OPEN):
            return ThinkingStart.INSIDE
        if tail.endswith(self.CLOSE):
            return ThinkingStart.CLOSED
        return ThinkingStart.MAY_OPEN

    def reader(self, prompt: str) -> ThinkTagReader:
        return ThinkTagReader(self.start_of(prompt), self.OPEN, self.CLOSE)

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return cls.OPEN in chat_template or cls.CLOSE in chat_template


class Gemma4ThoughtParser(ThinkTagParser):
    """Gemma 4's thought channel (vLLM's name: gemma4). Its template turns thinking on with
    `enable_thinking` (a `<|think|>` in the system turn); the model then opens the channel
    itself, `<|channel>thought\n...<channel|>`, and answers after it. With thinking off the
    generation prompt closes an empty channel, as Qwen3's closes an empty `<think>`."""

    OPEN = "<|channel>thought"
    CLOSE = "<channel|>"
    markers = ("<|channel>", CLOSE)
    open_marker = "<|channel>"  # the one token that opens the channel
    end_marker = grammar_marker = CLOSE

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return cls.OPEN in chat_template and cls.CLOSE in chat_template
