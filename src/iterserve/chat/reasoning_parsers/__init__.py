"""The reasoning parser, chosen with `--reasoning-parser`: where a thinking model's answer
keeps its thinking, so it goes to `reasoning_content` and the rest to `content`. Qwen3's
and DeepSeek-R1's are one format (think_tags.py), under both of vLLM's names, and Gemma 4's
thought channel the same with its own markers; gpt-oss's channels are another (harmony.py)."""

from __future__ import annotations

from collections.abc import Callable

from iterserve.chat.reasoning_parsers.base import (
    ReasoningParser,
    ReasoningSplit,
    ThinkingReader,
    ThinkingStart,
)
from iterserve.chat.reasoning_parsers.harmony import HarmonyParser
from iterserve.chat.reasoning_parsers.streaming import ReasoningStream
from iterserve.chat.reasoning_parsers.think_tags import OPEN, Gemma4ThoughtParser, ThinkTagParser

# vLLM's names: the `<think>...</think>` format's two, and gpt-oss's.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": ThinkTagParser,
    "deepseek_r1": ThinkTagParser,
    "openai_gptoss": HarmonyParser,
    "gemma4": Gemma4ThoughtParser,
}
REASONING_PARSER_CHOICES = ("auto", *REASONING_PARSERS, "none")


def select_reasoning_parser(
    choice: str, chat_template: str | None, probe: Callable[[], str | None]
) -> ReasoningParser | None:
    """The parser `--reasoning-parser choice` names (None for `none`). `auto` reads
    Harmony's channels where the chat template writes them (gpt-oss), and `<think>`
    where it writes `<think>` or `</think>`, naming that one as vLLM would: deepseek_r1
    when the template's generation prompt opens the thinking (`probe()`, a one-message
    conversation rendered by the template, ends with `<think>`), qwen3 otherwise. Both
    read alike: each request's rendered prompt says where its answer starts."""
    if choice == "none":
        return None
    if choice != "auto":
        if choice not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {choice!r}; choose from "
                f"{', '.join(REASONING_PARSER_CHOICES)}"
            )
        return REASONING_PARSERS[choice](choice)
    template = chat_template or ""
    if HarmonyParser.detects(template):
        return HarmonyParser("openai_gptoss")
    if Gemma4ThoughtParser.detects(template):
        return Gemma4ThoughtParser("gemma4")
    if not ThinkTagParser.detects(template):
        return None
    probe_prompt = probe()
    opened = probe_prompt is not None and probe_prompt.rstrip().endswith(OPEN)
    return ThinkTagParser("deepseek_r1" if opened else "qwen3")


__all__ = [
    "REASONING_PARSERS",
    "REASONING_PARSER_CHOICES",
    "HarmonyParser",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStream",
    "ThinkTagParser",
    "ThinkingReader",
    "ThinkingStart",
    "select_reasoning_parser",
]
