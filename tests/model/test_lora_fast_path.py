"""LoRA deltas on the fast CPU path (iterserve's tiled bf16 projections and C++ attention, the
deltas by csrc/lora.cpp, inside the fused layer op or layer by layer op by op) against the
torch reference (fp32, whose deltas are batched both ways: padded batched products and
per-adapter segments), rows of three adapters and the base in one step, slots taken in order
and out of it. The reference itself is checked against peft in tests/engine/test_lora.py."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from iterserve.executor.paged_model import ForwardSeq, PagedModel
from iterserve.model.attention import allocate_kv_caches
from iterserve.model.llama import LlamaForCausalLM
from iterserve.model.lora_model import LoRAModel
from iterserve.model.lora_weights import AdapterWeights, LoRAModule
from tiny_checkpoints import model_config_of, tiny_hf_model
from transformers_reference import assert_same_greedy

VOCAB = 256
RANK = 8


def _adapter(model: LoRAModel, seed: int, kinds: tuple[str, ...]) -> AdapterWeights:
    generator = torch.Generator().manual_seed(seed)
    modules = {}
    for name, (out, inp) in model.shapes.items():
        if name.rsplit(".", 1)[-1] in kinds:
            a = torch.randn(RANK, inp, generator=generator) * 0.1
            b = torch.randn(out, RANK, generator=generator) * 0.1
            modules[name] = LoRAModule(a, b)
    return AdapterWeights(modules)


def _network(
    hf: transformers.PreTrainedModel, dtype: torch.dtype, backend: str, fused: bool = False
) -> PagedModel:
    model = LlamaForCausalLM(model_config_of(hf), dtype, torch.device("cpu"))
    model.load(hf.state_dict(), backend)  # type: ignore[arg-type]
    lora = LoRAModel(model, max_loras=4, max_rank=RANK)
    kernel = backend == "tiled"
    assert model.fused_layers == kernel
    model.fused_layers = fused
    if kernel:
        from iterserve import kernels

        model.use_kernel_ops(kernels.ops())
    caches = allocate_kv_caches(model.config, 64, 16, dtype, torch.device("cpu"))
    network = PagedModel(model, caches, 16, torch.device("cpu"), paged_attention_kernel=kernel)
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    everything = (*attention, "gate_proj", "up_proj", "down_proj")
    # Slots 0, 1 and 3 (2 stays empty: the stacks are then gathered, not sliced).
    for slot, seed, kinds in ((0, 1, attention), (1, 2, everything), (3, 3, everything)):
        lora.load_slot(slot, _adapter(lora, seed, kinds))
    return network


def _run(network: PagedModel, tokens: list[list[int]], slots: list[int]) -> list[torch.Tensor]:
    """Teacher-forced: uneven prompt chunks (deltas by segments), then decodes (padded)."""
    rows: list[list[torch.Tensor]] = [[] for _ in tokens]
    done = [0] * len(tokens)

    def step(plan: list[tuple[int, int]]) -> None:
        seqs = [
            ForwardSeq(
                tuple(range(4 * i, 4 * i + 4)),
                done[i],
                tokens[i][done[i] : done[i] + n],
                n,
                lora_slot=slots[i],
            )
            for i, n in plan
        ]
        logits = network.forward(seqs)
        row = 0
        for i, n in plan:
            rows[i].append(logits[row : row + n])
            row += n
            done[i] += n

    step([(0, 30), (1, 2), (2, 3)])
    step([(1, 1), (2, 1), (3, 25), (0, 4)])
    while any(d < len(t) for d, t in zip(done, tokens, strict=True)):
        step([(i, 1) for i in range(len(tokens)) if done[i] < len(tokens[i])])
    return [torch.cat(r) for r in rows]


SLOTS = [0, -1, 1, 3]


@pytest.fixture(scope="module")
def hf() -> transformers.PreTrainedModel:
    return tiny_hf_model(
        vocab_size=VOCAB,
        weight_std=0.1,
        hidden_size=128,
        intermediate_size=256,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def tokens() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (36, 6, 8, 30)]


@pytest.fixture(scope="module")
def reference(hf: transformers.PreTrainedModel, tokens: list[list[int]]) -> list[torch.Tensor]:
    """The torch path's logits; the base model's rows alone move when the slots are dropped."""
    reference = _run(_network(hf, torch.float32, "torch"), tokens, SLOTS)
    base = _run(_network(hf, torch.float32, "torch"), tokens, [-1] * len(SLOTS))
    top = torch.cat(reference).abs().max()
    for i, slot in enumerate(SLOTS):
        moved = (reference[i] - base[i]).abs().max()
        assert (moved > 0.05 * top) == (slot >= 0), i
    return reference


@pytest.mark.slow
@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("fused", [True, False], ids=["fused-layers", "op-by-op"])
def test_tiled_path_with_adapters_keeps_the_reference_greedy_tokens(
    hf: transformers.PreTrainedModel,
    tokens: list[list[int]],
    reference: list[torch.Tensor],
    fused: bool,
) -> None:
    network = _network(hf, torch.bfloat16, "tiled", fused)
    assert_same_greedy(reference, _run(network, tokens, SLOTS))
