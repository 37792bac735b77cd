"""Mistral calls, after the `[TOOL_CALLS]` marker, in either of Mistral's forms:

- older (Mistral 7B v0.3, Nemo, Small 3.1): a JSON list,
  `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (json_list.py's format);
- newer (tokenizers v11 and later: Small 3.2, Magistral, Devstral, Ministral 3): one
  marker per call, `[TOOL_CALLS]get_weather[ARGS]{...}`, v11 with `[CALL_ID]<id>`
  before `[ARGS]`.

Text before the marker is content, and a marker not followed by calls makes the rest of
the answer content (json_list.py)."""

from __future__ import annotations

import re
import secrets
import string

from iterserve.chat.tool_parsers.base import ParsedCall, call_from_object
from iterserve.chat.tool_parsers.json_list import JsonListToolParser, json_at, json_list_calls_at

MARKER = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9_\-]*)?(?:\[ARGS\])?")
_ID_CHARACTERS = string.ascii_letters + string.digits


class MistralToolParser(JsonListToolParser):
    name = "mistral"
    MARKER = MARKER

    def new_call_id(self) -> str:
        # Mistral's templates check the ids a client sends back: Nemo's raises unless an
        # id is nine letters or digits (vLLM's Mistral ids are the same).
        return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))

    def calls_at(self, text: str, pos: int) -> tuple[list[ParsedCall], int] | None:
        if text[pos:].lstrip().startswith("["):  # the older form
            return json_list_calls_at(text, pos)
        named = _NAMED.match(text, pos)
        if named is None:
            return None
        value, end = json_at(text, named.end())
        call = call_from_object({"name": named.group(1), "arguments": value}, ("arguments",))
        return None if call is None else ([call], end)
