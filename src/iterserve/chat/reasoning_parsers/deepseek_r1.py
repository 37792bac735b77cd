"""DeepSeek-R1 and its distills (QwQ too): the template ends the generation prompt with
`<think>\n`, so the answer starts inside the thinking, with no opening tag, and runs to
`</think>`. An answer that never writes `</think>` (cut by max_tokens) is all reasoning."""

from __future__ import annotations

from iterserve.chat.reasoning_parsers.base import ReasoningParser, ThinkingStart


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    # R1 always thinks: with a template that does not open the block, the model still
    # starts in it (it may write `<think>` first, which is dropped).
    unmarked_start = ThinkingStart.INSIDE
