"""What sets each model family's network apart from Llama's, as small named traits.

model/llama.py is one decoder for every family; each trait below switches one part of it.
A family's quirks are documented here, next to its traits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class FamilyTraits:
    # RMS norm over each head's q and k (weights [head_dim], shared by the heads), applied
    # before rope. Qwen3.
    qk_norm: bool = False
    # With qk_norm: q's heads normed together (weights [heads x head_dim]) and k's together,
    # rather than head by head. OLMo 2, OLMoE.
    qk_norm_whole: bool = False
    # With attention_bias: whether o_proj has a bias too (Llama) or only q/k/v do (Qwen2).
    o_proj_bias: bool = True
    # The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, in the
    # row order iterserve fuses them in anyway ([q; k; v], [gate; up]): they load as they are.
    # Phi-3/3.5.
    fused_checkpoint: bool = False
    # Norms scale by (1 + weight) (Gemma); iterserve adds the 1 when it loads them.
    norm_offset: bool = False
    # "Sandwich" norms: the attention and MLP outputs are normed before their residual adds
    # (Gemma 2/3). HF calls them post_attention_layernorm and post_feedforward_layernorm, and
    # the pre-MLP norm pre_feedforward_layernorm (Llama's post_attention_layernorm).
    sandwich_norms: bool = False
    # The attention's and the MLP's inputs RMS-normed (every family but OLMo 2, which norms
    # only their outputs: its sandwich norms without the bread's first slice).
    pre_norms: bool = True
    # The gated MLP's activation: SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, Gemma).
    activation: Literal["silu", "gelu_tanh"] = "silu"
    # Token embeddings times sqrt(hidden_size), rounded to the model dtype first (Gemma).
    embed_scale: bool = False
    # A learned logit per query head that joins every softmax of attention and takes its
    # share of the probability with no value behind it ("attention sinks", gpt-oss).
    attention_sinks: bool = False
    # The router and every expert projection have biases (gpt-oss).
    expert_biases: bool = False
    # The shared expert's output scaled by a sigmoid of a learned row times the token
    # (Qwen2-MoE's shared_expert_gate; model/shared_expert.py).
    shared_expert_gate: bool = False
    # V RMS-normed over each head, without a weight, before it is stored (Gemma 4).
    value_norm: bool = False
    # Each layer's output times a learned scalar of its own (`layer_scalar`, Gemma 4).
    layer_scalar: bool = False


FAMILIES: dict[str, FamilyTraits] = {
    # Llama 2/3, SmolLM; Mistral is Llama plus an optional sliding window (ModelConfig).
    "llama": FamilyTraits(),
    "mistral": FamilyTraits(),
    # Ministral 3 (3B, 8B, 14B): Mistral with YaRN and Llama 4's attention temperature, each
    # query scaled by its position past the original context (ModelConfig.query_temperature).
    "ministral3": FamilyTraits(),
    # Mixtral: Mistral with a sparse mixture-of-experts MLP (ModelConfig.num_local_experts;
    # model/moe.py).
    "mixtral": FamilyTraits(),
    # Qwen2: q/k/v always biased, o_proj never; no config flag says so.
    "qwen2": FamilyTraits(o_proj_bias=False),
    # Qwen3 (dense): Qwen2 without the biases, plus q/k norms; head_dim is set explicitly
    # (128 in the released models, not hidden_size / heads).
    "qwen3": FamilyTraits(qk_norm=True),
    # Qwen3-MoE: Qwen3 with a sparse mixture-of-experts MLP on every layer (model/moe.py;
    # Qwen3-30B-A3B: 128 experts of 768, 8 a token).
    "qwen3_moe": FamilyTraits(qk_norm=True),
    # OLMo 2: Llama's projections with q and k each normed whole (over all their heads), and
    # norms on the attention's and the MLP's outputs only (HF's post_attention_layernorm and
    # post_feedforward_layernorm), none on their inputs.
    "olmo2": FamilyTraits(qk_norm=True, qk_norm_whole=True, sandwich_norms=True, pre_norms=False),
    # OLMo 3: OLMo 2's layer; three layers in four attend through a window and rotate by plain
    # RoPE, the fourth attends fully and takes the model's RoPE scaling (ModelConfig's
    # sliding_window_layers and local_rope_theta, as Gemma 3's).
    "olmo3": FamilyTraits(qk_norm=True, qk_norm_whole=True, sandwich_norms=True, pre_norms=False),
    # EXAONE 4.0: OLMo 2's norms (on the blocks' outputs only) with Qwen3's per-head q/k
    # norms; where the config has a window, three layers in four attend through it and only
    # those rotate (the full layers take no RoPE: ModelConfig's rope_layers).
    "exaone4": FamilyTraits(qk_norm=True, sandwich_norms=True, pre_norms=False),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biased, o not)
    # and, on every layer, a sparse mixture of experts beside a shared expert whose output a
    # sigmoid gate scales (ModelConfig.shared_expert_intermediate_size).
    "qwen2_moe": FamilyTraits(o_proj_bias=False, shared_expert_gate=True),
    # OLMoE (1B-7B): Llama's layer with q and k each normed whole (over all their heads),
    # and a sparse mixture of experts on every layer named as Qwen3-MoE's (64 experts of 1024,
    # 8 a token, the top-k weights not renormalised).
    "olmoe": FamilyTraits(qk_norm=True, qk_norm_whole=True),
    # gpt-oss: q/k/v/o biases, attention sinks, a 128-token window on every other layer, YaRN,
    # and a mixture of experts whose router and projections are biased and whose SwiGLU is
    # clamped (ModelConfig.swiglu_clamp); its checkpoint stacks each layer's experts and
    # interleaves gate and up (model/loader.py unstacks them).
    "gpt_oss": FamilyTraits(attention_sinks=True, expert_biases=True),
    # LFM2 (350M-2.6B): Qwen3's per-head q/k norms on its attention layers; most layers mix
    # tokens by a short gated convolution instead (ModelConfig.conv_layers,
    # model/short_conv.py).
    "lfm2": FamilyTraits(qk_norm=True),
    # LFM2-MoE (LFM2-8B-A1B): LFM2's layers with a sparse mixture of experts past two leading
    # dense MLPs (ModelConfig.leading_dense_layers), routed by sigmoid scores with a selection
    # bias (ModelConfig.router_scoring, expert_selection_bias).
    "lfm2_moe": FamilyTraits(qk_norm=True),
    # Granite 3.x: Llama with four multipliers (ModelConfig: embeddings, each block's output
    # before its residual add, the attention scale, the logits' divisor).
    "granite": FamilyTraits(),
    # Granite MoE (Granite 3.x 1B-A400M, 3B-A800M): Granite's multipliers and a sparse
    # mixture of experts on every layer (model/moe.py), its router a softmax over the top-k
    # logits; the checkpoint stacks each layer's experts (model/loader.py unstacks them).
    "granitemoe": FamilyTraits(),
    # SmolLM3: Llama whose every fourth layer attends without RoPE ("NoPE": ModelConfig's
    # rope_layers).
    "smollm3": FamilyTraits(),
    # Phi-3/3.5: Llama with fused checkpoint projections, usually longrope scaling
    # (model/rope.py) and, for the 4k models, a sliding window of 2047 on every layer.
    "phi3": FamilyTraits(fused_checkpoint=True),
    # Gemma 2: GeGLU, (1 + w) norms, sandwich norms, scaled embeddings, attention scale from
    # query_pre_attn_scalar, attention and final logit soft-caps, a sliding window on every
    # other layer (ModelConfig has the numbers). head_dim 256 in the released models.
    "gemma2": FamilyTraits(
        norm_offset=True, sandwich_norms=True, activation="gelu_tanh", embed_scale=True
    ),
    # Gemma 3 (text): Gemma 2 without soft-caps, plus q/k norms, five sliding layers to one
    # full, and a separate RoPE base for the sliding layers (local_rope_theta).
    "gemma3": FamilyTraits(
        qk_norm=True,
        norm_offset=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=True,
    ),
    # Gemma 4 (text): Gemma 3's layer with plain-weight norms (no 1 + w), a weightless norm on V,
    # attention unscaled (its q/k norms set the scale), a learned scalar on each layer's
    # output; its full layers have heads of their own size and count, keys that may serve as
    # values, and RoPE over a quarter of each head ("proportional"); E2B and E4B add per-layer
    # embeddings and layers that share earlier layers' K/V (ModelConfig's full_*, kv_shared_*,
    # per_layer_* fields).
    "gemma4": FamilyTraits(
        qk_norm=True,
        sandwich_norms=True,
        activation="gelu_tanh",
        embed_scale=True,
        value_norm=True,
        layer_scalar=True,
    ),
}
