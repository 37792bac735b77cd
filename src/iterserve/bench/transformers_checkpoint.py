"""A loaded GGUF file as the transformers model of its family, for the `transformers` peer.

iterserve's GGUF loader gives a ModelConfig and HF-named weights (Gemma's norms back to HF's
values, Llama's Q/K rows un-permuted). Written out as config.json + safetensors, transformers
loads them with `AutoModelForCausalLM.from_pretrained`, which applies its own checkpoint
conversions (e.g. Mixtral's per-expert tensors into its fused expert layout): any family
iterserve loads from GGUF, with both engines then running bit-identical weights.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from iterserve.model.config import (
    GRANITE_FAMILIES,
    GRANITE_MULTIPLIERS,
    LFM2_FAMILIES,
    ModelConfig,
)
from iterserve.model.loader import lfm2_checkpoint_name

# ModelConfig.architecture -> (HF architectures entry, HF model_type).
HF_CLASSES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "ministral3": ("Ministral3ForCausalLM", "ministral3"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3"),
    "granite": ("GraniteForCausalLM", "granite"),
    "granitemoe": ("GraniteMoeForCausalLM", "granitemoe"),
    "olmoe": ("OlmoeForCausalLM", "olmoe"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
    "olmo3": ("Olmo3ForCausalLM", "olmo3"),
    "exaone4": ("Exaone4ForCausalLM", "exaone4"),
    "lfm2": ("Lfm2ForCausalLM", "lfm2"),
    "lfm2_moe": ("Lfm2MoeForCausalLM", "lfm2_moe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "gpt_oss": ("GptOssForCausalLM", "gpt_oss"),
}


def hf_config_json(config: ModelConfig) -> dict[str, Any]:
    """config.json (transformers 5 spelling) for `config`'s family.

    A GGUF's `rope_freqs` (Llama 3.1+) has no transformers rope type: the model is written
    with default rope and `apply_freq_factors` divides its frequencies afterwards.
    """
    architecture, model_type = HF_CLASSES[config.architecture]
    rope: dict[str, Any] = dict(config.rope_scaling or {"rope_type": "default"})
    if rope.get("rope_type") == "freq_factors":
        rope = {"rope_type": "default"}
    rope["rope_theta"] = config.rope_theta
    if config.query_temperature is not None:  # Ministral 3
        rope["llama_4_scaling_beta"], original = config.query_temperature
        rope.setdefault("original_max_position_embeddings", original)
    if config.rotary_dim is not None:  # Phi-4-mini
        rope["partial_rotary_factor"] = config.rotary_dim / config.head_dim
    raw: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) or None,
        # Not Phi-3's default 32000, out of range of a smaller vocabulary (the peer pads
        # with the generation config's pad or EOS id).
        "pad_token_id": None,
        "rope_parameters": rope,
        "sliding_window": config.sliding_window,
    }
    if "original_max_position_embeddings" in rope:  # Phi-3 reads it from the top level
        raw["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if config.rope_layers is not None and config.architecture == "smollm3":
        # SmolLM3: 1 where a layer rotates, despite the name (EXAONE 4.0's follow its windows)
        raw["no_rope_layers"] = [int(rotates) for rotates in config.rope_layers]
    if config.architecture in GRANITE_FAMILIES:
        for name in GRANITE_MULTIPLIERS:
            raw[name] = getattr(config, name)
    if config.num_local_experts:
        raw["num_local_experts"] = config.num_local_experts
        raw["num_experts_per_tok"] = config.num_experts_per_tok
    if config.architecture in ("qwen3_moe", "qwen2_moe"):  # intermediate_size is dense MLPs'
        raw["num_experts"] = config.num_local_experts
        raw["moe_intermediate_size"] = config.intermediate_size
        raw["norm_topk_prob"] = config.norm_topk_prob
    if config.architecture == "qwen2_moe":
        raw["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
        raw["qkv_bias"] = config.attention_bias
    if config.architecture == "olmoe":
        raw["num_experts"] = config.num_local_experts
        raw["norm_topk_prob"] = config.norm_topk_prob
    if config.architecture == "lfm2_moe":  # intermediate_size is its leading dense layers'
        raw["num_experts"] = config.num_local_experts
        raw["norm_topk_prob"] = config.norm_topk_prob
        raw["moe_intermediate_size"] = config.intermediate_size
        raw["intermediate_size"] = config.dense_intermediate_size
        raw["num_dense_layers"] = config.leading_dense_layers
        raw["use_expert_bias"] = config.expert_selection_bias
        raw["routed_scaling_factor"] = config.routed_scaling_factor
    if config.architecture in ("gemma2", "gemma3", "gpt_oss", "olmo3", "exaone4"):
        windows = config.sliding_window_layers or (True,) * config.num_hidden_layers
        raw["layer_types"] = [
            "sliding_attention" if sliding else "full_attention" for sliding in windows
        ]
    if config.conv_layers is not None:  # LFM2; its MLP's width as loaded, not to adjust
        raw["layer_types"] = ["conv" if c else "full_attention" for c in config.conv_layers]
        raw["conv_L_cache"] = config.conv_kernel
        raw["norm_eps"] = config.rms_norm_eps
        raw["block_auto_adjust_ff_dim"] = False
    if config.architecture in ("gemma2", "gemma3"):
        raw["query_pre_attn_scalar"] = config.query_pre_attn_scalar or config.head_dim
        raw["attn_logit_softcapping"] = config.attn_logit_softcapping
        raw["final_logit_softcapping"] = config.final_logit_softcapping
        raw["hidden_activation"] = "gelu_pytorch_tanh"
    if config.swiglu_clamp is not None:  # gpt-oss
        raw["swiglu_alpha"], raw["swiglu_limit"] = config.swiglu_clamp
    if config.local_rope_theta is not None:  # Gemma 3, OLMo 3: rope per layer type
        raw["rope_parameters"] = {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": config.local_rope_theta},
        }
    return raw


def from_loaded(
    config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> Any:
    """The transformers model of `config`'s family holding `weights` (HF names).

    Passes through a temporary directory: from_pretrained is what knows each family's
    checkpoint-to-module conversions. Costs one copy of the weights on disk, briefly."""
    from transformers import AutoModelForCausalLM

    tensors = {}
    for name, tensor in weights.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        tensor = tensor.contiguous()
        if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()  # a view into a stack (GGUF experts): safetensors wants its own
        tensors[name] = tensor
    if config.architecture == "gpt_oss":
        tensors = gpt_oss_stacks(tensors, config.num_hidden_layers, config.num_local_experts)
    if config.architecture == "granitemoe":
        tensors = granite_moe_stacks(tensors, config.num_hidden_layers, config.num_local_experts)
    if config.architecture in LFM2_FAMILIES:
        tensors = {lfm2_checkpoint_name(name): tensor for name, tensor in tensors.items()}
    with tempfile.TemporaryDirectory(prefix="iterserve-peer-") as directory:
        path = Path(directory)
        (path / "config.json").write_text(json.dumps(hf_config_json(config)))
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    if config.rope_scaling and config.rope_scaling.get("rope_type") == "freq_factors":
        apply_freq_factors(model, config.rope_scaling["freq_factors"])
    return model


def gpt_oss_stacks(
    tensors: Mapping[str, torch.Tensor], layers: int, experts: int
) -> dict[str, torch.Tensor]:
    """gpt-oss's per-expert tensors (as iterserve's loaders name them) back in its
    checkpoint's stacks: gate_up_proj [experts, hidden, 2 x width] with gate and up
    interleaved, down_proj [experts, width, hidden], and their biases."""
    out = dict(tensors)
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp.experts"

        def take(projection: str, kind: str, prefix: str = prefix) -> torch.Tensor:
            return torch.stack(
                [out.pop(f"{prefix}.{e}.{projection}.{kind}") for e in range(experts)]
            )

        for kind, suffix in (("weight", ""), ("bias", "_bias")):
            gate, up, down = (take(p, kind) for p in ("gate_proj", "up_proj", "down_proj"))
            if kind == "weight":  # [experts, outputs, inputs] -> [experts, inputs, outputs]
                gate, up, down = (t.transpose(1, 2) for t in (gate, up, down))
            out[f"{prefix}.gate_up_proj{suffix}"] = (
                torch.stack((gate, up), dim=-1).flatten(-2).contiguous()
            )
            out[f"{prefix}.down_proj{suffix}"] = down.contiguous()
    return out


def granite_moe_stacks(
    tensors: Mapping[str, torch.Tensor], layers: int, experts: int
) -> dict[str, torch.Tensor]:
    """Granite MoE's per-expert tensors (as iterserve's loaders name them) back in its
    checkpoint's stacks: input_linear [experts, 2 x width, hidden] (gate's rows, then up's)
    and output_linear [experts, hidden, width]."""
    out = dict(tensors)
    for layer in range(layers):
        prefix = f"model.layers.{layer}.block_sparse_moe"

        def take(projection: str, prefix: str = prefix) -> torch.Tensor:
            return torch.stack(
                [out.pop(f"{prefix}.experts.{e}.{projection}.weight") for e in range(experts)]
            )

        gate, up, down = (take(p) for p in ("gate_proj", "up_proj", "down_proj"))
        out[f"{prefix}.input_linear.weight"] = torch.cat((gate, up), dim=1).contiguous()
        out[f"{prefix}.output_linear.weight"] = down.contiguous()
    return out


def apply_freq_factors(model: Any, factors: list[float]) -> None:
    """llama.cpp's Llama 3 scaling on a default-rope transformers model: each frequency
    divided by its factor (what transformers' llama3 rope type computes from its parameters)."""
    rotary = model.model.rotary_emb
    divisors = torch.tensor(factors, dtype=rotary.inv_freq.dtype, device=rotary.inv_freq.device)
    rotary.inv_freq = rotary.inv_freq / divisors
    rotary.original_inv_freq = rotary.inv_freq
