"""Qwen3 (and QwQ-style hybrids with the same switch): the model opens its thinking itself,
`<think>\n...\n</think>\n\n` then the answer, and may answer without it. With
`enable_thinking: false` the template writes an empty block into the prompt
(`<think>\n\n</think>\n\n`), and the answer is all content."""

from __future__ import annotations

from iterserve.chat.reasoning_parsers.base import ReasoningParser, ThinkingStart


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    # No marker at the end of the prompt: the answer is content unless it opens with `<think>`.
    unmarked_start = ThinkingStart.MAY_OPEN
