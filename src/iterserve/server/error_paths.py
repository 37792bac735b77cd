"""Reading where pydantic says a request went wrong: the path of a validation error, as
the field a client sent (shared by errors.py and the Responses and Messages requests'
own checks), and a chat request's field as those APIs name it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from iterserve.invalid_request import InvalidRequestError

Model = TypeVar("Model", bound=BaseModel)

# Pydantic names each member of a union it tried in an error's path, after the field:
# `str`, `list[str]`, a model's class name. The API's own field names are lower-case words.
_BUILTIN_TYPES = {"str", "int", "float", "bool", "dict", "list", "none"}


def is_union_member(part: str) -> bool:
    return part in _BUILTIN_TYPES or "[" in part or part[:1].isupper()


def field_path(loc: Sequence[object]) -> str:
    """`loc` as a dotted field name, without the union members pydantic tried."""
    return ".".join(str(part) for part in loc if not is_union_member(str(part)))


def renamed_chat_field(
    param: str | None, names: Mapping[str, str], tool_field: Callable[[str], str]
) -> str | None:
    """A chat-request field, as an API read as a chat request spells it (Responses',
    Anthropic's): `names` renames top-level fields (`messages`, whatever follows it: a
    message's index counts what the translation added or merged), `tool_field` a tool's
    path."""
    if param is None:
        return None
    head = param.split(".", 1)[0]
    if head == "tools":
        return tool_field(param)
    if head == "messages":
        return names.get(head, head)
    return names.get(head, param)


def validated(model: type[Model], raw: Any, where: str) -> Model:
    """`raw` read as `model`, part of a request at `where` (a dotted field path): what
    does not fit is a 400 naming the field inside it."""
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        first = error.errors()[0]
        param = f"{where}.{field_path(first['loc'])}".rstrip(".")
        raise InvalidRequestError(f"invalid value for '{param}': {first['msg']}", param) from None
