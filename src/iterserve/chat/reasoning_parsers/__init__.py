"""The reasoning parser, chosen with `--reasoning-parser`: where a thinking model's answer
keeps its thinking, so it goes to `reasoning_content` and the rest to `content`. Qwen3's
and DeepSeek-R1's are one format (base.py), under both of vLLM's names."""

from __future__ import annotations

from collections.abc import Callable

from iterserve.chat.reasoning_parsers.base import (
    ReasoningParser,
    ReasoningSplit,
    ThinkingReader,
    ThinkingStart,
)
from iterserve.chat.reasoning_parsers.streaming import ReasoningStream

# vLLM's names for the `<think>...</think>` format (base.py).
REASONING_PARSERS = ("qwen3", "deepseek_r1")
REASONING_PARSER_CHOICES = ("auto", *REASONING_PARSERS, "none")


def select_reasoning_parser(
    choice: str, chat_template: str | None, probe: Callable[[], str | None]
) -> ReasoningParser | None:
    """The parser `--reasoning-parser choice` names (None for `none`). `auto` reads
    thinking only where the chat template writes `<think>` or `</think>`, and names it as
    vLLM would: deepseek_r1 when the template's generation prompt opens the thinking
    (`probe()`, a one-message conversation rendered by the template, ends with `<think>`),
    qwen3 otherwise. Both read alike: each request's rendered prompt says where its answer
    starts."""
    if choice == "none":
        return None
    if choice != "auto":
        if choice not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {choice!r}; choose from "
                f"{', '.join(REASONING_PARSER_CHOICES)}"
            )
        return ReasoningParser(choice)
    if not ReasoningParser.detects(chat_template or ""):
        return None
    probe_prompt = probe()
    opened = probe_prompt is not None and probe_prompt.rstrip().endswith(
        ReasoningParser.open_marker
    )
    return ReasoningParser("deepseek_r1" if opened else "qwen3")


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
