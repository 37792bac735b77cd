"""Hermes / Qwen 2.5 / Qwen 3 calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, possibly after some text. A block that does not hold a call stays
content, tags and all, so nothing the model wrote is lost."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from iterserve.chat.tool_parsers.base import (
    Piece,
    ToolParser,
    call_from_object,
    partial_marker_length,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    markers: ClassVar[tuple[str, ...]] = (OPEN,)
    call_format = (
        f'{OPEN}\n{{"name": <function name>, "arguments": <arguments as a JSON object>}}\n{CLOSE}'
    )

    def write_call(self, function: dict[str, Any]) -> str:
        call = {"name": function["name"], "arguments": function["arguments"]}
        return f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}"

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        pos = 0
        while (start := text.find(OPEN, pos)) >= 0:
            pieces.append(text[pos:start])
            body = start + len(OPEN)
            end = text.find(CLOSE, body)
            if end < 0:
                if final:  # the answer ended inside the block: a call if it is whole
                    call = self._call(text[body:])
                    pieces.append(call or text[start:])
                return pieces
            call = self._call(text[body:end])
            pos = end + len(CLOSE)
            pieces.append(call or text[start:pos])
        tail = text[pos:]
        held = 0 if final else partial_marker_length(tail, OPEN)
        pieces.append(tail[: len(tail) - held])
        return pieces

    @staticmethod
    def _call(body: str) -> Piece | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        return call_from_object(value, ("arguments", "parameters"))
