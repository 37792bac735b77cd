"""Reading where pydantic says a request went wrong: the path of a validation error, as
the field a client sent (shared by errors.py and the Responses request's own checks)."""

from __future__ import annotations

from collections.abc import Sequence

# Pydantic names each member of a union it tried in an error's path, after the field:
# `str`, `list[str]`, a model's class name. The API's own field names are lower-case words.
_BUILTIN_TYPES = {"str", "int", "float", "bool", "dict", "list", "none"}


def is_union_member(part: str) -> bool:
    return part in _BUILTIN_TYPES or "[" in part or part[:1].isupper()


def field_path(loc: Sequence[object]) -> str:
    """`loc` as a dotted field name, without the union members pydantic tried."""
    return ".".join(str(part) for part in loc if not is_union_member(str(part)))
