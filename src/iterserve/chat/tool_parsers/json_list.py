"""Formats that write their calls as one JSON list after a marker, possibly after some text:
Granite's `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`, Phi-4-mini's
`functools[...]`, and Mistral's older `[TOOL_CALLS] [...]` (mistral.py, which also reads
Mistral's newer form). A marker not followed by such a list makes the rest of the answer
content; while streaming, that rest is held to the end, since JSON still being written
cannot be told from JSON that will never close."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from iterserve.chat.streamed_text import partial_marker_length
from iterserve.chat.tool_parsers.base import ParsedCall, Piece, ToolParser, call_from_object

_DECODER = json.JSONDecoder()


def json_at(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value at `pos` (after any whitespace) and where it ends; (None, pos) when
    there is none (yet)."""
    try:
        return _DECODER.raw_decode(text, len(text) - len(text[pos:].lstrip()))
    except json.JSONDecodeError:
        return None, pos


def json_list_calls_at(text: str, pos: int) -> tuple[list[ParsedCall], int] | None:
    """The calls of a JSON list of {"name", "arguments" or "parameters"} objects at `pos`,
    and where the list ends; None when there is no such list there (or not yet)."""
    value, end = json_at(text, pos)
    if not isinstance(value, list) or not value:
        return None
    calls = [call_from_object(item, ("arguments", "parameters")) for item in value]
    if any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None], end


class JsonListToolParser(ToolParser):
    MARKER: ClassVar[str]  # a subclass names it; its markers and call format follow

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.markers = (cls.MARKER,)
        cls.call_format = (
            f'{cls.MARKER}[{{"name": <function name>, "arguments": <arguments as a JSON object>}}]'
        )

    def write_call(self, function: Mapping[str, Any]) -> str:
        call = {"name": function["name"], "arguments": function["arguments"]}
        return self.MARKER + json.dumps([call], ensure_ascii=False)

    def calls_at(self, text: str, pos: int) -> tuple[list[ParsedCall], int] | None:
        """The calls right after a marker at `pos`, and where they end."""
        return json_list_calls_at(text, pos)

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (start := text.find(self.MARKER, pos)) >= 0:
            pieces.append(text[pos:start])
            read = self.calls_at(text, start + len(self.MARKER))
            if read is None:  # not calls, or not yet
                return pieces + [text[start:]] if final else pieces
            calls, pos = read
            pieces += calls
        tail = text[pos:]
        held = 0 if final else partial_marker_length(tail, self.MARKER)
        pieces.append(tail[: len(tail) - held])
        return pieces


class GraniteToolParser(JsonListToolParser):
    """Granite 3.x: its template asks for `<|tool_call|>` followed by a JSON list."""

    name = "granite"
    MARKER = "<|tool_call|>"


class Phi4MiniJsonToolParser(JsonListToolParser):
    """Phi-4-mini: `functools[...]`, the list right after the word (vLLM's phi4_mini_json).
    `auto` never picks it: its marker is a plain word any template may hold. Name it."""

    name = "phi4_mini_json"
    MARKER = "functools"

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return False
