"""Penalties, logit_bias, min_tokens and bad_words (sample/logits_controls.py) against a
plain per-entry reference, and through the engine against transformers' own processors;
prompt logprobs against a transformers fp32 forward."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from draft_llms import draft_llm
from iterserve import LLM, SamplingParams
from iterserve.core import step_plan
from iterserve.core.outputs import ScheduledSeq, TokenContext
from iterserve.sample.logits_controls import apply_logits_controls, row_contexts
from iterserve.sampling_params import InvalidRequestError

VOCAB = 40


def reference_controls(logits: list[float], p: SamplingParams, ctx: TokenContext) -> list[float]:
    """vLLM's order and rules, one vocabulary entry at a time."""
    out = list(logits)
    if p.allowed_token_ids is not None:
        out = [x if t in p.allowed_token_ids else float("-inf") for t, x in enumerate(out)]
    output = list(ctx.output_token_ids)
    for word in ctx.bad_words_token_ids:
        if len(word) == 1 or output[-(len(word) - 1) :] == word[:-1]:
            out[word[-1]] = float("-inf")
    if len(output) < p.min_tokens:
        for token in ctx.stop_token_ids:
            out[token] = float("-inf")
    for token, bias in (p.logit_bias or {}).items():
        out[token] += bias
    counted, seen = output, [*ctx.prompt_token_ids, *output]
    if p.penalty_last_n is not None:  # llama.cpp's window over prompt and output, for all three
        counted = seen = seen[-p.penalty_last_n :]
    for token in range(len(out)):
        count = counted.count(token)
        if count or token in seen:
            r = p.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_controls_match_the_reference() -> None:
    rng = random.Random(0)
    logits = torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(),  # untouched row between others
        SamplingParams(presence_penalty=0.5, frequency_penalty=-1.25, logit_bias={3: 7.5, 9: -100}),
        SamplingParams(min_tokens=12, repetition_penalty=0.6, frequency_penalty=0.3),
        SamplingParams(logit_bias={0: 1.0}),  # bias alone: no context needed
        SamplingParams(
            allowed_token_ids=[3, 4, 5, 11], logit_bias={4: 2.0}, repetition_penalty=1.3
        ),
        # llama.cpp's windows: within the output, into the prompt, past the whole sequence.
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, penalty_last_n=5),
        SamplingParams(repetition_penalty=0.7, presence_penalty=0.9, penalty_last_n=14),
        SamplingParams(frequency_penalty=0.2, presence_penalty=0.3, penalty_last_n=10**6),
    ]
    contexts: list[TokenContext | None] = []
    for p in params:
        prompt = [rng.randrange(VOCAB) for _ in range(12)]
        output = [rng.randrange(VOCAB) for _ in range(7)] + [4, 5]
        words = [[11], [4, 5, 6], [5, 7], [30, 31]]  # [4, 5, 6] and [11] apply, the rest not
        context = TokenContext(prompt, output, (2, 8), words)
        contexts.append(context if p.uses_token_history else None)
    controlled = apply_logits_controls(logits, params, contexts)
    for i, (p, context) in enumerate(zip(params, contexts, strict=True)):
        expected = logits[i].tolist()
        if p.adjusts_logits:
            empty = TokenContext([], [], (), [])
            expected = reference_controls(expected, p, context or empty)
        torch.testing.assert_close(controlled[i], torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert controlled[3, 2] == float("-inf") and controlled[0, 6] == float("-inf")
    allowed = torch.isfinite(controlled[5]).nonzero().flatten().tolist()
    assert set(allowed) <= {3, 4, 5, 11} and 3 in allowed
    assert torch.equal(logits, logits.clone()), "the raw logits are left for logprobs"


@pytest.mark.parametrize("penalty", [4e-128, 1e-40, 1e39, 1e308])
def test_extreme_repetition_penalties_stay_numbers(penalty: float) -> None:
    """Penalties float32 cannot hold, on banned (-inf) and zero logits: never NaN."""
    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, 0.5]])
    params = [SamplingParams(repetition_penalty=penalty, min_tokens=1)]
    context = TokenContext([0, 1, 2, 4], [], (4,), [])
    controlled = apply_logits_controls(logits, params, [context])
    assert not controlled.isnan().any() and controlled[0, 4] == float("-inf")
    assert controlled[0].argmax() == (1 if penalty < 1 else 3)


def test_a_batch_without_controls_is_untouched() -> None:
    logits = torch.randn(3, VOCAB)
    assert apply_logits_controls(logits, [SamplingParams()] * 3, [None] * 3) is logits


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.8}, {"min_p": 0.5}])
def test_banned_tokens_stay_banned_at_any_temperature(extra: dict) -> None:
    """At T = 1e308, 1 / T underflows float32; a banned token's -inf must still weigh 0."""
    from iterserve.sample.sampler import Sampler

    logits = torch.zeros(4, 2048)
    logits[:, :2000] = float("-inf")
    params = [SamplingParams(temperature=1e308, seed=i, **extra) for i in range(4)]
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    assert all(t >= 2000 for t in Sampler()(logits, params, generators).token_ids)


def test_drafts_count_as_output_at_later_positions() -> None:
    """A speculating row j is sampled after drafts 0..j-1: they are its output there."""
    context = TokenContext([1], [5], (), [])
    seq = ScheduledSeq(
        "r", [5, 6, 7], 1, (0,), True, SamplingParams(frequency_penalty=1.0), [6, 7], context
    )
    outputs = [c.output_token_ids for c in row_contexts([seq]) if c is not None]
    assert outputs == [[5], [5, 6], [5, 6, 7]]
    assert context.output_token_ids == [5], "the scheduler's record is not touched"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_out_of_range_values_name_their_field(fields: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**fields)
    assert error.value.param == param


# ---- through the engine, against transformers -------------------------------------------


@pytest.fixture(scope="module")
def hf(tiny_llama_dir: Path) -> tuple[Any, Any]:
    """The same checkpoint in transformers, fp32: (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


REPEATING = "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3 1 2"


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 5, "max_num_seqs": 4, "block_size": 4},
        {"speculative_method": "ngram", "num_speculative_tokens": 3},
        {"num_kv_blocks": 16, "block_size": 4},  # preempted and recomputed
    ],
    ids=["chunked", "ngram", "preemption"],
)
def test_repetition_penalty_matches_transformers(
    tiny_llama_dir: Path, hf: tuple[Any, Any], settings: dict
) -> None:
    """Greedy under repetition_penalty (prompt + output, vLLM's and transformers' rule)
    gives transformers' tokens, with the prompt chunked or drafts proposed and rejected."""
    model, tokenizer = hf
    ids = torch.tensor([tokenizer.encode(REPEATING)])
    expected = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=10,
        min_new_tokens=10,
        repetition_penalty=1.3,
        pad_token_id=0,
    )[0, ids.shape[1] :].tolist()
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3)
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # The same prompt again finds its blocks in the prefix cache: the penalty still sees them.
    outputs = llm.generate([REPEATING, REPEATING, REPEATING], [plain, params, params], False)
    assert outputs[1].token_ids == expected and outputs[2].token_ids == expected
    assert outputs[0].token_ids != expected, "the penalty changes this output"
    if "num_kv_blocks" in settings:
        assert llm.engine.scheduler.num_preemptions > 0


def test_a_penalty_window_decodes_as_llama_cpps_rule(
    tiny_llama_dir: Path, hf: tuple[Any, Any]
) -> None:
    """Greedy under penalties counted over the last 4 tokens of prompt and output
    (llama.cpp's repeat_last_n), against a decode loop here that applies that rule to
    transformers' logits, with the prompt chunked across steps."""
    model, tokenizer = hf
    ids = tokenizer.encode(REPEATING)
    window, repeat, frequency, presence = 4, 1.4, 0.3, 0.2
    expected: list[int] = []
    with torch.no_grad():
        for _ in range(10):
            logits = model(torch.tensor([ids + expected])).logits[0, -1].tolist()
            recent = (ids + expected)[-window:]
            for token in set(recent):
                x = logits[token]
                x = x / repeat if x > 0 else x * repeat
                logits[token] = x - frequency * recent.count(token) - presence
            expected.append(max(range(len(logits)), key=logits.__getitem__))
    chunked = {"max_num_batched_tokens": 5, "max_num_seqs": 4}  # the prompt over several steps
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False, **chunked)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                            repetition_penalty=repeat, frequency_penalty=frequency,
                            presence_penalty=presence, penalty_last_n=window)  # fmt: skip
    vllm_rule = replace(params, penalty_last_n=None)
    outputs = llm.generate([REPEATING, REPEATING], [params, vllm_rule], False)
    assert outputs[0].token_ids == expected
    assert outputs[1].token_ids != expected, "the window changes this output"
    with pytest.raises(InvalidRequestError, match="penalty_last_n"):
        SamplingParams(penalty_last_n=0)


def test_penalties_hold_through_rejected_drafts(tiny_llama_dir: Path) -> None:
    """The model drafts for itself, unpenalised: under strong frequency and presence
    penalties the target turns its guesses down, and the text is the one decoding
    without speculation gives (the rejected drafts never count as output)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, frequency_penalty=2, presence_penalty=2
    )
    plain = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    expected = plain.generate(REPEATING, params, use_tqdm=False)[0].token_ids
    drafting = draft_llm(tiny_llama_dir, tiny_llama_dir, num_speculative_tokens=3)
    out = drafting.generate(REPEATING, params, use_tqdm=False)[0]
    assert out.token_ids == expected and len(set(expected)) > 5, "the penalties bite"
    assert out.num_draft_tokens > out.num_accepted_tokens, "some drafts were turned down"


def test_sampled_drafts_ignore_the_controls_and_the_text_keeps_them(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft proposes without the request's logit bias. Here the target's raw logits
    favour one token by far, the bias bans it, and the draft proposes nothing else (its
    q all on that token): the target keeps a guess by the ratio of its own *biased*
    distribution to q, so it keeps none and the text never has the token. Verifying
    against the raw distribution would keep nearly all of them."""
    llm = draft_llm(tiny_llama_dir, tiny_llama_dir, num_speculative_tokens=3)
    banned = 1234
    network = llm.engine.executor.network
    forward = network.forward

    def favouring(seqs: list[Any]) -> torch.Tensor:
        logits = forward(seqs)
        logits[:, banned] += 30.0
        return logits

    monkeypatch.setattr(network, "forward", favouring)
    draft = llm.engine.draft
    assert draft is not None

    def guess_banned(query: Any, logits: torch.Tensor) -> int:
        q = torch.zeros(logits.shape[-1])
        q[banned] = 1.0
        draft._probs.setdefault(query.request_id, []).append(q)
        return banned

    monkeypatch.setattr(draft, "_guess", guess_banned)
    # logprobs: the runner keeps the raw logits apart from the biased ones.
    params = SamplingParams(
        seed=3, max_tokens=16, ignore_eos=True, logit_bias={banned: -100.0}, logprobs=0
    )
    out = llm.generate(REPEATING, params, use_tqdm=False)[0]
    assert banned not in out.token_ids
    assert out.num_draft_tokens > 0 and out.num_accepted_tokens == 0
    unbiased = llm.generate(REPEATING, replace(params, logit_bias=None), use_tqdm=False)[0]
    assert unbiased.token_ids.count(banned) > 8, "the raw logits do favour it"


def test_bad_words_and_logit_bias_ban_tokens(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    free = llm.generate(REPEATING, greedy, use_tqdm=False)[0].token_ids
    token = free[0]
    word = llm.tokenizer.decode([token])
    biased = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={token: -100}
    )
    banned = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, bad_words=[word])
    for params in (biased, banned):
        assert token not in llm.generate(REPEATING, params, use_tqdm=False)[0].token_ids
    # min_tokens holds back a stop token id: without it the request ends at once.
    stop_at_first = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[token])
    assert llm.generate(REPEATING, stop_at_first, use_tqdm=False)[0].token_ids == [token]
    held = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[token], min_tokens=3)
    out = llm.generate(REPEATING, held, use_tqdm=False)[0].token_ids
    assert len(out) >= 3 and token not in out[:3]
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("x", SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    assert error.value.param == "logit_bias"
    # A word the tokenizer writes with no token (a control character it drops) bans
    # nothing; it was an IndexError, a 500 (found by tests/server/test_fuzz_api.py).
    assert llm.tokenizer.encode("\x14", add_special_tokens=False) == []
    dropped = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, bad_words=["\x14"])
    assert llm.generate(REPEATING, dropped, use_tqdm=False)[0].token_ids == free


def _reference_prompt_logprobs(
    hf: tuple[Any, Any], prompt: str, top_n: int
) -> tuple[list[int], list[float], list[list[int]]]:
    model, tokenizer = hf
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    chosen = [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]
    top = logprobs[:-1].topk(top_n, -1).indices.tolist()
    return ids, chosen, top


LONG_PROMPT = (
    "A prompt long enough to span several KV cache blocks and several chunks, so that "
    "its logprobs come from more than one step: the quick brown fox jumps over the dog."
)


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 7, "max_num_seqs": 7, "block_size": 4},
        {"block_size": 4},
        {"block_size": 4, "scored_rows_cap": 6},  # the budget allows the whole prompt
    ],
    ids=["chunked", "whole", "capped"],
)
def test_prompt_logprobs_match_transformers(
    tiny_llama_dir: Path,
    hf: tuple[Any, Any],
    settings: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ids, expected, top = _reference_prompt_logprobs(hf, LONG_PROMPT, 2)
    cap = settings.pop("scored_rows_cap", None)
    if cap is not None:
        monkeypatch.setattr(step_plan, "MAX_SCORED_PROMPT_ROWS", cap)
    llm = LLM(str(tiny_llama_dir), dtype="float32", compile=False, **settings)
    rows: list[int] = []  # rows of logits of each step
    network = llm.engine.executor.network
    forward = network.forward

    def counted(seqs: list[Any]) -> torch.Tensor:
        rows.append(sum(seq.num_logits for seq in seqs))
        return forward(seqs)

    monkeypatch.setattr(network, "forward", counted)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    scored = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    # First a plain run fills the prefix cache; the scored one must not use it, and a
    # plain one after it still does.
    runs = [llm.generate(LONG_PROMPT, p, use_tqdm=False)[0] for p in (plain, scored, plain)]
    out = runs[1]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    entries = out.prompt_logprobs[1:]
    assert [e.token_id for e in entries if e] == ids[1:]
    got = [e.logprob for e in entries if e]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-4)
    assert [[t for t, _ in e.top] for e in entries if e] == top
    assert out.num_cached_tokens == 0 and runs[2].num_cached_tokens > 0
    assert out.token_ids == runs[0].token_ids
    if cap is not None:  # the scored prompt came in chunks of at most `cap` rows of logits
        assert max(rows) <= cap and len(rows) > len(ids) // cap, rows
