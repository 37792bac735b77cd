"""Checks the mixture-of-experts test modules share (test_moe.py, test_lfm2_moe.py): a model's
logits over steps of every kind against transformers', and the fused layer op against the
same weights op by op."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import transformers

from iterserve.model.llama import LlamaForCausalLM
from paged_runner import PagedRunner

# A mixed prefill step, a chunked one beside a decode, then decodes alone and together.
MIXED_STEPS = (
    [("s0", 12), ("s1", 9)],
    [("s0", 9), ("s2", 5), ("s1", 1)],
    [("s2", 9), ("s1", 1)],
    [("s1", 1)],
)


def assert_mixed_steps_match_transformers(
    model: LlamaForCausalLM, hf: transformers.PreTrainedModel, vocab: int
) -> None:
    """Three sequences of 21, 12 and 14 random tokens through MIXED_STEPS: each one's logits
    those of transformers' forward over the whole sequence (fp32, atol 1e-4)."""
    runner = PagedRunner(model, block_size=4, seed=1)
    rng = random.Random(0)
    seqs = {f"s{i}": [rng.randrange(vocab) for _ in range(n)] for i, n in enumerate([21, 12, 14])}
    for name, tokens in seqs.items():
        runner.add(name, tokens)
    got: dict[str, list[torch.Tensor]] = {name: [] for name in seqs}
    for plan in MIXED_STEPS:
        for name, logits in runner.step(plan).items():
            got[name].append(logits)
    with torch.inference_mode():
        for name, tokens in seqs.items():
            expected = hf(torch.tensor([tokens])).logits[0]
            torch.testing.assert_close(torch.cat(got[name]), expected, atol=1e-4, rtol=0)


def assert_fused_layers_keep_the_torch_logits(model: Callable[[bool], LlamaForCausalLM]) -> None:
    """`model(fast)`'s rows over a prefill, a chunk and 12 decodes of two sequences, the fused
    layer op (fast) against torch op by op on the same bf16 weights. In bf16 two router logits
    can tie or nearly so, and a rounding upstream (the fused layer's norms and rope round as
    a compiled graph does, not as torch's ops) then gives a token other experts, and other
    logits from there on: such rows must be rare; where the top two logits stand clear
    apart, the greedy token is the same."""
    rows = {}
    for fast in (False, True):
        ours = model(fast)
        assert ours.fused_layers == fast
        runner = PagedRunner(ours, block_size=4, paged_kernel=fast)
        runner.add("a", list(range(3, 65)))  # 30 + 17 prompt tokens, 12 decodes
        runner.add("b", list(range(60, 90)))  # 15 + 1, then 12
        out = [runner.step([("a", 30), ("b", 15)])["a"], runner.step([("a", 17), ("b", 1)])["a"]]
        for _ in range(12):
            step = runner.step([("a", 1), ("b", 1)])
            out += [step["a"], step["b"]]
        rows[fast] = torch.cat(out).float()
    ref, got = rows[False], rows[True]
    close = (got - ref).abs().amax(-1) < 0.05 * ref.abs().max()
    assert close.float().mean() >= 0.85, f"{int((~close).sum())} of {len(ref)} rows apart"
    top2 = ref.topk(2, dim=-1).values
    clear = ((top2[:, 0] - top2[:, 1]) > 0.1 * ref.std()) & close
    assert int(clear.sum()) >= 0.3 * len(ref)
    assert bool((ref.argmax(-1)[clear] == got.argmax(-1)[clear]).all())
