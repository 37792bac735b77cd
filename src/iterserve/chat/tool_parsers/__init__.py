"""Tool-call parsers, chosen with `--tool-call-parser`: one small class per output format."""

from __future__ import annotations

from iterserve.chat.tool_parsers.base import (
    AnswerReader,
    ParsedCall,
    Piece,
    ToolParser,
    shows_tool_calls,
    shows_tools,
)
from iterserve.chat.tool_parsers.deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from iterserve.chat.tool_parsers.gemma4 import Gemma4ToolParser
from iterserve.chat.tool_parsers.hermes import HermesToolParser
from iterserve.chat.tool_parsers.json_list import GraniteToolParser, Phi4MiniJsonToolParser
from iterserve.chat.tool_parsers.llama3_json import Llama3JsonToolParser
from iterserve.chat.tool_parsers.mistral import MistralToolParser
from iterserve.chat.tool_parsers.openai import OpenAIToolParser
from iterserve.chat.tool_parsers.pythonic import PythonicToolParser
from iterserve.chat.tool_parsers.qwen3_coder import Qwen3CoderToolParser

# The families' real templates each match exactly one `detects` (tests check it), so the
# order here is only the order of the CLI's choices.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        PythonicToolParser,
        Qwen3CoderToolParser,
        DeepSeekV3ToolParser,
        DeepSeekV31ToolParser,
        GraniteToolParser,
        Phi4MiniJsonToolParser,
        OpenAIToolParser,
        Gemma4ToolParser,
    )
}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS, "none")


def select_tool_parser(choice: str, chat_template: str | None) -> ToolParser | None:
    """The parser `--tool-call-parser choice` names (None for `none`). `auto` picks the
    format the chat template asks for; a template with no place for tools gets Hermes',
    which the system message then teaches (tool_prompt.py); a template that shows tools
    in a format no parser here reads gets None."""
    if choice == "none":
        return None
    if choice != "auto":
        if choice not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {choice!r}; choose from {', '.join(TOOL_PARSER_CHOICES)}"
            )
        return TOOL_PARSERS[choice]()
    template = chat_template or ""
    for parser in TOOL_PARSERS.values():
        if parser.detects(template):
            return parser()
    return None if shows_tools(template) else HermesToolParser()


__all__ = [
    "AnswerReader",
    "TOOL_PARSERS",
    "TOOL_PARSER_CHOICES",
    "ParsedCall",
    "Piece",
    "ToolParser",
    "select_tool_parser",
    "shows_tool_calls",
    "shows_tools",
]
