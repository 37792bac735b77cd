"""Forced calls (`tool_choice` `required` or a named function): the JSON schema the answer
must follow, and the parser that reads such an answer back into calls. Decoding
constrained to the schema makes the answer valid; this module only says what valid is."""

from __future__ import annotations

import json
from typing import Any

from iterserve.chat.tool_parsers.base import (
    AnswerReader,
    ParsedCall,
    Piece,
    ToolParser,
    call_from_object,
)
from iterserve.chat.tool_protocol import NamedToolChoice, ToolDefinition
from iterserve.sampling_params import InvalidRequestError


def forced_call_schema(
    tools: list[ToolDefinition], choice: str | NamedToolChoice, max_calls: int | None
) -> dict[str, Any]:
    """The JSON the answer must be when a call is forced, as vLLM shapes it: for a named
    function, that function's arguments object; for `required`, a list of one or more
    {"name": ..., "parameters": {...}} objects, each a tool with its own schema.
    `parse_forced_answer` reads such an answer back into calls."""
    if isinstance(choice, NamedToolChoice):
        for tool in tools:
            if tool.function.name == choice.function.name:
                return tool.function.parameters_schema()
        raise InvalidRequestError(
            f"tool_choice names {choice.function.name!r}, which is not one of the tools",
            "tool_choice",
        )
    one_call = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters_schema(),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


def parse_forced_answer(text: str, choice: str | NamedToolChoice) -> list[ParsedCall]:
    """The calls in an answer constrained by `forced_call_schema(.., choice, ..)`; an
    answer that is not one (cut short by max_tokens) gives no calls."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    if isinstance(choice, NamedToolChoice):
        if not isinstance(value, dict):
            return []
        return [ParsedCall(choice.function.name, json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list):
        return []
    calls = [call_from_object(item, ("parameters",)) for item in value]
    return [call for call in calls if call is not None]


class ForcedCallReader(AnswerReader):
    """The whole answer is the call(s), as JSON: nothing is certain before its end. The
    calls get ids as the model's own format has them (`call_format`), so a template that
    checks ids takes them back."""

    def __init__(self, choice: str | NamedToolChoice, call_format: ToolParser) -> None:
        self.choice = choice
        self.call_format = call_format

    def new_call_id(self) -> str:
        return self.call_format.new_call_id()

    def scan(self, text: str, final: bool) -> list[Piece]:
        if not final:
            return []
        forced = parse_forced_answer(text, self.choice)
        if forced:
            return list(forced)
        # The grammar starts after a thinking model's thinking; gpt-oss may instead call in
        # its own format, which its grammar never saw: its calls of the right tools count.
        native = self.call_format.scan(text, final=True)
        if any(isinstance(piece, ParsedCall) and self._allows(piece) for piece in native):
            return [p for p in native if not isinstance(p, ParsedCall) or self._allows(p)]
        # An answer cut short by max_tokens is not JSON: the client gets it as content.
        return [text]

    def _allows(self, call: ParsedCall) -> bool:
        named = isinstance(self.choice, NamedToolChoice)
        return not named or call.name == self.choice.function.name
