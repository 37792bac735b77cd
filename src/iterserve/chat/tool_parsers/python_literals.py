"""Python literals as some models write argument values (pythonic calls, Qwen3-Coder's
objects): read with `ast`, never evaluated, and only what JSON can carry: strings,
numbers, booleans, None, lists and dicts with string keys. Anything else (a name, a
call, an operation, a tuple) is not a literal, and the text it is in stays content."""

from __future__ import annotations

import ast
import math
from typing import Any


class NotALiteral(ValueError):
    pass


def literal_value(node: ast.expr) -> Any:
    """The value `node` spells; NotALiteral when it is anything but a JSON-able literal."""
    if isinstance(node, ast.Constant) and _is_json_scalar(node.value):
        return node.value
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub | ast.UAdd)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
        and _is_json_scalar(node.operand.value)
    ):
        value = node.operand.value
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List):
        return [literal_value(element) for element in node.elts]
    if isinstance(node, ast.Dict):
        keys = [literal_value(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):  # JSON keys; None: `**spread`
            raise NotALiteral("a dict key that is not a string")
        return dict(zip(keys, (literal_value(value) for value in node.values), strict=True))
    raise NotALiteral(ast.dump(node))


def parse_expression(text: str) -> ast.expr:
    """`text` as one Python expression, unevaluated; NotALiteral if it is not Python."""
    try:
        return ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as error:
        raise NotALiteral(str(error)) from None


def parse_literal(text: str) -> Any:
    """The value of `text` as one Python literal; NotALiteral if it is not one."""
    return literal_value(parse_expression(text))


def literal_text(value: Any) -> str:
    """`value` (decoded JSON) written as a Python literal, which `parse_literal` reads back."""
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{literal_text(k)}: {literal_text(v)}" for k, v in value.items()) + "}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(literal_text(item) for item in value) + "]"
    return repr(value)


def _is_json_scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)  # 1e999 is inf, which JSON cannot say
    return value is None or isinstance(value, str | int | bool)
