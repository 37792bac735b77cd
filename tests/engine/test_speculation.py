"""Speculative decoding: the n-gram proposer, the scheduler's drafts (with a model that
never needs torch), and the engine on a real model, where speculation must not change a
single token, greedy or seeded."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import openai
import pytest

from conftest import VOCAB, _save_tiny
from draft_llms import draft_llm
from fake_executor import FakeExecutor, make_request, make_scheduler, run
from iterserve.config import ConfigError, SpeculativeConfig
from iterserve.core.speculation import NgramProposer, SpecDecodeStats
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm import LLM
from iterserve.engine.llm_engine import LLMEngine
from iterserve.sampling_params import SamplingParams
from server_fixtures import MODEL_NAME, engine_config, serving

NGRAM = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=3)


# ---- the proposer -----------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    proposer = NgramProposer(2, 3)
    tokens = [5, 6, 7, 1, 2, 5, 6, 9, 8, 5, 6]
    # The suffix (5, 6) occurred twice before; the latest was followed by 9, 8.
    assert proposer.lookup("a", tokens, 2) == [9, 8]
    # Past the end, the guess goes on as the text repeated: with the period of the match.
    assert proposer.lookup("a", tokens, 6) == [9, 8, 5, 6, 9, 8]


def test_ngram_prefers_the_longest_suffix_and_never_matches_itself() -> None:
    proposer = NgramProposer(1, 3)
    # (7,) alone last occurred before 4; (3, 7) occurred before 1: the longer match wins.
    tokens = [3, 7, 1, 9, 7, 4, 3, 7]
    assert proposer.lookup("a", tokens, 1) == [1]
    assert NgramProposer(2, 2).lookup("b", [1, 2, 3, 4], 3) == []  # no earlier match
    assert NgramProposer(1, 1).lookup("c", [8], 3) == []  # the suffix is all there is


def test_ngram_index_grows_with_the_tokens() -> None:
    """Extending one request's index step by step answers like a fresh index."""
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2]
    grown = NgramProposer(2, 3)
    for end in range(1, len(tokens) + 1):
        fresh = NgramProposer(2, 3).lookup("x", tokens[:end], 3)
        assert grown.lookup("r", tokens[:end], 3) == fresh
    grown.forget("r")
    assert grown.lookup("r", [1, 2, 5, 1, 2], 3) == [5, 1, 2]


def test_stats_count_acceptance_by_position() -> None:
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(2, 0)
    assert stats.accepted_per_position == [1, 1, 0]
    assert stats.acceptance_rate == pytest.approx(2 / 5)
    assert stats.mean_accepted_length == pytest.approx(1 + 2 / 2)


def test_bad_speculative_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="--speculative-method"):
        SpeculativeConfig(speculative_method="medusa")
    with pytest.raises(ConfigError, match="--num-speculative-tokens"):
        SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ConfigError, match="--ngram-min"):
        SpeculativeConfig(ngram_min=4, ngram_max=3)
    with pytest.raises(ConfigError, match="--speculative-disable-by-batch-size"):
        SpeculativeConfig(speculative_disable_by_batch_size=0)


# ---- the scheduler, with a model that repeats itself --------------------------------------


def repeat_every_5(tokens: list[int]) -> int:
    """A "model" whose text cycles with period 5 once the prompt is past: the n-gram
    proposer's guesses are then right, and only max_tokens or a stop ends a run."""
    return tokens[-5] if len(tokens) >= 5 else 1


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(repeat_every_5(tokens))
    return tokens[len(prompt) :]


PROMPTS = [[10, 11, 12, 13, 14, 10, 11], [20, 21, 22, 23, 24, 20], [7, 8, 9, 3, 4, 7, 8, 9]]


def run_repeating(
    speculative: SpeculativeConfig | None, max_tokens: int = 13, **config: object
) -> tuple[dict[str, list[int]], list, object]:
    scheduler, clock = make_scheduler(prefix_caching=False, speculative=speculative, **config)
    for i, prompt in enumerate(PROMPTS):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens))
    outputs, plans = run(scheduler, clock, executor=FakeExecutor(repeat_every_5))
    return outputs, plans, scheduler


def test_drafts_are_verified_and_change_no_token() -> None:
    plain, plain_plans, _ = run_repeating(None)
    spec, spec_plans, scheduler = run_repeating(NGRAM)
    assert spec == plain == {f"r{i}": expected(p, 13) for i, p in enumerate(PROMPTS)}
    stats = scheduler.spec_stats
    assert stats.num_accepted_tokens > 0 and len(spec_plans) < len(plain_plans)
    assert stats.acceptance_rate == 1.0  # this model's text is exactly a repeat
    assert max(len(p) for plan in spec_plans for p in [s.draft_token_ids for s in plan.seqs]) == 3
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_drafts_count_in_the_step_budget_and_respect_max_tokens() -> None:
    spec, plans, _ = run_repeating(NGRAM, max_tokens=6, max_num_batched_tokens=5, max_num_seqs=3)
    assert spec == {f"r{i}": expected(p, 6) for i, p in enumerate(PROMPTS)}
    for plan in plans:
        assert plan.num_batched_tokens == sum(s.num_new_tokens for s in plan.seqs) <= 5
        assert plan.num_draft_tokens == sum(len(s.draft_token_ids) for s in plan.seqs)


def mostly_repeat(tokens: list[int]) -> int:
    """Repeats with period 5 but says 99 at every 7th position: guesses made from the
    repetition are wrong there, and the text is the model's, not the guess."""
    return 99 if len(tokens) % 7 == 0 else repeat_every_5(tokens)


def test_wrong_guesses_are_rejected() -> None:
    scheduler, clock = make_scheduler(prefix_caching=False, speculative=NGRAM)
    prompt = PROMPTS[0]
    scheduler.add_request(make_request("r", prompt, max_tokens=30))
    outputs, plans = run(scheduler, clock, executor=FakeExecutor(mostly_repeat))
    tokens = list(prompt)
    for _ in range(30):
        tokens.append(mostly_repeat(tokens))
    assert outputs["r"] == tokens[len(prompt) :]
    stats = scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there() -> None:
    scheduler, clock = make_scheduler(prefix_caching=False, speculative=NGRAM)
    prompt = PROMPTS[0]
    params = SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[13])
    scheduler.add_request(make_request("r", prompt, max_tokens=20))
    scheduler.requests["r"].sampling_params = params
    outputs, _ = run(scheduler, clock, executor=FakeExecutor(repeat_every_5))
    full = expected(prompt, 20)
    assert outputs["r"] == full[: full.index(13) + 1]
    assert scheduler.spec_stats.num_accepted_tokens > 0


def test_speculation_turns_off_for_big_batches_and_per_request() -> None:
    big = SpeculativeConfig(speculative_method="ngram", speculative_disable_by_batch_size=3)
    scheduler, clock = make_scheduler(prefix_caching=False, speculative=big)
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, (3, 5, 30), strict=True)):
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens))
    outputs, plans = run(scheduler, clock, executor=FakeExecutor(repeat_every_5))
    assert outputs["r2"] == expected(PROMPTS[2], 30)
    assert all(not s.draft_token_ids for plan in plans if len(plan.seqs) >= 3 for s in plan.seqs)
    assert any(s.draft_token_ids for plan in plans for s in plan.seqs)  # once fewer remain

    scheduler, clock = make_scheduler(prefix_caching=False, speculative=NGRAM)
    request = make_request("r", PROMPTS[0], max_tokens=12)
    request.sampling_params.speculative = False
    scheduler.add_request(request)
    _, plans = run(scheduler, clock, executor=FakeExecutor(repeat_every_5))
    assert scheduler.spec_stats.num_draft_tokens == 0


# ---- the engine on a real model ----------------------------------------------------------

# Repetitive prompts: the tiny random model's greedy text soon loops, so guesses land.
REAL_PROMPTS = [
    "one two three one two three one two three one two",
    "the cat sat on the mat and the cat sat on the",
    "a b c d a b c d a b c",
]


def test_greedy_output_is_the_same_with_and_without_speculation(tiny_llama_dir: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    plain = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    spec = LLM(str(tiny_llama_dir), dtype="float32", compile=False, speculative_method="ngram")
    want = plain.generate(REAL_PROMPTS, greedy, use_tqdm=False)
    got = spec.generate(REAL_PROMPTS, greedy, use_tqdm=False)
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids and b.text == a.text
        assert [lp.token_id for lp in b.logprobs] == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
    assert sum(o.num_accepted_tokens for o in got) > 0, "no guess was accepted: test is moot"
    assert all(o.num_draft_tokens >= o.num_accepted_tokens for o in got)
    kv = spec.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_seeded_sampling_is_the_same_with_and_without_speculation(tiny_llama_dir: Path) -> None:
    """Each kept token is drawn with the uniform it would have had one token per step."""
    params = [
        SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=30, ignore_eos=True)
        for t, p, s in ((0.05, 1.0, 1), (0.1, 0.9, 2), (0.03, 0.95, 3))
    ]
    plain = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    spec = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        compile=False,
        speculative_method="ngram",
        num_speculative_tokens=5,
    )
    want = plain.generate(REAL_PROMPTS, params, use_tqdm=False)
    got = spec.generate(REAL_PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(o.num_accepted_tokens for o in got) > 0, "no guess was accepted: test is moot"


def test_stop_strings_hold_under_speculation(tiny_llama_dir: Path) -> None:
    plain = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    spec = LLM(str(tiny_llama_dir), dtype="float32", compile=False, speculative_method="ngram")
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = plain.generate(REAL_PROMPTS[0], greedy, use_tqdm=False)[0]
    cut_at = full.text[2 * len(full.text) // 3 :][:4]
    assert cut_at
    stop = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[cut_at])
    want = plain.generate(REAL_PROMPTS[0], stop, use_tqdm=False)[0]
    got = spec.generate(REAL_PROMPTS[0], stop, use_tqdm=False)[0]
    assert got.finish_reason == want.finish_reason == "stop"
    assert got.text == want.text and got.token_ids == want.token_ids
    kv = spec.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_served_streams_speculate_and_report_it(tiny_llama_dir: Path) -> None:
    """Through the HTTP server and the official client: the streamed text is the offline
    text without speculation, /metrics counts drafts, and a request can opt out."""
    config = engine_config(tiny_llama_dir)
    config.speculative = SpeculativeConfig(speculative_method="ngram")
    async_engine = AsyncEngine(LLMEngine(config))
    offline = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    want = offline.generate(
        REAL_PROMPTS[1], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    )[0].text
    with serving(async_engine) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        before = server.metrics()
        stream = client.completions.create(
            model=MODEL_NAME,
            prompt=REAL_PROMPTS[1],
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == want
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens_details is not None
        details = usage.completion_tokens_details
        after = server.metrics()
        drafted = after["iterserve:spec_decode_num_draft_tokens_total"]
        accepted = after["iterserve:spec_decode_num_accepted_tokens_total"]
        assert drafted > before.get("iterserve:spec_decode_num_draft_tokens_total", 0.0)
        assert 0 < accepted <= drafted
        # usage reports them per request as OpenAI's accepted/rejected prediction tokens
        assert details.accepted_prediction_tokens == accepted
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == drafted
        assert after['iterserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0

        opted_out = client.completions.create(
            model=MODEL_NAME,
            prompt=REAL_PROMPTS[1],
            max_tokens=32,
            temperature=0,
            extra_body={"ignore_eos": True, "speculative": False},
        )
        assert opted_out.choices[0].text == want
        assert server.metrics()["iterserve:spec_decode_num_draft_tokens_total"] == drafted


# ---- a draft model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A different, smaller network with the same tokenizer: one layer, its own head."""
    return _save_tiny(
        "llama",
        tmp_path_factory.mktemp("tiny-draft"),
        tokenizer_dir,
        tie_word_embeddings=False,
        num_hidden_layers=1,
    )


@pytest.fixture(scope="module")
def tiny_near_draft_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """One layer with the target's tied embeddings: its distributions are near the target's,
    not equal."""
    return _save_tiny(
        "llama",
        tmp_path_factory.mktemp("tiny-near-draft"),
        tokenizer_dir,
        tie_word_embeddings=True,
        num_hidden_layers=1,
    )


@pytest.mark.parametrize("draft_is_target", [True, False])
def test_draft_model_guesses_change_no_token(
    tiny_llama_dir: Path, tiny_draft_dir: Path, draft_is_target: bool
) -> None:
    """The target drafting for itself has every guess accepted; another model far fewer;
    the greedy text is the target's own either way."""
    draft = tiny_llama_dir if draft_is_target else tiny_draft_dir
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
    ]
    plain = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    spec = draft_llm(tiny_llama_dir, draft, num_speculative_tokens=3)
    want = plain.generate(REAL_PROMPTS, params, use_tqdm=False)
    got = spec.generate(REAL_PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = spec.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    if draft_is_target:
        assert stats.acceptance_rate > 0.9
    else:
        assert stats.acceptance_rate < 0.9
    assert spec.engine.scheduler.kv_cache_stats().num_used_blocks == 0
    assert spec.engine.draft is not None and spec.engine.draft.pool.num_free_blocks == (
        spec.engine.draft.pool.num_blocks
    )


def test_seeded_sampling_with_a_draft_model_is_repeatable(
    tiny_llama_dir: Path, tiny_draft_dir: Path
) -> None:
    """Guesses sampled by the draft and accepted by ratio: a seeded request's text is the
    same alone and in a crowd (draft and verifier draw from the request's generators)."""
    spec = draft_llm(tiny_llama_dir, tiny_draft_dir, num_speculative_tokens=3)
    seeded = SamplingParams(temperature=0.8, top_k=8, seed=11, max_tokens=24, ignore_eos=True)
    alone = spec.generate(REAL_PROMPTS[0], seeded, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    crowd = spec.generate(REAL_PROMPTS, [seeded, others, others], use_tqdm=False)
    assert crowd[0].token_ids == alone
    assert spec.engine.scheduler.spec_stats.num_draft_tokens > 0


def test_a_small_draft_pool_evicts_and_still_serves(
    tiny_llama_dir: Path, tiny_draft_dir: Path
) -> None:
    """Six blocks of 16 tokens cannot hold three requests' draft caches: the least recently
    used lose theirs and catch up later, or go without guesses; the text does not change."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), dtype="float32", compile=False, num_kv_blocks=6)
    spec = draft_llm(tiny_llama_dir, tiny_llama_dir, num_kv_blocks=6)
    want = [plain.generate(p, greedy, use_tqdm=False)[0].token_ids for p in REAL_PROMPTS]
    got = spec.generate(REAL_PROMPTS, greedy, use_tqdm=False)
    assert [o.token_ids for o in got] == want
    assert spec.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_a_draft_model_must_share_the_vocabulary(
    tiny_llama_dir: Path, tmp_path: Path, tokenizer_dir: Path
) -> None:
    other = _save_tiny("llama", tmp_path / "other", tokenizer_dir, vocab_size=VOCAB + 64)
    with pytest.raises(ConfigError, match="vocabulary"):
        draft_llm(tiny_llama_dir, other)
    with pytest.raises(ConfigError, match="--draft-model"):
        SpeculativeConfig(speculative_method="draft")
    with pytest.raises(ConfigError, match="needs a quantized GGUF"):
        draft_llm(tiny_llama_dir, Path("self-int4"))


# ---- exactness under every kind of step -----------------------------------------------------

SHARED = "You are a careful assistant. Answer briefly and repeat the question first. " * 2


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_is_exact_through_chunks_prefix_hits_and_preemption(
    tiny_llama_dir: Path, method: str, k: int
) -> None:
    """Prompts sharing a prefix (cache hits), chunked 16 tokens a step, in a pool too small
    for all of them (preemptions, some in the middle of speculated runs): greedy text equal
    to the same engine's without speculation."""
    settings = {
        "dtype": "float32",
        "compile": False,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
        "num_kv_blocks": 7,
    }
    prompts = [SHARED + p for p in REAL_PROMPTS] + [SHARED + REAL_PROMPTS[0][::-1]]
    greedy = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), **settings)
    extra = {"draft_model": str(tiny_llama_dir)} if method == "draft" else {}
    spec = LLM(
        str(tiny_llama_dir),
        speculative_method=method,
        num_speculative_tokens=k,
        **extra,
        **settings,
    )
    want = plain.generate(prompts, greedy, use_tqdm=False)
    got = spec.generate(prompts, greedy, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    scheduler = spec.engine.scheduler
    assert scheduler.spec_stats.num_accepted_tokens > 0
    assert scheduler.num_preemptions > 0, "no preemption: the test is moot"
    assert scheduler.kv_cache_stats().prefix_hits > 0, "no prefix hit: the test is moot"


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (z = 3.09), Wilson-Hilferty's approximation."""
    h = 2 / (9 * dof)
    return dof * (1 - h + z * h**0.5) ** 3


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_with_speculation_keeps_the_distribution(
    tiny_llama_dir: Path, tiny_near_draft_dir: Path, method: str
) -> None:
    """Unseeded draws of the first tokens, with and without speculation, come from the
    same distribution (chi-square test of homogeneity, per output position, p = 0.001):
    n-gram guesses kept by matching draws, a draft model's sampled guesses by the
    probability ratio. (tests/sample/test_sampler.py tests the ratio rule itself, sharply.)"""
    n = 400
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
    plain = LLM(str(tiny_llama_dir), dtype="float32", compile=False, max_num_seqs=64)
    settings = {"max_num_seqs": 64, "num_speculative_tokens": 3}
    if method == "draft":
        spec = draft_llm(tiny_llama_dir, tiny_near_draft_dir, **settings)
    else:
        spec = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            compile=False,
            speculative_method="ngram",
            ngram_min=1,
            **settings,
        )
    prompt = REAL_PROMPTS[1]
    a = [o.token_ids for o in plain.generate([prompt] * n, params, use_tqdm=False)]
    b = [o.token_ids for o in spec.generate([prompt] * n, params, use_tqdm=False)]
    stats = spec.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    for position in range(1, 4):
        counts_a = Counter(tokens[position] for tokens in a)
        counts_b = Counter(tokens[position] for tokens in b)
        cells = sorted(set(counts_a) | set(counts_b), key=lambda t: -(counts_a[t] + counts_b[t]))
        big = [t for t in cells if counts_a[t] + counts_b[t] >= 10]
        rows = [(counts_a[t], counts_b[t]) for t in big]
        rest = (n - sum(x for x, _ in rows), n - sum(y for _, y in rows))
        if sum(rest):
            rows.append(rest)
        statistic = sum(
            (x - (x + y) / 2) ** 2 / ((x + y) / 2) + (y - (x + y) / 2) ** 2 / ((x + y) / 2)
            for x, y in rows
        )
        assert len(rows) > 2
        assert statistic < chi_square_critical(len(rows) - 1), (position, rows)


def test_a_chats_prediction_is_what_its_drafts_follow(tiny_llama_dir: Path) -> None:
    """OpenAI's Predicted Outputs through the official client: an answer predicted right is
    mostly drafted from its prediction (accepted_prediction_tokens, where prompt lookup alone
    guesses little of a sampled text), one predicted wrong is the same answer all the same."""
    config = engine_config(tiny_llama_dir)
    config.speculative = SpeculativeConfig(speculative_method="ngram")
    messages = [{"role": "user", "content": "Write a short line about the sea."}]
    with serving(AsyncEngine(LLMEngine(config))) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")

        def answer(**fields: object) -> tuple[str | None, int]:
            reply = client.chat.completions.create(
                model=MODEL_NAME,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=24,
                temperature=1.0,  # seeded draws: a text that does not loop, as greedy's does
                seed=7,
                **fields,  # type: ignore[arg-type]
            )
            details = reply.usage.completion_tokens_details  # type: ignore[union-attr]
            assert details is not None
            return reply.choices[0].message.content, details.accepted_prediction_tokens or 0

        text, unguided = answer(extra_body={"ignore_eos": True})
        assert text
        parts = [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]
        for content in (text, parts):
            guided, accepted = answer(
                prediction={"type": "content", "content": content},
                extra_body={"ignore_eos": True},
            )
            assert guided == text
            assert accepted > max(unguided, 12), (accepted, unguided)
        wrong, _ = answer(
            prediction={"type": "content", "content": "Nothing like the answer at all."},
            extra_body={"ignore_eos": True},
        )
        assert wrong == text
