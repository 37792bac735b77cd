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
    `parse_forced_answer` reads such an answer back into calls.

    The arguments take only the keys their tool declares (`closed`): a call with others
    fails where it is run (a Python function given an unknown keyword), and an open
    object lets a small model write keys until max_tokens cuts the call into plain text.
    vLLM's default grammar backend reads an unsaid `additionalProperties` as false too."""
    if isinstance(choice, NamedToolChoice):
        for tool in tools:
            if tool.function.name == choice.function.name:
                return closed(tool.function.parameters_schema())
        raise InvalidRequestError(
            f"tool_choice names {choice.function.name!r}, which is not one of the tools",
            "tool_choice",
        )
    one_call = []
    definitions: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        parameters, own = _hoisted(closed(tool.function.parameters_schema()), f"tool{index}.")
        definitions.update(own)
        one_call.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
    if definitions:
        schema["$defs"] = definitions
    if max_calls is not None:
        schema["maxItems"] = max_calls
    return schema


# Where a schema holds schemas: one under a key, a list of them, or a mapping of them.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def closed(schema: Any) -> Any:
    """`schema` with every object that lists its properties and says nothing of others
    closed to them (`additionalProperties: false`); a copy, the tool's own left as sent.
    An object without `properties` (a free-form mapping) stays open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if key in out:
            out[key] = closed(out[key])
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(part) for part in out[key]]
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(part) for name, part in out[key].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _hoisted(schema: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """A tool's parameters without their definitions (`$defs`, `definitions`), which the
    `required` form's root holds instead, renamed with `prefix` so tools' names do not
    meet; their local references (`#/$defs/X`) follow them. Nested under the list, the
    definitions would be out of reach of a reference from the root."""
    if not isinstance(schema, dict):
        return schema, {}
    definitions: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        for name, part in (schema.get(key) or {}).items():
            definitions[f"{prefix}{name}"] = part
    if not definitions:
        return schema, {}
    body = {key: value for key, value in schema.items() if key not in ("$defs", "definitions")}
    renamed = json.loads(
        json.dumps({"body": body, "definitions": definitions})
        .replace('"#/$defs/', f'"#/$defs/{prefix}')
        .replace('"#/definitions/', f'"#/$defs/{prefix}')
    )
    return renamed["body"], renamed["definitions"]


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
