"""Checkpoint on disk -> LoadedModel: dispatch by format, and the HF safetensors directory."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from iterserve.model.config import (
    GRANITE_FAMILIES,
    GRANITE_MULTIPLIERS,
    LFM2_FAMILIES,
    ModelConfig,
    rope_every_layer_but,
)
from iterserve.model.errors import ModelLoadError
from iterserve.model.gguf_parts import model_file
from iterserve.model.image_encoders import load_image_encoder
from iterserve.model.lazy_weights import LazyWeights
from iterserve.model.loaded import LoadedModel
from iterserve.model.model_source import find_model
from iterserve.model.rope import UnsupportedRope, rope_type_of, rotary_dims, served_rope
from iterserve.model.safetensors_file import StoredTensor, stored_tensors
from iterserve.model.safetensors_mxfp4 import gpt_oss_mxfp4_experts, is_mxfp4_tensor
from iterserve.model.tokenizer import chat_template_of, load_hf_tokenizer
from iterserve.sampling_defaults import SamplingDefaults

if TYPE_CHECKING:
    from iterserve.model.gguf_blocks import QuantizedBlocks

# HF `architectures` entries (and their `model_type`s) that the Llama implementation runs.
SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Ministral3ForCausalLM": "ministral3",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "GraniteMoeForCausalLM": "granitemoe",
    # Granite 4.0's class; only its models without Mamba layers or experts (granite-4.0-micro):
    # Granite 3's network, its MLP under other names (_granite4_fields).
    "GraniteMoeHybridForCausalLM": "granite",
    "OlmoeForCausalLM": "olmoe",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Exaone4ForCausalLM": "exaone4",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "GptOssForCausalLM": "gpt_oss",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",  # text only (model_type gemma3_text)
    "Gemma4ForCausalLM": "gemma4",  # text only (model_type gemma4_text)
}
# The same networks saved without their LM head, as sentence-transformers saves an
# embedding model (Qwen3-Embedding: Qwen3Model): weights named without `model.`, and the
# head tied to the embeddings so the network is whole (an embedding never runs it).
BARE_HF_ARCHITECTURES = {
    name.removesuffix("ForCausalLM") + "Model": family
    for name, family in SUPPORTED_HF_ARCHITECTURES.items()
}
# The same networks with a classifier head (`score.weight`, no LM head) instead, as
# transformers saves a reranker (Qwen3-Reranker converted to one, as vLLM's docs do): served as
# scoring models (model/score_head.py), the head tied to the embeddings so the network is
# whole (a score never runs it).
CLASSIFIER_HF_ARCHITECTURES = {
    name.removesuffix("ForCausalLM") + "ForSequenceClassification": family
    for name, family in SUPPORTED_HF_ARCHITECTURES.items()
}
# Mixture-of-experts families whose routing or experts model/moe.py does not reproduce
# (Granite's ungated shared expert, grouped routing, latent attention): refused by name.
_UNSUPPORTED_MOE = {
    "GraniteMoeSharedForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
}
# Families whose sliding_window is used as it stands (Qwen's is refused above).
_WINDOWED = (
    "mistral",
    "ministral3",
    "mixtral",
    "phi3",
    "gemma2",
    "gemma3",
    "gemma4",
    "gpt_oss",
    "olmo3",
    "exaone4",
)
_GEMMA_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer attends fully
_OLMO3_WINDOW_PATTERN = 4
_EXAONE4_WINDOW_PATTERN = 4  # "LLLG": three windowed (local) layers, then a full (global) one
_EXAONE4_LAYER_TYPES = {"L": "sliding_attention", "G": "full_attention"}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_model(
    spec: str | Path | None, dtype: torch.dtype = torch.bfloat16, revision: str | None = None
) -> LoadedModel:
    """Load an HF directory (config.json + safetensors) or a GGUF file, or either from the
    local Hugging Face cache by its repository, at `revision` (model/model_source.py); None
    is the bundled model."""
    source = find_model(spec, revision)
    loaded = _load_path(source.path, dtype)
    if source.sampling:
        try:
            defaults = loaded.sampling_defaults.with_overrides(source.sampling)
        except ValueError as error:
            raise ModelLoadError(f"model {spec}'s sampling settings: {error}") from None
        loaded = dataclasses.replace(loaded, sampling_defaults=defaults)
    if source.projector is not None and loaded.projector_file is None:
        loaded = dataclasses.replace(loaded, projector_file=source.projector)
    # A repository is served by the name it was given, as vLLM's default served name is.
    return dataclasses.replace(loaded, name=source.name) if source.name else loaded


def _load_path(path: Path, dtype: torch.dtype) -> LoadedModel:
    if path.is_dir() and not (path / "config.json").exists():
        if (gguf := model_file(path)) is None:
            ggufs = sorted(path.glob("*.gguf"))
            found = f"several GGUF files ({', '.join(p.name for p in ggufs)})" if ggufs else "none"
            raise ModelLoadError(
                f"{path} has no config.json, so it is not an HF model directory, and it holds "
                f"{found} where one GGUF model (a file, or the parts of a split one) would do; "
                "pass a file or a directory with config.json"
            )
        path = gguf
    if path.is_file():
        # Deferred: only GGUF files need the gguf package.
        from iterserve.model.gguf_loader import load_gguf

        return load_gguf(path, dtype)
    return load_hf_directory(path, dtype)


def load_hf_directory(directory: Path, dtype: torch.dtype) -> LoadedModel:
    whole = raw = _read_json(directory / "config.json")
    multimodal = (text := text_model_config(raw)) is not None
    raw = text or raw
    generation = _read_optional_json(directory / "generation_config.json")
    config = hf_model_config(raw, generation)
    bare = is_bare_model(raw)
    if bare or is_classifier(raw):
        config = dataclasses.replace(config, tie_word_embeddings=True)
    gpt_oss = config.architecture == "gpt_oss"
    shards = _shards(directory)
    stacks = _EXPERT_STACKS.get(config.architecture)
    if raw.get("model_type") == _GRANITE4:
        stacks = _granite4_mlp
    rename = _lfm2_name if config.architecture in LFM2_FAMILIES else None
    if multimodal:
        rename = _text_model_name
    weights = _load_safetensors(
        directory, shards, dtype, "model." if bare else "", stacks, gpt_oss, rename
    )
    quantized: dict[str, QuantizedBlocks] = {}
    if gpt_oss:  # OpenAI's own checkpoints keep the experts in MXFP4: run from their blocks
        quantized.update(gpt_oss_mxfp4_experts([directory / shard for shard in shards]))
    for name, blocks in quantized.items():
        weights.add(name, blocks.shape, functools.partial(_dequantized, blocks, dtype))
    if config.tie_word_embeddings:
        weights.discard("lm_head.weight")
    elif "lm_head.weight" not in weights:
        raise ModelLoadError(
            f"{directory}: config.json says the embeddings are not tied, but no lm_head.weight "
            "is among the weights"
        )
    if not any((directory / name).exists() for name in _TOKENIZER_FILES):
        # Otherwise transformers reports it cannot "instantiate the backend tokenizer".
        raise ModelLoadError(
            f"{directory} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
            "save the tokenizer next to the model"
        )
    try:
        tokenizer = load_hf_tokenizer(directory)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{directory}: cannot load the tokenizer: {error}") from error
    labels = raw.get("id2label") or {}
    images = load_image_encoder(directory, whole, tokenizer, dtype) if multimodal else None
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        chat_template=chat_template_of(tokenizer),
        name=directory.resolve().name,
        quantized=dict(quantized),
        classifier_labels=[str(labels[k]) for k in sorted(labels, key=int)] or None,
        sampling_defaults=SamplingDefaults.from_generation_config(generation),
        images=images,
    )


# Multimodal checkpoints whose language model is a family here, by their text config's
# model_type: the class it is read as. The language model is read here; a family's vision
# tower and projector, where images are read (model/images.py), by its own module.
_MULTIMODAL = (
    "Gemma3ForConditionalGeneration",
    "Gemma4ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
)
_TEXT_MODELS = {
    "gemma3_text": "Gemma3ForCausalLM",  # Gemma 3 4B, 12B, 27B
    "gemma4_text": "Gemma4ForCausalLM",  # Gemma 4 E2B, E4B, 31B
    "ministral3": "Ministral3ForCausalLM",  # Ministral 3 (3B, 8B, 14B)
    "mistral": "MistralForCausalLM",  # Mistral Small 3.1, 3.2
    # Qwen3-VL (2B-32B): Qwen3's layers rotated by M-RoPE, whose three position components
    # (time, height, width) are all the token's position for text, which is plain RoPE;
    # an image's tokens turn by their grid positions (ModelConfig.mrope_section).
    "qwen3_vl_text": "Qwen3ForCausalLM",
    # Qwen2.5-VL (3B, 7B, 32B, 72B): Qwen2's layers, M-RoPE's frequencies a run each.
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
}
# M-RoPE's fields, taken out of the rope dict to the text config's own keys (see above);
# Qwen2.5-VL's released configs name the rope's type "mrope", which is plain RoPE for text.
_MROPE_FIELDS = ("mrope_section", "mrope_interleaved")
_MROPE_TYPES = ("mrope",)
# How transformers turns each family's images whatever its config says: the split it takes
# unless given, and whether the three positions take turns among the frequencies.
_MROPE_DEFAULTS = {"qwen3_vl_text": ([24, 20, 20], True), "qwen2_5_vl_text": ([16, 24, 24], False)}
# Where such a checkpoint keeps its language model's tensors (transformers 4.5x and the
# released files: language_model.model.*, language_model.lm_head; transformers 5 in memory:
# model.language_model.*), and the names they are read under.
_TEXT_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("lm_head.", "lm_head."),
    # Qwen2.5-VL's released files: the language model's under the text model's own names.
    ("model.layers.", "model.layers."),
    ("model.embed_tokens.", "model.embed_tokens."),
    ("model.norm.", "model.norm."),
)


def text_model_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    """A multimodal checkpoint's config.json as its language model's own (its text_config,
    named as the text model's class; the embeddings tied as the whole model says), or None
    for any other checkpoint."""
    names = raw.get("architectures") or []
    if not (found := [name for name in names if name in _MULTIMODAL]):
        return None
    text = dict(raw.get("text_config") or {})
    model = _TEXT_MODELS.get(text.get("model_type", ""))
    if model is None:
        raise ModelLoadError(
            f"{found[0]} whose language model is {text.get('model_type')!r} is not supported; "
            f"supported: {', '.join(_TEXT_MODELS)}"
        )
    if "tie_word_embeddings" in raw:  # the whole model's, which ties its head
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(rope := text.get(key), dict):
            text[key] = {k: v for k, v in rope.items() if k not in _MROPE_FIELDS}
            text |= {k: v for k, v in rope.items() if k in _MROPE_FIELDS}
            for kind in ("type", "rope_type"):
                if text[key].get(kind) in _MROPE_TYPES:
                    text[key][kind] = "default"
    if (mrope := _MROPE_DEFAULTS.get(text.get("model_type", ""))) is not None:
        text.setdefault("mrope_section", mrope[0])
        text["mrope_interleaved"] = mrope[1]
    return {**text, "architectures": [model]}


def _text_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under its language model's name; None for the rest."""
    for theirs, ours in _TEXT_MODEL_PREFIXES:
        if name.startswith(theirs):
            return ours + name.removeprefix(theirs)
    return None


def _dequantized(blocks: QuantizedBlocks, dtype: torch.dtype) -> torch.Tensor:
    return blocks.dequantize().to(dtype)


def hf_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """ModelConfig from config.json, in both the transformers 4 and 5 spellings of RoPE."""
    architecture = _hf_architecture(raw)
    # transformers 5 writes `rope_parameters` = {"rope_type", "rope_theta", scaling fields...};
    # earlier versions write `rope_theta` and an optional `rope_scaling` dict.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    gemma = _gemma_fields(architecture, raw, rope) if architecture in _GEMMA_WINDOW_PATTERN else {}
    experts = _hf_experts(architecture, raw)
    extra = _lfm2_fields(architecture, raw) | _granite4_fields(raw)
    extra |= _gemma4_fields(architecture, raw, rope)
    extra |= _query_temperature(architecture, raw, rope)
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or hidden // heads
    rotary_dim = _hf_rotary_dim(architecture, raw, rope, head_dim)
    rope_theta, rope_scaling, max_positions = _hf_rope(architecture, raw, rope)
    # Llama 3 instruct models list their end-of-turn token only in generation_config.json.
    eos_ids = [*_as_ids(raw.get("eos_token_id")), *_as_ids((generation or {}).get("eos_token_id"))]
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=experts.pop("intermediate_size", None)
        or extra.pop("intermediate_size", None)
        or raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_layers=_hf_rope_layers(architecture, raw),
        **_hf_multipliers(architecture, raw),
        rms_norm_eps=float(raw.get("rms_norm_eps", raw.get("norm_eps", 1e-6))),
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        # LFM2's own configs say tie_embedding (true), its config class's default.
        tie_word_embeddings=bool(
            raw.get(
                "tie_word_embeddings",
                raw.get("tie_embedding", architecture in LFM2_FAMILIES),
            )
        ),
        # Qwen2 always has q/k/v biases and its config has no flag for them; Qwen2-MoE's
        # says so in qkv_bias (true unless said otherwise).
        attention_bias=architecture == "qwen2"
        or (architecture == "qwen2_moe" and bool(raw.get("qkv_bias", True)))
        or bool(raw.get("attention_bias", False)),
        rope_scaling=rope_scaling,
        # Mistral, Mixtral and Phi-3 window every layer alike (Qwen's per-layer windows are
        # refused).
        sliding_window=raw.get("sliding_window") if architecture in _WINDOWED else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        **experts,
        **gemma,
        **_gpt_oss_fields(architecture, raw),
        **_olmo3_fields(architecture, raw, rope),
        **_exaone4_fields(architecture, raw),
        **_mrope_fields(raw),
        **extra,
    )


def _mrope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """M-RoPE's split of a head's frequencies, where a multimodal checkpoint's text config
    holds it (text_model_config)."""
    section = raw.get("mrope_section")
    if not section:
        return {}
    if len(section) != 3:
        raise ModelLoadError(f"mrope_section {section!r}: three counts are read (t, h, w)")
    return {
        "mrope_section": tuple(int(n) for n in section),
        "mrope_interleaved": bool(raw.get("mrope_interleaved", False)),
    }


def _hf_experts(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a mixture-of-experts family (model/moe.py), with
    `intermediate_size` one expert's width; {} for a dense one."""
    if architecture == "mixtral":  # MixtralConfig's defaults: 8 experts, 2 per token
        return {
            "num_local_experts": raw.get("num_local_experts", 8),
            "num_experts_per_tok": raw.get("num_experts_per_tok", 2),
        }
    if architecture == "olmoe":  # OlmoeConfig's defaults (OLMoE-1B-7B's shape)
        if raw.get("clip_qkv") is not None:
            raise ModelLoadError("olmoe checkpoints with clip_qkv are not supported")
        return {
            "num_local_experts": raw.get("num_experts", 64),
            "num_experts_per_tok": raw.get("num_experts_per_tok", 8),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        }
    if architecture == "granitemoe":  # GraniteMoeConfig's defaults
        # Its router takes a softmax over the top-k logits, as gpt-oss's.
        return {
            "num_local_experts": raw.get("num_local_experts", 8),
            "num_experts_per_tok": raw.get("num_experts_per_tok", 2),
        }
    if architecture == "gpt_oss":  # GptOssConfig's defaults (gpt-oss-20b's shape)
        # Its router takes a softmax over the top-k logits: the top-k probabilities
        # renormalised.
        return {
            "num_local_experts": raw.get("num_local_experts", 32),
            "num_experts_per_tok": raw.get("num_experts_per_tok", 4),
        }
    if architecture == "lfm2_moe":  # Lfm2MoeConfig's defaults (LFM2-8B-A1B's shape)
        return {
            "num_local_experts": raw.get("num_experts", 32),
            "num_experts_per_tok": raw.get("num_experts_per_tok", 4),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", True)),
            "intermediate_size": raw.get("moe_intermediate_size", 1792),
            "leading_dense_layers": raw.get("num_dense_layers", 2),
            "dense_intermediate_size": raw["intermediate_size"],
            "router_scoring": "sigmoid",
            "expert_selection_bias": bool(raw.get("use_expert_bias", True)),
            "routed_scaling_factor": float(raw.get("routed_scaling_factor", 1.0)),
        }
    if architecture not in ("qwen3_moe", "qwen2_moe"):
        return {}
    if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
        # Dense MLPs between sparse ones: no released Qwen2- or Qwen3-MoE has them.
        raise ModelLoadError(
            f"{architecture} checkpoints with dense layers (mlp_only_layers, "
            "decoder_sparse_step > 1) are not supported; every layer must be sparse"
        )
    if architecture == "qwen2_moe":  # Qwen2MoeConfig's defaults (Qwen1.5-MoE-A2.7B's shape)
        return {
            "num_local_experts": raw.get("num_experts", 60),
            "num_experts_per_tok": raw.get("num_experts_per_tok", 4),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "intermediate_size": raw.get("moe_intermediate_size", 1408),
            "shared_expert_intermediate_size": raw.get("shared_expert_intermediate_size", 5632),
        }
    # Qwen3MoeConfig's defaults (Qwen3-30B-A3B's shape), norm_topk_prob off as its own is.
    return {
        "num_local_experts": raw.get("num_experts") or raw.get("num_local_experts") or 128,
        "num_experts_per_tok": raw.get("num_experts_per_tok", 8),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "intermediate_size": raw.get("moe_intermediate_size", 768),
    }


def is_classifier(raw: dict[str, Any]) -> bool:
    """Whether config.json names a network with a classifier head (CLASSIFIER_HF_ARCHITECTURES)."""
    return any(a in CLASSIFIER_HF_ARCHITECTURES for a in raw.get("architectures") or [])


def is_bare_model(raw: dict[str, Any]) -> bool:
    """Whether config.json names a network saved without its LM head (BARE_HF_ARCHITECTURES)."""
    names = raw.get("architectures") or []
    return any(a in BARE_HF_ARCHITECTURES for a in names) and not any(
        a in SUPPORTED_HF_ARCHITECTURES for a in names
    )


def _hf_architecture(raw: dict[str, Any]) -> str:
    """The family config.json names, or ModelLoadError naming what is not supported."""
    names = raw.get("architectures") or []
    known = SUPPORTED_HF_ARCHITECTURES | BARE_HF_ARCHITECTURES | CLASSIFIER_HF_ARCHITECTURES
    architecture = next((known[a] for a in names if a in known), None)
    if (
        architecture is None
        and not names
        and raw.get("model_type") in SUPPORTED_HF_ARCHITECTURES.values()
    ):
        architecture = raw["model_type"]  # a bare config.json saved without a model class
    if moe := [n for n in names if n in _UNSUPPORTED_MOE]:
        raise ModelLoadError(
            f"mixture-of-experts architecture {moe[0]} is not supported; the MoE families "
            "supported are Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, Granite MoE, OLMoE and "
            "LFM2-MoE"
        )
    if architecture is None:
        found = ", ".join(names) or f"model_type {raw.get('model_type')!r}"
        raise ModelLoadError(
            f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
        )
    if raw.get("mlp_bias"):
        raise ModelLoadError("Llama checkpoints with mlp_bias=true are not supported")
    qwen = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3")
    if architecture in qwen and raw.get("use_sliding_window"):
        # Qwen windows only the layers past max_window_layers; rather than run every layer
        # with full attention and answer differently from the model, refuse.
        raise ModelLoadError(
            f"{architecture} checkpoints with use_sliding_window=true are not supported"
        )
    return architecture


def _gpt_oss_fields(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's window on every other layer (from the first) and its clamped SwiGLU."""
    if architecture != "gpt_oss":
        return {}
    return {
        "sliding_window_layers": _sliding_layers(architecture, raw, 2),
        "swiglu_clamp": (
            float(raw.get("swiglu_alpha", 1.702)),
            float(raw.get("swiglu_limit", 7.0)),
        ),
    }


def _hf_multipliers(architecture: str, raw: dict[str, Any]) -> dict[str, float]:
    """Granite's four multipliers as ModelConfig fields (GraniteConfig's defaults: 1.0)."""
    if architecture not in GRANITE_FAMILIES:
        return {}
    return {name: float(raw.get(name, 1.0)) for name in GRANITE_MULTIPLIERS}


def _hf_rope_layers(architecture: str, raw: dict[str, Any]) -> tuple[bool, ...] | None:
    """SmolLM3's layers that rotate: `no_rope_layers` (1: rotates, despite the name), or
    every layer but each `no_rope_layer_interval`-th as its config class makes them. EXAONE
    4.0's: with a window, its windowed layers only (its full layers take no RoPE)."""
    if architecture == "exaone4":
        return _exaone4_sliding(raw)
    if raw.get("model_type") == _GRANITE4 and raw.get("position_embedding_type") != "rope":
        return (False,) * raw["num_hidden_layers"]  # Granite 4.0 without RoPE (NoPE)
    if architecture != "smollm3":
        return None
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval", 4)
        flags = rope_every_layer_but(interval, raw["num_hidden_layers"])
    if len(flags) != raw["num_hidden_layers"]:
        raise ModelLoadError(
            f"smollm3 no_rope_layers has {len(flags)} entries for {raw['num_hidden_layers']} layers"
        )
    return tuple(bool(f) for f in flags)


def _hf_rotary_dim(
    architecture: str, raw: dict[str, Any], rope: dict[str, Any], head_dim: int
) -> int | None:
    """How many dimensions of a head RoPE turns (None: all), from `partial_rotary_factor`
    (Phi-4-mini: 0.75), which transformers 5 keeps among the RoPE fields and 4 at the top."""
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor not in (None, 1.0) and architecture != "phi3":
        # transformers' other families rotate whole heads whatever the config says.
        raise ModelLoadError(f"{architecture} with partial_rotary_factor={factor} is not supported")
    if factor is None:
        return None
    try:
        return rotary_dims(head_dim, int(head_dim * factor))  # transformers' rounding
    except UnsupportedRope as error:
        raise ModelLoadError(f"{error}") from error


def _hf_rope(
    architecture: str, raw: dict[str, Any], rope: dict[str, Any]
) -> tuple[float, dict[str, Any] | None, int]:
    """(rope_theta, the scaling iterserve applies, max positions served) from config.json's
    RoPE fields `rope` (copied: this function changes it)."""
    if "full_attention" in rope:  # per layer type (Gemma 3): the full layers' here
        rope = dict(rope["full_attention"])
    rope_theta = float(raw.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
    rope.pop("rope_theta", None)
    if "type" in rope:  # the older key for the same thing
        rope.setdefault("rope_type", rope.pop("type"))
    if architecture == "phi3" and rope.get("rope_type") in ("su", "yarn"):
        rope["rope_type"] = "longrope"  # Phi-3's early names for it, as transformers reads them
    try:
        rope_scaling, max_positions = served_rope(
            rope,
            raw.get("max_position_embeddings", 2048),
            raw.get("original_max_position_embeddings"),
        )
    except UnsupportedRope as error:
        raise ModelLoadError(f"{error}") from error
    return rope_theta, rope_scaling, max_positions


def _sliding_layers(architecture: str, raw: dict[str, Any], pattern: int) -> tuple[bool, ...]:
    """Which layers attend through the window: config.json's `layer_types`, or every
    `pattern`-th layer full, the rest sliding (Gemma's and gpt-oss's config classes)."""
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(raw["num_hidden_layers"])
    ]
    if unknown := set(layer_types) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{architecture} layer types {sorted(unknown)} are not supported")
    return tuple(t == "sliding_attention" for t in layer_types)


def _gemma_fields(architecture: str, raw: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields only Gemma sets: window pattern, soft-caps, attention scale, the
    sliding layers' RoPE base. Refuses the variants the family's traits do not cover."""
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(
            f"{architecture} with hidden_activation {activation!r} is not supported"
        )
    pattern = raw.get("sliding_window_pattern") or _GEMMA_WINDOW_PATTERN[architecture]
    local_theta = None
    if architecture == "gemma3":
        local_theta = _sliding_rope_theta(
            architecture, rope, raw.get("rope_local_base_freq") or 10000.0
        )
    return {
        "sliding_window_layers": _sliding_layers(architecture, raw, pattern),
        "attn_logit_softcapping": raw.get("attn_logit_softcapping"),
        "final_logit_softcapping": raw.get("final_logit_softcapping"),
        "query_pre_attn_scalar": raw.get("query_pre_attn_scalar"),
        "local_rope_theta": local_theta,
    }


# Gemma 4's config class: one full layer in six unless layer_types says, the full layers'
# heads 512 wide.
_GEMMA4_WINDOW_PATTERN = 6
_GEMMA4_FULL_HEAD_DIM = 512


def _gemma4_fields(architecture: str, raw: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's ModelConfig fields (family.py says what they are): the window pattern, the
    full layers' head size and count, keys as values, KV sharing, per-layer embeddings, the
    sliding layers' RoPE base, the logit soft-cap, the experts beside each dense MLP
    (26B-A4B)."""
    if architecture != "gemma4":
        return {}
    if raw.get("use_bidirectional_attention") == "all":  # "vision": images' tokens only
        raise ModelLoadError("gemma4 attending both ways (use_bidirectional_attention: all)")
    activation = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh" or raw.get("attention_bias"):
        raise ModelLoadError(
            f"gemma4 with hidden_activation {activation!r} or attention biases is not supported"
        )
    sliding = _sliding_layers("gemma4", raw, _GEMMA4_WINDOW_PATTERN)
    sliding = (*sliding[:-1], False)  # its config class makes the last layer full
    full_head_dim = raw.get("global_head_dim") or _GEMMA4_FULL_HEAD_DIM
    keys_as_values = bool(raw.get("attention_k_eq_v", False))
    full_kv_heads = raw.get("num_global_key_value_heads") if keys_as_values else None
    # transformers 5 saves the full layers' shape per layer instead.
    overrides = {int(i): o for i, o in (raw.get("per_layer_config") or {}).items()}
    if overrides:
        if any(sliding[i] for i in overrides) or len({str(o) for o in overrides.values()}) > 1:
            raise ModelLoadError("gemma4 with per-layer shapes other than its full layers'")
        first = next(iter(overrides.values()))
        full_head_dim = first.get("head_dim", raw.get("head_dim"))
        full_kv_heads = first.get("num_key_value_heads")
    if full_kv_heads == raw.get("num_key_value_heads"):
        full_kv_heads = None  # as every layer's
    per_layer = raw.get("hidden_size_per_layer_input") or 0
    return {
        "sliding_window_layers": sliding,
        "final_logit_softcapping": raw.get("final_logit_softcapping"),
        # Unscaled scores (its q and k norms set their scale): 1 ** -0.5.
        "query_pre_attn_scalar": 1.0,
        "local_rope_theta": _sliding_rope_theta("gemma4", rope, 10000.0),
        "full_head_dim": full_head_dim,
        "full_kv_heads": full_kv_heads,
        "full_keys_as_values": keys_as_values,
        "kv_shared_layers": raw.get("num_kv_shared_layers") or 0,
        "shared_layers_double_mlp": bool(raw.get("use_double_wide_mlp", False)),
        "per_layer_input_size": per_layer,
        "per_layer_vocab_size": (raw.get("vocab_size_per_layer_input") or 0) if per_layer else 0,
        "per_layer_pad_id": raw.get("pad_token_id") or 0,
        **_gemma4_experts(raw),
    }


def _gemma4_experts(raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4 26B-A4B's experts (enable_moe_block): on every layer, beside the dense MLP
    (`intermediate_size` wide), `num_experts` of `moe_intermediate_size`, `top_k_experts` a
    token, the top-k weights renormalised, as its router always does."""
    if not raw.get("enable_moe_block"):
        return {}
    for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if not raw.get(name):
            raise ModelLoadError(f"gemma4 with enable_moe_block and no {name}")
    return {
        "num_local_experts": raw["num_experts"],
        "num_experts_per_tok": raw["top_k_experts"],
        "intermediate_size": raw["moe_intermediate_size"],
        "dense_intermediate_size": raw["intermediate_size"],
        "experts_beside_dense": True,
    }


def _olmo3_fields(architecture: str, raw: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3's windowed layers (three in four, as its config class makes them unless
    `layer_types` says) and their plain RoPE, on the model's own base unless said otherwise:
    its config class applies `rope_scaling` to the full layers only."""
    if architecture != "olmo3":
        return {}
    theta = raw.get("rope_theta") or (rope.get("full_attention") or rope).get("rope_theta")
    return {
        "sliding_window_layers": _sliding_layers(architecture, raw, _OLMO3_WINDOW_PATTERN),
        "local_rope_theta": _sliding_rope_theta(architecture, rope, float(theta or 10000.0)),
    }


def _exaone4_fields(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4.0's windowed layers (its RoPE follows them: _hf_rope_layers)."""
    sliding = _exaone4_sliding(raw) if architecture == "exaone4" else None
    return {} if sliding is None else {"sliding_window_layers": sliding}


def _exaone4_sliding(raw: dict[str, Any]) -> tuple[bool, ...] | None:
    """EXAONE 4.0's windowed layers, by `layer_types`, else its `sliding_window_pattern` (a
    string such as "LLLG", or every n-th layer full); None without a window (the 1.2B: every
    layer attends fully)."""
    if raw.get("sliding_window") is None:
        return None
    pattern = raw.get("sliding_window_pattern") or _EXAONE4_WINDOW_PATTERN
    if isinstance(pattern, str) and not raw.get("layer_types"):
        kinds = [pattern[i % len(pattern)] for i in range(raw["num_hidden_layers"])]
        raw = {**raw, "layer_types": [_EXAONE4_LAYER_TYPES[kind] for kind in kinds]}
        pattern = _EXAONE4_WINDOW_PATTERN
    return _sliding_layers("exaone4", raw, int(pattern))


def _query_temperature(
    architecture: str, raw: dict[str, Any], rope: dict[str, Any]
) -> dict[str, Any]:
    """Ministral 3's attention temperature (its RoPE fields' `llama_4_scaling_beta`, over
    their original context), taken out of `rope`; another family's is refused by name, as
    its attention never reads it."""
    beta = rope.pop("llama_4_scaling_beta", None)
    if beta is None:
        return {}
    if architecture != "ministral3":
        raise ModelLoadError(f"{architecture} with llama_4_scaling_beta is not supported")
    length = rope.get("original_max_position_embeddings") or raw.get(
        "original_max_position_embeddings"
    )
    if not length:
        raise ModelLoadError("ministral3's llama_4_scaling_beta needs its original context")
    return {"query_temperature": (float(beta), int(length))}


def _lfm2_fields(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """LFM2's conv layers (`layer_types`, or every layer not in `full_attn_idxs`), their
    width, and its MLP's width as Lfm2Config's block_auto_adjust_ff_dim makes it from
    `block_ff_dim` (2/3 of it, times block_ffn_dim_multiplier, rounded up to
    block_multiple_of: LFM2-1.2B's 12288 is 8192). LFM2-MoE's widths are its config's own."""
    if architecture not in LFM2_FAMILIES:
        return {}
    if raw.get("conv_bias"):
        raise ModelLoadError(f"{architecture} checkpoints with conv_bias=true are not supported")
    layers = raw["num_hidden_layers"]
    full = raw.get("full_attn_idxs")
    types = raw.get("layer_types") or [
        "full_attention" if full is None or i in full else "conv" for i in range(layers)
    ]
    if unknown := set(types) - {"conv", "full_attention"}:
        raise ModelLoadError(f"{architecture} layer types {sorted(unknown)} are not supported")
    if len(types) != layers:
        raise ModelLoadError(
            f"{architecture} layer_types has {len(types)} entries for {layers} layers"
        )
    conv = {
        "conv_layers": tuple(t == "conv" for t in types),
        "conv_kernel": raw.get("conv_L_cache", 3),
    }
    if architecture == "lfm2_moe":
        return conv
    width = raw.get("block_ff_dim") or raw["intermediate_size"]
    if raw.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if (multiplier := raw.get("block_ffn_dim_multiplier", 1.0)) is not None:
            multiple = raw.get("block_multiple_of", 256)
            width = multiple * -(-int(multiplier * width) // multiple)
    return {**conv, "intermediate_size": width}


_GRANITE4 = "granitemoehybrid"


def _granite4_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Granite 4.0 (GraniteMoeHybrid) without Mamba layers or experts: Granite 3's network
    with its MLP `shared_intermediate_size` wide; the rest is refused by name."""
    if raw.get("model_type") != _GRANITE4:
        return {}
    # Released configs say "attention" / "mamba"; transformers 5 saves "full_attention" /
    # "linear_attention".
    types = raw.get("layer_types") or raw.get("layers_block_type") or []
    if mamba := sorted({t for t in types if t not in ("attention", "full_attention")}):
        raise ModelLoadError(
            f"granitemoehybrid layers of type {', '.join(mamba)} (Mamba-2) are not supported; "
            "only Granite 4.0 models whose every layer attends (granite-4.0-micro) are"
        )
    if raw.get("num_local_experts"):
        raise ModelLoadError("granitemoehybrid with experts is not supported")
    return {"intermediate_size": raw["shared_intermediate_size"]}


# Granite 4.0's MLP: shared_mlp.input_linear [2 x width, hidden] (gate's rows, then up's) and
# shared_mlp.output_linear, read as Llama's gate, up and down projections.
_GRANITE4_MLP = re.compile(r"(.*)\.shared_mlp\.(input_linear|output_linear)\.weight")


def _granite4_mlp(name: str, shape: tuple[int, ...]) -> ExpertParts:
    """Granite 4.0's MLP tensors as Llama's projections, each read as its rows of the file;
    [] for any other tensor."""
    match = _GRANITE4_MLP.fullmatch(name)
    if match is None:
        return []
    prefix, linear = match.groups()
    if linear == "output_linear":
        rows = {"down_proj": (0, shape[0])}
    else:
        width = shape[0] // 2
        rows = {"gate_proj": (0, width), "up_proj": (width, width)}
    return [
        (
            f"{prefix}.mlp.{projection}.weight",
            (count, shape[1]),
            functools.partial(_read_rows, first=first, count=count),
        )
        for projection, (first, count) in rows.items()
    ]


def _read_rows(stored: StoredTensor, dtype: torch.dtype, first: int, count: int) -> torch.Tensor:
    return stored.read(first, count).to(dtype)


# LFM2's checkpoint names, as the names model/llama.py reads (Llama's; LFM2-MoE's router and
# experts, feed_forward.gate and feed_forward.experts.E.w1, as Qwen3-MoE's); its conv layers'
# (conv.in_proj, conv.conv, conv.out_proj) are read as they are (model/short_conv.py).
_LFM2_NAMES = {
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
    ".feed_forward.": ".mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
    ".operator_norm.": ".input_layernorm.",
    ".ffn_norm.": ".post_attention_layernorm.",
}


_LFM2_FINAL_NORM = ("model.embedding_norm.weight", "model.norm.weight")


def _lfm2_name(name: str) -> str:
    """An LFM2 checkpoint name as model/llama.py reads it (its final norm is
    `embedding_norm`, though it norms the last layer's output)."""
    if name == _LFM2_FINAL_NORM[0]:
        return _LFM2_FINAL_NORM[1]
    for theirs, ours in _LFM2_NAMES.items():
        name = name.replace(theirs, ours)
    return name


def lfm2_checkpoint_name(name: str) -> str:
    """The inverse of `_lfm2_name`: a loaded LFM2 tensor under its checkpoint's name."""
    if name == _LFM2_FINAL_NORM[1]:
        return _LFM2_FINAL_NORM[0]
    for theirs, ours in _LFM2_NAMES.items():
        name = name.replace(ours, theirs)
    return name


def _sliding_rope_theta(architecture: str, rope: dict[str, Any], default: float) -> float:
    """The base of the plain RoPE a family's windowed layers rotate by (Gemma 3, OLMo 3): the
    per-layer-type RoPE fields' `sliding_attention` entry, or `default`."""
    local = rope.get("sliding_attention") or {}
    if rope_type_of(local) != "default":
        raise ModelLoadError(
            f"{architecture} sliding layers with rope scaling {rope_type_of(local)!r} are not "
            "supported"
        )
    return float(local.get("rope_theta") or default)


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _shards(directory: Path) -> list[str]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return sorted(set(_read_json(index)["weight_map"].values()))
    if (directory / "model.safetensors").exists():
        return ["model.safetensors"]
    other = [p.name for p in directory.glob("*.bin")]
    hint = f" (found {', '.join(other)}: convert it to safetensors)" if other else ""
    raise ModelLoadError(
        f"{directory} has neither model.safetensors nor model.safetensors.index.json{hint}"
    )


# A family's checkpoint that keeps each layer's experts in stacks: how to list a stack as
# each expert's projections (model/moe.py's names), [] for a tensor that is not one. (Granite
# 4.0's fused MLP tensors are read through the same hook, as Llama's projections.)
ExpertParts = list[tuple[str, tuple[int, ...], Callable[..., Any]]]
ExpertStacks = Callable[[str, tuple[int, ...]], ExpertParts]


def _load_safetensors(
    directory: Path,
    shards: list[str],
    dtype: torch.dtype,
    prefix: str = "",
    stacks: ExpertStacks | None = None,
    mxfp4: bool = False,
    rename: Callable[[str], str | None] | None = None,
) -> LazyWeights:
    """The weights, each name after `prefix` (`model.` for a bare network's) and as `rename`
    gives it (LFM2's). Expert stacks (gpt-oss, Granite MoE, Gemma 4) are listed as each expert's
    projections, each read as a slice of the file; with `mxfp4`, gpt-oss's MXFP4 stacks are
    left to safetensors_mxfp4.py."""
    weights = LazyWeights()
    for shard in shards:
        if not (directory / shard).exists():
            raise ModelLoadError(f"{directory}: shard {shard} listed in the index is missing")
        # Each tensor read (and cast) from its place in the file when the model copies it in.
        for name, stored in stored_tensors(directory / shard).items():
            if name.endswith("rotary_emb.inv_freq"):  # a buffer old checkpoints saved; recomputed
                continue
            if mxfp4 and is_mxfp4_tensor(name):  # gpt-oss's: safetensors_mxfp4.py reads these
                continue
            parts = stacks(name, stored.shape) if stacks is not None else []
            for part, part_shape, make in parts:
                part_name = prefix + part
                if rename is not None and (part_name := rename(part_name)) is None:
                    continue
                weights.add(part_name, part_shape, functools.partial(make, stored, dtype))
            if not parts:
                read = functools.partial(_read_tensor, stored, dtype)
                full_name = prefix + name
                if rename is not None and (full_name := rename(full_name)) is None:
                    continue  # not the model's (a multimodal checkpoint's vision tower)
                # A vector stored in fp32 also as it is: what the model keeps in fp32 (LFM2-MoE's
                # selection biases, gpt-oss's sinks) is copied from it unrounded.
                native = None
                if stored.dtype == "F32" and len(stored.shape) == 1:
                    native = functools.partial(_read_tensor, stored, torch.float32)
                weights.add(full_name, stored.shape, read, native)
    return weights


# gpt-oss's checkpoint keeps a layer's experts in stacks: gate_up_proj [experts, hidden,
# 2 x width] with gate and up interleaved (columns 0, 2, 4... are gate's), down_proj
# [experts, width, hidden], each matrix [inputs, outputs], and their biases [experts, outputs].
_GPT_OSS_STACK = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?")


def _gpt_oss_experts(name: str, shape: tuple[int, ...]) -> ExpertParts:
    """A gpt-oss expert stack as each expert's projections (model/moe.py's names, [outputs,
    inputs]), each read as its expert's slice of the file; [] for any other tensor."""
    match = _GPT_OSS_STACK.fullmatch(name)
    if match is None:
        return []
    prefix, stack, bias = match.groups()
    columns = {"gate_proj": slice(0, None, 2), "up_proj": slice(1, None, 2)}
    if stack == "down_proj":
        columns = {"down_proj": slice(None)}
    outputs = shape[-1] // len(columns)
    parts = []
    for expert in range(shape[0]):
        for projection, cols in columns.items():
            part = f"{prefix}.{expert}.{projection}.{'bias' if bias else 'weight'}"
            part_shape = (outputs,) if bias else (outputs, shape[1])
            make = functools.partial(_read_expert, expert=expert, columns=cols)
            parts.append((part, part_shape, make))
    return parts


def _read_expert(
    stored: StoredTensor, dtype: torch.dtype, expert: int, columns: slice
) -> torch.Tensor:
    """One expert's projection (or bias) from its stack: only its slice is read."""
    tensor = stored.read(expert, 1)[0][..., columns]
    return (tensor.T if tensor.dim() == 2 else tensor).contiguous().to(dtype)


# Granite MoE's checkpoint keeps a layer's experts in two stacks, each matrix [outputs,
# inputs]: input_linear [experts, 2 x width, hidden] (gate's rows, then up's) and
# output_linear [experts, hidden, width]; its router is router.layer. Gemma 4's (26B-A4B)
# alike: experts.gate_up_proj and experts.down_proj (no .weight), beside the dense mlp.
_GRANITE_MOE_STACK = re.compile(r"(.*\.block_sparse_moe)\.(input_linear|output_linear)\.weight")
_GEMMA4_STACK = re.compile(r"(.*)\.experts\.(gate_up_proj|down_proj)")
_GATE_UP_STACKS = ("input_linear", "gate_up_proj")


def _row_stacked_experts(
    pattern: re.Pattern[str], name: str, shape: tuple[int, ...]
) -> ExpertParts:
    """An expert stack of rows (`pattern`: its layer's prefix and the stack's name) as each
    expert's projections, each read as its expert's rows of the file; [] for any other
    tensor."""
    match = pattern.fullmatch(name)
    if match is None:
        return []
    prefix, stack = match.groups()
    rows = {"down_proj": slice(None)}
    if stack in _GATE_UP_STACKS:
        width = shape[1] // 2
        rows = {"gate_proj": slice(0, width), "up_proj": slice(width, None)}
    parts = []
    for expert in range(shape[0]):
        for projection, part_rows in rows.items():
            part_shape = (len(range(shape[1])[part_rows]), shape[2])
            make = functools.partial(_read_expert_rows, expert=expert, rows=part_rows)
            parts.append((f"{prefix}.experts.{expert}.{projection}.weight", part_shape, make))
    return parts


def _read_expert_rows(
    stored: StoredTensor, dtype: torch.dtype, expert: int, rows: slice
) -> torch.Tensor:
    """One expert's projection from its stack, as it lies ([outputs, inputs])."""
    return stored.read(expert, 1)[0][rows].contiguous().to(dtype)


_EXPERT_STACKS: dict[str, ExpertStacks] = {
    "gpt_oss": _gpt_oss_experts,
    "granitemoe": functools.partial(_row_stacked_experts, _GRANITE_MOE_STACK),
    "gemma4": functools.partial(_row_stacked_experts, _GEMMA4_STACK),
}


def _read_tensor(stored: StoredTensor, dtype: torch.dtype) -> torch.Tensor:
    tensor = stored.read()
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from error


def _read_optional_json(path: Path) -> dict[str, Any] | None:
    return _read_json(path) if path.exists() else None
