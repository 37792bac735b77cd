"""Llama 3.1 / 3.2 JSON calls: the whole answer is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several separated by `;`. An answer that does not
start with a call is content; text after the last call that is not another call stays
content too."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from iterserve.chat.tool_parsers.base import Piece, ToolParser, call_from_object

PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = ("parameters", "arguments")
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers: ClassVar[tuple[str, ...]] = (PYTHON_TAG,)
    call_format = '{"name": <function name>, "parameters": <arguments as a JSON object>}'

    def write_call(self, function: Mapping[str, Any]) -> str:
        call = {"name": function["name"], "parameters": function["arguments"]}
        return json.dumps(call, ensure_ascii=False)

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        # Llama 3.1/3.2 templates tell the model to answer with this JSON; the python
        # tag alone marks 3.1's built-in tools, which another format serves.
        return '"parameters": dictionary of argument name and its value' in chat_template

    def scan(self, text: str, final: bool) -> list[Piece]:
        start = len(text) - len(text.lstrip())
        if text.startswith(PYTHON_TAG, start):
            start += len(PYTHON_TAG)
        elif not final and PYTHON_TAG.startswith(text[start:]):
            return []  # nothing yet, or the start of the tag
        pieces: list[Piece] = []
        pos = start
        while True:
            brace = len(text) - len(text[pos:].lstrip())
            if brace == len(text):  # nothing after the last call (yet)
                if final and not pieces:
                    return [text]
                return pieces
            if text[brace] != "{":
                return pieces + [text[pos:] if pieces else text]
            try:
                value, end = _DECODER.raw_decode(text, brace)
            except json.JSONDecodeError:
                if not final:
                    return pieces  # an object still being written
                return pieces + [text[pos:] if pieces else text]
            call = call_from_object(value, _ARGUMENT_KEYS)
            if call is None:
                return pieces + [text[pos:] if pieces else text]
            pieces.append(call)
            pos = end
            after = text[pos:].lstrip()
            if after.startswith(";"):
                pos = len(text) - len(after) + 1
