"""A thinking budget (thinking_budget.py): the rule that picks the forced token, the
sampling control that applies it (after every other control, at each speculative row),
and the engine keeping it with and without speculation. The server's side (the markers,
`thinking_token_budget`, Anthropic's `budget_tokens`) is tested in
tests/server/test_messages_thinking.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_llms import draft_llm
from iterserve import LLM, SamplingParams
from iterserve.core.outputs import ScheduledSeq, TokenContext
from iterserve.sample.logits_controls import apply_logits_controls, row_contexts
from iterserve.sampling_params import InvalidRequestError
from iterserve.thinking_budget import ThinkingBudget

OPEN, END = 9, 7
# <think> opened by the model itself, three tokens of thinking at most, </think> a token.
QWEN3_LIKE = ThinkingBudget(3, (OPEN,), (END,), (END,))
# Thinking opened by the prompt; the close is longer than the end (Harmony's shape).
HARMONY_LIKE = ThinkingBudget(2, (), (5, 6), (4, 5, 6))


@pytest.mark.parametrize(
    ("budget", "output", "forced"),
    [
        (QWEN3_LIKE, [], None),  # the first token may open thinking or answer
        (QWEN3_LIKE, [1, 2, 3, 4], None),  # it answered at once: no thinking to cap
        (QWEN3_LIKE, [OPEN, 1, 2], None),  # within the budget
        (QWEN3_LIKE, [OPEN, 1, 2, 3], END),  # the budget is spent
        (QWEN3_LIKE, [OPEN, 1, 2, 3, END], None),  # closed
        (QWEN3_LIKE, [OPEN, 1, END, 3], None),  # it ended its thinking in time
        (QWEN3_LIKE, [OPEN, 1, END, 3, 4, 5, 6], None),
        (HARMONY_LIKE, [1, 2], 4),  # the close, token by token
        (HARMONY_LIKE, [1, 2, 4], 5),
        (HARMONY_LIKE, [1, 2, 4, 5], 6),
        (HARMONY_LIKE, [1, 2, 4, 5, 6], None),
        (HARMONY_LIKE, [5, 6, 1, 2], None),  # ended before the budget ran out
        (HARMONY_LIKE, [1, 5], 4),  # a partial end is not an end
        (ThinkingBudget(0, (), (END,), (END,)), [], END),  # no thinking at all
    ],
)
def test_forced_token(budget: ThinkingBudget, output: list[int], forced: int | None) -> None:
    assert budget.forced_token(output) == forced


def test_budget_is_checked() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        ThinkingBudget(-1, (), (END,), (END,))
    assert caught.value.param == "thinking_token_budget"
    with pytest.raises(ValueError, match="end its thinking"):
        ThinkingBudget(4, (), (END,), (END, 1))


def test_control_forces_the_close_over_every_other_control() -> None:
    """The spent budget's row keeps only the close, even where a bias or a ban would have
    it otherwise; the other rows are those controls' alone; drafts count as output at the
    rows after them."""
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(0))
    spent = SamplingParams(thinking_budget=QWEN3_LIKE, logit_bias={END: -100.0, 1: 50.0})
    within = SamplingParams(thinking_budget=QWEN3_LIKE, logit_bias={1: 50.0})
    seq = ScheduledSeq(
        request_id="a",
        token_ids=[0, 2, 3],
        num_computed_tokens=10,
        block_ids=(0,),
        sample=True,
        sampling_params=within,
        draft_token_ids=[2, 3],
    )
    seq.context = TokenContext([0], [OPEN, 1], (), [])
    rows = row_contexts([seq])  # the output, then one draft, then both
    assert [len(c.output_token_ids) for c in rows if c is not None] == [2, 3, 4]
    out = apply_logits_controls(
        logits, [spent, within, within, within], [TokenContext([0], [OPEN, 1, 2, 3], (), []), *rows]
    )
    assert torch.isfinite(out[0]).tolist() == [token == END for token in range(12)]
    for row in (1, 2):  # within the budget: the bias alone
        assert torch.equal(out[row, 1], logits[row, 1] + 50.0)
        assert torch.isfinite(out[row]).all()
    assert torch.isfinite(out[3]).tolist() == [token == END for token in range(12)]
    assert torch.isfinite(logits).all()  # the raw logits are left for the logprobs


def test_sampling_params_take_a_budget_as_a_look_back_control() -> None:
    params = SamplingParams(thinking_budget=QWEN3_LIKE)
    assert params.uses_token_history and params.adjusts_logits


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", compile=False)


REPEATING = "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2"


def _capped(close: int, tokens: int = 4) -> SamplingParams:
    # Thinking opened by the prompt: the first `tokens` tokens are its thinking.
    budget = ThinkingBudget(tokens, (), (close,), (close,))
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, thinking_budget=budget)


def test_engine_closes_the_thinking_at_the_budget(llm: LLM, tiny_llama_dir: Path) -> None:
    free = llm.generate(
        REPEATING, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].token_ids
    close = next(token for token in range(100, 200) if token not in free[:5])
    out = llm.generate(REPEATING, _capped(close), use_tqdm=False)[0].token_ids
    assert out[:4] == free[:4] and out[4] == close
    # A close the model would have written by itself within the budget ends it in time.
    early = llm.generate(REPEATING, _capped(free[1]), use_tqdm=False)[0].token_ids
    assert early == free
    # Drafts from the model itself (greedy, accepted by matching): the same tokens.
    drafting = draft_llm(tiny_llama_dir, tiny_llama_dir, num_speculative_tokens=3)
    speculated = drafting.generate(REPEATING, _capped(close), use_tqdm=False)[0]
    assert speculated.token_ids == out
    assert speculated.num_draft_tokens > 0
