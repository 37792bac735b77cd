"""The sparse mixture-of-experts MLP of Mixtral, Qwen3-MoE, gpt-oss, LFM2-MoE...: the one part
of their layers that differs from a Llama (Mistral, Qwen3) layer (gpt-oss's own: biases on the
router and experts, a clamped SwiGLU, `gated`; Gemma 4's: its router's own input and
scales, GeGLU experts).

Each token's router logits pick its top-k experts, exactly as transformers does (`route`):
softmax over all experts in fp32, top-k, and (Mixtral always; Qwen3-MoE where `norm_topk_prob`
says, as in every released model) the k weights renormalised to sum to one; or (LFM2-MoE) each
expert's sigmoid, a selection bias added to pick but not to weigh, the k weights renormalised
and scaled. The experts then run
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
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from iterserve import kernels
from iterserve.model.block_formats import BF16, TILE, tile_dense
from iterserve.model.config import ModelConfig
from iterserve.model.errors import ModelLoadError
from iterserve.model.file_bytes import slice_reader
from iterserve.model.gguf_blocks import QuantizedBlocks
from iterserve.model.host_memory import weight_buffer
from iterserve.model.linear import Backend, Linear, WeightMode, WeightPart
from iterserve.model.norms import rms_norm


@dataclass(frozen=True)
class ExpertNames:
    """How a family's checkpoint names a layer's router and experts, under model.layers.N."""

    router: str
    expert: str  # .format(expert number, projection)
    gate: str
    up: str
    down: str
    # LFM2-MoE's per-expert bias that joins the scores only to pick the top k (fp32).
    selection_bias: str | None = None
    # Gemma 4's router: the scale of its input's norm [hidden] and a scale a weight by its
    # expert [experts].
    router_scale: str | None = None
    expert_scales: str | None = None

    def of(self, expert: int, projection: Literal["gate", "up", "down"]) -> str:
        return self.expert.format(expert, getattr(self, projection))

    def bias_of(self, expert: int, projection: Literal["gate", "up", "down"]) -> str:
        """The name of an expert projection's bias (FamilyTraits.expert_biases)."""
        return self.of(expert, projection).removesuffix(".weight") + ".bias"

    @property
    def router_bias(self) -> str:
        return self.router.removesuffix(".weight") + ".bias"

    def is_expert(self, name: str, *projections: Literal["gate", "up", "down"]) -> bool:
        """Whether the full tensor name `name` is an expert's projection among `projections`."""
        head, _, tail = self.expert.partition("{}")
        return f".{head}" in name and any(
            name.endswith(tail.format(getattr(self, p))) for p in projections
        )


_QWEN3_MOE_NAMES = ExpertNames(
    router="mlp.gate.weight",
    expert="mlp.experts.{}.{}.weight",
    gate="gate_proj",
    up="up_proj",
    down="down_proj",
)
EXPERT_NAMES = {
    "mixtral": ExpertNames(
        router="block_sparse_moe.gate.weight",
        expert="block_sparse_moe.experts.{}.{}.weight",
        gate="w1",
        up="w3",
        down="w2",
    ),
    "qwen3_moe": _QWEN3_MOE_NAMES,
    "qwen2_moe": _QWEN3_MOE_NAMES,
    "olmoe": _QWEN3_MOE_NAMES,
    # Qwen3-MoE's expert names, as model/loader.py unstacks gpt-oss's
    # `mlp.experts.gate_up_proj` and `down_proj`; its router is `mlp.router`.
    "gpt_oss": replace(_QWEN3_MOE_NAMES, router="mlp.router.weight"),
    # Granite MoE: the same, as model/loader.py unstacks its `block_sparse_moe.input_linear`
    # and `output_linear`; its router is `block_sparse_moe.router.layer`.
    "granitemoe": replace(
        _QWEN3_MOE_NAMES,
        router="block_sparse_moe.router.layer.weight",
        expert="block_sparse_moe.experts.{}.{}.weight",
    ),
    # LFM2-MoE: Qwen3-MoE's names as model/loader.py renames its checkpoint's (feed_forward.gate,
    # feed_forward.experts.E.w1...), and its expert_bias.
    "lfm2_moe": replace(_QWEN3_MOE_NAMES, selection_bias="mlp.expert_bias"),
    # Gemma 4 (26B-A4B): as model/loader.py unstacks its `experts.gate_up_proj` (gate's rows,
    # then up's) and `experts.down_proj`, beside the layer's dense `mlp`.
    "gemma4": replace(
        _QWEN3_MOE_NAMES,
        router="router.proj.weight",
        expert="experts.{}.{}.weight",
        router_scale="router.scale",
        expert_scales="router.per_expert_scale",
    ),
}

# llama.cpp stores each layer's experts as one tensor per projection, [experts, rows, cols]
# in row-major terms, and the router as ffn_gate_inp, whatever the family.
GGUF_ROUTER = "ffn_gate_inp"
# Gemma 4's converter keeps gate and up in one stack, ffn_gate_up_exps [experts, 2 x width,
# hidden]: each expert's gate rows, then its up rows.
_GGUF_STACK_NAME = re.compile(r"blk\.(\d+)\.ffn_(gate|down|up|gate_up)_exps\.(weight|bias)")


def gguf_expert_names(gguf_name: str, num_experts: int, architecture: str) -> list[str] | None:
    """The HF names of a GGUF expert stack's parts (weights, or gpt-oss's biases) in stack
    order, one an expert (a fused gate+up stack: its gate, then its up, two an expert), or
    None if `gguf_name` is not a stack."""
    match = _GGUF_STACK_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    names = EXPERT_NAMES[architecture]
    name_of = names.of if match[3] == "weight" else names.bias_of
    projections = ("gate", "up") if match[2] == "gate_up" else (match[2],)
    return [
        f"model.layers.{match[1]}.{name_of(e, p)}" for e in range(num_experts) for p in projections
    ]


@dataclass(frozen=True)
class Routing:
    """How a layer's router turns logits into a token's experts and weights (`route`)."""

    top_k: int
    renormalize: bool = True
    sigmoid: bool = False  # each expert's own sigmoid, not a softmax over all (LFM2-MoE)
    scale: float = 1.0  # the weights' final factor (routed_scaling_factor)

    @staticmethod
    def of(config: ModelConfig) -> Routing:
        return Routing(
            config.num_experts_per_tok,
            config.norm_topk_prob,
            config.router_scoring == "sigmoid",
            config.routed_scaling_factor,
        )


# transformers' LFM2-MoE adds it to the sum of a token's sigmoid weights before dividing.
SIGMOID_RENORM_EPS = 1e-6


def route(
    router_logits: torch.Tensor, routing: Routing, selection_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, its top-k experts [T, k] and their weights [T, k], fp32. Softmax scores:
    the top k's probabilities, renormalised to sum to 1 where `routing.renormalize` says.
    Sigmoid scores: the top k of score + `selection_bias` (the bias picks, the scores weigh),
    renormalised over their sum + 1e-6. Then times `routing.scale`."""
    logits = router_logits.float()
    if not routing.sigmoid:
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), routing.top_k, dim=-1)
        if routing.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = torch.sigmoid(logits)
        if selection_bias is None:
            weights, experts = torch.topk(scores, routing.top_k, dim=-1)
        else:
            experts = torch.topk(scores + selection_bias, routing.top_k, dim=-1).indices
            weights = scores.gather(1, experts)
        if routing.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + SIGMOID_RENORM_EPS)
    if routing.scale != 1.0:
        weights = weights * routing.scale
    return weights, experts


def gated(
    gate_up: torch.Tensor, width: int, clamp: tuple[float, float] | None, gelu: bool = False
) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up] of `width` each (`gelu`: Gemma 4's GeGLU, tanh's
    approximation); with `clamp` (alpha, limit), gpt-oss's form: gate clamped to <= limit, up
    to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate), as transformers
    computes it."""
    gate, up = gate_up[:, :width], gate_up[:, width:]
    if gelu:
        return F.gelu(gate, approximate="tanh").mul_(up)
    if clamp is None:
        return F.silu(gate).mul_(up)
    alpha, limit = clamp
    gate = gate.clamp(max=limit)
    return (gate * torch.sigmoid(gate * alpha)).mul_(up.clamp(-limit, limit) + 1)


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
        self.routing = Routing.of(config)
        self.names = EXPERT_NAMES[config.architecture]
        self.hidden = hidden
        self.intermediate = inter
        like = {"dtype": dtype, "device": device}
        self.router_weight = _weight(self.num_experts, hidden, **like)
        self.swiglu_clamp = config.swiglu_clamp
        # gpt-oss: biases on the router and every expert projection ([gate | up] per expert).
        biased = config.traits.expert_biases
        self.router_bias = _weight(self.num_experts, **like) if biased else None
        self.gate_up_bias = _weight(self.num_experts, 2 * inter, **like) if biased else None
        self.down_bias = _weight(self.num_experts, hidden, **like) if biased else None
        # LFM2-MoE's expert_bias, fp32 as its checkpoint keeps it and the scores are.
        self.selection_bias = (
            _weight(self.num_experts, dtype=torch.float32, device=device)
            if config.expert_selection_bias
            else None
        )
        # Gemma 4: the router reads the residual stream (not the experts' input) through a
        # weightless RMS norm times `router_scale` times hidden ** -0.5, and each weight is
        # then multiplied by its expert's scale (fp32, as the weights are); GeGLU experts.
        own_router = self.names.router_scale is not None
        self.router_scale = _weight(hidden, **like) if own_router else None
        self.expert_scales = (
            _weight(self.num_experts, dtype=torch.float32, device=device) if own_router else None
        )
        self.eps = config.rms_norm_eps
        self.gelu = config.traits.activation == "gelu_tanh"
        self.dtype = dtype
        self.gate_up: list[Linear] = []
        self.down: list[Linear] = []
        self.kernel: ExpertsKernel | None = None
        self.block_id = next(_BLOCK_IDS)
        _BLOCKS[self.block_id] = self

    def targets(self, prefix: str) -> dict[str, tuple[torch.Tensor | None, tuple[int, ...]]]:
        """HF name -> (destination of a small tensor, or None for an expert's projection
        part built by `build`; expected shape)."""
        hidden, inter, names = self.hidden, self.intermediate, self.names
        out: dict[str, tuple[torch.Tensor | None, tuple[int, ...]]] = {
            prefix + names.router: (self.router_weight, (self.num_experts, hidden)),
        }
        if self.selection_bias is not None:
            assert names.selection_bias is not None
            out[prefix + names.selection_bias] = (self.selection_bias, (self.num_experts,))
        if self.router_scale is not None and self.expert_scales is not None:
            assert names.router_scale is not None and names.expert_scales is not None
            out[prefix + names.router_scale] = (self.router_scale, (hidden,))
            out[prefix + names.expert_scales] = (self.expert_scales, (self.num_experts,))
        for e in range(self.num_experts):
            out[prefix + names.of(e, "gate")] = (None, (inter, hidden))
            out[prefix + names.of(e, "up")] = (None, (inter, hidden))
            out[prefix + names.of(e, "down")] = (None, (hidden, inter))
        if self.router_bias is None or self.gate_up_bias is None or self.down_bias is None:
            return out
        out[prefix + names.router_bias] = (self.router_bias, (self.num_experts,))
        for e in range(self.num_experts):
            gate_up = self.gate_up_bias[e]
            out[prefix + names.bias_of(e, "gate")] = (gate_up[:inter], (inter,))
            out[prefix + names.bias_of(e, "up")] = (gate_up[inter:], (inter,))
            out[prefix + names.bias_of(e, "down")] = (self.down_bias[e], (hidden,))
        return out

    def build(self, part: Callable[[str], WeightPart], backend: Backend, mode: WeightMode) -> None:
        """One Linear per expert and projection, from its checkpoint tensors (`part(name)`, by
        the name under the layer). The router stays a plain F.linear: E rows. Experts kept in
        their file's blocks are made straight into one stack a projection (`_stacked_tiles`),
        which the experts op runs from and each expert's Linear views."""
        names, experts = self.names, range(self.num_experts)
        parts = {p: [part(names.of(e, p)) for e in experts] for p in ("gate", "up", "down")}
        stacks = _stacked_tiles(parts) if backend == "tiled" and mode == "blocks" else None

        def made(e: int, *projections: str) -> list[tuple[torch.Tensor, int]] | None:
            if stacks is None:
                return None
            return [(stacks[p][0][e], stacks[p][1]) for p in projections]

        self.gate_up = [
            Linear(
                [parts["gate"][e], parts["up"][e]],
                None if self.gate_up_bias is None else self.gate_up_bias[e],
                backend,
                mode,
                self.dtype,
                made(e, "gate", "up"),
            )
            for e in experts
        ]
        self.down = [
            Linear(
                [parts["down"][e]],
                None if self.down_bias is None else self.down_bias[e],
                backend,
                mode,
                self.dtype,
                made(e, "down"),
            )
            for e in experts
        ]
        self.kernel = ExpertsKernel.of(self, stacks)

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    def describe(self) -> str:
        return f"{self.num_experts} experts, top-{self.top_k}, {self.gate_up[0].describe()}"

    def router_input(self, stream: torch.Tensor) -> torch.Tensor:
        """Gemma 4's router's rows: the residual stream normed, times its scale, times
        hidden ** -0.5, rounded step by step as transformers' are."""
        assert self.router_scale is not None
        return rms_norm(stream, None, self.eps) * self.router_scale * self.hidden**-0.5

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, stream: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: the normed hidden states [T, hidden]; the result is `residual` (or zeros, for a
        tensor-parallel rank other than 0) plus the weighted expert outputs. `stream`: what
        Gemma 4's router reads (`router_input`), the residual stream before the MLP."""
        routed = None if stream is None else self.router_input(stream)
        if torch.compiler.is_compiling():
            return moe_mlp(x, residual, self.block_id, routed)
        return self.run(x, residual, routed)

    def run(
        self, x: torch.Tensor, residual: torch.Tensor | None, routed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`forward`, eager: route, group the (token, expert) pairs by expert, one product
        pair per expert hit, weight, scatter onto the residual; in one C++ call where every
        expert runs on the tiled kernels (`ExpertsKernel`), else op by op. `routed`: the
        router's own input rows (Gemma 4's), else x."""
        if self.kernel is not None:
            return self.kernel(x, residual, self, routed)
        return self.run_ops(x, residual, routed)

    def run_ops(
        self, x: torch.Tensor, residual: torch.Tensor | None, routed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`run` op by op: the reference the C++ call is checked against."""
        logits = F.linear(x if routed is None else routed, self.router_weight, self.router_bias)
        weights, experts = route(logits, self.routing, self.selection_bias)
        if self.expert_scales is not None:
            weights = weights * self.expert_scales[experts]
        # The step's T*k (token, expert) pairs in expert order: pair i is token i // k.
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        token_rows = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, token_rows)
        outputs = []
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            gate_up = self.gate_up[expert](rows[start : start + count])
            act = gated(gate_up, self.intermediate, self.swiglu_clamp, self.gelu)
            outputs.append(self.down[expert](act))
            start += count
        # Weighted in fp32 and rounded once to the model dtype, as transformers does.
        pair_weights = weights.flatten().index_select(0, order).unsqueeze(1)
        weighted = (torch.cat(outputs).float() * pair_weights).to(x.dtype)
        base = residual if residual is not None else torch.zeros_like(x)
        return base.index_add(0, token_rows, weighted)


@dataclass(frozen=True)
class ExpertsKernel:
    """A block's experts as the C++ `experts_mlp` op takes them (kernels/csrc/moe.cpp): each
    projection of every expert in one stack [experts, tiles, bytes a tile], one format a
    stack. The op runs the whole of `SparseMoeBlock.run_ops` (routing, grouping, the
    experts, the weighted scatter) in one call: op by op, a Qwen3-30B-A3B decode step made
    ~40 calls a layer, 8 experts each; and three stacks pass to it where every expert's
    tiles as a list of tensors cost ~0.2 ms a call to convert. The router rides along as bf16
    tiles, so that a row's router logits come from the same fixed-order kernel whatever the
    step's size (torch's GEMM may sum a row otherwise at another size: `--batch-invariant`)."""

    ops: Any
    router: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    formats: list[int]
    # gpt-oss: the router's bias padded to its tiles' rows (the block's other biases are
    # its own tensors), and the SwiGLU's (alpha, limit), (0, 0) for plain SwiGLU.
    router_bias: torch.Tensor | None = None
    swiglu: tuple[float, float] = (0.0, 0.0)

    @staticmethod
    def of(
        block: SparseMoeBlock, stacks: dict[str, tuple[torch.Tensor, int]] | None = None
    ) -> ExpertsKernel | None:
        """The block's experts as stacks: `stacks` where `build` made them so, else restacked,
        each expert's Linear then holding views of the stacks (the tiles are copied once, a
        layer at a time, and the copies freed); None unless every expert runs on the tiled
        kernels, unpadded (whole tiles of 16 outputs, as the op's SwiGLU needs), one format
        for each projection across the experts."""
        linears = [*block.gate_up, *block.down]
        if any(lin.backend != "tiled" for lin in linears):
            return None
        if block.intermediate % 16 or block.hidden % 16:
            return None
        router, code = tile_dense(block.router_weight.detach())
        if code != BF16:
            return None
        router_bias = None
        if block.router_bias is not None:
            router_bias = block.router_bias.new_zeros(router.shape[0] * 16)
            router_bias[: block.num_experts] = block.router_bias.detach()
        swiglu = block.swiglu_clamp or (0.0, 0.0)
        if stacks is not None:
            (gate, gate_code), (up, up_code), (down, down_code) = (
                stacks[p] for p in ("gate", "up", "down")
            )
            formats = [gate_code, up_code, down_code]
            return ExpertsKernel(
                linears[0].ops, router, gate, up, down, formats, router_bias, swiglu
            )
        parts = [(lin, i) for lin in block.gate_up for i in (0, 1)]
        gates, ups, downs = parts[0::2], parts[1::2], [(lin, 0) for lin in block.down]
        restacked = []
        for part in (gates, ups, downs):
            if len({lin.codes[i] for lin, i in part}) != 1:
                return None
            tiles, row_bytes = part[0][0].segments[part[0][1]].shape
            if any(lin.segments[i].shape != (tiles, row_bytes) for lin, i in part):
                return None
            # On huge pages, as any projection's tiles (model/host_memory.py): an expert's
            # own are each under 2 MiB, so they were made on ordinary pages.
            stack = weight_buffer(len(part) * tiles, row_bytes).view(len(part), tiles, -1)
            for e, (lin, i) in enumerate(part):
                stack[e].copy_(lin.segments[i])
                lin.segments[i] = stack[e]
            restacked.append(stack)
        formats = [gates[0][0].codes[0], ups[0][0].codes[1], downs[0][0].codes[0]]
        return ExpertsKernel(linears[0].ops, router, *restacked, formats, router_bias, swiglu)

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        block: SparseMoeBlock,
        routed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        routing = block.routing
        return self.ops.experts_mlp(
            x.contiguous(),
            residual,
            self.router,
            routing.top_k,
            routing.renormalize,
            self.gate,
            self.up,
            self.down,
            self.formats,
            self.router_bias,
            block.gate_up_bias,
            block.down_bias,
            *self.swiglu,
            routing.sigmoid,
            block.selection_bias,
            routing.scale,
            None if routed is None else routed.contiguous(),
            block.expert_scales,
            block.gelu,
        )


def _stacked_tiles(
    parts: dict[str, list[WeightPart]],
) -> dict[str, tuple[torch.Tensor, int]] | None:
    """Each projection's experts' tiles made straight into one stack [experts, tiles, bytes
    a tile] and its format, where every expert's part is in the file's blocks, one format a
    projection, in whole tiles; None otherwise (the Linears then make their own, and
    ExpertsKernel.of copies them into stacks). Made in place: a copy would leave the first
    tiles' memory held, as they share packed mappings with the layer's other weights
    (model/host_memory.py)."""
    stacks = {}
    pending: list[tuple[QuantizedBlocks, torch.Tensor]] = []
    for projection, experts in parts.items():
        blocks = [part.blocks for part in experts if part.blocks is not None]
        if len(blocks) < len(experts) or any(b.rows is not None for b in blocks):
            return None
        first = blocks[0]
        n, k = first.shape
        if n % TILE or k % first.format.inputs or len({b.format for b in blocks}) != 1:
            return None
        stack = weight_buffer(len(blocks) * n // TILE, first.format.bytes_per_tile(k))
        stack = stack.view(len(blocks), n // TILE, -1)
        pending += [(expert, stack[e]) for e, expert in enumerate(blocks)]
        stacks[projection] = (stack, first.format.code)
    # Read in the file's order (an expert's slices are ~1 MB; Gemma 4's stack holds each
    # expert's gate beside its up), so the load's reader serves them from its reads ahead.
    ops = kernels.ops()
    with slice_reader() as reader, reader.reading_ahead():
        for expert, out in sorted(pending, key=lambda item: item[0].file_order):
            expert.tiles(ops, out=out)
    return stacks


# The blocks a compiled layer stack reaches through `moe_mlp`, by a number (held weakly).
# Numbered in order of creation rather than by id(): the number is a constant of the
# compiled graph, and the same model built by the next process must give the same graph for
# inductor's on-disk cache to serve it.
_BLOCKS: weakref.WeakValueDictionary[int, SparseMoeBlock] = weakref.WeakValueDictionary()
_BLOCK_IDS = itertools.count()


@torch.library.custom_op("iterserve::moe_mlp", mutates_args=())
def moe_mlp(
    x: torch.Tensor, residual: torch.Tensor | None, block: int, routed: torch.Tensor | None
) -> torch.Tensor:
    """`SparseMoeBlock.run` as one opaque op of a compiled graph: the grouping by expert has
    data-dependent shapes (and a host read of the counts), which the graph need not see."""
    return _BLOCKS[block].run(x, residual, routed)


@moe_mlp.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor | None, block: int, routed: torch.Tensor | None
) -> torch.Tensor:
    return torch.empty_like(x)
