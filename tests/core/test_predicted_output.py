"""Drafts from a request's predicted output (OpenAI's Predicted Outputs): the answer followed
through its prediction, lost where it is edited and found again after, at the occurrence
after where it left off; in the scheduler, drafts that change no token and save steps."""

from __future__ import annotations

from dataclasses import replace

from fake_executor import FakeExecutor, make_request, make_scheduler, run
from iterserve.config import SpeculativeConfig
from iterserve.core.predicted_output import PredictionCursor

NGRAM = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=4)


def test_an_answer_that_follows_its_prediction_gets_the_next_tokens() -> None:
    cursor = PredictionCursor(list(range(1, 11)), 2, 4)
    assert cursor.draft([], 3) == [1, 2, 3]  # before the first token: the start
    assert cursor.draft([1], 3) == [2, 3, 4]
    assert cursor.draft([1, 2, 3], 3) == [4, 5, 6]  # two accepted at once
    assert cursor.draft(list(range(1, 11)), 3) == []  # the prediction is used up


def test_an_edit_loses_the_prediction_until_the_answer_meets_it_again() -> None:
    prediction = [10, 11, 12, 13, 14, 15, 16, 17]
    cursor = PredictionCursor(prediction, 2, 4)
    assert cursor.draft([10, 11, 99, 98], 2) == []  # edited: 99 98 is nowhere in it
    # The edit replaced 12 13; the answer goes on as predicted from 14.
    assert cursor.draft([10, 11, 99, 98, 14, 15], 2) == [16, 17]
    assert cursor.draft([10, 11, 99, 98, 14, 15, 16], 2) == [17]


def test_a_repeated_line_is_picked_up_after_where_the_answer_left_off() -> None:
    # 1 2 occurs three times; the answer left the prediction after 5 (position 1), so the
    # next occurrence is the one it continues from, not the last one (what prompt lookup's
    # "latest occurrence" would take).
    prediction = [5, 1, 2, 7, 1, 2, 9, 1, 2, 3]
    cursor = PredictionCursor(prediction, 2, 4)
    assert cursor.draft([5, 42, 1, 2], 2) == [7, 1]


def counting_up(tokens: list[int]) -> int:
    """A "model" whose next token is the last one plus one: its answer is predictable."""
    return tokens[-1] + 1


def test_a_prediction_saves_steps_and_changes_no_token() -> None:
    prompt = [3, 1, 4, 1, 5]
    predicted = tuple(range(6, 6 + 12))  # what counting_up says next: all right

    def outputs(prediction: tuple[int, ...] | None) -> tuple[list[int], int, int]:
        scheduler, clock = make_scheduler(prefix_caching=False, speculative=NGRAM)
        request = make_request("r", prompt, max_tokens=12)
        request.sampling_params = replace(request.sampling_params, prediction=prediction)
        scheduler.add_request(request)
        done, plans = run(scheduler, clock, executor=FakeExecutor(counting_up))
        return done["r"], len(plans), scheduler.spec_stats.num_accepted_tokens

    plain, plain_steps, plain_accepted = outputs(None)  # counting never repeats itself
    followed, steps, accepted = outputs(predicted)
    assert followed == plain == list(predicted)
    # The prompt's step gives the first token; each step after guesses 4 and keeps them
    # with its own fifth, until max_tokens leaves no room for guesses.
    assert (plain_steps, plain_accepted) == (12, 0)
    assert (steps, accepted) == (4, 8)
    # A wrong prediction costs guesses, not tokens.
    wrong, _, _ = outputs(tuple(range(100, 112)))
    assert wrong == plain
