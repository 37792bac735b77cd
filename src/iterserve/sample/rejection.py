"""Speculative sampling's acceptance rule, for guesses a draft sampled from its own
distribution (Leviathan et al. 2023, Chen et al. 2023).

Guess d at position i was drawn from q_i; keep it with probability min(1, p_i(d) / q_i(d)),
and at the first refusal draw instead from norm(max(0, p_i - q_i)); if every guess is kept,
draw one more token from p_k. Each emitted token is then distributed exactly as a draw from
the target's p given the tokens before it, whatever q is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def verify_by_ratio(
    p: torch.Tensor,
    q: torch.Tensor,
    guesses: list[int],
    uniform: Callable[[], float],
    generator: torch.Generator | None = None,
) -> list[int]:
    """p: [k + 1, vocab] the target's distributions at the last token and each guess;
    q: [k, vocab] the draft's, which drew `guesses`. Returns the kept guesses and then
    one token of the target's own (1 to k + 1 tokens)."""
    tokens: list[int] = []
    for i, guess in enumerate(guesses):
        if uniform() * float(q[i, guess]) < float(p[i, guess]):
            tokens.append(guess)
            continue
        residual = (p[i] - q[i]).clamp_(min=0.0)
        weights = residual if float(residual.sum()) > 0 else p[i]
        tokens.append(int(torch.multinomial(weights, 1, generator=generator)))
        return tokens
    tokens.append(int(torch.multinomial(p[len(guesses)], 1, generator=generator)))
    return tokens
