"""Tool-call parsers, chosen with `--tool-call-parser`: one small class per output format."""

from __future__ import annotations

from iterserve.server.tool_parsers.base import ParsedCall, Piece, ToolParser
from iterserve.server.tool_parsers.hermes import HermesToolParser
from iterserve.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser)
}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS, "none")


def select_tool_parser(choice: str, chat_template: str | None) -> ToolParser | None:
    """The parser `--tool-call-parser choice` names; `auto` picks the one whose format
    the chat template asks for, and None when no template does (or `none`)."""
    if choice == "none":
        return None
    if choice != "auto":
        if choice not in TOOL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {choice!r}; choose from {', '.join(TOOL_PARSER_CHOICES)}"
            )
        return TOOL_PARSERS[choice]()
    for parser in TOOL_PARSERS.values():
        if chat_template and parser.detects(chat_template):
            return parser()
    return None


__all__ = [
    "TOOL_PARSERS",
    "TOOL_PARSER_CHOICES",
    "ParsedCall",
    "Piece",
    "ToolParser",
    "select_tool_parser",
]
