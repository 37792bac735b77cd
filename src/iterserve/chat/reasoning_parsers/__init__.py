"""Reasoning parsers, chosen with `--reasoning-parser`: where a thinking model's answer
keeps its thinking, so it goes to `reasoning_content` and the rest to `content`."""

from __future__ import annotations

from collections.abc import Callable

from iterserve.chat.reasoning_parsers.base import (
    ReasoningParser,
    ReasoningSplit,
    ThinkingReader,
    ThinkingStart,
)
from iterserve.chat.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from iterserve.chat.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from iterserve.chat.reasoning_parsers.streaming import ReasoningStream

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}
REASONING_PARSER_CHOICES = ("auto", *REASONING_PARSERS, "none")


def select_reasoning_parser(
    choice: str, chat_template: str | None, probe: Callable[[], str | None]
) -> ReasoningParser | None:
    """The parser `--reasoning-parser choice` names (None for `none`). `auto` reads
    thinking only where the chat template writes `<think>` or `</think>`: deepseek_r1's
    when the template's generation prompt opens the thinking (`probe()`, a one-message
    conversation rendered by the template, ends with `<think>`), qwen3's otherwise (the
    model opens it, or answers without). The two differ only in that default: a prompt
    that opens or closes the thinking decides for itself with either."""
    if choice == "none":
        return None
    if choice != "auto":
        if choice not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {choice!r}; choose from "
                f"{', '.join(REASONING_PARSER_CHOICES)}"
            )
        return REASONING_PARSERS[choice]()
    if not any(parser.detects(chat_template or "") for parser in REASONING_PARSERS.values()):
        return None
    probe_prompt = probe()
    if probe_prompt is not None and probe_prompt.rstrip().endswith(ReasoningParser.open_marker):
        return DeepSeekR1ReasoningParser()
    return Qwen3ReasoningParser()


__all__ = [
    "REASONING_PARSERS",
    "REASONING_PARSER_CHOICES",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStream",
    "ThinkingReader",
    "ThinkingStart",
    "select_reasoning_parser",
]
