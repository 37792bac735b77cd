"""The tiny checkpoints of the families beyond Llama (model/family.py), from transformers'
own classes: as transformers models, and saved as an HF directory or as a GGUF file the way
llama.cpp's converter writes them (tiny_gguf.py)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import transformers
from gguf import GGMLQuantizationType

from tiny_checkpoints import save_checkpoint, tiny_hf_model
from tiny_gguf import write_gguf

# The families beyond Llama with tiny models here: dense (family_model) and, with the
# mixtures of experts, every one engine_family_model makes.
DENSE_FAMILIES = [
    "qwen3",
    "smollm3",
    "granite",
    "phi3",
    "phi4-mini",
    "gemma2",
    "gemma3",
    "olmo2",
    "olmo3",
    "exaone4",
    "lfm2",
    "ministral3",
]
ENGINE_FAMILIES = [
    *DENSE_FAMILIES,
    "mixtral",
    "qwen3_moe",
    "qwen2_moe",
    "gpt_oss",
    "granitemoe",
    "olmoe",
    "lfm2_moe",
]
VOCAB = 49152  # the SmolLM2 tokenizer's (conftest.tokenizer_dir), so the engine can run them
ORIGINAL = 64  # Phi-3's original context: the tests run past it


# Ministral 3's RoPE fields (YaRN, Llama 4's attention temperature) over a 16-token original
# context, so that the tests' sequences run past it three times and more; its mscale_all_dim
# (1 in the released models) not 1, so that YaRN's attention factor is not either, and a
# temperature three times the released 0.1, so that it shows.
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1e6,
    "factor": 16.0,
    "original_max_position_embeddings": ORIGINAL // 4,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
    "llama_4_scaling_beta": 0.3,
}
# Multipliers far from 1, as Granite 3's (12, 0.22, 1/64, 8).
GRANITE = dict(
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=1 / 64,
    logits_scaling=8.0,
)


def family_model(
    family: str, gguf: bool = False, vocab_size: int = VOCAB, weight_std: float = 0.15
) -> transformers.PreTrainedModel:
    """`gguf`: a Gemma with the attention scale a GGUF file can say (GGUF has no
    query_pre_attn_scalar; llama.cpp, and so iterserve, scales by head_dim, or by hidden /
    heads for the 27B layer counts)."""
    shape: dict[str, object] = dict(
        vocab_size=vocab_size,
        weight_std=weight_std,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=family == "qwen3",
        attn_implementation="eager",
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "qwen3":
        return tiny_hf_model("qwen3", **shape, head_dim=64, max_position_embeddings=256)
    if family == "granite":
        return tiny_hf_model("granite", **shape, **GRANITE, max_position_embeddings=256)
    if family == "olmo2":
        return tiny_hf_model("olmo2", **shape, max_position_embeddings=256)
    if family == "exaone4":  # a sliding layer (rotating) then a full one (no RoPE)
        return tiny_hf_model(
            "exaone4",
            **shape,
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=256,
        )
    if family == "lfm2":  # conv layers around an attention layer; an MLP width to round
        shape.update(num_hidden_layers=3, intermediate_size=200, tie_word_embeddings=True)
        return tiny_hf_model(
            "lfm2",
            **shape,
            layer_types=["conv", "full_attention", "conv"],
            block_multiple_of=32,  # 200 -> 2/3 of it, 133 -> 160
            norm_eps=1e-5,
            max_position_embeddings=256,
        )
    if family == "ministral3":  # YaRN past ORIGINAL / 4 tokens, the temperature from there
        # Weights at 0.15 with a temperature sharpen its attention past bf16's reach: rows
        # of the fused op and of eager torch part (each as far from fp32 as the other).
        shape.update(weight_std=min(weight_std, 0.1))
        return tiny_hf_model("ministral3", **shape, rope_parameters=MINISTRAL3_ROPE)
    if family == "olmo3":  # a sliding layer (plain rope) then a full one (YaRN past ORIGINAL)
        rope = {
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 5e5,
                "factor": 4.0,
                "original_max_position_embeddings": ORIGINAL,
                "attention_factor": 1.25,  # not YaRN's own 1 + 0.1 ln 4: read, not recomputed
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
        }
        return tiny_hf_model(
            "olmo3",
            **shape,
            sliding_window=24,
            rope_parameters=rope,
            layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=4 * ORIGINAL,
        )
    if family == "granitemoe":  # 4 experts of 96, 2 a token
        shape.update(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)
        return tiny_hf_model("granitemoe", **shape, **GRANITE, max_position_embeddings=256)
    if family == "smollm3":  # four layers: the fourth without RoPE, as llama.cpp assumes
        shape.update(num_hidden_layers=4, tie_word_embeddings=True)
        return tiny_hf_model("smollm3", **shape, max_position_embeddings=256, pad_token_id=0)
    gemma = dict(head_dim=32, query_pre_attn_scalar=32 if gguf else 24, sliding_window=24)
    if family == "gemma2":  # soft-caps low enough to bite at these logit sizes
        return tiny_hf_model(
            "gemma2", **shape, **gemma, attn_logit_softcapping=4.0, final_logit_softcapping=15.0
        )
    if family == "gemma3":  # a sliding layer (local rope) then a full one (linear scaling)
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
        layer_types = ["sliding_attention", "full_attention"]
        return tiny_hf_model(
            "gemma3", **shape, **gemma, rope_parameters=rope, layer_types=layer_types
        )
    # Phi-4-mini: Phi-3 with its head's 96 of 128 dimensions rotated, grouped kv heads, a
    # tied head.
    phi4 = family == "phi4-mini"
    if phi4:  # twice the width: weights 1/sqrt(2) as large keep the activations' sizes
        shape.update(hidden_size=256, num_attention_heads=2, num_key_value_heads=1)
        shape.update(tie_word_embeddings=True, weight_std=0.15 / 2**0.5)
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]  # type: ignore[operator]
    rotated = head_dim * 3 // 4 if phi4 else head_dim
    rng = random.Random(0)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + rng.random() * 0.5 for _ in range(rotated // 2)],
        "long_factor": [1.0 + rng.random() * 8 for _ in range(rotated // 2)],
        **({"partial_rotary_factor": 0.75} if phi4 else {}),
    }
    return tiny_hf_model(
        "phi3",
        **shape,
        max_position_embeddings=4 * ORIGINAL,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters=rope,
        sliding_window=48,
        pad_token_id=0,
    )


def gpt_oss_model(
    vocab_size: int = VOCAB, swiglu_limit: float = 1.0, **overrides: object
) -> transformers.PreTrainedModel:
    """A tiny gpt-oss (4 experts, 2 a token; a window of 16 on the first layer; YaRN past
    ORIGINAL) whose attention sinks are spread from far below the scores to above them and
    whose SwiGLU limit (1.0; gpt-oss's own, 7, is the one a GGUF file implies) clamps many
    gates and ups."""
    hf = tiny_hf_model(
        "gpt_oss",
        vocab_size=vocab_size,
        weight_std=0.15,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        swiglu_limit=swiglu_limit,
        tie_word_embeddings=False,
        max_position_embeddings=8 * ORIGINAL,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "original_max_position_embeddings": ORIGINAL,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        attn_implementation="eager",
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return hf


def gguf_metadata(hf: transformers.PreTrainedModel) -> tuple[dict[str, object], dict]:
    """What llama.cpp's converter adds for Phi-3 (longrope factors, the window) and Gemma
    (soft-caps, the window; Gemma 3's full layers' linear scaling), plus Gemma 3's layer
    pattern: these tiny models alternate, where llama.cpp assumes five sliding to one full."""
    c = hf.config
    if c.model_type == "gpt_oss":
        rope = c.rope_parameters
        return {
            "expert_count": c.num_local_experts,
            "expert_used_count": c.num_experts_per_tok,
            "expert_feed_forward_length": c.intermediate_size,
            "attention.sliding_window": c.sliding_window,
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": rope["factor"],
            "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
            "rope.scaling.yarn_beta_fast": rope["beta_fast"],
            "rope.scaling.yarn_beta_slow": rope["beta_slow"],
        }, {}
    if c.model_type in ("granite", "granitemoe"):
        experts = {}
        if c.model_type == "granitemoe":
            experts = {
                "expert_count": c.num_local_experts,
                "expert_used_count": c.num_experts_per_tok,
            }
        return {
            **experts,
            "embedding_scale": c.embedding_multiplier,
            "residual_scale": c.residual_multiplier,
            "attention.scale": c.attention_multiplier,
            "logit_scale": c.logits_scaling,
        }, {}
    if c.model_type == "gemma2":
        return {
            "attn_logit_softcapping": c.attn_logit_softcapping,
            "final_logit_softcapping": c.final_logit_softcapping,
            "attention.sliding_window": c.sliding_window,
        }, {}
    if c.model_type == "gemma3_text":
        full = c.rope_parameters["full_attention"]
        return {
            "attention.sliding_window": c.sliding_window,
            "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types],
            "rope.scaling.type": full["rope_type"],
            "rope.scaling.factor": full["factor"],
        }, {}
    if c.model_type == "ministral3":  # as llama.cpp's converter writes it
        rope = c.rope_parameters
        return {
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": rope["factor"],
            "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
            "rope.scaling.yarn_beta_fast": rope["beta_fast"],
            "rope.scaling.yarn_beta_slow": rope["beta_slow"],
            "rope.scaling.yarn_log_multiplier": rope["mscale_all_dim"],
            "attention.temperature_scale": rope["llama_4_scaling_beta"],
        }, {}
    if c.model_type == "exaone4":
        return {
            "attention.sliding_window": c.sliding_window,
            "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types],
        }, {}
    if c.model_type == "olmo3":  # llama.cpp's converter: an olmo2 file with a window
        full = c.rope_parameters["full_attention"]
        return {
            "attention.sliding_window": c.sliding_window,
            "attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types],
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": full["factor"],
            "rope.scaling.original_context_length": full["original_max_position_embeddings"],
            "rope.scaling.yarn_attn_factor": full["attention_factor"],
        }, {}
    if c.model_type != "phi3":
        return {}, {}
    rope = c.rope_parameters
    scale = c.max_position_embeddings / ORIGINAL
    attn_factor = (1 + torch.tensor(scale).log() / torch.tensor(float(ORIGINAL)).log()).sqrt()
    metadata = {
        "rope.scaling.original_context_length": ORIGINAL,
        "rope.scaling.attn_factor": float(attn_factor),
        "attention.sliding_window": c.sliding_window,
    }
    factors = {
        "rope_factors_long": torch.tensor(rope["long_factor"]).numpy(),
        "rope_factors_short": torch.tensor(rope["short_factor"]).numpy(),
    }
    return metadata, factors


def family_checkpoint(
    kind: str, hf: transformers.PreTrainedModel, out: Path, tokenizer_dir: Path
) -> Path:
    """`hf` saved as an HF directory or as a GGUF file of this kind (its q/k/v rows as
    llama.cpp's converter writes them)."""
    if kind == "hf":
        return save_checkpoint(hf, out, tokenizer_dir)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    metadata, factors = gguf_metadata(hf)
    path = out / f"tiny.{kind}.gguf"
    qtype = GGMLQuantizationType.Q8_0 if kind == "q8_0" else GGMLQuantizationType.F32
    rope = hf.config.rope_parameters
    # gemma3_text: GGUF's gemma3; gpt_oss: gpt-oss; OLMo 3 is written as olmo2.
    arch = hf.config.model_type.removesuffix("_text").replace("gpt_oss", "gpt-oss")
    arch = arch.replace("olmo3", "olmo2").replace("lfm2_moe", "lfm2moe")
    arch = arch.replace("ministral3", "mistral3")
    write_gguf(
        path,
        arch,
        hf,
        tokenizer,
        qtype=qtype,
        rope_freq_base=rope.get("full_attention", rope)["rope_theta"],  # Gemma 3: full layers'
        metadata=metadata,
        rope_tensors=factors,
    )
    return path


# A small vocabulary: random weights then repeat themselves within a few tokens, so prompt
# lookup finds drafts that are sometimes right.
SMALL_VOCAB = 128


def lfm2_moe_model(**overrides: object) -> transformers.PreTrainedModel:
    """A tiny LFM2-MoE: a conv layer with a dense MLP (its one leading dense layer), then an
    attention layer and a conv layer each with 4 experts of 96, 2 a token, whose selection
    biases (a buffer transformers leaves at zero) are drawn too, large enough to change picks."""
    shape: dict[str, object] = dict(
        vocab_size=VOCAB,
        weight_std=0.15,
        hidden_size=128,
        intermediate_size=192,
        moe_intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv"],
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        norm_eps=1e-5,
        attn_implementation="eager",
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    hf = tiny_hf_model("lfm2_moe", **{**shape, **overrides})
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.2)
    return hf


def engine_family_model(name: str, gguf: bool = False) -> transformers.PreTrainedModel:
    """A family's model with SMALL_VOCAB; the mixture-of-experts ones (Mixtral, Qwen3-MoE,
    Qwen2-MoE with its shared expert, gpt-oss, Granite MoE, OLMoE: 4 experts, 2 a token) among
    them. `gguf`: as family_model's."""
    experts = {
        "mixtral": dict(num_local_experts=4),
        "qwen3_moe": dict(num_experts=4, moe_intermediate_size=128, norm_topk_prob=True),
        "qwen2_moe": dict(
            num_experts=4,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
        ),
        "granitemoe": dict(num_local_experts=4, **GRANITE),
        "olmoe": dict(num_experts=4, intermediate_size=128, norm_topk_prob=False),
    }
    if name == "lfm2":  # weights at 0.15 make a random walk of its greedy text: no drafts
        return family_model(name, vocab_size=SMALL_VOCAB, weight_std=0.07)
    if name == "lfm2_moe":
        return lfm2_moe_model(vocab_size=SMALL_VOCAB, weight_std=0.07)
    if name == "gpt_oss":  # a GGUF implies llama.cpp's SwiGLU limit (7)
        return gpt_oss_model(vocab_size=SMALL_VOCAB, **({"swiglu_limit": 7.0} if gguf else {}))
    if name not in experts:
        return family_model(name, gguf=gguf, vocab_size=SMALL_VOCAB)
    return tiny_hf_model(
        name,
        vocab_size=SMALL_VOCAB,
        weight_std=0.15,
        head_dim=16,
        num_experts_per_tok=2,
        attn_implementation="eager",
        bos_token_id=1,
        eos_token_id=2,
        **experts[name],
    )


GEMMA4_ROPE = {
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1e6,
    },
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
}
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma 4 31B's attention layout, which 26B-A4B shares.
_31B_ATTENTION = dict(
    num_hidden_layers=4,
    num_key_value_heads=2,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    layer_types=[SLIDING, FULL, SLIDING, FULL],
    hidden_size_per_layer_input=0,
)
GEMMA4_SHAPES = {
    # E2B's parts: one kv head, per-layer embeddings, the last two layers reading the K/V of
    # the last earlier layer of their kind (2 and 1), their MLPs twice as wide.
    "e2b": dict(
        num_hidden_layers=5,
        num_key_value_heads=1,
        layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=32,
        vocab_size_per_layer_input=VOCAB,
        tie_word_embeddings=True,
    ),
    # 31B's: full layers with fewer kv heads of their own whose keys are their values.
    "31b": dict(**_31B_ATTENTION, tie_word_embeddings=False),
    # 26B-A4B's: 31B's attention, and on every layer experts (GeGLU, top 2 of 8) beside the
    # dense MLP, routed from the stream through the router's own norm and scales.
    "26b": dict(
        **_31B_ATTENTION,
        tie_word_embeddings=True,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=64,
    ),
}


def gemma4_model(
    shape: str, vocab_size: int = VOCAB, **overrides: object
) -> transformers.PreTrainedModel:
    hf = tiny_hf_model(
        "gemma4",
        vocab_size=vocab_size,
        weight_std=0.15,
        hidden_size=128,
        intermediate_size=192,
        num_attention_heads=4,
        head_dim=32,
        global_head_dim=64,
        sliding_window=24,
        rope_parameters=GEMMA4_ROPE,
        final_logit_softcapping=15.0,
        max_position_embeddings=256,
        attn_implementation="eager",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **{**GEMMA4_SHAPES[shape], **overrides},
    )
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a buffer transformers leaves at one
        for layer in hf.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5, generator=generator)
            if hf.config.enable_moe_block:  # scales near one, and routers that pick clearly
                layer.router.scale.uniform_(0.5, 1.5, generator=generator)
                layer.router.per_expert_scale.uniform_(0.5, 1.5, generator=generator)
                layer.router.proj.weight.normal_(0.0, 2.0, generator=generator)
    return hf
