"""JSON that ends: numbers' digits bounded as llama.cpp's JSON grammar bounds them, a
schema's own limits honoured, what the compiler cannot enforce refused naming the field.

Every check feeds text, as the bundled tokenizer's tokens, to the compiled constraint
through StructuredBatch (the schema's matcher and its number bound together, as the
executor uses them), with no model. In this vocabulary every digit is its own token,
so a refusal lands on exactly one digit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from iterserve.sample.json_number_bounds import NumberBounds
from iterserve.sample.structured import GrammarCompiler, StructuredBatch, _Rows
from iterserve.sampling_params import InvalidRequestError
from iterserve.structured_output import StructuredOutput

VOCAB = 49152
DIGITS_16 = "1234567890123456"


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    from iterserve.model.tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])


def _spec(schema: dict[str, Any] | None) -> StructuredOutput:
    if schema is None:
        return StructuredOutput(json_object=True)
    return StructuredOutput.from_json_schema(schema, "response_format")


def _batch(compiler: GrammarCompiler, schema: dict[str, Any] | None) -> StructuredBatch:
    batch = StructuredBatch()
    batch.add("r", compiler.compile(_spec(schema)))
    return batch


def accepted(compiler: GrammarCompiler, schema: dict[str, Any] | None, text: str) -> str:
    """The longest prefix of `text` (in whole tokens) the constraint accepts, plus
    "<end>" where it accepts all of it as a complete output (EOS next)."""
    tokenizer = compiler._hf_tokenizer
    tokens = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    valid = _batch(compiler, schema).valid_prefix("r", tokens)
    prefix = tokenizer.decode(tokens[: min(valid, len(tokens) - 1)])
    return prefix + "<end>" if valid == len(tokens) else prefix


def allowed_after(compiler: GrammarCompiler, schema: dict[str, Any] | None, text: str) -> set[str]:
    """Which of the ten digit tokens and EOS the one-pass mask allows after `text`."""
    tokenizer = compiler._hf_tokenizer
    batch = _batch(compiler, schema)
    batch.advance("r", tokenizer.encode(text, add_special_tokens=False))
    logits = torch.zeros(1, VOCAB)
    batch.mask(logits, ["r"])
    probes = {str(d): tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    probes["<eos>"] = tokenizer.eos_token_id
    return {name for name, token in probes.items() if torch.isfinite(logits[0, token])}


NUMBER = {"type": "number"}
INTEGER = {"type": "integer"}


@pytest.mark.parametrize("schema", [NUMBER, INTEGER], ids=["number", "integer"])
@pytest.mark.parametrize("sign", ["", "-"])
def test_integral_part_takes_16_digits_and_refuses_the_17th(
    compiler: GrammarCompiler, schema: dict[str, Any], sign: str
) -> None:
    assert accepted(compiler, schema, sign + DIGITS_16) == sign + DIGITS_16 + "<end>"
    assert accepted(compiler, schema, sign + DIGITS_16 + "7") == sign + DIGITS_16
    # The mask says so too: after 16 digits, no digit; the number may end.
    assert allowed_after(compiler, schema, sign + DIGITS_16) == {"<eos>"}
    assert allowed_after(compiler, schema, sign + DIGITS_16[:15]) == {*"0123456789", "<eos>"}
    assert accepted(compiler, schema, "01") == "0"  # no leading zero, as JSON says


def test_fraction_takes_16_digits_and_the_exponent_3(compiler: GrammarCompiler) -> None:
    fraction = "0." + DIGITS_16
    assert accepted(compiler, NUMBER, fraction) == fraction + "<end>"
    assert accepted(compiler, NUMBER, fraction + "7") == fraction
    assert allowed_after(compiler, NUMBER, fraction) == {"<eos>"}
    longest = "-9." + DIGITS_16 + "e-324"  # 17 significant digits, any double's exponent
    assert accepted(compiler, NUMBER, longest) == longest + "<end>"
    assert accepted(compiler, NUMBER, "1E+3081") == "1E+308"
    assert accepted(compiler, NUMBER, "1e0071") == "1e007"


@pytest.mark.parametrize(
    ("schema", "template"),
    [
        ({"type": "array", "items": NUMBER}, "[1.5, {n}]"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "object", "properties": {"b": INTEGER}}},
            },
            '{{"a": {{"b": {n}}}}}',
        ),
        (
            {
                "$defs": {
                    "Point": {"type": "object", "properties": {"x": NUMBER}, "required": ["x"]}
                },
                "type": "array",
                "items": {"$ref": "#/$defs/Point"},
            },
            '[{{"x": 2}}, {{"x": {n}}}]',
        ),
        ({"anyOf": [{"type": "string"}, {"type": "array", "items": INTEGER}]}, "[{n}]"),
        ({"type": "object", "additionalProperties": NUMBER}, '{{"k": {n}}}'),
        ({"type": "array", "prefixItems": [{"type": "string"}, NUMBER]}, '["a", {n}]'),
        ({"type": ["number", "null"]}, "{n}"),
        (None, '{{"a": [true, {{"b": -{n}}}]}}'),  # json_object: any JSON object
    ],
    ids=[
        "items",
        "nested-property",
        "defs-ref",
        "anyOf",
        "additionalProperties",
        "prefixItems",
        "type-list",
        "json_object",
    ],
)
def test_numbers_are_bounded_wherever_they_are(
    compiler: GrammarCompiler, schema: dict[str, Any] | None, template: str
) -> None:
    within = template.format(n=DIGITS_16)
    assert accepted(compiler, schema, within) == within + "<end>"
    beyond = template.format(n=DIGITS_16 + "7")
    assert accepted(compiler, schema, beyond) == beyond[: beyond.index(DIGITS_16) + 16]


def test_digits_in_strings_stay_free(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"id": {"type": "string"}, "n": INTEGER}}
    text = '{"id": "' + DIGITS_16 * 3 + '-0.5e-123456", "n": 1}'
    assert accepted(compiler, schema, text) == text + "<end>"


def test_the_schemas_own_numbers_raise_the_caps(compiler: GrammarCompiler) -> None:
    big = {"type": "integer", "minimum": 0, "maximum": 9223372036854775807}
    assert NumberBounds.for_schema(big) == NumberBounds(integral_digits=20)
    assert accepted(compiler, big, "9223372036854775807") == "9223372036854775807<end>"
    assert accepted(compiler, big, "9223372036854775808") == "922337203685477580"  # the maximum
    # Above an exclusive 16-digit minimum, an integer needs a 17th digit.
    above = {"type": "integer", "exclusiveMinimum": 9999999999999999}
    assert accepted(compiler, above, "10000000000000000") == "10000000000000000<end>"
    tiny = {"type": "number", "exclusiveMinimum": 0, "maximum": 1e-20}
    assert NumberBounds.for_schema(tiny) == NumberBounds(fraction_digits=21)
    small = "0.000000000000000000005"  # 21 fraction digits, within (0, 1e-20]
    assert accepted(compiler, tiny, small) == small + "<end>"
    assert NumberBounds.for_schema({"enum": [1, 2.5, {"a": [1e-3]}], "default": True}) == (
        NumberBounds()
    )


def test_the_bound_yields_where_the_schema_needs_more_digits(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """10^15 is no multiple of 7: after its 16 digits the schema allows only another
    digit and the bound only the end. The row is the schema's alone (not empty), and
    once the request takes a 17th digit it goes on under its schema."""
    schema = {"type": "integer", "multipleOf": 7}
    prefix = "1" + "0" * 15
    assert allowed_after(compiler, schema, prefix) == set("0123456789")
    seventeenth = next(d for d in "0123456789" if int(prefix + d) % 7 == 0)
    batch = _batch(compiler, schema)
    batch.advance("r", tokenizer.encode(prefix + seventeenth, add_special_tokens=False))
    assert "r" not in batch._bounds, "the bound refused the 17th digit and was dropped"
    assert batch.valid_prefix("r", [tokenizer.eos_token_id]) == 1  # a complete multiple


def test_guesses_the_bound_refuses_are_cut(compiler: GrammarCompiler, tokenizer: Any) -> None:
    """Speculation sees the bound too: an n-gram guess is cut at the 17th digit, a draft
    model's guess of it is refused with both matchers left where they were, and the
    verification row after 16 drafted digits allows no further digit."""
    digits = tokenizer.encode(DIGITS_16 + "78", add_special_tokens=False)
    batch = _batch(compiler, NUMBER)
    assert batch.valid_prefix("r", digits) == 16
    batch.advance("r", digits[:15])
    assert batch.try_advance("r", digits[15])
    assert not batch.try_advance("r", digits[16])
    batch.rollback("r", 1)
    after_15 = torch.zeros(1, VOCAB)
    batch.mask(after_15, ["r"])
    drafted = torch.zeros(3, VOCAB)
    batch.mask(drafted, ["r"], [0], [[digits[15], digits[16]]])
    assert torch.equal(drafted[0], after_15[0]), "the matchers were rolled back"
    assert not torch.isfinite(drafted[1, digits[16]]), "no 17th digit after 16 drafted"
    assert torch.isfinite(drafted[1, tokenizer.eos_token_id])


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        (
            {"type": "string", "minLength": 2, "maxLength": 4},
            ['"ab"', '"abcd"'],
            ['"a"', '"abcde"'],
        ),
        (
            {"type": "array", "items": INTEGER, "minItems": 1, "maxItems": 2},
            ["[1]", "[1, 2]"],
            ["[]", "[1, 2, 3]"],
        ),
        ({"type": "integer", "minimum": -3, "maximum": 10}, ["-3", "10"], ["-4", "11"]),
        (
            {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            ["0.5", "0.0001"],
            ["0", "1", "1.5", "-0.5"],
        ),
        ({"type": "integer", "multipleOf": 3}, ["-6", "9"], ["4"]),
        ({"type": "number", "multipleOf": 0.25}, ["1.75", "2"], ["1.3"]),
        ({"type": "string", "pattern": "^[a-z]{2}$"}, ['"ab"'], ['"abc"', '"a1"']),
        ({"type": "string", "format": "date"}, ['"2024-02-29"'], ['"yesterday"']),
        (
            {
                "type": "object",
                "properties": {"a": INTEGER},
                "required": ["a"],
                "additionalProperties": False,
            },
            ['{"a": 1}'],
            ["{}", '{"a": 1, "b": 2}'],
        ),
    ],
    ids=[
        "length",
        "items",
        "min-max",
        "exclusive",
        "multipleOf",
        "multipleOf-fraction",
        "pattern",
        "format",
        "required",
    ],
)
def test_the_schemas_limits_are_honoured(
    compiler: GrammarCompiler, schema: dict[str, Any], good: list[str], bad: list[str]
) -> None:
    for text in good:
        assert accepted(compiler, schema, text) == text + "<end>", text
    for text in bad:
        assert not accepted(compiler, schema, text).endswith("<end>"), text


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": INTEGER}, "contains"),
        ({"not": {"type": "string"}}, "not"),
        ({"if": {"type": "string"}, "then": {"maxLength": 1}}, "if"),
        ({"type": "object", "propertyNames": {"maxLength": 1}}, "propertyNames"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
        ({"type": "string", "format": "uri-reference"}, "uri-reference"),
        ({"oneOf": [INTEGER, NUMBER]}, "oneOf"),
        ({"type": "object", "properties": {"a": INTEGER}, "maxProperties": 1}, "maxProperties"),
        ({"type": "number", "multipleOf": 1e-20}, "multipleOf"),
        ({"$ref": "https://example.com/schema.json"}, "https://example.com/schema.json"),
        ({"type": "object", "x-guidance": {"whitespace_flexible": True}}, "x-guidance"),
    ],
)
def test_what_cannot_be_enforced_is_refused_naming_the_field(
    compiler: GrammarCompiler, schema: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidRequestError) as error:
        compiler.compile(_spec(schema))
    assert error.value.param == "response_format"
    assert named in str(error.value)


@pytest.mark.parametrize(
    "schema",
    [None, {"type": "object", "additionalProperties": NUMBER}, {"type": "array"}],
    ids=["json_object", "additionalProperties", "any-array"],
)
def test_whitespace_is_only_the_separators(
    compiler: GrammarCompiler, schema: dict[str, Any] | None
) -> None:
    text = '{"a": 1, "b": 2}' if schema is None or schema["type"] == "object" else '[1, {"a": 2}]'
    assert accepted(compiler, schema, text) == text + "<end>"
    for spaced in (
        text.replace(": ", ":  "),
        text.replace(", ", ",\n "),
        " " + text,
        text[:-1] + " " + text[-1],
        text.replace(", ", ","),
    ):
        assert not accepted(compiler, schema, spaced).endswith("<end>"), spaced


# Text with what the bound's shortcuts tell apart: strings with dashes, escapes and
# characters of several UTF-8 bytes (split across tokens), numbers of every shape, a
# digit run at the cap.
TRICKY = (
    r'{"a": "--x-- \" \\ é ✓ 🙂 \n\t -1 01 1e--", '
    r'"b": [-12, 0.5, -0.0e+5, 1E-7, 1234567890123456, -9.1234567890123456e-324], '
    r'"c": {"d": "", "e-f": [true, null, "\"", 7]}}'
)


def _mask(matcher: Any) -> np.ndarray:
    """The library's full mask of a matcher where it is."""
    row = np.zeros((VOCAB + 31) // 32, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return row


def test_the_bounds_shortcuts_leave_every_mask_as_its_full_mask_would(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """The step skips the bound's mask where it cannot refuse what the schema allows and
    checks a row of a few tokens token by token (sample/json_number_bound_rows.py, NumberBound); a
    speculating step's rows, at every position of a tricky text, against the schema's
    and the bound's full masks ANDed (the schema's alone where that would be empty)."""
    tokens = tokenizer.encode(TRICKY, add_special_tokens=False)
    grammar = compiler.compile(_spec(None))
    schema, bound = grammar.new_matcher(), grammar.new_bound()
    expected = []  # the allowed tokens after each prefix of the text, the long way
    for token in [*tokens, None]:
        both = _mask(schema) & _mask(bound)
        row = both if both.any() else _mask(schema)
        expected.append(np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB] == 1)
        if token is not None:
            assert schema.consume_token(token) and bound.consume_token(token)
    batch = _batch(compiler, None)
    guesses = 3
    for position, token in enumerate(tokens):
        draft = tokens[position : position + guesses]
        # numpy's zeros: torch's wait for an OpenMP thread on a busy machine (~10 ms)
        logits = np.zeros((len(draft) + 1, VOCAB), dtype=np.float32)
        batch.mask(torch.from_numpy(logits), ["r"], [0], [draft])
        for j in range(len(draft) + 1):
            assert np.array_equal(np.isfinite(logits[j]), expected[position + j]), tokenizer.decode(
                tokens[: position + j]
            )
        batch.advance("r", [token])


def test_a_digit_run_guessed_to_the_cap_stops_there(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """Guesses taking a number from 13 digits to 16: each row checked against the bound
    (a row of a few tokens), the row after the 16th allows no digit, the rows before do;
    in a string the same digits stay free (the bound skipped)."""
    digits = tokenizer.encode(DIGITS_16, add_special_tokens=False)
    probes = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    for text, capped in (('{"n": ', True), ('{"s": "', False)):
        batch = _batch(compiler, None)
        batch.advance("r", tokenizer.encode(text, add_special_tokens=False) + digits[:13])
        logits = torch.zeros(4, VOCAB)
        batch.mask(logits, ["r"], [0], [digits[13:16]])
        for j in range(3):
            assert bool(torch.isfinite(logits[j, probes]).all()), (text, j)
        assert bool(torch.isfinite(logits[3, probes]).any()) is not capped, text


def test_outside_numbers_the_bound_allows_what_its_class_allows(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """What the shortcuts rest on: wherever the bound allows `"` next, its mask allows
    every token of its class (between values, or in a string where `--` may come too)."""
    grammar = compiler.compile(_spec(None))
    assert grammar.bound is not None
    spec = grammar.bound
    bound = grammar.new_bound()
    tokens = tokenizer.encode(TRICKY, add_special_tokens=False)
    classes = set()
    for i, token in enumerate(tokens):
        if bound.validate_tokens(spec.quote) == len(spec.quote):
            in_string = bound.validate_tokens(spec.dashes) == len(spec.dashes)
            unsafe = spec.unsafe_in_string if in_string else spec.unsafe_between
            assert not (~_mask(bound) & ~unsafe).any(), tokenizer.decode(tokens[:i])
            classes.add(in_string)
        assert bound.consume_token(token)
    assert classes == {True, False}


def test_the_bound_tells_strings_from_between_values(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """Rows no JSON schema writes, to the shortcut itself: a token the bound refuses in
    one class of states and allows in the other, beside one it allows in both, with the
    bound in the class that refuses it. Only the other token is left (from the row of a
    few tokens checked one by one), so a row is skipped only for its bound's own class."""
    grammar = compiler.compile(_spec(None))
    assert grammar.bound is not None
    spec = grammar.bound

    def tokens_of(words: np.ndarray) -> list[int]:
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB]
        return [t for t in np.flatnonzero(bits).tolist() if t != tokenizer.eos_token_id]

    letter = tokenizer.convert_tokens_to_ids("a")  # allowed anywhere outside numbers
    only_between = spec.unsafe_between & ~spec.unsafe_in_string
    only_in_string = spec.unsafe_in_string & ~spec.unsafe_between
    for opened, candidates in (("", only_between), ('"', only_in_string)):
        batch = _batch(compiler, None)
        bound = batch._bounds["r"]
        bound.consume_tokens(tokenizer.encode(opened, add_special_tokens=False))
        refused = next(t for t in tokens_of(candidates) if not bound.validate_tokens([t]))
        row = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
        for token in (letter, refused):
            row[0, token >> 5] |= np.int32(np.uint32(1 << (token & 31)).view(np.int32))
        batch._apply_bounds(["r"], [0, 1], [_Rows(0, ())], row)
        assert tokens_of(row[0]) == [letter], tokenizer.decode([refused])
