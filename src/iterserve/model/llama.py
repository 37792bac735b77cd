"""The Llama-style decoder (Llama 2/3, Mistral, Qwen2/3, Phi-3, Gemma 2/3, SmolLM) as one
network over a paged KV cache; what sets a family apart is a named trait (model/family.py)
or a number on ModelConfig, and RoPE variants live in model/rope.py.

The engine calls `forward` once per step on a flat ragged batch. q/k/v and gate/up are fused
into one projection each at load time, the rotary table is built once and indexed once per
step, the residual adds ride inside the output projections, and the LM head only sees the
rows that need logits. Each projection is a `Linear` whose backend (plain torch, oneDNN
packed, or iterserve's tiled kernels over bf16 or 4/8-bit weights) is chosen once by
`prepare`; the layer stack can then be compiled (`compile_layers`) into one graph for every
token count, attention being an opaque op that reads the step from a context.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model.attention import attend, attention_context
from iterserve.model.attention_metadata import AttentionMetadata
from iterserve.model.compiled import CompiledLayers
from iterserve.model.config import ModelConfig
from iterserve.model.lazy_weights import shape_of
from iterserve.model.linear import Backend, DenseFormat, Linear
from iterserve.model.moe import EXPERT_PREFIX, SparseMoeBlock
from iterserve.model.quant import QuantizedWeight
from iterserve.model.rope import apply_rope, rope_tables
from iterserve.model.tensor_parallel import TensorParallel


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32 like transformers, but without materialising an fp32 copy of x:
    # vector_norm accumulates in fp32 in one pass, and scaling stays in x's dtype. On a
    # 512-token bf16 prefill this is ~3x faster than the textbook form (and F.rms_norm, which
    # is composite on CPU; measured once, no script); fp32 results are unchanged, bf16 differs by at most a rounding.
    sum_sq = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32).square_()
    inv_rms = sum_sq.div_(x.shape[-1]).add_(eps).rsqrt_()
    return (x * inv_rms.to(x.dtype)).mul_(weight)


def _weight(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


# The projections of a layer, as (our fused name, the HF names fused into it in row order).
_FUSED = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
# The same for checkpoints that store them fused already (FamilyTraits.fused_checkpoint).
_FUSED_IN_CHECKPOINT = {
    **_FUSED,
    "qkv": ("self_attn.qkv_proj",),
    "gate_up": ("mlp.gate_up_proj",),
}


def _fused_quantized(
    quantized: Mapping[str, QuantizedWeight], prefix: str, parts: tuple[str, ...]
) -> QuantizedWeight | None:
    found = [quantized.get(f"{prefix}{part}.weight") for part in parts]
    if any(q is None for q in found):
        return None
    if len({q.layout for q in found}) > 1:  # type: ignore[union-attr]
        # Parts in different block formats (Q4_K_M stores v in Q6_K, q and k in Q4_K): the
        # fused projection runs dense.
        return None
    return type(found[0]).cat(found)  # type: ignore[arg-type]


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
        hidden, head_dim = config.hidden_size, config.head_dim
        self.index = index
        self.tp = tp
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.intermediate = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.scale = (config.query_pre_attn_scalar or head_dim) ** -0.5
        self.sliding_window = config.layer_window(index)
        self.softcap = config.attn_logit_softcapping or 0.0
        # Gemma 3: sliding layers rotate with their own RoPE base (the model's local tables).
        self.local_rope = config.local_rope_theta is not None and self.sliding_window > 0
        traits = config.traits
        self.gelu = traits.activation == "gelu_tanh"
        self.checkpoint_parts = _FUSED_IN_CHECKPOINT if traits.fused_checkpoint else _FUSED
        like = {"dtype": dtype, "device": device}
        self.input_norm = _weight(hidden, **like)
        self.qkv_weight = _weight(self.q_size + 2 * self.kv_size, hidden, **like)
        self.qkv_bias = (
            _weight(self.q_size + 2 * self.kv_size, **like) if config.attention_bias else None
        )
        self.o_weight = _weight(hidden, self.q_size, **like)
        has_o_bias = config.attention_bias and traits.o_proj_bias
        self.o_bias = _weight(hidden, **like) if has_o_bias else None
        # q/k norms (Qwen3, Gemma 3) as one weight over the fused q and k heads: the q_norm row
        # repeated per query head, then the k_norm row per kv head, so one norm call does both.
        self.qk_norm = (
            _weight(self.num_heads + self.num_kv_heads, head_dim, **like)
            if traits.qk_norm
            else None
        )
        self.post_norm = _weight(hidden, **like)  # before the MLP
        # Sandwich norms (Gemma): on the attention and MLP outputs, before the residual adds.
        self.attn_out_norm = _weight(hidden, **like) if traits.sandwich_norms else None
        self.mlp_out_norm = _weight(hidden, **like) if traits.sandwich_norms else None
        # The MLP: dense (fused gate+up, then down), or Mixtral's experts (model/moe.py).
        self.moe = SparseMoeBlock(config, dtype, device) if config.num_local_experts else None
        dense = self.moe is None
        self.gate_up_weight = _weight(2 * self.intermediate, hidden, **like) if dense else None
        self.down_weight = _weight(hidden, self.intermediate, **like) if dense else None
        self.linears: dict[str, Linear] = {}
        # The whole layer as one C++ op (kernels/csrc/layer.cpp), when every part fits it:
        # its projections' weights in order, their formats and row limits, and rope tables.
        self.fused: tuple[list[torch.Tensor | None], list[int], list[int]] | None = None
        self.rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        # The C++ ops of the kernels' ISA variant (kernels/__init__.py), set when they run.
        self.kernel_ops: Any = None

    def prepare(
        self,
        backend: Backend,
        quantized: Mapping[str, QuantizedWeight],
        wide: bool,
        dense_format: DenseFormat,
        rope_tables: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Build the projections' kernels; the dense weights are dropped unless torch runs."""
        prefix = f"model.layers.{self.index}."
        biases = {"qkv": self.qkv_bias, "o": self.o_bias, "gate_up": None, "down": None}
        self.fused = None
        if self.moe is not None:
            expert_prefixes = [
                prefix + EXPERT_PREFIX.format(e) for e in range(self.moe.num_experts)
            ]
            experts = [
                (
                    _fused_quantized(quantized, p, ("w1", "w3")),
                    _fused_quantized(quantized, p, ("w2",)),
                )
                for p in expert_prefixes
            ]
            self.moe.prepare(backend, dense_format, experts, wide)
        for name, parts in self.checkpoint_parts.items():
            if self.moe is not None and name in ("gate_up", "down"):
                continue
            weight = getattr(self, f"{name}_weight")
            self.linears[name] = Linear(
                weight,
                biases[name],
                backend,
                _fused_quantized(quantized, prefix, parts),
                wide,
                dense_format,
            )
            if backend != "torch":  # the kernels hold their own copies
                setattr(self, f"{name}_weight", None)
        if self.moe is not None:  # the C++ layer op has a dense MLP
            return
        tiled = [self.linears[name] for name in _FUSED]
        # The C++ layer op is Llama's layer; others run op by op (the C++ attention still).
        fits_layer_op = self.head_dim % 32 == 0 and self.is_llama_layer
        if all(lin.backend == "tiled" for lin in tiled) and fits_layer_op:
            self.rope_tables = rope_tables
            self.fused = (
                [t for lin in tiled for t in lin.kernel_tensors],
                [code for lin in tiled for code in lin.format_codes],
                [lin.max_tile_rows for lin in tiled],
            )

    @property
    def is_llama_layer(self) -> bool:
        """Nothing but Llama's parts (what the fused C++ layer op computes)."""
        return (
            self.qk_norm is None
            and self.attn_out_norm is None
            and not self.gelu
            and not self.softcap
            and not self.local_rope
        )

    def forward_fused(
        self,
        hidden: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        step: torch.Tensor,
    ) -> torch.Tensor:
        """`forward` in one call of the C++ layer op (which reads positions from `step`)."""
        assert self.fused is not None and self.rope_tables is not None
        return self.kernel_ops.decoder_layer(
            hidden,
            self.input_norm,
            self.post_norm,
            self.eps,
            *self.fused,
            *kv_cache,
            slot_mapping,
            step,
            *self.rope_tables,
            self.num_heads,
            self.num_kv_heads,
            self.scale,
            self.sliding_window,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        step: torch.Tensor | None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        linears = self.linears
        qkv = linears["qkv"](_rms_norm(hidden, self.input_norm, self.eps))
        # q and k share one rope call: they sit side by side in the fused projection.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.qk_norm is not None:
            qk = _rms_norm(qk, self.qk_norm, self.eps)
        qk = apply_rope(qk, cos, signed_sin)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if step is not None:  # the C++ op: store K/V, attend every row, one call
            attn = self.kernel_ops.store_and_attend(
                q, k, v, *kv_cache, slot_mapping, step, self.scale, self.sliding_window
            )
        else:
            attn = attend(q, k, v, self.index, self.scale, self.sliding_window, self.softcap)
        attn = attn.reshape(num_tokens, self.q_size)
        hidden = self._block_out(linears["o"], attn, hidden, self.attn_out_norm)
        normed = _rms_norm(hidden, self.post_norm, self.eps)
        if self.moe is not None:
            if self.tp is None:
                return self.moe(normed, hidden)
            return self.tp.all_reduce(self.moe(normed, hidden if self.tp.rank == 0 else None))
        gate_up = linears["gate_up"](normed)
        gate = gate_up[:, : self.intermediate]
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        act = gate.mul_(gate_up[:, self.intermediate :])
        return self._block_out(linears["down"], act, hidden, self.mlp_out_norm)

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
        return _rms_norm(linear(x), out_norm, self.eps).add_(residual)

    def _project_out(self, linear: Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x @ W.T + residual. Under tensor parallelism W is split by input columns: each
        rank's partial product, the residual added by rank 0 only so that the sum counts it
        once, then the layer's one all-reduce (per block: attention, MLP)."""
        if self.tp is None:
            return linear(x, residual=residual)
        return self.tp.all_reduce(linear(x, residual=residual if self.tp.rank == 0 else None))


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
        self.embed_tokens = _weight(config.vocab_size, config.hidden_size, **like)
        self.layers = nn.ModuleList(
            _DecoderLayer(config, dtype, device, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm_weight = _weight(config.hidden_size, **like)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _weight(config.vocab_size, config.hidden_size, **like)
        )
        positions = config.max_position_embeddings
        cos, signed_sin = rope_tables(
            config.head_dim, config.rope_theta, config.rope_scaling, positions, dtype, device
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_signed_sin", signed_sin, persistent=False)
        self.rope_local: tuple[torch.Tensor, torch.Tensor] | None = None
        if config.local_rope_theta is not None:  # Gemma 3's sliding layers: plain RoPE
            self.rope_local = rope_tables(
                config.head_dim, config.local_rope_theta, None, positions, dtype, device
            )
        # Gemma: sqrt(hidden) rounded to the model dtype, as transformers does.
        self.embed_scale = (
            torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device)
            if config.traits.embed_scale
            else None
        )
        self.head: Linear | None = None
        self.fused_layers = False
        self.backend: Backend = "torch"
        self._run_layers: Callable[..., torch.Tensor] = self._layers

    def _targets(self) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
        """HF name -> (destination view in our fused tensors, expected shape)."""
        c = self.config
        targets: dict[str, tuple[torch.Tensor, tuple[int, ...]]] = {
            "model.embed_tokens.weight": (self.embed_tokens, (c.vocab_size, c.hidden_size)),
            "model.norm.weight": (self.norm_weight, (c.hidden_size,)),
        }
        if not c.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head, (c.vocab_size, c.hidden_size))
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, _DecoderLayer)
            p = f"model.layers.{i}."
            targets |= _attention_targets(p, layer, c)
            targets |= _mlp_targets(p, layer, c)
            targets |= _norm_targets(p, layer, c)
        return targets

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; all checks happen before any copy."""
        targets = self._targets()

        def ignorable(name: str) -> bool:
            # Old checkpoints store the rotary buffer; tied models' state_dict lists lm_head.
            return name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and self.config.tie_word_embeddings
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
        offset = self.config.traits.norm_offset
        with torch.no_grad():
            for name, (dest, _) in targets.items():
                weight = weights[name]
                if offset and "norm" in name:  # Gemma's norms scale by (1 + weight)
                    weight = weight.float() + 1
                dest.copy_(weight)

    def prepare(
        self,
        backend: Backend = "torch",
        quantized: Mapping[str, QuantizedWeight] | None = None,
        wide: bool = True,
        dense_format: DenseFormat = "bf16",
    ) -> None:
        """Choose the projections' kernels once the weights are in.

        `quantized` holds checkpoint weights to keep in their own 4/8-bit blocks (HF names);
        only the tiled backend reads them, for few-row steps, with a dense copy in
        `dense_format` for larger ones unless not `wide`. Until this is called the torch
        backend runs.
        """
        quantized = quantized or {}
        if self.tp is not None and (backend != "torch" or quantized):
            # The fused C++ layer adds the residual inside one op, with no point at which to
            # all-reduce; only the plain torch projections are sharded.
            raise ValueError("a tensor-parallel shard runs the torch backend, dense weights")
        self.backend = backend
        for layer in self.layers:
            assert isinstance(layer, _DecoderLayer)
            layer.prepare(
                backend, quantized, wide, dense_format, (self.rope_cos, self.rope_signed_sin)
            )
        head_name = (
            "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        )
        self.head = Linear(
            self.lm_head, None, backend, quantized.get(head_name), wide, dense_format
        )
        # One C++ op per layer wherever the paged attention op also runs (the step's
        # packed table tells each layer its rows' positions).
        self.fused_layers = all(layer.fused is not None for layer in self.layers)

    def use_kernel_ops(self, ops: Any) -> None:
        """Run attention (and whole layers, where `fused_layers`) through these C++ ops: one
        ISA variant's namespace of them (kernels.ops())."""
        for layer in self.layers:
            assert isinstance(layer, _DecoderLayer)
            layer.kernel_ops = ops

    def describe_linears(self) -> dict[str, str]:
        """Kernel of each projection kind, e.g. {"qkv": "tiled-q4(<=8 rows)+onednn", ...}."""
        first = self.layers[0]
        assert isinstance(first, _DecoderLayer) and self.head is not None
        experts = {"experts": first.moe.describe()} if first.moe is not None else {}
        return {
            **{n: lin.describe() for n, lin in first.linears.items()},
            **experts,
            "lm_head": self.head.describe(),
        }

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
        self._run_layers = CompiledLayers(self._layers, dynamic_arg=4)

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
    ) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed_tokens)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        if step is not None and self.fused_layers:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden = layer.forward_fused(hidden, kv_cache, slot_mapping, step)
            return hidden
        rope = [
            table.index_select(0, positions).unsqueeze(1)
            for table in (self.rope_cos, self.rope_signed_sin)
        ]
        local = rope
        if self.rope_local is not None:
            local = [table.index_select(0, positions).unsqueeze(1) for table in self.rope_local]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, signed_sin = local if layer.local_rope else rope
            hidden = layer(hidden, cos, signed_sin, kv_cache, slot_mapping, step)
        return hidden

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
        if self.head is None:
            self.prepare()
        assert self.head is not None
        with attention_context(meta, kv_caches):
            step = None if meta.kernel is None else meta.kernel.packed
            hidden = self._run_layers(input_ids, positions, kv_caches, meta.slot_mapping, step)
        # Norm and head only where logits are wanted: the head is the largest matrix here.
        hidden = _rms_norm(
            hidden.index_select(0, logits_indices), self.norm_weight, self.config.rms_norm_eps
        )
        # Logits unrounded where the kernel allows: in bf16, logits near 16 are 1/8 apart and
        # close calls become ties (the bundled model's first answer token was one).
        logits = self.head(hidden, fp32_out=True).float()
        if cap := self.config.final_logit_softcapping:  # Gemma 2
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits


_Targets = dict[str, tuple[torch.Tensor, tuple[int, ...]]]


def _attention_targets(p: str, layer: _DecoderLayer, c: ModelConfig) -> _Targets:
    """A layer's q/k/v (rows of its fused qkv), o and q/k norms under their HF names."""
    q, kv = layer.q_size, layer.kv_size
    qkv_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    if c.traits.fused_checkpoint:  # Phi-3: already [q; k; v]
        qkv_rows = {"qkv_proj": (0, q + 2 * kv)}
    targets: _Targets = {}
    for name, (lo, hi) in qkv_rows.items():
        targets[f"{p}self_attn.{name}.weight"] = (layer.qkv_weight[lo:hi], (hi - lo, c.hidden_size))
        if layer.qkv_bias is not None:
            targets[f"{p}self_attn.{name}.bias"] = (layer.qkv_bias[lo:hi], (hi - lo,))
    targets[f"{p}self_attn.o_proj.weight"] = (layer.o_weight, (c.hidden_size, q))
    if layer.o_bias is not None:
        targets[f"{p}self_attn.o_proj.bias"] = (layer.o_bias, (c.hidden_size,))
    if layer.qk_norm is not None:  # each [head_dim] row, broadcast over its heads
        heads = layer.num_heads
        targets[f"{p}self_attn.q_norm.weight"] = (layer.qk_norm[:heads], (c.head_dim,))
        targets[f"{p}self_attn.k_norm.weight"] = (layer.qk_norm[heads:], (c.head_dim,))
    return targets


def _mlp_targets(p: str, layer: _DecoderLayer, c: ModelConfig) -> _Targets:
    """A layer's gate/up (halves of its fused gate_up) and down, or its experts."""
    if layer.moe is not None:
        return layer.moe.targets(p)
    inter = layer.intermediate
    if c.traits.fused_checkpoint:  # Phi-3: already [gate; up]
        targets: _Targets = {
            f"{p}mlp.gate_up_proj.weight": (layer.gate_up_weight, (2 * inter, c.hidden_size))
        }
    else:
        targets = {
            f"{p}mlp.gate_proj.weight": (layer.gate_up_weight[:inter], (inter, c.hidden_size)),
            f"{p}mlp.up_proj.weight": (layer.gate_up_weight[inter:], (inter, c.hidden_size)),
        }
    if layer.down_weight is not None:
        targets[f"{p}mlp.down_proj.weight"] = (layer.down_weight, (c.hidden_size, inter))
    return targets


def _norm_targets(p: str, layer: _DecoderLayer, c: ModelConfig) -> _Targets:
    """A layer's RMS norms: before attention and the MLP, and Gemma's after each."""
    hidden = (c.hidden_size,)
    targets: _Targets = {f"{p}input_layernorm.weight": (layer.input_norm, hidden)}
    if layer.attn_out_norm is not None and layer.mlp_out_norm is not None:
        targets[f"{p}pre_feedforward_layernorm.weight"] = (layer.post_norm, hidden)
        targets[f"{p}post_attention_layernorm.weight"] = (layer.attn_out_norm, hidden)
        targets[f"{p}post_feedforward_layernorm.weight"] = (layer.mlp_out_norm, hidden)
    else:
        targets[f"{p}post_attention_layernorm.weight"] = (layer.post_norm, hidden)
    return targets
