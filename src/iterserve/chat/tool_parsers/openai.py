"""gpt-oss's calls (vLLM's `openai` parser): a Harmony message to a function,
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>`.

The reasoning parser reads Harmony's channels first (chat/reasoning_parsers/harmony.py) and
hands each whole call on in this one form, whichever of Harmony's headers the model wrote;
it is also how the chat template writes earlier calls. A call to another namespace (a
built-in tool this server does not run) or with arguments that are not a JSON object stays
content, so nothing the model wrote is lost."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from iterserve.chat.harmony import CALL, CHANNEL, MESSAGE, START, call_text
from iterserve.chat.tool_parsers.base import ParsedCall
from iterserve.chat.tool_parsers.blocks import BlockToolParser

_NAMESPACE = "functions."


class OpenAIToolParser(BlockToolParser):
    name = "openai"
    OPEN = f"{START}assistant to="
    CLOSE = CALL
    markers = (START, CHANNEL, MESSAGE)
    call_format = call_text(f"{_NAMESPACE}<function name>", "<arguments as a JSON object>")

    @classmethod
    def detects(cls, chat_template: str) -> bool:
        # gpt-oss's template writes a call's header in pieces: "<|start|>assistant to=",
        # then "functions." + name + "<|channel|>commentary ".
        return f"{CHANNEL}commentary" in chat_template and " to=" in chat_template

    def write_call(self, function: Mapping[str, Any]) -> str:
        arguments = json.dumps(function["arguments"], ensure_ascii=False)
        return call_text(_NAMESPACE + function["name"], arguments)

    def read_block(self, body: str) -> list[ParsedCall] | None:
        header, found, arguments = body.partition(MESSAGE)
        recipient = header.split(CHANNEL)[0].strip()
        if not found or not recipient.startswith(_NAMESPACE):
            return None
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict):
            return None
        name = recipient[len(_NAMESPACE) :]
        return [ParsedCall(name, json.dumps(value, ensure_ascii=False))]
