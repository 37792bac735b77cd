"""A parameter value written as raw text (Qwen3-Coder's `<parameter=days>\n3\n</parameter>`)
as the JSON value the tool's schema says it is: `3` for an integer, `true` for a
boolean, an object for an object. Text that is not of the schema's type, or a parameter
the schema does not type, stays a string: the client validates the call anyway, and the
model's text is not lost."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from iterserve.chat.tool_parsers.python_literals import NotALiteral, parse_literal

_INTEGER = re.compile(r"[-+]?\d+")


def typed_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """`raw` as the first of the schema's types it reads as; else `raw` itself."""
    declared = (schema or {}).get("type")
    kinds = [declared] if isinstance(declared, str) else list(declared or [])
    for kind in kinds:
        reader = _READERS.get(kind)
        if reader is None:
            continue
        try:
            return reader(raw if kind == "string" else raw.strip())
        except ValueError:
            continue
    return raw


def _integer(text: str) -> int:
    if not _INTEGER.fullmatch(text):
        raise ValueError(text)
    return int(text)


def _number(text: str) -> int | float:
    value = _json(text)  # JSON's number syntax; JSONDecodeError is a ValueError
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(text)
    return value


def _json(text: str) -> Any:
    return json.loads(text, parse_constant=_not_json)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")  # json.loads takes NaN and Infinity


def _boolean(text: str) -> bool:
    # The template writes Python's str(True) for an earlier call's boolean.
    lowered = text.lower()
    if lowered not in ("true", "false"):
        raise ValueError(text)
    return lowered == "true"


def _null(text: str) -> None:
    if text not in ("null", "None"):
        raise ValueError(text)


def _structured(kind: type) -> Callable[[str], Any]:
    def read(text: str) -> Any:
        # JSON, or the Python repr the template writes for an earlier call's object.
        try:
            value = _json(text)
        except ValueError:
            try:
                value = parse_literal(text)
            except NotALiteral as error:
                raise ValueError(text) from error
        if not isinstance(value, kind):
            raise ValueError(text)
        return value

    return read


_READERS: dict[str, Callable[[str], Any]] = {
    "string": lambda text: text,
    "integer": _integer,
    "number": _number,
    "boolean": _boolean,
    "null": _null,
    "object": _structured(dict),
    "array": _structured(list),
}
