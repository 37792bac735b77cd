"""Tiny random Hugging Face checkpoints, built here and never downloaded: the one builder
every test that needs a model uses, and the ModelConfig a test derives from one by hand
(independently of the loader it may be testing)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

from iterserve.model.config import ModelConfig
from iterserve.model.rope import served_rope

# The default shape; a test overrides what it needs (vocab_size always: it follows the
# tokenizer the test pairs the model with).
TINY_SHAPE: dict[str, object] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

_ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
    "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM),
    "granitemoehybrid": (
        transformers.GraniteMoeHybridConfig,
        transformers.GraniteMoeHybridForCausalLM,
    ),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
    "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM),
    "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM),
    "lfm2_moe": (transformers.Lfm2MoeConfig, transformers.Lfm2MoeForCausalLM),
    "ministral3": (transformers.Ministral3Config, transformers.Ministral3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    # A reranker as transformers saves one: a classifier head (score.weight), no LM head.
    "qwen3_classifier": (transformers.Qwen3Config, transformers.Qwen3ForSequenceClassification),
}


def tiny_hf_model(
    kind: str = "llama", *, vocab_size: int, weight_std: float | None = None, **overrides: object
) -> transformers.PreTrainedModel:
    """A tiny random model in eval mode, seeded: the same arguments give the same weights.

    `weight_std`: draw every weight afresh, norms uniform in [0.7, 1.3] and the rest normal
    with this deviation, so biases and norms are non-trivial too (HF initialises them to
    0 and 1, which would hide a bias or norm applied wrongly)."""
    config_class, model_class = _ARCHITECTURES[kind]
    torch.manual_seed(0)
    model = model_class(config_class(**{**TINY_SHAPE, "vocab_size": vocab_size, **overrides}))
    if weight_std is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(0.7, 1.3)
                else:
                    param.normal_(0.0, weight_std)
    return model.eval()


def save_checkpoint(
    model: transformers.PreTrainedModel,
    out: Path,
    tokenizer: Path | transformers.PreTrainedTokenizerBase,
    **save_kw: object,
) -> Path:
    """`model` as an HF directory (config.json + safetensors; `save_kw` go to
    save_pretrained) with a tokenizer: one to save, or a directory of its files to copy."""
    model.save_pretrained(out, **save_kw)
    if isinstance(tokenizer, Path):
        for item in tokenizer.iterdir():
            shutil.copy(item, out / item.name)
    else:
        tokenizer.save_pretrained(out)
    return out


def model_config_of(hf: transformers.PreTrainedModel) -> ModelConfig:
    """The ModelConfig of an HF model, read from its config object by hand (the rope dict
    through rope.served_rope, which says how far a scaled rope is served)."""
    c = hf.config
    rope_scaling, positions = served_rope(
        c.rope_parameters,
        c.max_position_embeddings,
        getattr(c, "original_max_position_embeddings", None),
    )
    named = ("qwen2", "mistral", "mixtral", "qwen3", "qwen3_moe", "qwen2_moe", "olmoe", "phi3")
    arch = c.model_type if c.model_type in named else "llama"
    return ModelConfig(
        architecture=arch,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        # Qwen3-MoE's own name for an expert's width (Mixtral's is intermediate_size).
        intermediate_size=getattr(c, "moe_intermediate_size", c.intermediate_size),
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_parameters["rope_theta"],
        max_position_embeddings=positions,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=arch == "qwen2"
        or bool(getattr(c, "attention_bias", False) or getattr(c, "qkv_bias", False)),
        rope_scaling=rope_scaling,
        sliding_window=getattr(c, "sliding_window", None)
        if arch in ("mistral", "mixtral", "phi3")
        else None,
        num_local_experts=getattr(c, "num_local_experts", 0) or getattr(c, "num_experts", 0),
        num_experts_per_tok=getattr(c, "num_experts_per_tok", 0),
        norm_topk_prob=getattr(c, "norm_topk_prob", True),
        shared_expert_intermediate_size=getattr(c, "shared_expert_intermediate_size", 0),
    )


@torch.inference_mode()
def hf_token_by_token(
    hf: transformers.PreTrainedModel, tokens: list[int], prompt: int
) -> torch.Tensor:
    """transformers' fp32 logits of every position: the first `prompt` tokens in one forward,
    then one token per forward over its KV cache (how it generates; longrope and dynamic NTK
    rotate differently in one long forward, model/rope.py)."""
    out = hf(torch.tensor([tokens[:prompt]]), use_cache=True)
    rows, cache = [out.logits[0]], out.past_key_values
    for p in range(prompt, len(tokens)):
        out = hf(torch.tensor([[tokens[p]]]), cache=cache, use_cache=True)
        rows.append(out.logits[0])
        cache = out.past_key_values
    return torch.cat(rows).float()
