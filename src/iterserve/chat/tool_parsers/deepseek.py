"""DeepSeek's calls, in one block per answer, one inner block per call:

- V3 / R1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather`
  then the arguments in a JSON fence (a newline, three backticks and `json`, the object,
  a newline and three backticks), then `<｜tool▁call▁end｜>`, ..., `<｜tool▁calls▁end｜>`;
- V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}`
  `<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.

Each call says which form it is in (an object right after the separator is V3.1's), so
both parsers read both. They differ in what they write and teach: DeepSeek's templates
have no place for tools, so the system message teaches the model its format
(tool_prompt.py), and V3 and V3.1 models learned different ones. The calls are sent once
the whole block has closed: a call that does not read makes the whole block content."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from iterserve.chat.tool_parsers.base import ParsedCall, call_from_object
from iterserve.chat.tool_parsers.blocks import BlockToolParser

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"

_CALL = re.compile(
    rf"\s*{re.escape(CALL_BEGIN)}(.*?){re.escape(SEP)}(.*?){re.escape(CALL_END)}", re.DOTALL
)
# V3's part after the separator: the name, then the arguments in a JSON fence.
_FENCED = re.compile(rf"(\S+?)\s*{FENCE}(?:json)?\s*(.*?)\s*{FENCE}", re.DOTALL)


class DeepSeekV3ToolParser(BlockToolParser):
    name = "deepseek_v3"
    OPEN = CALLS_BEGIN
    CLOSE = CALLS_END
    markers = (OPEN,)
    call_format = (
        f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}<function name>\n{FENCE}json\n"
        f"<arguments as a JSON object>\n{FENCE}{CALL_END}{CALLS_END}"
    )

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        # V3's and R1's templates write earlier calls' arguments in the fence.
        return cls.OPEN in chat_template and f"{FENCE}json" in chat_template

    def write_call(self, function: Mapping[str, Any]) -> str:
        arguments = json.dumps(function["arguments"], ensure_ascii=False)
        return (
            f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}{function['name']}\n{FENCE}json\n"
            f"{arguments}\n{FENCE}{CALL_END}{CALLS_END}"
        )

    def read_block(self, body: str) -> list[ParsedCall] | None:
        calls = []
        pos = 0
        while found := _CALL.match(body, pos):
            call = _read_call(*found.groups())
            if call is None:
                return None
            calls.append(call)
            pos = found.end()
        if not calls or body[pos:].strip():
            return None
        return calls


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseek_v31"
    call_format = (
        f"{CALLS_BEGIN}{CALL_BEGIN}<function name>{SEP}<arguments as a JSON object>"
        f"{CALL_END}{CALLS_END}"
    )

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        return cls.OPEN in chat_template and f"{FENCE}json" not in chat_template

    def write_call(self, function: Mapping[str, Any]) -> str:
        arguments = json.dumps(function["arguments"], ensure_ascii=False)
        return f"{CALLS_BEGIN}{CALL_BEGIN}{function['name']}{SEP}{arguments}{CALL_END}{CALLS_END}"


def _read_call(head: str, rest: str) -> ParsedCall | None:
    if rest.lstrip().startswith("{"):  # V3.1: the name, then the arguments
        name, arguments = head.strip(), rest
    else:  # V3: the call's type, then the name and the fenced arguments
        fenced = _FENCED.fullmatch(rest.strip())
        if fenced is None:
            return None
        name, arguments = fenced.groups()
    if not name or any(char.isspace() for char in name):
        return None
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return call_from_object({"name": name, "arguments": value}, ("arguments",))
