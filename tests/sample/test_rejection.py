"""The speculative sampling rule and the dense distribution it compares, tested sharply:
many draws on small vocabularies against the exact probabilities."""

from __future__ import annotations

from collections import Counter

import torch

from iterserve.sample.rejection import verify_by_ratio
from iterserve.sample.sampler import Sampler
from iterserve.sampling_params import SamplingParams


def chi_square(counts: Counter[int], probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Goodness of fit of `counts` (n draws) to `probs`, over the cells with probability."""
    support = [t for t in range(probs.numel()) if float(probs[t]) > 0]
    assert set(counts) <= set(support), "a draw outside the distribution's support"
    stat = sum((counts[t] - n * float(probs[t])) ** 2 / (n * float(probs[t])) for t in support)
    return stat, len(support) - 1


def critical(dof: int, z: float = 3.09) -> float:
    """chi-square quantile at p = 0.001 (Wilson-Hilferty)."""
    h = 2 / (9 * dof)
    return dof * (1 - h + z * h**0.5) ** 3


def test_kept_and_redrawn_tokens_follow_the_target() -> None:
    """Guesses drawn from q, kept by ratio: the first token is distributed as p_0 and the
    second (where the first guess was kept) as p_1, though q differs a lot from p."""
    p = torch.tensor(
        [
            [0.50, 0.20, 0.15, 0.10, 0.05, 0.00],
            [0.05, 0.05, 0.10, 0.30, 0.20, 0.30],
            [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
        ]
    )
    q = torch.tensor(
        [
            [0.05, 0.10, 0.15, 0.20, 0.30, 0.20],
            [0.40, 0.30, 0.10, 0.10, 0.05, 0.05],
        ]
    )
    generator = torch.Generator().manual_seed(0)
    n = 20_000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for _ in range(n):
        guesses = [int(torch.multinomial(q[i], 1, generator=generator)) for i in range(2)]
        tokens = verify_by_ratio(
            p, q, guesses, lambda: float(torch.rand(1, generator=generator)), generator
        )
        assert 1 <= len(tokens) <= 3 and tokens[: len(tokens) - 1] == guesses[: len(tokens) - 1]
        first[tokens[0]] += 1
        if len(tokens) >= 2:
            second[tokens[1]] += 1
    for counts, probs in ((first, p[0]), (second, p[1])):
        total = sum(counts.values())
        stat, dof = chi_square(counts, probs, total)
        assert stat < critical(dof), (counts, stat)


def test_the_dense_distribution_is_the_one_the_sampler_draws_from() -> None:
    """Sampler.probs (temperature, top-k, top-p over the top-k, min-p) against 8,000 of the
    sampler's own draws from the same logits."""
    torch.manual_seed(0)
    logits = torch.randn(1, 4096) * 3
    params = SamplingParams(temperature=0.7, top_k=12, top_p=0.8, min_p=0.02)
    sampler = Sampler()
    probs = sampler.probs(logits, params)[0]
    assert abs(float(probs.sum()) - 1) < 1e-5
    generator = torch.Generator().manual_seed(1)
    counts: Counter[int] = Counter()
    n = 8000
    for _ in range(n):
        counts[sampler(logits, [params], [generator]).token_ids[0]] += 1
    stat, dof = chi_square(counts, probs, n)
    assert dof >= 2 and stat < critical(dof), (counts, stat)
