"""Checks the model-family test modules share (test_model_families.py, test_gemma4.py): a
model's logits through chunked prefill and decodes against transformers', the fast paths'
greedy tokens against eager torch on the same bf16 weights, and an engine's greedy tokens
through preemption and n-gram speculation."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import transformers

from iterserve.engine.llm import LLM
from iterserve.model.config import ModelConfig
from iterserve.model.llama import LlamaForCausalLM
from iterserve.sampling_params import SamplingParams
from paged_runner import PagedRunner
from tiny_checkpoints import hf_token_by_token

# A 30-token chunk beside a 12-token prompt, then 45 and 15 more tokens of the first beside
# the second's decodes: chunks over cached prefixes, past a window of 24 and 48.
CHUNKED_STEPS = ([("s0", 30), ("s1", 12)], [("s1", 1), ("s0", 45)], [("s1", 1), ("s0", 15)])


def assert_chunks_and_decodes_match_transformers(
    ours: LlamaForCausalLM, reference: transformers.PreTrainedModel, vocab: int, prompt: int
) -> None:
    """Sequences of 90 and 20 random tokens through CHUNKED_STEPS: their logits those of
    transformers run over the first `prompt` tokens, then one token at a time (fp32, atol
    1e-4)."""
    rng = random.Random(3)
    seqs = {f"s{i}": [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate((90, 20))}
    runner = PagedRunner(ours, block_size=8, num_blocks=64)
    for seq, tokens in seqs.items():
        runner.add(seq, tokens)
    got: dict[str, list[torch.Tensor]] = {seq: [] for seq in seqs}
    for plan in CHUNKED_STEPS:
        for seq, logits in runner.step(plan).items():
            got[seq].append(logits)
    for seq, tokens in seqs.items():
        computed = runner.computed[seq]
        ref = hf_token_by_token(reference, tokens[:computed], prompt=min(computed, prompt))
        torch.testing.assert_close(torch.cat(got[seq]), ref, atol=1e-4, rtol=0)


def assert_fast_paths_keep_the_eager_greedy_tokens(
    config: ModelConfig,
    weights: Callable[[], Mapping[str, torch.Tensor]],
    vocab: int,
    fused: bool,
) -> None:
    """100 random tokens as a 40-token chunk, a 30-token one and 30 decodes: the tiled
    kernels and the paged attention op (in the fused layer op where `fused`, else layer by
    layer) in bf16 against eager torch, each loaded from `weights()` (the checkpoint's
    tensors as the loader lists them). The fast path's greedy token is float32's, or one
    float32 scores within bf16's rounding of it; no logit strays from eager bf16's by a tenth
    of the largest."""
    rng = random.Random(5)
    tokens = [rng.randrange(vocab) for _ in range(100)]
    rows = {}
    for name, dtype, fast in (
        ("exact", torch.float32, False),
        ("eager", torch.bfloat16, False),
        ("fast", torch.bfloat16, True),
    ):
        model = LlamaForCausalLM(config, dtype, torch.device("cpu"))
        model.load(weights(), "tiled" if fast else "torch")
        assert model.fused_layers == (fast and fused)
        runner = PagedRunner(model, block_size=16, num_blocks=32, paged_kernel=fast)
        runner.add("s", tokens)
        out = [runner.step([("s", n)])["s"] for n in (40, 30)]
        out += [runner.step([("s", 1)])["s"] for _ in range(30)]
        rows[name] = torch.cat(out).float()
    exact, ref, got = rows["exact"], rows["eager"], rows["fast"]
    # bf16's own rounding, as it moved the eager path's logits of each row. On every row the
    # fast path's greedy token stands, in float32, within three times that of float32's best
    # (its own logit and the best's may each move by about as much, and a near-tie in a
    # router's top-k moves more: Granite MoE's fast path strayed 1.7 roundings on an AVX2
    # machine); where float32's top two stand further apart, it is float32's token. Exact
    # agreement wherever the top two stood a tenth of the logits' spread apart was no fair
    # demand: SmolLM3's row 36 stood 0.27 apart while eager bf16 moved its logits by up to
    # 0.31, and the two bf16 paths split.
    rounding = (ref - exact).abs().amax(dim=-1)
    chosen = exact.gather(1, got.argmax(dim=-1, keepdim=True)).squeeze(1)
    assert bool((chosen >= exact.amax(dim=-1) - 3 * rounding).all())
    # No logit strays from eager bf16's by a tenth of the largest; or, where the two bf16
    # paths round apart by more, the fast one stands at most twice as far from float32 as
    # eager bf16 does. Gemma 4 E2B's C++ layer op rounds its glue as transformers does, not
    # as the Python layer does, and its tiny random model (weights of std 0.15) carried the
    # first layer's difference to 14% of the largest logit, while that layer's own output
    # stood as close to float32's as the Python layer's on the same input (mean error 0.023
    # against 0.022, max 0.24 against 0.17 of 12.5; 2026-12-04, a throwaway script).
    strays = (got - ref).abs().max() >= 0.1 * ref.abs().max()
    assert not strays or (got - exact).abs().max() <= 2 * (ref - exact).abs().max()


@torch.inference_mode()
def greedy_tokens(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """transformers' `n` greedy tokens after `prompt`, each from a forward over the whole
    sequence (no generate(): Phi-3's recomputes its cache at the longrope switch)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def preempted_ngram_run(
    hf: transformers.PreTrainedModel, directory: Path, seed: int, vocab: int, compiled: bool
) -> tuple[LLM, list[list[int]], list[list[int]]]:
    """Three prompts that end as their phrase begins (a draft for prompt lookup), 16 greedy
    tokens each through an engine whose KV pool holds the prompts (at most 6 blocks each)
    but not the outputs (preemption), n-gram speculation on: the engine, its tokens and
    transformers'."""
    rng = random.Random(seed)
    prompts = []
    for n in (5, 6, 7):
        phrase = [rng.randrange(3, vocab) for _ in range(n)]
        prompts.append(phrase * 3 + phrase[:2])
    expected = [greedy_tokens(hf, p, 16) for p in prompts]
    llm = LLM(
        str(directory),
        dtype="float32",
        compile=compiled,
        block_size=4,
        num_kv_blocks=14,
        max_num_batched_tokens=16,
        max_num_seqs=3,
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.token_ids for o in outputs], expected


def assert_batch_invariant(directory: Path, vocab: int) -> None:
    """--batch-invariant on the fused layers: a seeded request alone, then among others of
    other lengths (its prompt chunked beside theirs, its decodes in batches of every size as
    the others finish): the same tokens and logprobs to the last bit."""
    llm = LLM(
        str(directory),
        dtype="bfloat16",
        batch_invariant=True,
        max_num_batched_tokens=96,
        enable_prefix_caching=False,
        compile=False,
    )
    assert llm.engine.model_plan.step == "fused-layers"
    rng = random.Random(3)
    prompt = [rng.randrange(3, vocab) for _ in range(70)]
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True, logprobs=2)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]
    others = [[rng.randrange(3, vocab) for _ in range(20 + 30 * i)] for i in range(5)]
    crowd = llm.generate(
        [*others[:2], prompt, *others[2:]],
        [*[SamplingParams(temperature=0.8, max_tokens=3 * i + 2) for i in range(2)], seeded]
        + [SamplingParams(temperature=0.8, max_tokens=3 * i + 8) for i in range(3)],
        use_tqdm=False,
    )
    together = crowd[2]
    assert together.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs
