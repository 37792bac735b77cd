"""The bundled SmolLM2-135M-Instruct through the whole engine (bf16, the default)."""

from __future__ import annotations

import pytest

from conftest import kernel_test_isas
from iterserve import LLM, SamplingParams, kernels

pytestmark = pytest.mark.slow  # processes of their own, or the bundled model


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=8)


def test_capital_of_france_is_paris(llm: LLM) -> None:
    if kernels.available():
        assert llm.engine.model_plan.weights == "Q4_1+Q8_0"  # the file's blocks, as they are
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )[0]
    assert out.text.startswith(" Paris"), out.text


def test_chat_template_from_the_gguf(llm: LLM) -> None:
    # Not "What is the capital of France?": its first token is a near-tie on this model
    # ("The" against "L'", 0.125 nats apart on the reference torch path), which roundings
    # decide either way; this one's answer leads by 1.4-1.7 nats on every path.
    messages = [{"role": "user", "content": "Name the capital of France."}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def _weight_cases() -> list[tuple[str | None, str, str]]:
    """Every --weights choice on the best ISA variant here; AVX2 (where it is another variant)
    runs the default only, its kernels for every format being checked one by one in
    tests/kernels/ (each whole-model case is 10-40 s)."""
    choices = [("auto", "Q4_1+Q8_0"), ("int4", "Q4_1+Q8_0"), ("int8", "Q8_0"), ("bf16", "bf16")]
    best, *others = kernel_test_isas()
    return [(best, *c) for c in choices] + [(isa, *choices[0]) for isa in others]


@pytest.mark.parametrize("kernel_isa,weights,formats", _weight_cases(), indirect=["kernel_isa"])
def test_every_weight_format_answers_paris(kernel_isa: str, weights: str, formats: str) -> None:
    """auto: the file's blocks at every step size; int8: everything made Q8_0; bf16:
    everything dense. A prompt of over 16 tokens runs the many-row kernels (the sweep of
    csrc/tiles.h)."""
    llm = LLM(weights=weights, max_num_seqs=2)
    assert llm.engine.model_plan.weights == formats
    prompt = "The Eiffel Tower is a famous landmark. It stands in the capital city of France, which is called"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert len(llm.engine.tokenize(prompt)) > 16
    assert "Paris" in out.text, out.text


@pytest.mark.skipif(
    not kernels.available(), reason=f"C++ kernels unavailable: {kernels.why_unavailable()}"
)
def test_batch_invariant_seeded_text_and_logprobs_whatever_shares_the_steps() -> None:
    """--batch-invariant: a seeded request alone, then among others of other lengths (its
    prompt chunked beside theirs, decoding in batches of every size as they finish): the
    same tokens and the same logprobs to the last bit."""
    llm = LLM(batch_invariant=True, max_num_batched_tokens=64, enable_prefix_caching=False)
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]
    others = [f"Tell me fact number {i} about the ocean, in detail." * (i + 1) for i in range(6)]
    crowd_params = [SamplingParams(temperature=0.8, max_tokens=4 * i + 3) for i in range(6)]
    crowd = llm.generate(
        [*others[:3], prompt, *others[3:]],
        [*crowd_params[:3], seeded, *crowd_params[3:]],
        use_tqdm=False,
    )
    together = crowd[3]
    assert together.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs


@pytest.mark.skipif(
    not kernels.available(), reason=f"C++ kernels unavailable: {kernels.why_unavailable()}"
)
def test_default_logits_ignore_chunking_and_the_prefix_cache() -> None:
    """The defaults (no --batch-invariant): a prompt prefilled whole, in chunks of 48 rows,
    and after its first 192 tokens came from the prefix cache gives the same tokens and
    logprobs to the last bit. (Until 2026-12-02 attention took other kernels for chunks of
    many rows, and an agent's second turn was answered otherwise from a warm cache:
    docs/agent_frameworks.md.)"""
    llm = LLM(max_num_seqs=2)
    tokens = llm.engine.tokenize(
        "Write a long and careful story about a lighthouse keeper, the sea, the storms of the "
        "winter and the ships that pass in the night. " * 8
    )[:300]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    llm.engine.reset_prefix_cache()
    whole = llm.generate([tokens], greedy, use_tqdm=False)[0]
    llm.engine.reset_prefix_cache()
    llm.generate([[*tokens[:192], 7, 8, 9]], SamplingParams(max_tokens=1), use_tqdm=False)
    warm = llm.generate([tokens], greedy, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 192
    chunked = LLM(max_num_seqs=2, max_num_batched_tokens=48, enable_prefix_caching=False)
    split = chunked.generate([tokens], greedy, use_tqdm=False)[0]
    for other in (warm, split):
        assert other.token_ids == whole.token_ids
        assert other.logprobs == whole.logprobs


@pytest.mark.skipif(
    not kernels.available(), reason=f"C++ kernels unavailable: {kernels.why_unavailable()}"
)
def test_self_int4_draft_keeps_the_bf16_text() -> None:
    """--weights bf16 with the GGUF's own 4-bit weights as the draft: most guesses land,
    and (batch-invariant, so a verify step's rows compute as a lone decode's would) the
    greedy tokens are the bf16 model's own. (Sampled guesses are kept by the probability
    ratio: the same distribution, other draws; tests/sample/test_rejection.py.)"""
    settings = {"weights": "bf16", "batch_invariant": True, "enable_prefix_caching": False}
    plain = LLM(**settings)
    spec = LLM(
        speculative_method="draft", draft_model="self-int4", num_speculative_tokens=3, **settings
    )
    messages = [{"role": "user", "content": "Name three rivers in Europe and their countries."}]
    prompt = plain.apply_chat_template(messages)
    other = plain.apply_chat_template([{"role": "user", "content": "Describe a cat."}])
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = plain.generate([prompt, other], params, use_tqdm=False)
    got = spec.generate([prompt, other], params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = spec.engine.scheduler.spec_stats
    assert stats.acceptance_rate > 0.5, stats


@pytest.mark.skipif(
    not kernels.available(), reason=f"C++ kernels unavailable: {kernels.why_unavailable()}"
)
def test_ngram_speculation_keeps_the_text() -> None:
    """Prompt lookup on the default weights, k = 1, 3 and 5, on a request that copies its
    prompt (guesses land and miss): batch-invariant, so a verify step's rows compute as
    lone decodes would, the greedy tokens are exactly those of plain decoding."""
    settings = {"batch_invariant": True, "enable_prefix_caching": False}
    plain = LLM(**settings)
    passage = "def area(width, height):\n    return width * height\n\nprint(area(3, 4))\n"
    ask = f"Rename the function area to rectangle_area:\n\n{passage}"
    prompt = plain.apply_chat_template([{"role": "user", "content": ask}])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain.generate([prompt], params, use_tqdm=False)[0].token_ids
    for k in (1, 3, 5):
        spec = LLM(speculative_method="ngram", num_speculative_tokens=k, **settings)
        got = spec.generate([prompt], params, use_tqdm=False)[0].token_ids
        stats = spec.engine.scheduler.spec_stats
        assert got == want, f"k={k}"
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, (k, stats)
