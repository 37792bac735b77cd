"""Gemma 4's calls: `<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>`,
one block a call, anywhere in the answer.

The arguments are Gemma's own notation, which its chat template writes for earlier calls and
tool declarations: an object's keys bare, strings between `<|"|>` tokens (so a string may
hold any character, quotes and braces included), numbers, `true`/`false`/`null`, `{...}` and
`[...]` nested. A block whose body does not read as one call stays content."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from iterserve.chat.tool_parsers.base import ParsedCall
from iterserve.chat.tool_parsers.blocks import BlockToolParser

QUOTE = '<|"|>'
_CALL = "call:"
_SCALARS = {"true": True, "false": False, "null": None}


class Gemma4ToolParser(BlockToolParser):
    name = "gemma4"
    OPEN = "<|tool_call>"
    CLOSE = "<tool_call|>"
    markers = (OPEN,)
    call_format = f"{OPEN}call:<function name>{{<argument>:<value>,...}}{CLOSE}"

    def write_call(self, function: Mapping[str, Any]) -> str:
        arguments = ",".join(f"{k}:{write_value(v)}" for k, v in function["arguments"].items())
        return f"{self.OPEN}{_CALL}{function['name']}{{{arguments}}}{self.CLOSE}"

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return f"{cls.OPEN}{_CALL}" in chat_template

    def read_block(self, body: str) -> list[ParsedCall] | None:
        body = body.strip()
        brace = body.find("{")
        name = body[len(_CALL) : brace].strip()
        if not body.startswith(_CALL) or brace < 0 or not name:
            return None
        try:
            arguments, end = _read(body, brace)
        except (ValueError, IndexError):
            return None
        if body[end:].strip() or not isinstance(arguments, dict):
            return None
        return [ParsedCall(name, json.dumps(arguments))]


def write_value(value: Any) -> str:
    """A JSON value in Gemma's notation (as its template's format_argument writes one)."""
    if isinstance(value, str):
        return f"{QUOTE}{value}{QUOTE}"
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{write_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(write_value(v) for v in value) + "]"
    return json.dumps(value)


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _read(text: str, pos: int) -> tuple[Any, int]:
    """The value at `pos` (whitespace before it skipped) and where it ends; ValueError or
    IndexError where the text is not one."""
    pos = _skip(text, pos)
    if text.startswith(QUOTE, pos):
        end = text.index(QUOTE, pos + len(QUOTE))
        return text[pos + len(QUOTE) : end], end + len(QUOTE)
    if text[pos] == "{":
        return _read_object(text, pos + 1)
    if text[pos] == "[":
        return _read_array(text, pos + 1)
    end = pos
    while end < len(text) and text[end] not in ",}]":
        end += 1
    word = text[pos:end].strip()
    if word in _SCALARS:
        return _SCALARS[word], end
    number = json.loads(word)  # ValueError: not a number either
    if not isinstance(number, int | float) or not math.isfinite(number):
        raise ValueError(word)  # a JSON string, or Python's Infinity / NaN: not Gemma's
    return number, end


def _read_object(text: str, pos: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    pos = _skip(text, pos)
    if text[pos] == "}":
        return out, pos + 1
    while True:
        pos = _skip(text, pos)
        if text.startswith(QUOTE, pos):  # a key written quoted
            key, pos = _read(text, pos)
            colon = _skip(text, pos)
        else:
            colon = text.index(":", pos)
            key = text[pos:colon].strip()
            if any(c in key for c in ',{}[]"'):
                raise ValueError(f"not a key: {key!r}")
        if text[colon] != ":" or not key:
            raise ValueError("a key without its value")
        out[key], pos = _read(text, colon + 1)
        pos = _skip(text, pos)
        if text[pos] == "}":
            return out, pos + 1
        if text[pos] != ",":
            raise ValueError("expected , or }")
        pos += 1


def _read_array(text: str, pos: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    pos = _skip(text, pos)
    if text[pos] == "]":
        return out, pos + 1
    while True:
        value, pos = _read(text, pos)
        out.append(value)
        pos = _skip(text, pos)
        if text[pos] == "]":
            return out, pos + 1
        if text[pos] != ",":
            raise ValueError("expected , or ]")
        pos += 1
