"""Prompts the engine tests share, and what transformers' own greedy generate makes of them
on a checkpoint (fp32): the reference iterserve's text is compared with."""

from __future__ import annotations

from pathlib import Path

import torch

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "1 2 3",
    "A long prompt that keeps going so that it spans several KV cache blocks and is split "
    "into chunks when the token budget is small: the quick brown fox jumps over the lazy dog.",
]


def reference(model_dir: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        generated = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=0,
        )
        outputs.append(generated[0, ids.shape[1] :].tolist())
    return outputs


def assert_same_greedy(reference: list[torch.Tensor], fast: list[torch.Tensor]) -> None:
    """Same argmax at every row where the reference's top two are clearly apart (bf16 paths
    round differently, so near-ties may go either way), and logits close everywhere."""
    ref, got = torch.cat(reference), torch.cat(fast)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * ref.std()
    assert int(clear.sum()) >= 0.5 * len(ref)
    agree = ref.argmax(-1)[clear] == got.argmax(-1)[clear]
    assert bool(agree.all()), f"{int((~agree).sum())} of {int(clear.sum())} rows disagree"
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
