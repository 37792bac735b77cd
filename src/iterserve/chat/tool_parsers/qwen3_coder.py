"""Qwen3-Coder calls: XML inside Hermes' tags, one function per block,
`<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>`.

A parameter's value is raw text (no quotes, possibly many lines), so its type comes from
the request's tool schema (schema_values.py): this parser is bound to a request's tools
by `with_tools`. A block with a tag left open, or anything but parameters inside the
function, stays content."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from iterserve.chat.tool_parsers.base import ParsedCall, ToolParser
from iterserve.chat.tool_parsers.blocks import BlockToolParser
from iterserve.chat.tool_parsers.schema_values import typed_value

_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderToolParser(BlockToolParser):
    name = "qwen3_coder"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    markers = (OPEN,)
    call_format = (
        f"{OPEN}\n<function=<function name>>\n<parameter=<argument name>>\n<value>\n"
        f"</parameter>\n</function>\n{CLOSE}"
    )

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.schemas = schemas or {}  # each function's parameters schema, by name

    def with_tools(self, schemas: Mapping[str, Mapping[str, Any]]) -> ToolParser:
        return Qwen3CoderToolParser(schemas)

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        # Its template also says `<tool_call>`, as Hermes' does: the function tag tells.
        return cls.OPEN in chat_template and "<function=" in chat_template

    def write_call(self, function: Mapping[str, Any]) -> str:
        parameters = "".join(
            f"<parameter={key}>\n{_value_text(value)}\n</parameter>\n"
            for key, value in function["arguments"].items()
        )
        return f"{self.OPEN}\n<function={function['name']}>\n{parameters}</function>\n{self.CLOSE}"

    def read_block(self, body: str) -> list[ParsedCall] | None:
        function = _FUNCTION.fullmatch(body)
        if function is None:
            return None
        name, inside = function.groups()
        properties = _mapping(_mapping(self.schemas.get(name)).get("properties"))
        arguments: dict[str, Any] = {}
        pos = 0
        while parameter := _PARAMETER.match(inside, pos):
            key, raw = parameter.groups()
            if key in arguments or "<parameter=" in raw:  # a twin, or a tag left open
                return None
            # The template puts the value on lines of its own: those newlines are layout.
            raw = raw.removeprefix("\n").removesuffix("\n")
            arguments[key] = typed_value(raw, _mapping(properties.get(key)))
            pos = parameter.end()
        if inside[pos:].strip():
            return None
        return [ParsedCall(name, json.dumps(arguments, ensure_ascii=False))]


def _mapping(value: Any) -> Mapping[str, Any]:
    # A schema is the client's JSON: any level may be missing or not an object.
    return value if isinstance(value, Mapping) else {}


def _value_text(value: Any) -> str:
    # A string as it is (the format's point); anything else as JSON, which reads back.
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
