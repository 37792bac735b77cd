"""vLLM's truncate_prompt_tokens on a prompt's ids (prompt_truncation.py)."""

from __future__ import annotations

import pytest

from iterserve.invalid_request import InvalidRequestError
from iterserve.prompt_truncation import PromptTruncation

IDS = list(range(10, 30))


@pytest.mark.parametrize(
    ("keep", "side", "expected"),
    [
        (5, "left", IDS[-5:]),
        (5, "right", IDS[:5]),
        (20, "left", IDS),
        (50, "right", IDS),  # longer than the prompt: nothing cut
        (-1, "left", IDS[-16:]),  # the context: 16 tokens here
    ],
)
def test_the_cut_keeps_one_end_and_is_idempotent(keep: int, side: str, expected: list[int]) -> None:
    truncation = PromptTruncation(keep, side)  # type: ignore[arg-type]
    once = truncation.apply(IDS, max_model_len=64 if keep != -1 else 16)
    assert once == expected
    # A data-parallel front end cuts to route, and the replica cuts again.
    assert truncation.apply(once, max_model_len=64 if keep != -1 else 16) == once


@pytest.mark.parametrize(
    ("keep", "side", "param"),
    [(0, "left", "truncate_prompt_tokens"), (-2, "left", "truncate_prompt_tokens"),
     (3, "middle", "truncation_side")],
)  # fmt: skip
def test_bad_values_name_their_field(keep: int, side: str, param: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        PromptTruncation(keep, side)  # type: ignore[arg-type]
    assert error.value.param == param


def test_more_than_the_context_is_refused_and_no_fields_no_cut() -> None:
    with pytest.raises(InvalidRequestError) as error:
        PromptTruncation(65).apply(IDS, max_model_len=64)
    assert error.value.param == "truncate_prompt_tokens" and "64" in str(error.value)
    assert PromptTruncation.of(None, "right") is None
    assert PromptTruncation.of(3, None) == PromptTruncation(3, "left")
