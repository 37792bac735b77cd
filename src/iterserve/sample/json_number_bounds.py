"""How many digits a JSON number may have: the bound that makes a small model's JSON end.

A JSON schema's grammar lets a number run on for ever (`"population": 1111111...`), and
a small model at temperature 0 loops on digits until `max_tokens`. llama.cpp's JSON
grammar bounds them (an integral part of at most 16 digits without a leading zero, a
fraction of at most 16); so does iterserve, with these caps (docs/structured_output.md):

- 16 integral digits write every integer a double holds exactly (2^53 ~ 9.0e15 has 16
  digits; so has JavaScript's largest safe integer) and any integer a JSON parser
  reading into a double can keep.
- 16 fraction digits plus one integral digit are 17 significant digits, enough to write
  any double in scientific form so that it reads back unchanged
  (`d.dddddddddddddddde-123`).
- 3 exponent digits reach every finite double (10^-324 to 10^308); a fourth could only
  write infinity or zero.

The schema's own numbers raise the caps to one digit more than the longest of them (the
neighbour of an exclusive bound may need it): a `maximum` of 9223372036854775807 allows
20 integral digits, an `exclusiveMinimum` of 1e-20 21 fraction digits, so a bound a
schema sets stays satisfiable.

The bound is lexical, one regular language over the whole output: strings are free,
every number outside them is bounded. The grammar compiler intersects it with the
schema's grammar (sample/structured.py), so it holds wherever a number is: properties,
items, anyOf branches, $defs, additionalProperties, any JSON at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

INTEGRAL_DIGITS = 16
FRACTION_DIGITS = 16
EXPONENT_DIGITS = 3

# A JSON string, permissively: the schema's grammar checks its escapes.
_STRING = r'"(?:[^"\\]|\\.)*"'
# One character outside strings that is neither a string's start nor a number's.
_OTHER = r'[^"0-9\-]'
# What may follow a number: anything that cannot continue one (so two numbers never
# join into one longer than the cap) and is no string's start.
_AFTER_NUMBER = r'[^"0-9.eE+\-]'


@dataclass(frozen=True)
class NumberBounds:
    """The most digits a number may have in each of its parts."""

    integral_digits: int = INTEGRAL_DIGITS
    fraction_digits: int = FRACTION_DIGITS
    exponent_digits: int = EXPONENT_DIGITS

    @classmethod
    def for_schema(cls, schema: Any) -> NumberBounds:
        """The default caps, raised where a number the schema writes (a bound, a
        `multipleOf`, a `const` or `enum` value) needs more digits than they allow."""
        integral, fraction = INTEGRAL_DIGITS, FRACTION_DIGITS
        for value in _numbers_in(schema):
            value_integral, value_fraction = _digits(value)
            # One more than the number itself: an exclusive bound's neighbours need it.
            if value_integral >= integral:
                integral = value_integral + 1
            if value_fraction >= fraction:
                fraction = value_fraction + 1
        return cls(integral, fraction)

    def number_regex(self) -> str:
        """A JSON number within the caps (leading zeros refused, as JSON does)."""
        return (
            rf"-?(?:0|[1-9][0-9]{{0,{self.integral_digits - 1}}})"
            rf"(?:\.[0-9]{{1,{self.fraction_digits}}})?"
            rf"(?:[eE][+-]?[0-9]{{1,{self.exponent_digits}}})?"
        )

    def text_regex(self) -> str:
        """Any text whose numbers outside strings are within the caps: strings, other
        characters, and numbers each followed by a character that cannot extend them
        (or by the end). It says nothing else about JSON; the schema's grammar does."""
        number = self.number_regex()
        return rf"(?:{_STRING}|{_OTHER}|{number}{_AFTER_NUMBER})*(?:{number})?"


def _numbers_in(value: Any) -> list[int | float]:
    """Every number anywhere in a JSON value (keys are strings: never numbers)."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [value]
    if isinstance(value, dict):
        return [n for item in value.values() for n in _numbers_in(item)]
    if isinstance(value, list):
        return [n for item in value for n in _numbers_in(item)]
    return []


def _digits(value: int | float) -> tuple[int, int]:
    """(integral digits, fraction digits) of `value` written out in plain decimal."""
    if isinstance(value, int):
        return len(str(abs(value))), 0
    if not math.isfinite(value):
        return 0, 0  # JSON has no such number; the schema's grammar refuses it
    _, digits, exponent = Decimal(repr(value)).as_tuple()
    assert isinstance(exponent, int)
    return max(len(digits) + exponent, 1), max(-exponent, 0)
