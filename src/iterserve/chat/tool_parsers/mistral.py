"""Mistral calls, after the `[TOOL_CALLS]` marker, in either of Mistral's forms:

- older (Mistral 7B v0.3, Nemo, Small 3.1): a JSON list,
  `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`;
- newer (tokenizers v11 and later: Small 3.2, Magistral, Devstral, Ministral 3): one
  marker per call, `[TOOL_CALLS]get_weather[ARGS]{...}`, v11 with `[CALL_ID]<id>`
  before `[ARGS]`.

Text before the marker is content. A marker that is not followed by calls makes the
rest of the answer content; while streaming, that rest is held to the end, since JSON
still being written cannot be told from JSON that will never close."""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping
from typing import Any, ClassVar

from iterserve.chat.tool_parsers.base import (
    ParsedCall,
    Piece,
    ToolParser,
    call_from_object,
    partial_marker_length,
)

MARKER = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9_\-]*)?(?:\[ARGS\])?")
_DECODER = json.JSONDecoder()
_ID_CHARACTERS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    markers: ClassVar[tuple[str, ...]] = (MARKER,)
    call_format = (
        f'{MARKER}[{{"name": <function name>, "arguments": <arguments as a JSON object>}}]'
    )

    def new_call_id(self) -> str:
        # Mistral's templates check the ids a client sends back: Nemo's raises unless an
        # id is nine letters or digits (vLLM's Mistral ids are the same).
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))

    def write_call(self, function: Mapping[str, Any]) -> str:
        call = {"name": function["name"], "arguments": function["arguments"]}
        return MARKER + json.dumps([call], ensure_ascii=False)

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (start := text.find(MARKER, pos)) >= 0:
            pieces.append(text[pos:start])
            read = _calls_at(text, start + len(MARKER))
            if read is None:  # not calls, or not yet
                return pieces + [text[start:]] if final else pieces
            calls, pos = read
            pieces += calls
        tail = text[pos:]
        held = 0 if final else partial_marker_length(tail, MARKER)
        pieces.append(tail[: len(tail) - held])
        return pieces


def _calls_at(text: str, pos: int) -> tuple[list[ParsedCall], int] | None:
    """The calls that start at `pos`, right after a marker, and where they end."""
    if text[pos:].lstrip().startswith("["):  # the older form
        value, end = _json_at(text, pos)
        if not isinstance(value, list) or not value:
            return None
        calls = [call_from_object(item, ("arguments", "parameters")) for item in value]
        if any(call is None for call in calls):
            return None
        return [call for call in calls if call is not None], end
    named = _NAMED.match(text, pos)
    if named is None:
        return None
    value, end = _json_at(text, named.end())
    call = call_from_object({"name": named.group(1), "arguments": value}, ("arguments",))
    return None if call is None else ([call], end)


def _json_at(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value at `pos` and where it ends; (None, pos) when there is none (yet)."""
    try:
        return _DECODER.raw_decode(text, len(text) - len(text[pos:].lstrip()))
    except json.JSONDecodeError:
        return None, pos
