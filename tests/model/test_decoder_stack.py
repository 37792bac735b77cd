"""The fused layers in one call a step (csrc/layer.cpp `decoder_stack`) against one call a
layer (`decoder_layer`): the same kernels in the same order, so the same bits, through a
prefill in chunks, steps mixing a prompt's chunk with decodes, and decodes; Qwen3's q/k norms,
Phi-3's sliding window (passed, 48 positions) and biases-free fused projections, Gemma's GELU
and sandwich norms, Gemma 2's soft-cap and Gemma 3's sliding layers' own rope included. Both against transformers: tests/model/test_model_families.py."""

from __future__ import annotations

import random

import pytest
import torch

from iterserve.model.linear import WeightMode
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.loader import hf_model_config
from paged_runner import PagedRunner
from tiny_checkpoints import tiny_hf_model
from tiny_families import SMALL_VOCAB, VOCAB, family_model


def _stacked_and_layer_by_layer(
    hf: torch.nn.Module,
    prompts: dict[str, list[int]],
    plan: list[list[tuple[str, int]]],
    monkeypatch: pytest.MonkeyPatch,
    mode: WeightMode = "blocks",
) -> dict[bool, torch.Tensor]:
    """Every step's logits, the layers run in one call (True) and one call a layer (False);
    the weights held as `mode` says (model/linear.py)."""
    logits = {}
    for stacked in (True, False):
        config = hf_model_config({**hf.config.to_dict(), "architectures": [type(hf).__name__]})
        model = LlamaForCausalLM(config, torch.bfloat16, torch.device("cpu"))
        model.load(dict(hf.state_dict()), "tiled", mode=mode)
        assert model.fused_layers
        if not stacked:
            monkeypatch.setattr(model, "_stacked", lambda kv_caches: None)
        blocks = sum(len(tokens) for tokens in prompts.values()) // 16 + 8
        runner = PagedRunner(model, block_size=16, num_blocks=blocks, paged_kernel=True)
        for name, tokens in prompts.items():
            runner.add(name, tokens[:1])
        out = []
        for step in plan:
            for name, n in step:  # the tokens a step computes, as they come
                runner.tokens[name] = prompts[name][: runner.computed[name] + n]
            rows = runner.step(step)
            out.extend(rows[name] for name, _ in step)
        logits[stacked] = torch.cat(out)
        assert (model._stack is not None) == stacked  # the path this round meant to take
    assert logits[True].shape[0] == sum(n for step in plan for _, n in step)
    return logits


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_one_call_for_every_layer_gives_one_call_a_layers_bits(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(3)
    prompts = {name: [rng.randrange(VOCAB) for _ in range(n)] for name, n in (("a", 90), ("b", 70))}
    plan = [[("a", 40)], [("a", 30), ("b", 1)], [("a", 1), ("b", 29)]]
    plan += [[("a", 1), ("b", 1)]] * 12
    logits = _stacked_and_layer_by_layer(family_model(family), prompts, plan, monkeypatch)
    assert torch.equal(logits[True], logits[False])


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize(("mode", "chunks"), [("blocks", (1100, 1050)), ("int8", (2800, 2750))])
def test_a_prompt_steps_mapped_tensors_passed_from_layer_to_layer_keep_the_bits(
    mode: WeightMode, chunks: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt step's tensors of 32 MiB and more are handed from layer to layer within one
    call (reused_empty.h `LayersScope`), each on the smallest free storage that holds it, and
    let go at its end: the same bits as calls a layer, which keep none, through a second chunk
    of another shape, then decodes. In bf16 tiles ("blocks"), gate_up's [1100, 16384] output
    (36 MB) is one; in int8 tiles, the down projection's quantized activations, 2800 rows of
    8192 inputs (35 MB, linear.cpp `quantized`), too."""
    hf = tiny_hf_model(
        "llama",
        vocab_size=SMALL_VOCAB,
        weight_std=0.15,
        hidden_size=128,
        intermediate_size=8192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    rng = random.Random(4)
    first, second = chunks
    lengths = (("a", first + second + 10), ("b", 16))
    prompts = {name: [rng.randrange(SMALL_VOCAB) for _ in range(n)] for name, n in lengths}
    plan = [[("a", first)], [("a", second), ("b", 7)], [("a", 1), ("b", 1)]]
    plan += [[("a", 1), ("b", 1)]] * 4
    logits = _stacked_and_layer_by_layer(hf, prompts, plan, monkeypatch, mode)
    assert torch.equal(logits[True], logits[False])
