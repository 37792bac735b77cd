"""Pythonic calls: a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), get_time()]`. Either the answer starts with it (Llama 3.2 /
4 and Gemma 3 served with a template that asks for `[func_name1(params_name1=...)]`),
or it sits between LFM2's markers, `<|tool_call_start|>[...]<|tool_call_end|>`,
anywhere in the answer (Liquid's LFM2 / LFM2.5 templates).

The list is read with `ast`, never evaluated: arguments must be literals
(python_literals.py). A list that is not calls, or a call with a positional or
non-literal argument, leaves the text as content."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any

from iterserve.chat.tool_parsers.base import ParsedCall, Piece
from iterserve.chat.tool_parsers.blocks import BlockToolParser
from iterserve.chat.tool_parsers.python_literals import (
    NotALiteral,
    literal_text,
    literal_value,
    parse_expression,
)


class PythonicToolParser(BlockToolParser):
    name = "pythonic"
    OPEN = "<|tool_call_start|>"
    CLOSE = "<|tool_call_end|>"
    markers = (OPEN,)
    call_format = "[<function name>(<argument>=<value as a Python literal>, ...), ...]"

    def write_call(self, function: Mapping[str, Any]) -> str:
        arguments = ", ".join(
            f"{key}={literal_text(value)}" for key, value in function["arguments"].items()
        )
        return f"[{function['name']}({arguments})]"

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        # LFM2's templates write earlier calls inside the markers; templates that teach
        # the bare form quote Meta's and Google's wording of it.
        return f"{cls.OPEN}[" in chat_template or "[func_name1(" in chat_template

    def read_block(self, body: str) -> list[ParsedCall] | None:
        return read_call_list(body)

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        read = 0  # how much of the text the bare lists so far account for
        start = len(text) - len(text.lstrip())
        while text.startswith("[", start):
            end = list_end(text, start)
            if end is None and not final:
                return pieces  # a list still being written: calls, or not, once it closes
            calls = None if end is None else read_call_list(text[start:end])
            if calls is None or end is None:
                break
            pieces += calls
            read = end
            start = len(text) - len(text[end:].lstrip())
        # After the bare calls (or with none), the rest is content and LFM2 blocks.
        return pieces + super().scan(text[read:], final)


def read_call_list(source: str) -> list[ParsedCall] | None:
    """The calls a pythonic list spells; None when it is not one."""
    try:
        tree = parse_expression(source)
    except NotALiteral:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        if any(keyword.arg is None for keyword in node.keywords):  # `**spread`
            return None
        try:
            arguments = {keyword.arg: literal_value(keyword.value) for keyword in node.keywords}
        except NotALiteral:
            return None
        calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


_OPENING, _CLOSING = "([{", ")]}"


def list_end(text: str, start: int) -> int | None:
    """Where the bracket opened at `start` closes (the index after it), skipping quoted
    strings; None while it is still open. Only finds the span: `ast` then judges it."""
    depth = 0
    quote = ""
    pos = start
    while pos < len(text):
        char = text[pos]
        if quote:
            if char == "\\":
                pos += 1  # the escaped character cannot end the string
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in _OPENING:
            depth += 1
        elif char in _CLOSING:
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    return None
