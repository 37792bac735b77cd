"""Hermes / Qwen 2.5 / Qwen 3 calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, possibly after some text."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from iterserve.chat.tool_parsers.base import ParsedCall, call_from_object
from iterserve.chat.tool_parsers.blocks import BlockToolParser


class HermesToolParser(BlockToolParser):
    name = "hermes"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    markers = (OPEN,)
    call_format = (
        f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}'
    )

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        # Qwen3-Coder's template says `<tool_call>` too, around its XML calls.
        return cls.OPEN in chat_template and "<function=" not in chat_template

    def write_call(self, function: Mapping[str, Any]) -> str:
        call = {"name": function["name"], "arguments": function["arguments"]}
        return f"{self.OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{self.CLOSE}"

    def read_block(self, body: str) -> list[ParsedCall] | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        call = call_from_object(value, ("arguments", "parameters"))
        return None if call is None else [call]
