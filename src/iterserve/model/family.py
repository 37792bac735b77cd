"""What sets each model family's network apart from Llama's, as small named traits.

model/llama.py is one decoder for every family; each trait below switches one part of it.
A family's quirks are documented here, next to its traits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyTraits:
    # RMS norm over each head's q and k (weights [head_dim], shared by the heads), applied
    # before rope. Qwen3.
    qk_norm: bool = False
    # With attention_bias: whether o_proj has a bias too (Llama) or only q/k/v do (Qwen2).
    o_proj_bias: bool = True
    # The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, in the
    # row order iterserve fuses them in anyway ([q; k; v], [gate; up]): they load as they are.
    # Phi-3/3.5.
    fused_checkpoint: bool = False


FAMILIES: dict[str, FamilyTraits] = {
    # Llama 2/3, SmolLM; Mistral is Llama plus an optional sliding window (ModelConfig).
    "llama": FamilyTraits(),
    "mistral": FamilyTraits(),
    # Qwen2: q/k/v always biased, o_proj never; no config flag says so.
    "qwen2": FamilyTraits(o_proj_bias=False),
    # Qwen3 (dense): Qwen2 without the biases, plus q/k norms; head_dim is set explicitly
    # (128 in the released models, not hidden_size / heads).
    "qwen3": FamilyTraits(qk_norm=True),
    # Phi-3/3.5: Llama with fused checkpoint projections, usually longrope scaling
    # (model/rope.py) and, for the 4k models, a sliding window of 2047 on every layer.
    "phi3": FamilyTraits(fused_checkpoint=True),
}
