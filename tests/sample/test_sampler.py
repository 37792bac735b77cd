"""Sampler semantics: greedy, temperature, top-k/p, min-p, seeds, logprobs.

Every random test is seeded, so none can flake; distribution checks use a
chi-square statistic against a generous bound.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from iterserve.sample.sampler import (
    Sampler,
    SamplerOutput,
    TokenLogprobs,
    _LogitRows,
    make_generator,
)
from iterserve.sampling_params import InvalidRequestError, SamplingParams

VOCAB = 49152  # the bundled model's: exercises the chunked fast paths
ODD_VOCAB = 1000  # not a multiple of the chunk width: exercises the fallbacks


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def _sample(
    logits: torch.Tensor,
    params: SamplingParams | list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
) -> SamplerOutput:
    rows = logits.shape[0]
    plist = params if isinstance(params, list) else [params] * rows
    return Sampler()(logits, plist, generators if generators is not None else [None] * rows)


def _embed(probs: list[float], token_ids: list[int], vocab: int, rows: int) -> torch.Tensor:
    """Rows of logits whose distribution is `probs` on `token_ids`, zero elsewhere."""
    logits = torch.full((rows, vocab), -math.inf)
    logits[:, token_ids] = torch.tensor(probs).log()
    return logits


def _draw_counts(
    probs: list[float], token_ids: list[int], params: SamplingParams, vocab: int, total: int
) -> dict[int, int]:
    torch.manual_seed(1234)  # unseeded rows use the global RNG
    sampler, counts = Sampler(), dict.fromkeys(token_ids, 0)
    rows = min(total, 250 if vocab > 4096 else total)
    logits = _embed(probs, token_ids, vocab, rows)
    for _ in range(total // rows):
        for token in sampler(logits, [params] * rows, [None] * rows).token_ids:
            assert token in counts, f"sampled {token}, outside the support"
            counts[token] += 1
    return counts


def _assert_matches(counts: dict[int, int], expected: dict[int, float]) -> None:
    total = sum(counts.values())
    for token, count in counts.items():
        if expected.get(token, 0.0) == 0.0:
            assert count == 0, f"token {token} has probability 0 but was drawn {count} times"
    support = [t for t in expected if expected[t] > 0]
    chi2 = sum((counts[t] - total * expected[t]) ** 2 / (total * expected[t]) for t in support)
    # df <= 5 here; 40 is far beyond p = 1e-6, yet a wrong distribution blows past it.
    assert chi2 < 40, (chi2, counts, expected)


# -- greedy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [VOCAB, ODD_VOCAB])
def test_greedy_is_argmax_including_ties(vocab: int) -> None:
    logits = _logits(40, vocab)
    # bf16 rounding makes many exact ties; plant a tie for the max in some rows too.
    logits = logits.to(torch.bfloat16).float()
    logits[::3, 7] = 100.0
    logits[::3, vocab - 5] = 100.0
    logits[1::3, 2000 % vocab] = 100.0
    logits[1::3, 1000 % vocab + 1] = 100.0
    out = _sample(logits, SamplingParams(temperature=0.0))
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 40


def test_row_ops_are_exact() -> None:
    logits = _logits(30).to(torch.bfloat16).float()  # ties
    rows = _LogitRows(logits)
    subset = torch.tensor([29, 3, 3, 17, 0])
    assert torch.equal(rows.argmax(None), logits.argmax(-1))
    assert torch.equal(rows.argmax(subset), logits[subset].argmax(-1))
    assert torch.equal(rows.max(subset), logits[subset].amax(-1, keepdim=True))
    for k in (1, 7, 64, 300):
        values, indices = rows.topk(subset, k)
        assert torch.equal(values, logits[subset].topk(k).values)
        assert torch.equal(logits[subset].gather(1, indices), values)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0])
def test_top_k_1_is_argmax_at_any_temperature(temperature: float) -> None:
    logits = _logits(16)
    out = _sample(logits, SamplingParams(temperature=temperature, top_k=1))
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [VOCAB, ODD_VOCAB])
@pytest.mark.parametrize("temperature", [0.5, 2.0, 50.0])
def test_tiny_top_p_and_min_p_1_pick_the_max(vocab: int, temperature: float) -> None:
    logits = _logits(16, vocab, seed=3)
    argmax = logits.argmax(-1).tolist()
    assert _sample(logits, SamplingParams(temperature=temperature, top_p=1e-6)).token_ids == argmax
    assert _sample(logits, SamplingParams(temperature=temperature, min_p=1.0)).token_ids == argmax
    assert _sample(logits, SamplingParams(temperature=1e-7)).token_ids == argmax


@pytest.mark.parametrize("vocab", [VOCAB, ODD_VOCAB])
@pytest.mark.parametrize("top_p", [1e-85, 5e-324])
def test_top_p_below_float32_range_is_greedy(vocab: int, top_p: float) -> None:
    # Found by fuzzing the server: top_p rounds to 0 in float32, which used to leave no
    # token kept and index past the candidate row.
    logits = _logits(4, vocab, seed=5)
    params = [SamplingParams(top_p=top_p), SamplingParams(top_p=top_p, top_k=50, min_p=0.5)]
    out = _sample(logits, params * 2)
    assert out.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("seed", [2**64, 10**30, -(2**70)])
def test_any_integer_is_a_seed(seed: int) -> None:
    logits = _logits(1)
    first = _sample(logits, SamplingParams(seed=seed), [make_generator(seed)]).token_ids
    again = _sample(logits, SamplingParams(seed=seed), [make_generator(seed)]).token_ids
    assert first == again


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_sampling_values_are_refused(name: str, value: float) -> None:
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**{name: value})  # type: ignore[arg-type]


# -- distributions ------------------------------------------------------------------------------

PROBS = [0.4, 0.3, 0.2, 0.1]
# Spread over different chunks of the vocab, including its first and last token.
SPREAD_IDS = [0, 4097, 30000, VOCAB - 1]


CASES = [
    (SamplingParams(temperature=1.0), PROBS),
    # p ** (1 / T), renormalised
    (SamplingParams(temperature=0.5), [16 / 30, 9 / 30, 4 / 30, 1 / 30]),
    (SamplingParams(top_k=3), [4 / 9, 3 / 9, 2 / 9, 0.0]),
    # keep a token while the mass above it is < p: 0.7 < 0.75 keeps the third
    (SamplingParams(top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0.0]),
    # top-p applies to the top-k survivors: 4/9 + 3/9 = 0.78 >= 0.75 drops the third
    (SamplingParams(top_k=3, top_p=0.75), [4 / 7, 3 / 7, 0.0, 0.0]),
    # min-p keeps p >= 0.45 * 0.4
    (SamplingParams(min_p=0.45), [4 / 9, 3 / 9, 2 / 9, 0.0]),
    (SamplingParams(temperature=0.5, top_p=0.9, min_p=0.5), [16 / 25, 9 / 25, 0.0, 0.0]),
]


@pytest.mark.parametrize("params,expected", CASES)
def test_sampling_matches_the_distribution(params: SamplingParams, expected: list[float]) -> None:
    token_ids = [1, 2, 5, 7]
    counts = _draw_counts(PROBS, token_ids, params, vocab=8, total=20000)
    _assert_matches(counts, dict(zip(token_ids, expected, strict=True)))


@pytest.mark.parametrize("params,expected", [CASES[1], CASES[4], CASES[5]])
def test_sampling_matches_the_distribution_at_full_vocab(
    params: SamplingParams, expected: list[float]
) -> None:
    """The chunked paths: two-level draw over the vocab, chunked top-k candidates."""
    counts = _draw_counts(PROBS, SPREAD_IDS, params, VOCAB, total=2000)
    _assert_matches(counts, dict(zip(SPREAD_IDS, expected, strict=True)))


# llama.cpp's order (its default `samplers`, temperature last): top-k, top-p and min-p
# judge the untempered PROBS, the temperature shapes what they keep. Each case keeps
# another support than vLLM's order would (in brackets).
SQRT_2 = [0.4**0.5 / (0.4**0.5 + 0.3**0.5), 0.3**0.5 / (0.4**0.5 + 0.3**0.5), 0.0, 0.0]
LLAMA_CASES = [
    # cumulative 0.4, 0.7 < 0.75 keeps three; then p ** 2 renormalised (tempered: two)
    (SamplingParams(temperature=0.5, top_p=0.75, temperature_last=True), [16 / 29, 9 / 29, 4 / 29, 0.0]),
    # p / p_max >= 0.45 keeps three (tempered: 0.25 < 0.45, two)
    (SamplingParams(temperature=0.5, min_p=0.45, temperature_last=True), [16 / 29, 9 / 29, 4 / 29, 0.0]),
    # 0.7 >= 0.65 drops the third; then p ** 0.5 renormalised (tempered: 0.61, three)
    (SamplingParams(temperature=2.0, top_p=0.65, temperature_last=True), SQRT_2),
    # top-3 renormalised 4/9, 3/9, 2/9: 7/9 < 0.8 keeps the third (tempered: 0.86, two)
    (SamplingParams(temperature=0.5, top_k=3, top_p=0.8, temperature_last=True), [16 / 29, 9 / 29, 4 / 29, 0.0]),
]  # fmt: skip


@pytest.mark.parametrize("params,expected", LLAMA_CASES)
def test_llama_cpps_order_truncates_before_the_temperature(
    params: SamplingParams, expected: list[float]
) -> None:
    token_ids = [1, 2, 5, 7]
    counts = _draw_counts(PROBS, token_ids, params, vocab=8, total=20000)
    _assert_matches(counts, dict(zip(token_ids, expected, strict=True)))
    full = _draw_counts(PROBS, SPREAD_IDS, params, VOCAB, total=2000)
    _assert_matches(full, dict(zip(SPREAD_IDS, expected, strict=True)))
    dense = Sampler().probs(_embed(PROBS, token_ids, 8, 1), params)[0, token_ids]
    assert dense.tolist() == pytest.approx(expected, abs=1e-6)


def test_wide_nucleus_falls_back_exactly() -> None:
    """A nucleus larger than every candidate set still gets exactly the right support."""
    vocab, rows = VOCAB, 16
    logits = torch.full((rows, vocab), -5.0)
    wide = torch.arange(0, vocab, 16)[:3000]  # 3000 equally likely tokens, over 1024 candidates
    logits[:, wide] = 5.0
    torch.manual_seed(0)
    seen: set[int] = set()
    for _ in range(10):
        seen.update(_sample(logits, SamplingParams(top_p=0.5)).token_ids)
    # Token i of the tied 3000 stays while i * p < 0.5, and the stable sort puts
    # ties in vocab order, so the nucleus is a prefix of `wide`.
    p = torch.softmax(logits[0].double(), -1)[wide[0]].item()
    size = math.ceil(0.5 / p)
    assert 1400 < size < 1600
    assert seen <= set(wide[:size].tolist())
    assert len(seen) > 100  # 160 draws from ~1500 equally likely tokens


@pytest.mark.parametrize("vocab", [VOCAB, ODD_VOCAB])
def test_top_k_and_top_p_never_leave_their_support(vocab: int) -> None:
    logits = _logits(32, vocab, seed=5, scale=4.0)
    torch.manual_seed(0)
    top5 = logits.topk(5).indices
    out = _sample(logits, SamplingParams(temperature=3.0, top_k=5))
    for row, token in enumerate(out.token_ids):
        assert token in top5[row].tolist()
    probs = logits.softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    for _ in range(5):
        out = _sample(logits, SamplingParams(top_p=0.3))
        for row, token in enumerate(out.token_ids):
            rank = order[row].tolist().index(token)
            assert sorted_probs[row, :rank].sum() < 0.3 + 1e-5


# -- seeds --------------------------------------------------------------------------------------

SEEDED = [
    SamplingParams(temperature=0.9, seed=11),
    SamplingParams(temperature=0.8, top_p=0.9, seed=12),
    SamplingParams(temperature=1.2, top_k=40, min_p=0.02, seed=13),
    SamplingParams(temperature=3.0, top_p=0.95, seed=14),  # flat: escalates to the full sort
    SamplingParams(temperature=0.7, min_p=0.1, seed=15),
]
OTHERS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_p=0.5),
    SamplingParams(temperature=1.5, top_k=7, seed=99),
]


@functools.cache
def _bank(steps: int) -> torch.Tensor:
    """[steps, 16, V] logits, bf16-rounded so that exact ties are common."""
    return _logits(steps * 16, seed=21, scale=4.0).to(torch.bfloat16).float().view(steps, 16, -1)


def _run_steps(rows: list[int], params: list[SamplingParams], steps: int) -> list[list[int]]:
    """Tokens per step for rows of a fixed logits bank; row r always sees logits[step, r]."""
    bank = _bank(steps)
    sampler = Sampler()
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    return [sampler(bank[step, rows].contiguous(), params, gens).token_ids for step in range(steps)]


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    steps = 4
    for r, params in enumerate(SEEDED):
        alone = [t[0] for t in _run_steps([r], [params], steps)]
        # The same row among others, in a different position, with other seeded rows.
        rows = [8, 9, r, 10, 11, 12, 13]
        batch_params = [OTHERS[0], OTHERS[1], params, OTHERS[2], OTHERS[3], *SEEDED[:2]]
        torch.manual_seed(r + 100)  # a different global RNG state changes nothing
        crowded = [t[2] for t in _run_steps(rows, batch_params, steps)]
        assert alone == crowded, params


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, VOCAB)  # uniform: two seeds agreeing 8 times is ~impossible
    runs = []
    for seed in (1, 2):
        gen, sampler = make_generator(seed), Sampler()
        params = SamplingParams(seed=seed)
        runs.append([sampler(logits, [params], [gen]).token_ids[0] for _ in range(8)])
    assert runs[0] != runs[1]
    gen, sampler = make_generator(1), Sampler()
    again = [sampler(logits, [SamplingParams(seed=1)], [gen]).token_ids[0] for _ in range(8)]
    assert again == runs[0]


# -- logprobs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [VOCAB, ODD_VOCAB])
def test_logprobs_match_log_softmax(vocab: int) -> None:
    logits = _logits(5, vocab, seed=8)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.7, top_p=0.9, logprobs=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=3, logprobs=20),
        SamplingParams(temperature=0.0, logprobs=1),
    ]
    torch.manual_seed(0)
    out = _sample(logits, params)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for row, p in enumerate(params):
        lp = out.logprobs[row]
        if p.logprobs is None:
            continue
        assert isinstance(lp, TokenLogprobs)
        assert lp.token_id == out.token_ids[row]
        # The raw model distribution, not the temperature/top-k-processed one.
        assert lp.logprob == pytest.approx(reference[row, lp.token_id].item(), abs=1e-4)
        assert len(lp.top) == p.logprobs
        expected = reference[row].topk(p.logprobs) if p.logprobs else None
        if expected is not None:
            assert [t for t, _ in lp.top] == expected.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(expected.values.tolist(), abs=1e-4)
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), [SamplingParams()], [None, None])
