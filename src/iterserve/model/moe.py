"""Mixtral's sparse mixture-of-experts MLP: the one part of a Mixtral layer that differs
from a Llama layer.

Each token's router logits pick its top-k experts, exactly as transformers does: softmax over
all experts in fp32, top-k, the k weights renormalised to sum to one. The experts then run
batched by the tokens routed to them, never token by token: the step's (token, expert) pairs
are sorted by expert, so each expert's rows are one contiguous slice of a gathered copy of
the activations and the expert runs once, as two matrix products (fused gate+up, then down),
over all of them. The weighted outputs are scattered back onto the residual with one
index_add. A step costs one gather, one product pair per expert hit and one scatter, whatever
its token count; a decode of one token touches only its k experts' weights.

Each expert's fused gate+up and its down projection is a `Linear` (model/linear.py) built
from its checkpoint tensors by `build`, so experts run on the same kernels as the dense
projections (a GGUF's expert stacks in their own blocks, sliced per expert).

Sorting by expert needs the count of rows per expert on the host, a data-dependent shape:
in a compiled layer stack the block is one opaque op (`moe_mlp`, like attention's `attend`),
so the graph around it (norms, rope, projections) compiles for every token count and never
sees the grouping.
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.linear import Backend, Linear, WeightMode, WeightPart

# Mixtral's checkpoint names under model.layers.N.: the router, and per expert E its gate
# (w1), down (w2) and up (w3) projections.
ROUTER = "block_sparse_moe.gate.weight"
EXPERT_PREFIX = "block_sparse_moe.experts.{}."
EXPERT = EXPERT_PREFIX + "{}.weight"

# llama.cpp stores each layer's experts as one tensor per projection, [experts, rows, cols]
# in row-major terms, and the router as ffn_gate_inp.
GGUF_EXPERT_STACKS = {"ffn_gate_exps": "w1", "ffn_down_exps": "w2", "ffn_up_exps": "w3"}
GGUF_ROUTER = "ffn_gate_inp"
_GGUF_STACK_NAME = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|down|up)_exps)\.weight")


def gguf_expert_names(gguf_name: str, num_experts: int) -> list[str] | None:
    """The Mixtral HF names of a GGUF expert stack's experts, in stack order, or None if
    `gguf_name` is not a stack."""
    match = _GGUF_STACK_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part = match[1], GGUF_EXPERT_STACKS[match[2]]
    return [f"model.layers.{layer}.{EXPERT.format(e, part)}" for e in range(num_experts)]


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, its top-k experts [T, k] and their weights [T, k] (fp32, summing to 1)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def _weight(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class SparseMoeBlock(nn.Module):
    """The expert MLP of one layer: residual + sum over the token's k experts of
    weight * down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        """`config` is this rank's share under tensor parallelism: every rank holds every
        expert, each a 1/T slice of its intermediate width (the router is replicated)."""
        super().__init__()
        if not 0 < config.num_experts_per_tok <= config.num_local_experts:
            raise ModelLoadError(
                f"num_experts_per_tok={config.num_experts_per_tok} must be between 1 and "
                f"num_local_experts={config.num_local_experts}"
            )
        hidden, inter = config.hidden_size, config.intermediate_size
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.hidden = hidden
        self.intermediate = inter
        like = {"dtype": dtype, "device": device}
        self.router_weight = _weight(self.num_experts, hidden, **like)
        self.dtype = dtype
        self.gate_up: list[Linear] = []
        self.down: list[Linear] = []
        self.block_id = next(_BLOCK_IDS)
        _BLOCKS[self.block_id] = self

    def targets(self, prefix: str) -> dict[str, tuple[torch.Tensor | None, tuple[int, ...]]]:
        """HF name -> (destination of a small tensor, or None for an expert's projection
        part built by `build`; expected shape)."""
        hidden, inter = self.hidden, self.intermediate
        out: dict[str, tuple[torch.Tensor | None, tuple[int, ...]]] = {
            prefix + ROUTER: (self.router_weight, (self.num_experts, hidden)),
        }
        for e in range(self.num_experts):
            out[prefix + EXPERT.format(e, "w1")] = (None, (inter, hidden))
            out[prefix + EXPERT.format(e, "w3")] = (None, (inter, hidden))
            out[prefix + EXPERT.format(e, "w2")] = (None, (hidden, inter))
        return out

    def build(self, part: Callable[[str], WeightPart], backend: Backend, mode: WeightMode) -> None:
        """One Linear per expert and projection, from its checkpoint tensors (`part(name)`, by
        the name under the layer). The router stays a plain F.linear: E rows."""
        self.gate_up = [
            Linear(
                [part(EXPERT.format(e, "w1")), part(EXPERT.format(e, "w3"))],
                None,
                backend,
                mode,
                self.dtype,
            )
            for e in range(self.num_experts)
        ]
        self.down = [
            Linear([part(EXPERT.format(e, "w2"))], None, backend, mode, self.dtype)
            for e in range(self.num_experts)
        ]

    def describe(self) -> str:
        return f"{self.num_experts} experts, top-{self.top_k}, {self.gate_up[0].describe()}"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """x: the normed hidden states [T, hidden]; the result is `residual` (or zeros, for a
        tensor-parallel rank other than 0) plus the weighted expert outputs."""
        if torch.compiler.is_compiling():
            return moe_mlp(x, residual, self.block_id)
        return self.run(x, residual)

    def run(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """`forward`, eager: route, group the (token, expert) pairs by expert, one product
        pair per expert hit, weight, scatter onto the residual."""
        weights, experts = route(F.linear(x, self.router_weight), self.top_k)
        # The step's T*k (token, expert) pairs in expert order: pair i is token i // k.
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        token_rows = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        routed = x.index_select(0, token_rows)
        outputs = []
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            gate_up = self.gate_up[expert](routed[start : start + count])
            act = F.silu(gate_up[:, : self.intermediate]).mul_(gate_up[:, self.intermediate :])
            outputs.append(self.down[expert](act))
            start += count
        # Weighted in fp32 and rounded once to the model dtype, as transformers does.
        pair_weights = weights.flatten().index_select(0, order).unsqueeze(1)
        weighted = (torch.cat(outputs).float() * pair_weights).to(x.dtype)
        base = residual if residual is not None else torch.zeros_like(x)
        return base.index_add(0, token_rows, weighted)


# The blocks a compiled layer stack reaches through `moe_mlp`, by a number (held weakly).
# Numbered in order of creation rather than by id(): the number is a constant of the
# compiled graph, and the same model built by the next process must give the same graph for
# inductor's on-disk cache to serve it.
_BLOCKS: weakref.WeakValueDictionary[int, SparseMoeBlock] = weakref.WeakValueDictionary()
_BLOCK_IDS = itertools.count()


@torch.library.custom_op("iterserve::moe_mlp", mutates_args=())
def moe_mlp(x: torch.Tensor, residual: torch.Tensor | None, block: int) -> torch.Tensor:
    """`SparseMoeBlock.run` as one opaque op of a compiled graph: the grouping by expert has
    data-dependent shapes (and a host read of the counts), which the graph need not see."""
    return _BLOCKS[block].run(x, residual)


@moe_mlp.register_fake
def _(x: torch.Tensor, residual: torch.Tensor | None, block: int) -> torch.Tensor:
    return torch.empty_like(x)
