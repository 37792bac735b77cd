"""Logprobs as the engine reports them (sampled tokens' and prompt tokens')."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """Log-probabilities under the model's raw distribution (log_softmax of raw logits)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n (token_id, logprob), best first; empty if n == 0
