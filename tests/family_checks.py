"""Checks the model-family test modules share (test_model_families.py, test_gemma4.py): a
model's logits through chunked prefill and decodes against transformers', and the fast
paths' greedy tokens against eager torch on the same bf16 weights."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import torch
import transformers

from iterserve.model.config import ModelConfig
from iterserve.model.llama import LlamaForCausalLM
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
    layer) against bf16 eager torch, each loaded from `weights()` (the checkpoint's tensors as
    the loader lists them). Where the top two logits stand clear, the greedy token is the
    same; no logit strays by a tenth of the largest."""
    rng = random.Random(5)
    tokens = [rng.randrange(vocab) for _ in range(100)]
    rows = {}
    for fast in (False, True):
        model = LlamaForCausalLM(config, torch.bfloat16, torch.device("cpu"))
        model.load(weights(), "tiled" if fast else "torch")
        assert model.fused_layers == (fast and fused)
        runner = PagedRunner(model, block_size=16, num_blocks=32, paged_kernel=fast)
        runner.add("s", tokens)
        out = [runner.step([("s", n)])["s"] for n in (40, 30)]
        out += [runner.step([("s", 1)])["s"] for _ in range(30)]
        rows[fast] = torch.cat(out).float()
    ref, got = rows[False], rows[True]
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * ref.std()
    # A vocabulary of 49152 random rows leaves many near-ties: a third of rows clear is plenty.
    assert int(clear.sum()) >= 0.3 * len(ref)
    assert bool((ref.argmax(-1)[clear] == got.argmax(-1)[clear]).all())
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
