"""llama.cpp's infill sampler (sample/infill_filter.py): its rules on hand-made candidates,
and the sampler drawing through it (the survivors by their own logits)."""

from __future__ import annotations

import math

import pytest
import torch

from iterserve.sample.infill_filter import infill_keep
from iterserve.sample.sampler import Sampler
from iterserve.sampling_params import SamplingParams

PIECES = {1: b"ret", 2: b"return", 3: b" x", 4: b" y", 5: b" z", 6: b"(", 9: b""}
EOG = (9,)


def piece(token: int) -> bytes:
    return PIECES.get(token, f"<{token}>".encode())


def test_the_end_wins_when_the_text_is_spread_thin() -> None:
    # 3 x 0.2 x 2 candidates = 1.2 > 0.8: only the end is kept.
    assert infill_keep([3, 9], [0.8, 0.2], piece, EOG) == [9]
    assert infill_keep([3, 9], [0.9, 0.1], piece, EOG) == [3, 9]


def test_a_token_that_begins_another_gives_it_its_mass() -> None:
    # "ret" (0.3) begins "return" (0.25): one choice of 0.55 under the likelier, "ret".
    assert infill_keep([3, 1, 2], [0.45, 0.3, 0.25], piece, EOG) == [3, 1]
    # Texts that begin nothing of each other, both over 1/3 of the rest: both stay.
    assert infill_keep([3, 2], [0.6, 0.4], piece, EOG) == [3, 2]


def test_text_under_its_floors_goes() -> None:
    # Under 0.2 goes; then, renormalised (0.47, 0.29, 0.24), under 1/4 goes.
    assert infill_keep([3, 4, 5, 6], [0.4, 0.25, 0.2, 0.15], piece, EOG) == [3, 4]


def test_nothing_left_but_the_end_is_the_end_alone() -> None:
    ids = [3, 4, 5, 6, 10, 11]
    assert infill_keep(ids, [1 / 6] * 6, piece, EOG) == []


def test_a_special_token_begins_nothing() -> None:
    assert infill_keep([3, 9], [0.95, 0.05], lambda t: b"" if t == 3 else piece(t), EOG) == [3, 9]


def _row(probs: dict[int, float], vocab: int = 16) -> torch.Tensor:
    logits = torch.full((1, vocab), -math.inf)
    for token, p in probs.items():
        logits[0, token] = math.log(p)
    return logits


def test_the_sampler_draws_the_survivors_by_their_own_logits() -> None:
    sampler = Sampler()
    sampler.token_piece = piece
    params = SamplingParams(top_k=40, top_p=0.99, infill_eog=EOG)
    logits = _row({3: 0.45, 1: 0.3, 2: 0.25}).repeat(400, 1)
    torch.manual_seed(0)
    counts = dict.fromkeys((1, 2, 3), 0)
    for _ in range(10):
        for token in sampler(logits, [params] * 400, [None] * 400).token_ids:
            counts[token] += 1
    # Kept: " x" and "ret", drawn 0.45 : 0.3 (the merged mass only decided who stayed).
    assert counts[2] == 0
    assert counts[1] / 4000 == pytest.approx(0.3 / 0.75, abs=0.03)
    spread = _row({3: 1 / 6, 4: 1 / 6, 5: 1 / 6, 6: 1 / 6, 10: 1 / 6, 11: 1 / 6})
    assert sampler(spread, [params], [None]).token_ids == [9]
    greedy = SamplingParams(temperature=0, infill_eog=EOG)  # greedy: the argmax, as ever
    assert sampler(spread, [greedy], [None]).token_ids == [3]
