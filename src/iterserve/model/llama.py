"""The Llama-style decoder (Llama 2/3, Mistral, Qwen2/3, Phi-3, Gemma 2/3, SmolLM) as one
network over a paged KV cache; what sets a family apart is a named trait (model/family.py)
or a number on ModelConfig, and RoPE variants live in model/rope.py.

The engine calls `forward` once per step on a flat ragged batch. q/k/v and gate/up are fused
into one projection each, the rotary table is built once and indexed once per step, the
residual adds ride inside the output projections, and the LM head only sees the rows that
need logits. The network is made without its projections; `load` builds each one as a
`Linear` straight from its checkpoint tensors, one projection at a time, in the backend
chosen (plain torch, oneDNN packed, or iterserve's tiled kernels over the checkpoint's own
blocks or bf16), so a quantized checkpoint is never made dense. The layer stack can then be
compiled (`compile_layers`) into one graph for every token count, attention being an opaque
op that reads the step from a context.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model.attention import attend, attention_context
from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.model.compiled import CompiledLayers
from iterserve.model.config import ModelConfig
from iterserve.model.gguf_blocks import QuantizedBlocks
from iterserve.model.lazy_weights import native_of, shape_of
from iterserve.model.linear import Backend, Linear, WeightMode, WeightPart
from iterserve.model.moe import Routing, SparseMoeBlock
from iterserve.model.norms import rms_norm
from iterserve.model.per_layer_inputs import PerLayerInputs
from iterserve.model.rope import (
    apply_rope,
    grid_rope_rows,
    mrope_components,
    no_rope_tables,
    query_temperature_scales,
    rope_tables,
)
from iterserve.model.score_head import SCORE_WEIGHT
from iterserve.model.shared_expert import SharedExpert
from iterserve.model.short_conv import ShortConv
from iterserve.model.tensor_parallel import TensorParallel
from iterserve.model.token_embedding import TokenEmbedding


def _pre_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A block's input norm; an empty weight: none (OLMo 2, FamilyTraits.pre_norms)."""
    return x if weight.numel() == 0 else rms_norm(x, weight, eps)


def _weight(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


# The projections of a layer, as (our fused name, the HF names fused into it in row order).
_FUSED = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
# The fused layer op's LoRA arguments for a layer without adapters: no slots, no rows.
_NO_LORA: tuple[list[torch.Tensor], list[int], None] = ([], [], None)
# The same for checkpoints that store them fused already (FamilyTraits.fused_checkpoint).
_FUSED_IN_CHECKPOINT = {
    **_FUSED,
    "qkv": ("self_attn.qkv_proj",),
    "gate_up": ("mlp.gate_up_proj",),
}
# Gemma 4's per-layer input gate and projection (model/per_layer_inputs.py).
_PER_LAYER_INPUT = {
    "per_layer_gate": ("per_layer_input_gate",),
    "per_layer_proj": ("per_layer_projection",),
}
# This step's K and V of each layer that others read (Gemma 4's KV sharing), by layer index.
StepKV = dict[int, tuple[torch.Tensor, torch.Tensor]]


# Rotary table rows made at start (more as steps reach further: LlamaForCausalLM.cover_positions).
_ROPE_POSITIONS = 4096
# Every layer's (key cache, value cache), in layer order.
KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def weight_part(
    weights: Mapping[str, torch.Tensor], quantized: Mapping[str, QuantizedBlocks], name: str
) -> WeightPart:
    """A checkpoint tensor as a projection's part: read only when the projection is built."""
    shape = shape_of(weights, name)
    return WeightPart(
        name,
        (shape[0], shape[1]),
        functools.partial(weights.__getitem__, name),
        functools.partial(native_of, weights, name),
        quantized.get(name),
    )


class _DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        index: int,
        tp: TensorParallel | None = None,
    ) -> None:
        """`config` is this rank's share of the model under tensor parallelism (`tp`)."""
        super().__init__()
        hidden, head_dim = config.hidden_size, config.layer_head_dim(index)
        self.index = index
        self.tp = tp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.layer_kv_heads(index)
        self.head_dim = head_dim
        # Gemma 4: a layer that reads an earlier layer's K/V (this step's, and its cache)
        # rather than making its own, and one whose values are its keys before norm and rope.
        self.kv_source = config.layer_kv_source(index)
        self.shares_kv = self.kv_source != index
        layers = range(index + 1, config.num_hidden_layers)
        self.kv_read_later = any(config.layer_kv_source(i) == index for i in layers)
        self.keys_as_values = config.layer_keys_as_values(index)
        self.value_norm = config.traits.value_norm
        self.hidden_size = hidden
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.intermediate = config.layer_mlp_width(index)
        traits = config.traits
        # Every norm of the layer takes it: a family with a residual multiplier (Granite) has
        # no q/k or output norms, which read no residual stream.
        assert config.residual_multiplier is None or not (traits.qk_norm or traits.sandwich_norms)
        self.eps = config.stream_norm_eps
        self.scale = config.attention_multiplier or (
            (config.query_pre_attn_scalar or head_dim) ** -0.5
        )
        self.sliding_window = config.layer_window(index)
        self.softcap = config.attn_logit_softcapping or 0.0
        # Whether the layer rotates by the model's second tables: Gemma 3's sliding layers
        # (their own RoPE base), SmolLM3's layers without RoPE (tables that rotate nothing).
        local = config.local_rope_theta is not None and self.sliding_window > 0
        self.second_rope = local or not config.layer_rotates(index)
        self.gelu = traits.activation == "gelu_tanh"
        self.checkpoint_parts = dict(_FUSED_IN_CHECKPOINT if traits.fused_checkpoint else _FUSED)
        if self.shares_kv or self.keys_as_values:  # q alone, or q and k (Gemma 4)
            self.checkpoint_parts["qkv"] = _FUSED["qkv"][: 1 if self.shares_kv else 2]
        if config.per_layer_input_size:
            self.checkpoint_parts |= _PER_LAYER_INPUT
        like = {"dtype": dtype, "device": device}
        # LFM2's conv layers mix tokens by a short convolution (model/short_conv.py) and have
        # no attention: no q/k/v/o, q/k norms or biases.
        self.conv = ShortConv(config, index, dtype, device) if config.layer_is_conv(index) else None
        if self.conv is not None:
            self.checkpoint_parts = {
                n: parts for n, parts in self.checkpoint_parts.items() if n not in ("qkv", "o")
            }
        # Empty where the family norms no block input (OLMo 2): the C++ layer skips those too.
        norm_width = hidden if traits.pre_norms else 0
        self.input_norm = _weight(norm_width, **like)
        # The projections' weights are not parameters: `build` makes each one's Linear.
        attention = self.conv is None
        self.qkv_bias = (
            _weight(self.q_size + 2 * self.kv_size, **like)
            if config.attention_bias and attention
            else None
        )
        has_o_bias = config.attention_bias and traits.o_proj_bias and attention
        self.o_bias = _weight(hidden, **like) if has_o_bias else None
        # q/k norms as one weight over the fused q and k heads. Head by head (Qwen3, Gemma 3):
        # [heads, head_dim], the q_norm row repeated per query head, then the k_norm row per kv
        # head, so one norm call does both. Whole (OLMoE): flat, q_norm's q_size values then
        # k_norm's kv_size, q's heads normed together and k's together (the C++ layer reads
        # the same convention from the weight's shape).
        self.qk_norm = None
        if traits.qk_norm and attention:
            shape = (self.num_heads + (0 if self.shares_kv else self.num_kv_heads), head_dim)
            self.qk_norm = _weight(
                *((math.prod(shape),) if traits.qk_norm_whole else shape), **like
            )
        # gpt-oss's attention sinks, one logit a query head, kept in fp32 as the softmax is.
        self.sinks = (
            _weight(self.num_heads, dtype=torch.float32, device=device)
            if traits.attention_sinks
            else None
        )
        self.post_norm = _weight(norm_width, **like)  # before the MLP
        # Sandwich norms (Gemma): on the attention and MLP outputs, before the residual adds.
        self.attn_out_norm = _weight(hidden, **like) if traits.sandwich_norms else None
        self.mlp_out_norm = _weight(hidden, **like) if traits.sandwich_norms else None
        # The MLP: dense (fused gate+up, then down), or experts (model/moe.py: Mixtral, Qwen3-MoE,
        # gpt-oss; LFM2-MoE past its leading dense layers).
        self.moe = (
            SparseMoeBlock(config, dtype, device) if config.layer_has_experts(index) else None
        )
        # Gemma 4 26B-A4B: the experts beside the dense MLP, the experts on their own norm of
        # the stream, each output normed before their sum takes the MLP's output norm.
        beside = self.moe is not None and config.experts_beside_dense
        # Whether the layer has a dense MLP (gate_up, down): no experts, or 26B-A4B's.
        self.dense_mlp = self.moe is None or beside
        self.experts_in_norm = _weight(hidden, **like) if beside else None
        self.dense_out_norm = _weight(hidden, **like) if beside else None
        self.experts_out_norm = _weight(hidden, **like) if beside else None
        # Beside the experts, Qwen2-MoE's shared expert (model/shared_expert.py).
        self.shared_expert = (
            SharedExpert(config, dtype, device) if config.shared_expert_intermediate_size else None
        )
        # Gemma 4: the norm of what the per-layer input adds (model/per_layer_inputs.py), and
        # the scalar the layer's output is multiplied by.
        self.per_layer_norm = _weight(hidden, **like) if config.per_layer_input_size else None
        self.layer_scalar = _weight(1, **like) if traits.layer_scalar else None
        self.dtype = dtype
        self.linears: dict[str, Linear] = {}
        # The whole layer as one C++ op (kernels/csrc/layer.cpp), when every part fits it:
        # its projections' weight segments in order, their formats, how many segments each
        # projection has, and their biases.
        self.fused: (
            tuple[list[torch.Tensor], list[int], list[int], list[torch.Tensor | None]] | None
        ) = None
        # The C++ ops of the kernels' ISA variant (kernels/__init__.py), set when they run.
        self.kernel_ops: Any = None
        # With LoRA adapters on the fused path, what the layer op takes to add their deltas
        # (model/lora_model.py's LayerSlots).
        self.lora_slots: Any = None
        # Gemma 4 26B-A4B's experts as the layer op takes them beside its dense MLP
        # (`_beside_arguments`): tensors, formats, top-k; empty otherwise.
        self.fused_experts: tuple[list[torch.Tensor], list[int], int] = ([], [], 0)

    def build(
        self,
        part: Callable[[str], WeightPart],
        backend: Backend,
        mode: WeightMode,
        rotated: int,
    ) -> None:
        """Make the projections' Linears from their checkpoint tensors (`part(name)`);
        `rotated`: how many of each head's dimensions its RoPE turns."""
        prefix = f"model.layers.{self.index}."
        biases = {"qkv": self.qkv_bias, "o": self.o_bias}
        self.fused = None
        if self.moe is not None:
            self.moe.build(lambda name: part(prefix + name), backend, mode)
        if self.shared_expert is not None:
            self.shared_expert.build(lambda name: part(prefix + name), backend, mode)
        if self.conv is not None:
            self.conv.build(lambda name: part(prefix + name), backend, mode)
        beside = self.experts_in_norm is not None  # Gemma 4 26B-A4B: a dense MLP too
        for name, parts in self.checkpoint_parts.items():
            if name in ("gate_up", "down") and not self.dense_mlp:
                continue
            self.linears[name] = Linear(
                [part(f"{prefix}{p}.weight") for p in parts],
                biases.get(name),
                backend,
                mode,
                self.dtype,
            )
        # The C++ layer op is Llama's layer and every dense family's parts (q/k norms, windows,
        # GeGLU, sandwich norms, soft-caps, local RoPE) and LFM2's convolution in place of
        # attention (in decoder_stack only); a layer of experts takes it in
        # decoder_stack when the experts run in one call (model/moe.py `ExpertsKernel`), its
        # MLP then no projection of the layer's own but a shared expert's (Qwen2-MoE).
        # LFM2: the convolution's projections in q/k/v's and o's place.
        mixer = (
            self.conv.linears()
            if self.conv is not None
            else [self.linears["qkv"], self.linears["o"]]
        )
        mlp = [self.linears["gate_up"], self.linears["down"]] if self.dense_mlp else []
        tiled = [*mixer, *mlp]
        if self.shared_expert is not None:
            tiled += self.shared_expert.linears()
        per_layer = [self.linears[name] for name in _PER_LAYER_INPUT if name in self.linears]
        # The op takes heads, and the rotated part of each, 32 dimensions at a time. (Gemma 4's
        # layers, each with its own attention shape, K/V of an earlier layer, values normed or
        # the keys themselves, per-layer input and scalar, are decoder_layer's, not
        # decoder_stack's: `_stacked`.)
        fits_layer_op = self.head_dim % 32 == 0 and rotated % 32 == 0
        if self.moe is not None and (
            self.moe.kernel is None or (self.mlp_out_norm is not None and not beside)
        ):
            fits_layer_op = False
        if all(lin.backend == "tiled" for lin in tiled + per_layer) and fits_layer_op:
            args = [lin.kernel_args for lin in tiled]
            args += [([], [], None)] * (len(_FUSED) - len(tiled))  # an MLP of experts
            args += [lin.kernel_args for lin in per_layer]  # Gemma 4's, after the four
            self.fused = (
                [seg for segments, _, _ in args for seg in segments],
                [code for _, codes, _ in args for code in codes],
                [len(segments) for segments, _, _ in args],
                [bias for _, _, bias in args],
            )
            if beside:
                self.fused_experts = self._beside_arguments()

    def _beside_arguments(self) -> tuple[list[torch.Tensor], list[int], int]:
        """decoder_layer's experts beside the dense MLP (Gemma 4 26B-A4B): the router's
        tiles, the gate, up and down stacks, the router's scale, the experts' scales, the
        experts' input norm and the two outputs' norms; the stacks' formats; top-k."""
        block = self.moe
        assert block is not None and block.kernel is not None
        assert block.router_scale is not None and block.expert_scales is not None
        kernel = block.kernel
        norms = (self.experts_in_norm, self.dense_out_norm, self.experts_out_norm)
        assert all(norm is not None for norm in norms)
        tensors = [kernel.router, kernel.gate, kernel.up, kernel.down, block.router_scale]
        tensors += [block.expert_scales, *norms]  # type: ignore[list-item]
        return tensors, list(kernel.formats), block.top_k

    def forward_fused(
        self,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        step: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        query_scales: torch.Tensor | None = None,
        per_layer_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward` in one call of the C++ layer op (which reads positions from `step` and
        their rows of the whole rotary tables `rope`); an attention layer's (decoder_stack
        alone runs LFM2's convolution). `query_scales`: the rows' (Ministral 3's temperature);
        `per_layer_input`: this layer's [T, size] (Gemma 4 E2B, E4B)."""
        assert self.fused is not None and self.conv is None
        return self.kernel_ops.decoder_layer(
            hidden,
            self.input_norm,
            self.post_norm,
            self.eps,
            *self.fused,
            self.qk_norm,
            self.attn_out_norm,
            self.mlp_out_norm,
            self.gelu,
            self.softcap,
            *kv_cache,
            slot_mapping,
            step,
            *rope,
            self.num_heads,
            self.num_kv_heads,
            self.scale,
            self.sliding_window,
            *(self.lora_slots.kernel_args() if self.lora_slots is not None else _NO_LORA),
            *self.fused_experts,
            self.sinks,
            query_scales,
            self.value_norm,
            self.shares_kv,
            per_layer_input,
            self.per_layer_norm,
            self.layer_scalar,
            self.keys_as_values,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        step: torch.Tensor | None,
        step_kv: StepKV | None = None,
        per_layer_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`step_kv`: this step's K/V of the layers so far (Gemma 4's sharing layers read
        their source's); `per_layer_input`: this layer's [T, size] (Gemma 4 E2B, E4B)."""
        step_kv = {} if step_kv is None else step_kv
        out = self._mixer_and_mlp(hidden, cos, signed_sin, kv_cache, slot_mapping, step, step_kv)
        if per_layer_input is not None:
            out = self._per_layer(out, per_layer_input)
        if self.layer_scalar is not None:
            out = out * self.layer_scalar
        return out

    def _per_layer(self, hidden: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        """Gemma 4: h + norm(P (gelu(G h) * this layer's per-layer input))."""
        gate = F.gelu(self.linears["per_layer_gate"](hidden), approximate="tanh")
        added = self.linears["per_layer_proj"](gate.mul_(per_layer_input))
        return rms_norm(added, self.per_layer_norm, self.eps).add_(hidden)

    def _mixer_and_mlp(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        step: torch.Tensor | None,
        step_kv: StepKV,
    ) -> torch.Tensor:
        linears = self.linears
        if self.conv is not None:
            hidden = self.conv(_pre_norm(hidden, self.input_norm, self.eps), hidden)
        else:
            hidden = self._attention(
                hidden, (cos, signed_sin), kv_cache, slot_mapping, step, step_kv
            )
        normed = _pre_norm(hidden, self.post_norm, self.eps)
        if self.experts_in_norm is not None:
            return self._dense_and_experts(normed, hidden)
        if self.moe is not None:
            if self.shared_expert is not None:  # refused under tensor parallelism
                hidden = self.shared_expert(normed, hidden)
            if self.tp is None:
                return self.moe(normed, hidden)
            return self.tp.all_reduce(self.moe(normed, hidden if self.tp.rank == 0 else None))
        return self._block_out(linears["down"], self._gated(normed), hidden, self.mlp_out_norm)

    def _gated(self, normed: torch.Tensor) -> torch.Tensor:
        """The dense MLP's activations: act(gate) * up."""
        gate_up = self.linears["gate_up"](normed)
        gate = gate_up[:, : self.intermediate]
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return gate.mul_(gate_up[:, self.intermediate :])

    def _dense_and_experts(self, normed: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Gemma 4 26B-A4B's MLP block: the dense MLP on `normed`, the experts on their own
        norm of the stream `hidden` (their router on its own, SparseMoeBlock.router_input),
        each output normed, their sum normed by the MLP's output norm and added to the
        stream, as transformers computes it."""
        assert self.moe is not None and self.tp is None  # refused by check_shardable
        dense = self.linears["down"](self._gated(normed))
        dense = rms_norm(dense, self.dense_out_norm, self.eps)
        experts = self.moe(rms_norm(hidden, self.experts_in_norm, self.eps), None, hidden)
        both = dense.add_(rms_norm(experts, self.experts_out_norm, self.eps))
        return rms_norm(both, self.mlp_out_norm, self.eps).add_(hidden)

    def _attention(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        step: torch.Tensor | None,
        step_kv: StepKV,
    ) -> torch.Tensor:
        """The residual stream after the attention block: norm, q/k/v, rope (the step's cos
        and signed sin rows), attend, o."""
        num_tokens = hidden.shape[0]
        linears = self.linears
        qkv = linears["qkv"](_pre_norm(hidden, self.input_norm, self.eps))
        own_kv = 0 if self.shares_kv else self.kv_size
        # q and k share one rope call: they sit side by side in the fused projection.
        qk = qkv[:, : self.q_size + own_kv].view(num_tokens, -1, self.head_dim)
        if self.qk_norm is not None and self.qk_norm.dim() == 1:  # q whole, then k whole
            q_part, k_part = qk.flatten(1).split((self.q_size, self.kv_size), dim=1)
            weights = self.qk_norm.split((self.q_size, self.kv_size))
            qk = torch.cat(
                [rms_norm(x, w, self.eps) for x, w in zip((q_part, k_part), weights, strict=True)],
                dim=1,
            ).view(qk.shape)
        elif self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, self.eps)
        qk = apply_rope(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if self.shares_kv:
            # The source layer's K/V of this step: storing them again into its cache (this
            # layer's) writes the same bytes, and then every attention path reads as usual.
            k, v = step_kv[self.kv_source]
        else:
            # Keys as values: the key projection as it left the matmul (norm and rope made
            # new tensors).
            v_start = self.q_size + (0 if self.keys_as_values else self.kv_size)
            v = qkv[:, v_start : v_start + self.kv_size].view(num_tokens, -1, self.head_dim)
            if self.value_norm:
                v = rms_norm(v, None, self.eps)
            if self.kv_read_later:  # held to the step's end only where a later layer reads it
                step_kv[self.index] = (k, v)
        if step is not None:  # the C++ op: store K/V, attend every row, one call
            attn = self.kernel_ops.store_and_attend(
                q,
                k,
                v,
                *kv_cache,
                slot_mapping,
                step,
                self.scale,
                self.sliding_window,
                self.softcap,
                self.sinks,
            )
        else:
            attn = attend(
                q, k, v, self.index, self.scale, self.sliding_window, self.softcap, self.sinks
            )
        attn = attn.reshape(num_tokens, self.q_size)
        return self._block_out(linears["o"], attn, hidden, self.attn_out_norm)

    def _block_out(
        self,
        linear: Linear,
        x: torch.Tensor,
        residual: torch.Tensor,
        out_norm: torch.Tensor | None,
    ) -> torch.Tensor:
        """residual + the block's output projection, normed first with sandwich norms."""
        if out_norm is None:
            return self._project_out(linear, x, residual)
        assert self.tp is None  # refused by tensor_parallel.check_shardable
        return rms_norm(linear(x), out_norm, self.eps).add_(residual)

    def _project_out(self, linear: Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x @ W.T + residual. Under tensor parallelism W is split by input columns: each
        rank's partial product, the residual added by rank 0 only so that the sum counts it
        once, then the layer's one all-reduce (per block: attention, MLP)."""
        if self.tp is None:
            return linear(x, residual=residual)
        return self.tp.all_reduce(linear(x, residual=residual if self.tp.rank == 0 else None))


def _experts_arguments(layers: Sequence[_DecoderLayer]) -> tuple[Any, ...]:
    """decoder_stack's mixture-of-experts arguments: each layer's router tiles (None: a dense
    MLP), the experts' gate, up and down stacks and their formats, top-k, renormalisation;
    then each layer's attention sinks, its experts' three biases (router, gate+up, down), the
    SwiGLU's clamp (gpt-oss's; None and (0, 0) elsewhere), its shared expert's gate
    (Qwen2-MoE's, a [hidden] row; its projections are the layer's gate_up and down), and the
    routing's sigmoid scores, selection biases (a layer) and scale (LFM2-MoE's)."""
    blocks = [layer.moe for layer in layers]
    kernels = [block.kernel for block in blocks if block is not None and block.kernel is not None]
    first = next((block for block in blocks if block is not None), None)
    routing = first.routing if first is not None else Routing(top_k=0)
    biases = []
    for block in blocks:
        kernel = None if block is None else block.kernel
        if block is None or kernel is None:
            biases += [None, None, None]
        else:
            biases += [kernel.router_bias, block.gate_up_bias, block.down_bias]
    return (
        [
            None if block is None or block.kernel is None else block.kernel.router
            for block in blocks
        ],
        [stack for k in kernels for stack in (k.gate, k.up, k.down)],
        [code for k in kernels for code in k.formats],
        routing.top_k,
        routing.renormalize,
        [layer.sinks for layer in layers],
        biases,
        *(kernels[0].swiglu if kernels else (0.0, 0.0)),
        [
            None
            if layer.shared_expert is None or layer.shared_expert.gate_weight is None
            else layer.shared_expert.gate_weight.view(-1)
            for layer in layers
        ],
        routing.sigmoid,
        [None if block is None else block.selection_bias for block in blocks],
        routing.scale,
    )


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder over a paged KV cache; weights come from `load_weights`."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel | None = None,
    ) -> None:
        """`tp`: this network is one rank's shard (`config` then being the shard's shape,
        model/tensor_parallel.py); it runs the torch backend, eager."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        like = {"dtype": dtype, "device": device}
        self.layers = nn.ModuleList(
            _DecoderLayer(config, dtype, device, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm_weight = _weight(config.hidden_size, **like)
        # Gemma 4 E2B/E4B's per-layer embeddings.
        self.per_layer_inputs = (
            PerLayerInputs(config, dtype, device) if config.per_layer_input_size else None
        )
        self.device = device
        # The rotary tables cover the positions steps have reached so far and grow (doubling)
        # when a step goes past them: a row depends on its position alone, and tables for a
        # model's whole context (131072 positions for Llama 3) are 33-67 MB held for nothing
        # by a server whose requests use a few thousand.
        self.rope_positions = 0
        # The second rotary tables, for the layers whose `second_rope` is set.
        self.rope_second: tuple[torch.Tensor, torch.Tensor] | None = None
        self._grow_rope(min(config.max_position_embeddings, _ROPE_POSITIONS))
        # M-RoPE: which of a token's three positions each rotary column turns by.
        self.mrope_components: torch.Tensor | None = None
        if config.mrope_section is not None:
            if 2 * sum(config.mrope_section) != config.rope_dim:
                raise ValueError(
                    f"mrope_section {config.mrope_section} does not split the "
                    f"{config.rope_dim // 2} rotary frequencies of a head"
                )
            self.mrope_components = mrope_components(config.mrope_section, config.mrope_interleaved)
        # ModelConfig.embed_scale, rounded to the model dtype as transformers does.
        embed_scale = config.embed_scale
        self.embed_scale = (
            None if embed_scale is None else torch.tensor(embed_scale, dtype=dtype, device=device)
        )
        # Made by `load`: the LM head, and the token embedding (a dense table, or rows looked
        # up in the head's or its own tiles, never a dense copy of a quantized table).
        self.head: Linear | None = None
        # A reranker's or classifier's head [labels, hidden], fp32: W . (final-norm last
        # state) are its logits.
        self.score_head: torch.Tensor | None = None
        self.embedding: TokenEmbedding | None = None
        self.fused_layers = False
        self.backend: Backend = "torch"
        # The C++ ops' namespace where the model runs on them (`use_kernel_ops`).
        self.kernel_ops: Any = None
        # Its LoRA slots when it serves adapters: the LoRAModel (model/lora_model.py, which
        # imports this module) sets itself here.
        self.lora: Any = None
        self._run_layers: Callable[..., torch.Tensor] = self._layers
        # decoder_stack's arguments but the step's, and the KV caches they name (`_stacked`).
        self._stack: tuple[KVCaches, tuple[Any, ...]] | None = None

    def _grow_rope(self, positions: int) -> None:
        """Rotary tables of `positions` rows (never past the model's context)."""
        c = self.config
        positions = min(positions, c.max_position_embeddings)
        cos, signed_sin = rope_tables(
            c.rope_dim, c.rope_theta, c.rope_scaling, positions, self.dtype, self.device
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_signed_sin", signed_sin, persistent=False)
        if c.local_rope_theta is not None:  # Gemma 3's and 4's sliding layers: plain RoPE
            self.rope_second = rope_tables(
                c.local_rope_dim, c.local_rope_theta, None, positions, self.dtype, self.device
            )
        elif c.rope_layers is not None and not all(c.rope_layers):  # SmolLM3's NoPE layers
            self.rope_second = no_rope_tables(positions, self.dtype, self.device)
        self.rope_positions = positions

    def _rope(self) -> tuple[torch.Tensor, ...]:
        """The rotary tables as a step takes them: cos and signed sin, then the second pair
        where some layers rotate by another (see `second_rope`)."""
        return (self.rope_cos, self.rope_signed_sin, *(self.rope_second or ()))

    def layer_rope_tables(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables (cos, signed sin) layer `index` turns its queries and keys by."""
        tables = self._rope()
        return (tables[2], tables[3]) if self.layers[index].second_rope else (tables[0], tables[1])

    def _rope_rows(
        self,
        tables: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        query_scales: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """The step's rows of cos and signed sin, [T, 1, rotated]; with query scales
        (Ministral 3's temperature) [T, q heads + kv heads, rotated], the query heads' rows
        times their token's scale: rope is linear in its tables, so that rotating q by them
        rotates and scales it at once, k as before."""
        rows = [table.index_select(0, positions).unsqueeze(1) for table in tables]
        if query_scales is None:
            return rows
        c = self.config
        scales = torch.cat(
            (
                query_scales[:, None].expand(-1, c.num_attention_heads),
                query_scales.new_ones(()).expand(len(positions), c.num_key_value_heads),
            ),
            dim=1,
        ).unsqueeze(2)
        return [(row.float() * scales).to(row.dtype) for row in rows]

    def cover_positions(self, needed: int) -> None:
        """Make the rotary tables reach position `needed` - 1 (doubling, capped at the context)."""
        if needed > self.rope_positions:
            self._grow_rope(max(needed, 2 * self.rope_positions))

    def _targets(self) -> dict[str, tuple[torch.Tensor | None, tuple[int, ...]]]:
        """HF name -> (destination of a small tensor, or None for a projection's part built
        by `load`; expected shape)."""
        c = self.config
        vocab = (c.vocab_size, c.hidden_size)
        targets: dict[str, tuple[torch.Tensor | None, tuple[int, ...]]] = {
            "model.embed_tokens.weight": (None, vocab),
            "model.norm.weight": (self.norm_weight, (c.hidden_size,)),
        }
        if not c.tie_word_embeddings:
            targets["lm_head.weight"] = (None, vocab)
        if self.per_layer_inputs is not None:
            targets |= self.per_layer_inputs.targets()
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, _DecoderLayer)
            p = f"model.layers.{i}."
            if layer.conv is not None:
                targets |= layer.conv.targets(p)
            else:
                targets |= _attention_targets(p, layer, c)
            targets |= _mlp_targets(p, layer, c)
            targets |= _norm_targets(p, layer, c)
            targets |= _output_targets(p, layer, c)
        return targets

    def load(
        self,
        weights: Mapping[str, torch.Tensor],
        backend: Backend = "torch",
        quantized: Mapping[str, QuantizedBlocks] | None = None,
        mode: WeightMode = "blocks",
    ) -> None:
        """Build the network's weights from HF-named tensors, one projection at a time, in
        `backend`'s form: q/k/v and gate/up fused, small tensors copied in. `quantized` holds
        checkpoint tensors kept in their file's blocks (the tiled backend reads them so in
        `mode` "blocks"). All checks happen before anything is built."""
        targets = self._targets()
        self._check(weights, targets)
        if SCORE_WEIGHT in weights:  # a reranker's (model/score_head.py): fp32, never tiled
            self.score_head = weights[SCORE_WEIGHT].float().clone()
        quantized = quantized or {}
        offset = self.config.traits.norm_offset
        with torch.no_grad():
            for name, (dest, _) in targets.items():
                if dest is None:
                    continue
                # What the model keeps in fp32 (sinks, selection biases) as the checkpoint
                # has it, not rounded to the model's dtype on the way.
                fp32 = dest.dtype == torch.float32 and self.dtype != torch.float32
                weight = native_of(weights, name) if fp32 else weights[name]
                if offset and "norm" in name:  # Gemma's norms scale by (1 + weight)
                    weight = weight.float() + 1
                dest.copy_(weight)
        if self.tp is not None and backend != "torch":
            # The fused C++ layer adds the residual inside one op, with no point at which to
            # all-reduce; only the plain torch projections are sharded.
            raise ValueError("a tensor-parallel shard runs the torch backend, dense weights")
        self.backend = backend
        part = functools.partial(weight_part, weights, quantized)
        for layer in self.layers:
            assert isinstance(layer, _DecoderLayer)
            cos = self._rope()[2 if layer.second_rope else 0]  # 0 wide: a layer without RoPE
            layer.build(part, backend, mode, cos.shape[1])
        if self.per_layer_inputs is not None:
            self.per_layer_inputs.build(part, backend, mode)
        table = part("model.embed_tokens.weight")
        tied = self.config.tie_word_embeddings
        self.head = Linear(
            [table if tied else part("lm_head.weight")], None, backend, mode, self.dtype
        )
        self.embedding = TokenEmbedding(
            table, self.head if tied else None, backend, mode, self.dtype
        )
        # A layer reading an earlier layer's K/V in Python takes them from that layer's
        # Python step (`step_kv`); one in the C++ op, from the pool they share. So the source
        # of a layer left to Python stays in Python too.
        for layer in self.layers:
            if isinstance(layer, _DecoderLayer) and layer.shares_kv and layer.fused is None:
                self.layers[layer.kv_source].fused = None
        # One C++ op per layer wherever the paged attention op also runs (the step's
        # packed table tells each layer its rows' positions).
        self.fused_layers = all(layer.fused is not None for layer in self.layers)
        self._stack = None

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """`load` on the reference path: plain torch projections, dense weights."""
        self.load(weights)

    def _check(
        self,
        weights: Mapping[str, torch.Tensor],
        targets: Mapping[str, tuple[torch.Tensor | None, tuple[int, ...]]],
    ) -> None:
        # Gemma 4's checkpoints may keep K/V projections and norms for the layers that
        # share an earlier layer's K/V, which never run (transformers skips them too).
        unused = {
            f"model.layers.{layer.index}.self_attn.{part}.weight"
            for layer in self.layers
            if isinstance(layer, _DecoderLayer) and layer.shares_kv
            for part in ("k_proj", "v_proj", "k_norm")
        }

        def ignorable(name: str) -> bool:
            # Old checkpoints store the rotary buffer; tied models' state_dict lists lm_head.
            return (
                name.endswith("rotary_emb.inv_freq")
                or (name == "lm_head.weight" and self.config.tie_word_embeddings)
                or name == SCORE_WEIGHT  # read by `load` itself
                or name in unused
            )

        missing = sorted(set(targets) - set(weights))
        unexpected = sorted(n for n in weights if n not in targets and not ignorable(n))
        misshaped = [
            f"{n}: got {shape_of(weights, n)}, expected {shape}"
            for n, (_, shape) in targets.items()
            if n in weights and shape_of(weights, n) != shape
        ]
        problems = []
        if missing:
            problems.append(f"missing {len(missing)}: {', '.join(missing[:8])}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)}: {', '.join(unexpected[:8])}")
        if misshaped:
            problems.append(f"mis-shaped {len(misshaped)}: {'; '.join(misshaped[:8])}")
        if problems:
            raise ValueError("cannot load weights: " + " | ".join(problems))

    def weight_bytes(self) -> int:
        """Bytes of weights the network holds: projections, head, embedding, small tensors."""
        linears = [self.head] if self.head is not None else []
        for layer in self.layers:
            assert isinstance(layer, _DecoderLayer)
            linears.extend(layer.linears.values())
            if layer.moe is not None:
                linears.extend([*layer.moe.gate_up, *layer.moe.down])
            if layer.shared_expert is not None:
                linears.extend(layer.shared_expert.linears())
            if layer.conv is not None:
                linears.extend(layer.conv.linears())
        small = sum(p.numel() * p.element_size() for p in self.parameters())
        embedding = self.embedding.nbytes if self.embedding is not None else 0
        if self.per_layer_inputs is not None:
            embedding += self.per_layer_inputs.nbytes
        return sum(lin.nbytes for lin in linears) + embedding + small

    def use_kernel_ops(self, ops: Any) -> None:
        """Run attention (and whole layers, where `fused_layers`) through these C++ ops: one
        ISA variant's namespace of them (kernels.ops())."""
        self.kernel_ops = ops
        for layer in self.layers:
            assert isinstance(layer, _DecoderLayer)
            layer.kernel_ops = ops

    def describe_linears(self) -> dict[str, str]:
        """Kernel of each projection kind, e.g. {"qkv": "tiled-q4(<=8 rows)+onednn", ...}."""
        assert self.head is not None
        described: dict[str, str] = {}
        for layer in self.layers:  # LFM2's first layer is a conv layer, without q/k/v
            assert isinstance(layer, _DecoderLayer)
            for name, lin in layer.linears.items():
                described.setdefault(name, lin.describe())
            if layer.moe is not None:
                described.setdefault("experts", layer.moe.describe())
            if layer.conv is not None and layer.conv.in_proj is not None:
                described.setdefault("conv", layer.conv.in_proj.describe())
        return {**described, "lm_head": self.head.describe()}

    def compile_layers(self) -> None:
        """Compile embedding + layer stack into graphs that every later step reuses.

        With the C++ paged attention op, attention is one call per layer on tensors the
        graph takes as inputs (the K/V caches, the step's slots and its packed sequence
        table), so a step runs the graph and nothing else in Python; without it, attention is
        an opaque op reading the step from a context, so the step's Python-side metadata
        never enters the graph or its guards.

        Two graphs serve every step: the first call (one token: a lone decode) is compiled
        for exactly that shape, the next size seen makes the token count dynamic. Inductor
        sizes its generated loops by that first dynamic example (a handful of tokens), so the
        small pointwise kernels (norms, rope, SiLU) stay on one thread instead of paying an
        OpenMP fork and barrier per kernel per step; the projections and attention parallelise
        inside their own kernels.
        """
        if self.tp is not None:
            raise ValueError("a tensor-parallel shard runs eager (its all-reduces are not traced)")
        # The step's packed table and the rotary tables vary in length: the tables are inputs
        # of the graph, not constants, so they grow with the longest sequence as the eager
        # step's do. (Tables for Gemma 4 E2B's whole context are 384 MiB in bf16.)
        self._run_layers = CompiledLayers(self._layers, dynamic_args=(4, 5), kv_caches_arg=2)

    def freeze_compiled(self) -> None:
        """After warm-up has run both graphs: call them without dynamo's guard checks."""
        if isinstance(self._run_layers, CompiledLayers):
            self._run_layers.freeze()

    def _layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        slot_mapping: torch.Tensor,
        step: torch.Tensor | None,
        rope: tuple[torch.Tensor, ...],
        given: tuple[torch.Tensor, torch.Tensor] | None,
        grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`rope`: the whole rotary tables (`_rope`); `given`: rows of the step given as
        input rows (a prompt's embeddings), their indices and the rows, written over the
        token embeddings. A given row wider than the model carries, after its input row,
        a row added to the stream after each of the first layers (Qwen3-VL's DeepStack:
        `_given_parts`). `grid`: every row's three rotary positions (M-RoPE), from which the
        step's own rows of the rotary tables are made; the step's table then gives each row
        its row's position (attention_metadata: SeqSpan.grid_rotary), so the C++ layers
        turn it by them as the torch paths do."""
        assert self.embedding is not None
        hidden = self.embedding(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        deep = None
        if given is not None:
            rows, values, deep = self._given_parts(given)
            if (scale := self.config.given_rows_scale) is not None:
                values = values * scale  # Granite's, as transformers scales inputs_embeds
            hidden = hidden.index_copy(0, rows, values.to(hidden.dtype))
        per_layer = None
        if self.per_layer_inputs is not None:
            ids = input_ids
            if given is not None:  # transformers looks given rows' per-layer rows up as padding
                ids = input_ids.index_fill(0, given[0], self.config.per_layer_pad_id)
            per_layer = self.per_layer_inputs(ids, hidden)
        temperature = self.config.query_temperature  # Ministral 3's
        query_scales = None
        if temperature is not None:
            query_scales = query_temperature_scales(positions, temperature)
        if grid is not None:  # M-RoPE: tables of the step's own rows, a row's position its row
            assert self.mrope_components is not None, "grid positions for a model without M-RoPE"
            rope = tuple(grid_rope_rows(table, grid, self.mrope_components) for table in rope)
            positions = torch.arange(len(input_ids), device=positions.device)
        if (
            step is not None
            and self.fused_layers
            and deep is None
            and (stacked := self._stacked(kv_caches)) is not None
        ):
            return self.layers[0].kernel_ops.decoder_stack(
                hidden,
                slot_mapping,
                step,
                *rope[:2],
                *(rope[2:] or (None, None)),
                *stacked,
                query_scales,
            )
        first_tables, second_tables = rope[:2], rope[2:] or rope[:2]
        first_rows = self._rope_rows(first_tables, positions, query_scales)
        second_rows = first_rows
        if len(rope) > 2:
            second_rows = self._rope_rows(second_tables, positions, query_scales)
        step_kv: StepKV = {}
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            # decoder_layer: a dense MLP (with Gemma 4's experts beside it), attention (LFM2's
            # convolution is decoder_stack's)
            fused = layer.fused is not None and layer.dense_mlp and layer.conv is None
            own = None if per_layer is None else per_layer[:, layer.index]
            if step is not None and fused:
                tables = second_tables if layer.second_rope else first_tables
                hidden = layer.forward_fused(
                    hidden, kv_cache, slot_mapping, step, tables, query_scales, own
                )
            else:
                cos, signed_sin = second_rows if layer.second_rope else first_rows
                hidden = layer(hidden, cos, signed_sin, kv_cache, slot_mapping, step, step_kv, own)
            if deep is not None and layer.index < deep.shape[1]:
                hidden = hidden.index_add(0, given[0], deep[:, layer.index])
        return hidden

    def _given_parts(
        self, given: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Given rows as (their indices, input rows [n, hidden], the rows added after each
        of the first layers [n, layers, hidden] or None): a row [hidden x (1 + layers)]
        holds them side by side, as Qwen3-VL's tower makes them (its DeepStack rows)."""
        rows, values = given
        width = self.config.hidden_size
        if values.shape[1] == width:
            return rows, values, None
        deep = values[:, width:].reshape(len(values), -1, width).to(self.dtype)
        return rows, values[:, :width], deep

    def _stacked(self, kv_caches: KVCaches) -> tuple[Any, ...] | None:
        """The fused layers as one decoder_stack call: its arguments after the step's (every
        layer's weights, norms and caches in lists, made once for these caches). None where
        the layers run one call each: with LoRA slots (decoder_layer adds their deltas) and
        while torch.compile traces them."""
        if self.lora is not None or torch.compiler.is_compiling():
            return None
        if not self.config.uniform_layers:  # Gemma 4's: decoder_layer, one call a layer
            return None
        if self._stack is not None and self._stack[0] is kv_caches:
            return self._stack[1]
        layers = [layer for layer in self.layers if isinstance(layer, _DecoderLayer)]
        fused = [layer.fused for layer in layers if layer.fused is not None]
        first = layers[0]
        arguments = (
            [layer.input_norm for layer in layers],
            [layer.post_norm for layer in layers],
            first.eps,
            [weight for weights, _, _, _ in fused for weight in weights],
            [code for _, codes, _, _ in fused for code in codes],
            [count for _, _, counts, _ in fused for count in counts],
            [bias for _, _, _, biases in fused for bias in biases],
            [layer.qk_norm for layer in layers],
            [layer.attn_out_norm for layer in layers],
            [layer.mlp_out_norm for layer in layers],
            first.gelu,
            first.softcap,
            [key for key, _ in kv_caches],
            [value for _, value in kv_caches],
            first.num_heads,
            first.num_kv_heads,
            first.scale,
            [layer.sliding_window for layer in layers],
            [int(layer.second_rope) for layer in layers],
            *_experts_arguments(layers),
            [
                None if layer.conv is None else layer.conv.weight.view(layer.hidden_size, -1)
                for layer in layers
            ],
        )
        self._stack = (kv_caches, arguments)
        return arguments

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Flat step of T tokens -> float32 logits [S, vocab] for the rows in logits_indices."""
        return self.logits(
            self.hidden_states(input_ids, positions, meta, kv_caches), logits_indices
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        given: tuple[torch.Tensor, torch.Tensor] | None = None,
        grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layers' output for every token of the step [T, hidden], before the final norm
        (taken by `normed` for the rows that need it); writes the step's K/V. `positions`:
        each row's rotary position. `given`: rows given as input rows, and `grid`: every
        row's three rotary positions (M-RoPE), where an image's grid is in the step
        (`_layers`); such a step runs eager: the compiled graphs were traced without them."""
        assert self.head is not None, "load() builds the network's weights first"
        if positions.numel():
            furthest = positions if grid is None else grid
            self.cover_positions(int(furthest.max()) + 1)
        with attention_context(meta, kv_caches):
            step = None if meta.kernel is None else meta.kernel.packed
            arguments = (input_ids, positions, kv_caches, meta.slot_mapping, step, self._rope())
            if given is not None or grid is not None:
                return self._layers(*arguments, given, grid)
            return self._run_layers(*arguments, None, None)

    def normed(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The final norm of the rows `indices` of `hidden_states`' output: what the LM head
        reads, and what an embedding pools."""
        eps = self.config.stream_norm_eps
        if self.kernel_ops is not None and self.fused_layers and hidden.dtype == torch.bfloat16:
            # Where the layers are the C++ op, so is their final norm, rounded as theirs: one
            # call for torch's ~8, each ~20 us at one row once a step has swept the caches.
            return self.kernel_ops.norm_rows(hidden, indices, self.norm_weight, eps)
        return rms_norm(hidden.index_select(0, indices), self.norm_weight, eps)

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """float32 logits [S, vocab] of the rows `logits_indices` of `hidden_states`' output."""
        assert self.head is not None, "load() builds the network's weights first"
        # Norm and head only where logits are wanted: the head is the largest matrix here.
        hidden = self.normed(hidden, logits_indices)
        # Logits unrounded where the kernel allows: in bf16, logits near 16 are 1/8 apart and
        # close calls become ties (the bundled model's first answer token was one).
        logits = self.head(hidden, fp32_out=True).float()
        if cap := self.config.final_logit_softcapping:  # Gemma 2
            logits = torch.tanh(logits / cap).mul_(cap)
        if divisor := self.config.logits_scaling:  # Granite
            logits = logits.div_(divisor)
        return logits


_Targets = dict[str, tuple[torch.Tensor | None, tuple[int, ...]]]


def _attention_targets(p: str, layer: _DecoderLayer, c: ModelConfig) -> _Targets:
    """A layer's q/k/v (parts of its fused qkv), o and q/k norms under their HF names."""
    q, kv = layer.q_size, layer.kv_size
    qkv_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    if c.traits.fused_checkpoint:  # Phi-3: already [q; k; v]
        qkv_rows = {"qkv_proj": (0, q + 2 * kv)}
    if layer.shares_kv or layer.keys_as_values:  # Gemma 4: q alone, or q and k
        qkv_rows = dict(list(qkv_rows.items())[: 1 if layer.shares_kv else 2])
    targets: _Targets = {}
    for name, (lo, hi) in qkv_rows.items():
        targets[f"{p}self_attn.{name}.weight"] = (None, (hi - lo, c.hidden_size))
        if layer.qkv_bias is not None:
            targets[f"{p}self_attn.{name}.bias"] = (layer.qkv_bias[lo:hi], (hi - lo,))
    targets[f"{p}self_attn.o_proj.weight"] = (None, (c.hidden_size, q))
    if layer.o_bias is not None:
        targets[f"{p}self_attn.o_proj.bias"] = (layer.o_bias, (c.hidden_size,))
    if layer.sinks is not None:
        targets[f"{p}self_attn.sinks"] = (layer.sinks, (layer.num_heads,))
    if layer.qk_norm is not None and layer.qk_norm.dim() == 1:  # whole: q's, then k's
        targets[f"{p}self_attn.q_norm.weight"] = (layer.qk_norm[:q], (q,))
        targets[f"{p}self_attn.k_norm.weight"] = (layer.qk_norm[q:], (kv,))
    elif layer.qk_norm is not None:  # each [head_dim] row, broadcast over its heads
        heads, head = layer.num_heads, (layer.head_dim,)
        targets[f"{p}self_attn.q_norm.weight"] = (layer.qk_norm[:heads], head)
        if not layer.shares_kv:
            targets[f"{p}self_attn.k_norm.weight"] = (layer.qk_norm[heads:], head)
    return targets


def _output_targets(p: str, layer: _DecoderLayer, c: ModelConfig) -> _Targets:
    """What Gemma 4 adds to a layer's output: its per-layer input's gate, projection and
    norm, and its scalar."""
    targets: _Targets = {}
    if layer.per_layer_norm is not None:
        size = c.per_layer_input_size
        targets[f"{p}per_layer_input_gate.weight"] = (None, (size, c.hidden_size))
        targets[f"{p}per_layer_projection.weight"] = (None, (c.hidden_size, size))
        targets[f"{p}post_per_layer_input_norm.weight"] = (layer.per_layer_norm, (c.hidden_size,))
    if layer.layer_scalar is not None:
        targets[f"{p}layer_scalar"] = (layer.layer_scalar, (1,))
    return targets


def _mlp_targets(p: str, layer: _DecoderLayer, c: ModelConfig) -> _Targets:
    """A layer's gate/up (halves of its fused gate_up) and down, or its experts (and beside
    them Gemma 4's dense MLP)."""
    if layer.moe is not None and layer.experts_in_norm is None:
        shared = layer.shared_expert.targets(p) if layer.shared_expert is not None else {}
        return {**layer.moe.targets(p), **shared}
    experts = layer.moe.targets(p) if layer.moe is not None else {}
    inter = layer.intermediate
    if c.traits.fused_checkpoint:  # Phi-3: already [gate; up]
        targets: _Targets = {f"{p}mlp.gate_up_proj.weight": (None, (2 * inter, c.hidden_size))}
    else:
        targets = {
            f"{p}mlp.gate_proj.weight": (None, (inter, c.hidden_size)),
            f"{p}mlp.up_proj.weight": (None, (inter, c.hidden_size)),
        }
    targets[f"{p}mlp.down_proj.weight"] = (None, (c.hidden_size, inter))
    return {**targets, **experts}


def _norm_targets(p: str, layer: _DecoderLayer, c: ModelConfig) -> _Targets:
    """A layer's RMS norms: before attention and the MLP, and Gemma's after each."""
    hidden = (c.hidden_size,)
    targets: _Targets = {}
    if c.traits.pre_norms:
        targets[f"{p}input_layernorm.weight"] = (layer.input_norm, hidden)
    if layer.attn_out_norm is not None and layer.mlp_out_norm is not None:
        if c.traits.pre_norms:
            targets[f"{p}pre_feedforward_layernorm.weight"] = (layer.post_norm, hidden)
        targets[f"{p}post_attention_layernorm.weight"] = (layer.attn_out_norm, hidden)
        targets[f"{p}post_feedforward_layernorm.weight"] = (layer.mlp_out_norm, hidden)
    else:
        targets[f"{p}post_attention_layernorm.weight"] = (layer.post_norm, hidden)
    if layer.experts_in_norm is not None:  # Gemma 4 26B-A4B's, beside its experts
        targets[f"{p}pre_feedforward_layernorm_2.weight"] = (layer.experts_in_norm, hidden)
        targets[f"{p}post_feedforward_layernorm_1.weight"] = (layer.dense_out_norm, hidden)
        targets[f"{p}post_feedforward_layernorm_2.weight"] = (layer.experts_out_norm, hidden)
    return targets
