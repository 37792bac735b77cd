"""Where the JSON number bound can be left out of a step's mask, and the cheap checks that
stand in for its mask (sample/structured.py fills the bound's own mask only where these
cannot answer; docs/structured_output.md, "What the bound costs")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# A row allowing at most this many tokens has each checked against the number bound
# (validate_tokens, ~3 us a token) instead of the bound's mask being filled (~1.3 ms
# outside strings, as its lexer allows nearly every token); inside a number a schema
# allows about a dozen (digits, `.`, `e`, what ends the number).
FEW_TOKENS = 64


@dataclass(frozen=True)
class NumberBound:
    """JSON's bound on number digits (sample/json_number_bounds.py) in its start state,
    and what tells a step that it cannot refuse any token the schema allows.

    Outside numbers the bound's regex is in one of three states: between values (its
    start state), inside a string, or after a backslash in one. Every other state is
    inside a number or inside a character's UTF-8 bytes, where `"` cannot come next.
    `--` can come next only inside a string (between values `-` starts a number, which
    a second `-` cannot continue; no number state takes two). So where the bound allows
    `--` next it allows every token both string states allow (`unsafe_in_string`
    leaves them clear), and where it allows `"` but not `--` every token its start
    state allows (`unsafe_between` leaves them clear). A row whose schema allows only
    such tokens is the schema's as it is, with no mask of the bound's."""

    template: Any  # llguidance.LLMatcher of NumberBounds.text_regex()
    quote: list[int]  # `"`, tokenized
    dashes: list[int]  # `--`, tokenized
    unsafe_between: np.ndarray  # int32 words: the tokens the start state refuses
    unsafe_in_string: np.ndarray  # int32 words: the tokens a string state refuses
    # The words where either is nonzero (a few hundred tokens of the vocabulary): a row
    # is tested on these alone, as one Python int against each of these two.
    unsafe_words: np.ndarray
    unsafe_between_bits: int
    unsafe_in_string_bits: int

    @classmethod
    def build(cls, template: Any, lltokenizer: Any, vocab_size: int) -> NumberBound:
        words = (vocab_size + 31) // 32
        masks = []
        for text in (b"", b'"', b'"\\'):  # between values, in a string, after a backslash
            state = template.deep_copy()
            tokens = lltokenizer.tokenize_bytes(text)
            if state.try_consume_tokens(tokens) != len(tokens):
                raise RuntimeError(f"the JSON number bound refuses {text!r}")  # iterserve's bug
            mask = np.zeros(words, dtype=np.int32)
            state.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            masks.append(mask)
        between, in_string = ~masks[0], ~(masks[1] & masks[2])
        at = np.flatnonzero(between | in_string)
        return cls(
            template,
            list(lltokenizer.tokenize_bytes(b'"')),
            list(lltokenizer.tokenize_bytes(b"--")),
            between,
            in_string,
            at,
            int.from_bytes(between[at].tobytes(), "little"),
            int.from_bytes(in_string[at].tobytes(), "little"),
        )

    def skips(self, bound: Any, prefix: list[int], schema_words: int) -> bool:
        """Whether `bound`, after `prefix`, allows every token a row allows whose words at
        `unsafe_words` are `schema_words`: one or two `validate_tokens` calls."""
        between = not schema_words & self.unsafe_between_bits
        in_string = not schema_words & self.unsafe_in_string_bits
        if not (between or in_string):
            return False
        n = len(prefix)
        if in_string and bound.validate_tokens(prefix + self.dashes) == n + len(self.dashes):
            return True  # in a string
        # Between values: `"` may come, and `--` not (a string's state took it above).
        return (
            between
            and bound.validate_tokens(prefix + self.quote) == n + len(self.quote)
            and (in_string or bound.validate_tokens(prefix + self.dashes) < n + len(self.dashes))
        )


def few_tokens(row: np.ndarray) -> list[int] | None:
    """The tokens a bitmask row allows, if at most FEW_TOKENS (None if more): its
    nonzero words counted first, so a wide row costs one pass over words, and a narrow
    one's bits read in Python (a few words: cheaper than numpy's calls)."""
    if np.count_nonzero(row) > FEW_TOKENS:
        return None
    tokens: list[int] = []
    for word in np.flatnonzero(row).tolist():
        bits = int(row[word]) & 0xFFFFFFFF
        while bits:
            low = bits & -bits
            tokens.append(32 * word + low.bit_length() - 1)
            bits ^= low
        if len(tokens) > FEW_TOKENS:
            return None
    return tokens
