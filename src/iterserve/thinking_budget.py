"""A cap on a thinking model's thinking, in tokens (vLLM's `thinking_token_budget`,
llama.cpp's `--reasoning-budget`, Anthropic's `thinking.budget_tokens`).

Once the thinking has run `tokens` tokens without ending, the sampler is made to write
`close` (`</think>`; Harmony's `<|end|><|start|>assistant`, after which the model picks its
next message itself) one token a step, and the model answers from there: the answer is
cut short in its thinking, not in the answer. The rule reads only the request's tokens so
far (a look-back control, sample/logits_controls.py), so a guessed token, a preemption's
recompute or a step planned ahead never leaves it out of date.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from iterserve.invalid_request import InvalidRequestError


@dataclass(frozen=True)
class ThinkingBudget:
    tokens: int
    # What the answer must start with for its thinking to count (`<think>` where the model
    # opens its thinking itself; empty where the prompt opened it).
    opener: tuple[int, ...]
    ended: tuple[int, ...]  # the thinking is over once these tokens appear
    close: tuple[int, ...]  # written when the budget runs out; ends with `ended`

    def __post_init__(self) -> None:
        if self.tokens < 0:
            raise InvalidRequestError(
                f"thinking_token_budget must be at least 0, got {self.tokens}",
                "thinking_token_budget",
            )
        if not self.ended or self.close[-len(self.ended) :] != self.ended:
            raise ValueError("a thinking budget's closing tokens must end its thinking")

    def forced_token(self, output: Sequence[int]) -> int | None:
        """The token the output's next position must be (None: the model's own choice)."""
        start = len(self.opener)
        if tuple(output[:start]) != self.opener:
            return None  # the answer opened no thinking
        limit = start + self.tokens
        written = len(output) - limit
        if written < 0 or written >= len(self.close):
            return None  # within the budget, or closed already
        if _holds(list(output[start:limit]), self.ended):
            return None  # the model ended its thinking in time
        return self.close[written]


def _holds(tokens: list[int], run: tuple[int, ...]) -> bool:
    """Whether `run` appears in `tokens` (the list's own search finds its first token)."""
    first, at = run[0], 0
    while True:
        try:
            at = tokens.index(first, at)
        except ValueError:
            return False
        if tuple(tokens[at : at + len(run)]) == run:
            return True
        at += 1
