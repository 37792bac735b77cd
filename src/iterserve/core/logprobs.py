"""Logprobs as the engine reports them (sampled tokens' and prompt tokens')."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """Log-probabilities under the model's raw distribution (log_softmax of raw logits)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n (token_id, logprob), best first; empty if n == 0
    # The token's rank in the distribution (1: the most likely), where it was counted (a
    # prompt token's, vLLM's prompt_logprobs report it).
    rank: int | None = None
