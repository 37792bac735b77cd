"""Real-size GGUF files with random weights: the bodies of the models people run on CPUs
(Llama 3.x, Qwen3, Mistral, Gemma 3), to time loading and decoding at their true sizes
without downloading them.

Each preset has its model's published shape (hidden size, layers, heads, context, rope),
and every file the bundled model's tokenizer (its 49,152-token vocabulary and chat
template). By default the embedding is tied to the head (no output.weight): 49,152 rows
instead of the real 32-262k make most files a little smaller than the real ones, and the
decoder layers, which are most of a step's bytes, are the real ones. With `real_vocab` a
file has the model's own vocabulary size and head: the bundled vocabulary cut to it or grown
by filler tokens (`resize_vocabulary`), and an output.weight where the model does not tie
it; the head a one-sequence step reads is then the real one (Llama 3's 128,256 rows in
Q6_K are 27% of its 1B's bytes a token).

Weights are random normal (std 0.02, seeded), norms 1. `write_shaped_gguf` writes F16 with
gguf's writer tensor by tensor (every tensor's info first, then each tensor's bytes as it is
made), so its peak memory is one tensor, never the model; llama.cpp's `llama-quantize` makes
the quantized types from it (benchmarks/big_models.py). With `blocks` it writes random blocks of
quantized types directly instead (`q4_k_m_types`: the types llama.cpp's Q4_K_M gives each
tensor), for a file of a quantized model's true layout and size without llama.cpp: what a
test of loading memory needs, not a model that says anything.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    PoolingType,
    RopeScalingType,
)

from iterserve.model.bundled import default_model_path
from iterserve.model.score_head import QWEN3_RERANKER_TEMPLATE

WEIGHT_STD = 0.02
# Elements drawn at a time: the float32 draws are a fixed 16 MiB beside the tensor.
_CHUNK = 1 << 22


@dataclass(frozen=True)
class Shape:
    """A model's body as its published config gives it (HF names in the comments)."""

    arch: str  # the GGUF architecture (general.architecture)
    source: str  # the model whose config these numbers are
    hidden: int  # hidden_size
    intermediate: int  # intermediate_size
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim
    rope_theta: float  # rope_theta
    context: int  # max_position_embeddings
    rms_eps: float  # rms_norm_eps
    # Llama 3.x's rope_scaling (rope_type "llama3"): factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings; llama.cpp's converter turns it
    # into a rope_freqs tensor.
    llama3_rope: tuple[float, float, float, int] | None = None
    qk_norm: bool = False  # Qwen3, Gemma 3: RMS norms over each head's q and k
    qk_norm_whole: bool = False  # OLMoE: the q and k norms over all their heads at once
    # Gemma 3: sliding-window layers (five in six), their own rope base, and a linear rope
    # scaling of the global layers.
    sliding_window: int | None = None
    rope_local_theta: float | None = None
    rope_linear_factor: float | None = None
    # Gemma 2: soft-caps of the attention scores and of the final logits.
    attn_softcap: float | None = None
    final_softcap: float | None = None
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    # Phi-3: q, k and v as one tensor (attn_qkv), gate and up as one (ffn_up, 2 x intermediate).
    fused_projections: bool = False
    # Phi-4-mini: RoPE turns only this many of a head's dimensions (partial_rotary_factor).
    rotary_dim: int | None = None
    # The model's own vocabulary (vocab_size: the embedding's rows) and whether its head is
    # the embedding (tie_word_embeddings); what `real_vocab` files have.
    vocab: int | None = None
    tied: bool = True
    # A sparse mixture-of-experts MLP on every layer (Qwen3-MoE): experts a layer
    # (num_experts) and a token's (num_experts_per_tok); `intermediate` is then one expert's
    # width (moe_intermediate_size) and `dense_intermediate` the config's intermediate_size,
    # which GGUF's feed_forward_length carries though no layer has a dense MLP.
    experts: int = 0
    experts_used: int = 0
    dense_intermediate: int | None = None
    # Qwen2-MoE: a shared expert of this width beside the routed ones, its output scaled by a
    # sigmoid gate (ffn_gate_inp_shexp, a vector); 0: none.
    shared_expert: int = 0
    # gpt-oss: attention sinks, a bias on attn_output too, biases on the router and experts,
    # its pre-MLP norm under llama.cpp's post_attention_norm, and YaRN (factor, original
    # context) with its ramp at beta_fast 32, beta_slow 1.
    attention_sinks: bool = False
    out_bias: bool = False
    expert_biases: bool = False
    # Granite: its four multipliers (embedding, residual, attention, logit scales).
    granite: tuple[float, float, float, float] | None = None
    mlp_norm: str = "ffn_norm"
    yarn: tuple[float, int] | None = None
    # Ministral 3: Llama 4's attention temperature (llama_4_scaling_beta) over YaRN's original
    # context, and its mscale_all_dim (yarn_log_multiplier).
    attn_temperature: float | None = None
    # A Qwen3-Reranker as llama.cpp's converter writes it: `cls.output` (the LM head's rows of
    # "yes" and "no"), pooling type rank, and its prompt as the "rerank" chat template.
    reranker: bool = False
    # LFM2: the layers that attend (its full_attn_idxs); the others are short convolutions
    # over `conv_kernel` tokens (blk.N.shortconv.*), and the final norm is token_embd_norm.
    attention_layers: tuple[int, ...] | None = None
    conv_kernel: int = 3
    # LFM2-MoE: the first layers' MLPs dense (dense_intermediate wide), experts past them
    # (leading_dense_block_count), routed by sigmoid scores with a selection bias a layer
    # (exp_probs_b).
    leading_dense: int = 0
    sigmoid_router: bool = False
    # Gemma 4: one layer in `full_every` attends fully, with heads of its own size and count
    # (RoPE over a quarter of them: llama.cpp's rope_freqs), its keys its values where
    # `keys_as_values`; the last `kv_shared` layers read earlier layers' K/V (no attn_k/v of
    # their own), their MLPs twice as wide with `double_mlp`; `per_layer_input` values a
    # layer from a per-layer embedding table (0: none).
    full_every: int = 0
    full_head_dim: int | None = None
    full_kv_heads: int | None = None
    keys_as_values: bool = False
    kv_shared: int = 0
    double_mlp: bool = False
    per_layer_input: int = 0
    # Gemma 4 26B-A4B: on every layer the experts beside a dense MLP (dense_intermediate
    # wide), each output normed (post_ffw_norm_1, _2), the experts' input by its own norm
    # (pre_ffw_norm_2), gate and up in one stack (ffn_gate_up_exps), the router's input scale
    # (ffn_gate_inp.scale) and a scale an expert (ffn_down_exps.scale), as llama.cpp's
    # converter writes them.
    experts_beside_dense: bool = False
    # Qwen3-VL: M-RoPE's split of a head's frequencies (rope.dimension_sections: time,
    # height, width) and how many layers its tower's DeepStack rows are added after.
    mrope_section: tuple[int, int, int] | None = None
    deepstack_layers: int = 0

    def is_conv(self, layer: int) -> bool:
        return self.attention_layers is not None and layer not in self.attention_layers

    def is_full(self, layer: int) -> bool:
        """A Gemma 4 layer outside the window."""
        return self.full_every > 0 and layer % self.full_every == self.full_every - 1

    def layer_attention(self, layer: int) -> tuple[int, int]:
        """(kv heads, head size) of a layer."""
        if self.is_full(layer):
            return self.full_kv_heads or self.kv_heads, self.full_head_dim or self.head_dim
        return self.kv_heads, self.head_dim

    def layer_width(self, layer: int) -> int:
        """A dense layer's MLP width (Gemma 4's shared layers': doubled with double_mlp)."""
        doubled = self.double_mlp and layer >= self.layers - self.kv_shared
        return (self.dense_intermediate or self.intermediate) * (2 if doubled else 1)


# The published configs (config.json of each model on the Hugging Face hub; Gemma 3's
# text_config). Vocabulary and head are the real ones only in `real_vocab` files: otherwise
# every preset has the bundled 49,152-token tokenizer and a tied head.
# fmt: off
PRESETS: dict[str, Shape] = {
    #                    arch      source                 hidden  inter layers heads kv  hd  rope theta context  rms eps
    "tiny":       Shape("llama",  "a few MB, for tests",      64,   128,   2,   4,   2,  16,  10000.0,   2048, 1e-5),
    "llama-1b":   Shape("llama",  "Llama-3.2-1B",           2048,  8192,  16,  32,   8,  64, 500000.0, 131072, 1e-5,
                        llama3_rope=(32.0, 1.0, 4.0, 8192), vocab=128256),
    "llama-3b":   Shape("llama",  "Llama-3.2-3B",           3072,  8192,  28,  24,   8, 128, 500000.0, 131072, 1e-5,
                        llama3_rope=(32.0, 1.0, 4.0, 8192), vocab=128256),
    "llama-8b":   Shape("llama",  "Llama-3.1-8B",           4096, 14336,  32,  32,   8, 128, 500000.0, 131072, 1e-5,
                        llama3_rope=(8.0, 1.0, 4.0, 8192), vocab=128256, tied=False),
    # llama.cpp stores Mistral as "llama"
    "mistral-7b": Shape("llama",  "Mistral-7B-v0.3",        4096, 14336,  32,  32,   8, 128,      1e6,  32768, 1e-5,
                        vocab=32768, tied=False),
    "qwen3-4b":   Shape("qwen3",  "Qwen3-4B",               2560,  9728,  36,  32,   8, 128,      1e6,  40960, 1e-6,
                        qk_norm=True, vocab=151936),
    "qwen3-8b":   Shape("qwen3",  "Qwen3-8B",               4096, 12288,  36,  32,   8, 128,      1e6,  40960, 1e-6,
                        qk_norm=True, vocab=151936, tied=False),
    "gemma3-4b":  Shape("gemma3", "gemma-3-4b-it",          2560, 10240,  34,   8,   4, 256,      1e6, 131072, 1e-6,
                        qk_norm=True, sliding_window=1024, rope_local_theta=10000.0, rope_linear_factor=8.0,
                        vocab=262208),
    "gemma2-2b":  Shape("gemma2", "gemma-2-2b-it",          2304,  9216,  26,   8,   4, 256,  10000.0,   8192, 1e-6,
                        sliding_window=4096, attn_softcap=50.0, final_softcap=30.0, vocab=256000),
    "qwen2.5-3b": Shape("qwen2",  "Qwen2.5-3B-Instruct",    2048, 11008,  36,  16,   2, 128,      1e6,  32768, 1e-6,
                        qkv_bias=True, vocab=151936),
    "qwen2.5-7b": Shape("qwen2",  "Qwen2.5-7B-Instruct",    3584, 18944,  28,  28,   4, 128,      1e6,  32768, 1e-6,
                        qkv_bias=True, vocab=152064, tied=False),
    "phi3-mini":  Shape("phi3",   "Phi-3-mini-4k-instruct", 3072,  8192,  32,  32,  32,  96,  10000.0,   4096, 1e-5,
                        sliding_window=2047, fused_projections=True, vocab=32064, tied=False),
    # Its longrope factors (past a 4k original context) are not written: plain RoPE over the
    # whole context, which a step's speed does not see.
    "phi4-mini":  Shape("phi3",   "Phi-4-mini-instruct",    3072,  8192,  32,  24,   8, 128,  10000.0, 131072, 1e-5,
                        fused_projections=True, rotary_dim=96, vocab=200064),
    # Rows of 1152 inputs: not whole K-quant blocks, which llama-quantize gives another type.
    "gemma3-1b":  Shape("gemma3", "gemma-3-1b-it",          1152,  6912,  26,   4,   1, 256,      1e6,  32768, 1e-6,
                        qk_norm=True, sliding_window=512, rope_local_theta=10000.0, vocab=262144),
    "qwen3-1.7b": Shape("qwen3",  "Qwen3-1.7B",             2048,  6144,  28,  16,   8, 128,      1e6,  40960, 1e-6,
                        qk_norm=True, vocab=151936),
    # Qwen3-VL-2B-Instruct's language model (its vision tower: bench/shaped_mmproj.py).
    "qwen3vl-2b": Shape("qwen3vl", "Qwen3-VL-2B-Instruct",  2048,  6144,  28,  16,   8, 128,      5e6, 262144, 1e-6,
                        qk_norm=True, vocab=151936, mrope_section=(24, 20, 20), deepstack_layers=3),
    # Qwen2.5-VL-3B-Instruct's language model (its vision tower: bench/shaped_mmproj.py).
    "qwen2.5vl-3b": Shape("qwen2vl", "Qwen2.5-VL-3B-Instruct", 2048, 11008, 36,  16,   2, 128,      1e6, 128000, 1e-6,
                        qkv_bias=True, vocab=151936, mrope_section=(16, 24, 24)),
    "qwen3-reranker-0.6b": Shape("qwen3", "Qwen3-Reranker-0.6B", 1024, 3072, 28,  16,   8, 128,      1e6,  40960, 1e-6,
                        qk_norm=True, vocab=151936, reranker=True),
    # Full multi-head attention: 32 K/V heads, 16x a grouped 8B's cache a token.
    "llama2-7b":  Shape("llama",  "Llama-2-7b-chat-hf",     4096, 11008,  32,  32,  32, 128,  10000.0,   4096, 1e-5,
                        vocab=32000, tied=False),
    # 128 experts of 768 a layer, 8 a token: 30.5B weights, 3.3B of them read a token. Its F16
    # file (61 GB) rarely fits a disk: big_models.py --random-blocks writes Q4_K_M directly.
    "qwen3-30b-a3b": Shape("qwen3moe", "Qwen3-30B-A3B",     2048,   768,  48,  32,   4, 128,      1e6,  40960, 1e-6,
                        qk_norm=True, vocab=151936, tied=False, experts=128, experts_used=8,
                        dense_intermediate=6144),
    # Ten short-convolution layers around six attention layers (its config as remembered,
    # not re-read offline; the MLP width its config's 12288 makes, block_auto_adjust_ff_dim).
    "lfm2-1.2b":  Shape("lfm2",   "LFM2-1.2B",              2048,  8192,  16,  32,   8,  64,      1e6, 128000, 1e-5,
                        qk_norm=True, vocab=65536, attention_layers=(2, 5, 8, 10, 12, 14)),
    # Mistral with YaRN 16x over 16,384 tokens and Llama 4's attention temperature (its text
    # config as remembered, not re-read offline).
    "ministral3-3b": Shape("mistral3", "Ministral-3-3B-Instruct-2512", 3072, 9216, 26, 32, 8, 128,   1e6, 262144, 1e-5,
                        vocab=131072, yarn=(16.0, 16384), attn_temperature=0.1),
    # LFM2's layers (18 conv, 6 attention) with 32 experts of 1792 a layer, 4 a token, past two
    # dense MLPs of 7168: 8.3B weights, 1.5B of them read a token (its config as remembered,
    # not re-read offline).
    "lfm2-8b-a1b": Shape("lfm2moe", "LFM2-8B-A1B",         2048,  1792,  24,  32,   8,  64,      1e6, 128000, 1e-5,
                        qk_norm=True, vocab=65536, attention_layers=(2, 6, 10, 14, 18, 21),
                        experts=32, experts_used=4, dense_intermediate=7168, leading_dense=2,
                        sigmoid_router=True),
    "olmo2-1b":   Shape("olmo2",  "OLMo-2-0425-1B",         2048,  8192,  16,  16,  16, 128, 500000.0,   4096, 1e-6,
                        qk_norm=True, qk_norm_whole=True, vocab=100352, tied=False),
    # OLMo 2's norms with per-head q/k norms, Llama 3's rope scaling; no window in the 1.2B (its
    # config as remembered, not re-read offline).
    "exaone4-1.2b": Shape("exaone4", "EXAONE-4.0-1.2B",      2048,  4096,  30,  32,   8,  64,      1e6,  65536, 1e-5,
                        qk_norm=True, llama3_rope=(16.0, 1.0, 4.0, 8192), vocab=102400),
    # OLMo 2's layer with a 4096-token window on three layers in four and YaRN on the fourth,
    # written as llama.cpp's converter writes OLMo 3: olmo2 with a window (its config as
    # remembered, not re-read offline; 100,278 rows of vocabulary: not whole tiles of 16).
    "olmo3-7b":   Shape("olmo2",  "Olmo-3-7B-Instruct",     4096, 11008,  32,  32,  32, 128, 500000.0,  65536, 1e-6,
                        qk_norm=True, qk_norm_whole=True, vocab=100278, tied=False,
                        sliding_window=4096, yarn=(8.0, 8192)),
    # 60 experts of 1408 a layer, 4 a token, and a shared expert of 5632: 14.3B weights, 2.7B
    # of them read a token (its config as remembered, not re-read offline).
    "qwen1.5-moe-a2.7b": Shape("qwen2moe", "Qwen1.5-MoE-A2.7B",  2048,  1408,  24,  16,  16, 128,  1000000.0,   8192, 1e-6,
                        qkv_bias=True, vocab=151936, tied=False, experts=60, experts_used=4,
                        dense_intermediate=5632, shared_expert=5632),
    "olmoe-1b-7b": Shape("olmoe", "OLMoE-1B-7B-0924",       2048,  1024,  16,  16,  16, 128,  10000.0,   4096, 1e-5,
                        qk_norm=True, qk_norm_whole=True, vocab=50304, tied=False, experts=64,
                        experts_used=8),
    # 40 experts of 512 a layer, 8 a token: 3.3B weights, 0.8B of them read a token (its
    # config as remembered, not re-read offline; its vocabulary is 49,155, 3 rows more than
    # the bundled tokenizer's whole tiles here).
    "granite-3b-a800m": Shape("granitemoe", "granite-3.1-3b-a800m-instruct", 1536, 512, 32, 24, 8, 64, 10000000.0, 131072, 1e-6,
                        vocab=49152, experts=40, experts_used=8, granite=(12.0, 0.22, 0.015625, 6.0)),
    # 32 experts of 2880 a layer, 4 a token: 20.9B weights, 3.6B of them read a token. Its F16
    # file is 42 GB: big_models.py --random-blocks --types MXFP4_MOE writes the layout of
    # ggml-org's gpt-oss-20b GGUF directly (experts MXFP4, the rest Q8_0).
    "gpt-oss-20b": Shape("gpt-oss", "gpt-oss-20b",          2880,  2880,  24,  64,   8,  64, 150000.0, 131072, 1e-5,
                        vocab=201088, tied=False, experts=32, experts_used=4, sliding_window=128,
                        qkv_bias=True, out_bias=True, attention_sinks=True, expert_biases=True,
                        mlp_norm="post_attention_norm", yarn=(32.0, 4096)),
    # Gemma 4's small models: four windowed layers to one full one (E2B; five to one in E4B),
    # heads of 512 on the full layers, the last 20 (18) layers reading earlier layers' K/V,
    # per-layer embeddings of 256 a layer (E2B: 2.3B of its 5.1B weights, one row a token
    # read). Their text configs (google/gemma-4-E2B-it, -E4B-it), as published.
    "gemma4-e2b": Shape("gemma4", "gemma-4-E2B-it",        1536,  6144,  35,   8,   1, 256,      1e6, 131072, 1e-6,
                        qk_norm=True, sliding_window=512, rope_local_theta=10000.0, final_softcap=30.0,
                        vocab=262144, full_every=5, full_head_dim=512, kv_shared=20, double_mlp=True,
                        per_layer_input=256),
    "gemma4-e4b": Shape("gemma4", "gemma-4-E4B-it",        2560, 10240,  42,   8,   2, 256,      1e6, 131072, 1e-6,
                        qk_norm=True, sliding_window=512, rope_local_theta=10000.0, final_softcap=30.0,
                        vocab=262144, full_every=6, full_head_dim=512, kv_shared=18, per_layer_input=256),
    # Gemma 4's mixture of experts: on each of 30 layers 128 experts of 704, 8 a token, beside
    # a dense MLP of 2112; five windowed layers to one full one, whose 2 kv heads of 512 are
    # keys and values at once: 25.2B weights, 3.8B of them read a token (its text config as
    # published copies of it give it, not re-read offline).
    "gemma4-26b-a4b": Shape("gemma4", "gemma-4-26B-A4B-it", 2816,   704,  30,  16,   8, 256,      1e6, 262144, 1e-6,
                        qk_norm=True, sliding_window=1024, rope_local_theta=10000.0, final_softcap=30.0,
                        vocab=262144, full_every=6, full_head_dim=512, full_kv_heads=2,
                        keys_as_values=True, experts=128, experts_used=8, dense_intermediate=2112,
                        experts_beside_dense=True),
}
# fmt: on


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # row-major (numpy's order; GGUF stores it reversed)
    # "weight" (random, F16), "bias" or "router" (random, F32: llama-quantize keeps a
    # router's few rows in F32), "norm" (ones, F32) or "rope_freqs" (F32)
    kind: str

    @property
    def dtype(self) -> type[np.floating[Any]]:
        return np.float16 if self.kind == "weight" else np.float32

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def tensor_specs(shape: Shape, vocab: int, head: bool = False) -> list[TensorSpec]:
    """The tensors of a file of this shape, in llama.cpp's converter's names and order; with
    `head`, an output.weight of its own (an untied head)."""
    h = shape.hidden
    specs = [TensorSpec("token_embd.weight", (vocab, h), "weight")]
    if shape.llama3_rope or shape.full_every:  # Gemma 4's: its full layers' share of RoPE
        rotated = shape.full_head_dim or shape.head_dim
        specs.append(TensorSpec("rope_freqs.weight", (rotated // 2,), "rope_freqs"))
    if shape.per_layer_input:
        width = shape.layers * shape.per_layer_input
        specs.append(TensorSpec("per_layer_token_embd.weight", (vocab, width), "weight"))
        specs.append(TensorSpec("per_layer_model_proj.weight", (width, h), "weight"))
        specs.append(TensorSpec("per_layer_proj_norm.weight", (shape.per_layer_input,), "norm"))
    gemma = shape.arch.startswith("gemma")
    olmo2 = shape.arch in ("olmo2", "exaone4")  # norms on the blocks' outputs only
    for i in range(shape.layers):
        blk = f"blk.{i}"
        if not olmo2:
            specs.append(TensorSpec(f"{blk}.attn_norm.weight", (h,), "norm"))
        if shape.is_conv(i):  # LFM2's conv layer in place of attention, then the MLP
            specs.append(TensorSpec(f"{blk}.shortconv.in_proj.weight", (3 * h, h), "weight"))
            specs.append(TensorSpec(f"{blk}.shortconv.conv.weight", (h, shape.conv_kernel), "bias"))
            specs.append(TensorSpec(f"{blk}.shortconv.out_proj.weight", (h, h), "weight"))
            specs += _mlp(blk, shape, i)
            continue
        kv_heads, hd = shape.layer_attention(i)
        q, kv = shape.heads * hd, kv_heads * hd
        # Gemma 4: q alone in a layer that reads another's K/V, no v where keys are values.
        shared = i >= shape.layers - shape.kv_shared
        parts = (("attn_q", q), ("attn_k", kv), ("attn_v", kv))
        parts = parts[: 1 if shared else 2 if shape.keys_as_values and shape.is_full(i) else 3]
        if shape.fused_projections:
            specs.append(TensorSpec(f"{blk}.attn_qkv.weight", (q + 2 * kv, h), "weight"))
        else:
            for name, rows in parts:
                specs.append(TensorSpec(f"{blk}.{name}.weight", (rows, h), "weight"))
                if shape.qkv_bias:
                    specs.append(TensorSpec(f"{blk}.{name}.bias", (rows,), "bias"))
        if shape.qk_norm:
            whole = shape.qk_norm_whole
            specs.append(TensorSpec(f"{blk}.attn_q_norm.weight", (q if whole else hd,), "norm"))
            if not shared:
                specs.append(
                    TensorSpec(f"{blk}.attn_k_norm.weight", (kv if whole else hd,), "norm")
                )
        specs.append(TensorSpec(f"{blk}.attn_output.weight", (h, shape.heads * hd), "weight"))
        if shape.out_bias:
            specs.append(TensorSpec(f"{blk}.attn_output.bias", (h,), "bias"))
        if shape.attention_sinks:
            specs.append(TensorSpec(f"{blk}.attn_sinks.weight", (shape.heads,), "bias"))
        if gemma or olmo2:  # the norms on the attention's and the MLP's outputs
            specs.append(TensorSpec(f"{blk}.post_attention_norm.weight", (h,), "norm"))
        mlp = _mlp(blk, shape, i)
        specs += mlp[1:] if olmo2 else mlp  # OLMo 2: no norm before the MLP
        if gemma or olmo2:
            specs.append(TensorSpec(f"{blk}.post_ffw_norm.weight", (h,), "norm"))
        if shape.per_layer_input:  # Gemma 4's per-layer input: gate, projection, norm
            size = shape.per_layer_input
            specs.append(TensorSpec(f"{blk}.inp_gate.weight", (size, h), "weight"))
            specs.append(TensorSpec(f"{blk}.proj.weight", (h, size), "weight"))
            specs.append(TensorSpec(f"{blk}.post_norm.weight", (h,), "norm"))
        if shape.full_every:  # Gemma 4's layer scalar
            specs.append(TensorSpec(f"{blk}.layer_output_scale.weight", (1,), "norm"))
    final_norm = "token_embd_norm" if shape.attention_layers is not None else "output_norm"
    specs.append(TensorSpec(f"{final_norm}.weight", (h,), "norm"))
    if shape.reranker:
        specs.append(TensorSpec("cls.output.weight", (2, h), "weight"))
    if head:
        specs.append(TensorSpec("output.weight", (vocab, h), "weight"))
    return specs


def _mlp(blk: str, shape: Shape, layer: int) -> list[TensorSpec]:
    """A layer's norm before its MLP, then its MLP: experts, stacked one tensor a projection
    (with a shared expert, biases or a selection bias where the shape has them), or dense
    projections (LFM2-MoE's leading layers: dense_intermediate wide)."""
    h = shape.hidden
    specs = [TensorSpec(f"{blk}.{shape.mlp_norm}.weight", (h,), "norm")]
    if shape.experts_beside_dense:
        return specs + _dense_and_experts(blk, shape)
    if not shape.experts or layer < shape.leading_dense:
        # dense_intermediate: a MoE shape's dense width (LFM2-MoE's leading layers)
        return specs + _dense_projections(blk, shape, shape.layer_width(layer))
    e, i_ = shape.experts, shape.intermediate
    specs.append(TensorSpec(f"{blk}.ffn_gate_inp.weight", (e, h), "router"))
    specs.append(TensorSpec(f"{blk}.ffn_gate_exps.weight", (e, i_, h), "weight"))
    specs.append(TensorSpec(f"{blk}.ffn_up_exps.weight", (e, i_, h), "weight"))
    specs.append(TensorSpec(f"{blk}.ffn_down_exps.weight", (e, h, i_), "weight"))
    if shape.sigmoid_router:
        specs.append(TensorSpec(f"{blk}.exp_probs_b.bias", (e,), "bias"))
    if shape.shared_expert:
        s_ = shape.shared_expert
        specs.append(TensorSpec(f"{blk}.ffn_gate_inp_shexp.weight", (h,), "router"))
        specs += _dense_projections(blk, shape, s_, "_shexp")
    if shape.expert_biases:
        specs.append(TensorSpec(f"{blk}.ffn_gate_inp.bias", (e,), "bias"))
        for name, width in (("gate", i_), ("up", i_), ("down", h)):
            specs.append(TensorSpec(f"{blk}.ffn_{name}_exps.bias", (e, width), "bias"))
    return specs


def _dense_and_experts(blk: str, shape: Shape) -> list[TensorSpec]:
    """Gemma 4 26B-A4B's MLP block past its first norm: the dense MLP and the experts beside
    it, with their norms and the router's scales."""
    h, e, i_ = shape.hidden, shape.experts, shape.intermediate
    assert shape.dense_intermediate is not None
    return [
        *_dense_projections(blk, shape, shape.dense_intermediate),
        TensorSpec(f"{blk}.post_ffw_norm_1.weight", (h,), "norm"),
        TensorSpec(f"{blk}.pre_ffw_norm_2.weight", (h,), "norm"),
        TensorSpec(f"{blk}.ffn_gate_inp.weight", (e, h), "router"),
        TensorSpec(f"{blk}.ffn_gate_inp.scale", (h,), "norm"),
        TensorSpec(f"{blk}.ffn_gate_up_exps.weight", (e, 2 * i_, h), "weight"),
        TensorSpec(f"{blk}.ffn_down_exps.weight", (e, h, i_), "weight"),
        TensorSpec(f"{blk}.ffn_down_exps.scale", (e,), "norm"),
        TensorSpec(f"{blk}.post_ffw_norm_2.weight", (h,), "norm"),
    ]


def _dense_projections(blk: str, shape: Shape, i_: int, suffix: str = "") -> list[TensorSpec]:
    """A dense MLP's projections, `i_` wide (`suffix`: a shared expert's, _shexp)."""
    h = shape.hidden
    specs = []
    if shape.fused_projections:
        specs.append(TensorSpec(f"{blk}.ffn_up{suffix}.weight", (2 * i_, h), "weight"))
    else:
        specs.append(TensorSpec(f"{blk}.ffn_gate{suffix}.weight", (i_, h), "weight"))
        specs.append(TensorSpec(f"{blk}.ffn_up{suffix}.weight", (i_, h), "weight"))
    specs.append(TensorSpec(f"{blk}.ffn_down{suffix}.weight", (h, i_), "weight"))
    return specs


def llama3_rope_freqs(shape: Shape) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter computes from Llama 3's rope_scaling
    (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors)."""
    assert shape.llama3_rope is not None
    factor, low_freq_factor, high_freq_factor, old_context = shape.llama3_rope
    dim = shape.head_dim
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def proportional_rope_freqs(shape: Shape) -> np.ndarray:
    """Gemma 4's full layers' rope_freqs as llama.cpp's converter writes them: 1 for the
    quarter of the frequencies its proportional RoPE turns, 1e30 (none) for the rest."""
    half = (shape.full_head_dim or shape.head_dim) // 2
    return np.asarray([1.0] * (half // 4) + [1e30] * (half - half // 4), dtype=np.float32)


def tokenizer_metadata(source: Path | None = None) -> dict[str, Any]:
    """The `tokenizer.*` keys (vocabulary, merges, special ids, chat template) of a GGUF,
    by default the bundled model's."""
    from iterserve.model.gguf_loader import read_gguf_header

    metadata, _ = read_gguf_header(source or default_model_path())
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


# A vocabulary grown past the bundled one: tokens no merge makes, so text never becomes
# them (byte-level BPE spells ASCII as itself); llama.cpp's NORMAL token type.
_FILLER = "<filler{}>"
_NORMAL_TOKEN = 1


def resize_vocabulary(tokenizer: dict[str, Any], size: int) -> dict[str, Any]:
    """The `tokenizer.*` keys of a byte-level BPE vocabulary with `size` tokens: cut to its
    first `size` (the merges kept that join two kept tokens into a kept one, so the cut
    vocabulary tokenizes text on its own), or grown by filler tokens (`_FILLER`)."""
    tokens: list[str] = tokenizer["tokenizer.ggml.tokens"]
    types: list[int] = tokenizer["tokenizer.ggml.token_type"]
    resized = dict(tokenizer)
    if size <= len(tokens):
        kept = set(tokens[:size])
        resized["tokenizer.ggml.tokens"] = tokens[:size]
        resized["tokenizer.ggml.token_type"] = types[:size]
        resized["tokenizer.ggml.merges"] = [
            merge
            for merge in tokenizer["tokenizer.ggml.merges"]
            if all(part in kept for part in merge.split(" ")) and merge.replace(" ", "") in kept
        ]
    else:
        extra = range(len(tokens), size)
        resized["tokenizer.ggml.tokens"] = tokens + [_FILLER.format(i) for i in extra]
        resized["tokenizer.ggml.token_type"] = types + [_NORMAL_TOKEN] * len(extra)
    if any(v >= size for k, v in resized.items() if k.endswith("_token_id")):
        raise ValueError(f"a special token's id is past a {size}-token vocabulary")
    return resized


def _add_value(writer: GGUFWriter, key: str, value: Any) -> None:
    """One key with the type llama.cpp reads it as (read_gguf_header returns plain values)."""
    if isinstance(value, bool):  # before int: a bool is an int
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)  # token ids
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:  # token strings and merges, token types (int32, as llama.cpp's converter writes)
        writer.add_array(key, value)


def add_shape_metadata(writer: GGUFWriter, shape: Shape, vocab: int) -> None:
    """The hyperparameter keys llama.cpp and iterserve read for the architecture."""
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    if shape.full_every:  # MLP widths, kv heads and head sizes a layer
        _add_gemma4_metadata(writer, shape)
    else:
        writer.add_feed_forward_length(shape.dense_intermediate or shape.intermediate)
        if shape.attention_layers is not None:  # LFM2: no kv heads marks a conv layer
            writer.add_head_count_kv(
                [0 if shape.is_conv(i) else shape.kv_heads for i in range(shape.layers)]
            )
            writer.add_shortconv_l_cache(shape.conv_kernel)
        else:
            writer.add_head_count_kv(shape.kv_heads)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_rope_dimension_count(shape.rotary_dim or shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    if shape.sliding_window is not None:
        writer.add_sliding_window(shape.sliding_window)
    if shape.rope_local_theta is not None:
        writer.add_rope_freq_base_swa(shape.rope_local_theta)
    if shape.rope_linear_factor is not None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(shape.rope_linear_factor)
    if shape.yarn is not None:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(shape.yarn[1])
        writer.add_rope_scaling_yarn_beta_fast(32.0)
        writer.add_rope_scaling_yarn_beta_slow(1.0)
    if shape.attn_temperature is not None:
        writer.add_rope_scaling_yarn_log_mul(1.0)
        writer.add_attn_temperature_scale(shape.attn_temperature)
    if shape.attn_softcap is not None:
        writer.add_attn_logit_softcapping(shape.attn_softcap)
    if shape.final_softcap is not None:
        writer.add_final_logit_softcapping(shape.final_softcap)
    if shape.reranker:
        writer.add_pooling_type(PoolingType.RANK)
        writer.add_classifier_output_labels(["yes", "no"])
        writer.add_chat_template([{"name": "rerank", "template": QWEN3_RERANKER_TEMPLATE}])
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.intermediate)
    if shape.shared_expert:
        writer.add_expert_shared_feed_forward_length(shape.shared_expert)
    if shape.leading_dense:
        writer.add_leading_dense_block_count(shape.leading_dense)
    if shape.sigmoid_router:
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if shape.mrope_section is not None:
        writer.add_rope_dimension_sections([*shape.mrope_section, 0])
    if shape.deepstack_layers:
        writer.add_num_deepstack_layers(shape.deepstack_layers)
    if shape.granite is not None:
        embedding, residual, attention, logit = shape.granite
        writer.add_embedding_scale(embedding)
        writer.add_residual_scale(residual)
        writer.add_attention_scale(attention)
        writer.add_logit_scale(logit)


def _add_gemma4_metadata(writer: GGUFWriter, shape: Shape) -> None:
    """Gemma 4's keys as llama.cpp's converter writes them: MLP widths and kv heads a
    layer, the full layers' head size as key_length (and RoPE's), the windowed layers' as
    key_length_swa, which layers slide, how many share K/V, the per-layer embeddings' width."""
    layers = range(shape.layers)
    writer.add_feed_forward_length([shape.layer_width(i) for i in layers])
    writer.add_head_count_kv([shape.layer_attention(i)[0] for i in layers])
    full = shape.full_head_dim or shape.head_dim
    writer.add_key_length(full)
    writer.add_value_length(full)
    writer.add_key_length_swa(shape.head_dim)
    writer.add_value_length_swa(shape.head_dim)
    writer.add_rope_dimension_count(full)
    writer.add_rope_dimension_count_swa(shape.head_dim)
    writer.add_sliding_window_pattern([not shape.is_full(i) for i in layers])
    writer.add_shared_kv_layers(shape.kv_shared)
    writer.add_embedding_length_per_layer_input(shape.per_layer_input)


def _random_weight(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """N(0, WEIGHT_STD) in F16, drawn in float32 a chunk at a time, so that beside the
    tensor itself only one chunk of draws is held."""
    out = np.empty(spec.shape, dtype=np.float16)
    flat = out.reshape(-1)
    draws = np.empty(min(_CHUNK, flat.size), dtype=np.float32)
    for start in range(0, flat.size, _CHUNK):
        part = draws[: min(_CHUNK, flat.size - start)]
        rng.standard_normal(out=part, dtype=np.float32)
        np.multiply(part, WEIGHT_STD, out=flat[start : start + part.size], casting="same_kind")
    return out


# Byte offsets of the fp16 scales in each quantized type's block (ggml-common.h's structs),
# and of the E8M0 exponents (a scale 2^(e - 128)).
HALF_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "IQ4_NL": (0,), "MXFP4": (), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ2_XXS": (0,),
}  # fmt: skip
EXPONENT_FIELDS = {"MXFP4": (0,)}


def random_blocks(
    qtype: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01
) -> np.ndarray:
    """[rows, row bytes] of random blocks of GGUF type `qtype`: random bits, but for finite
    scales in [scale / 10, scale] (fp16, or powers of two; a weight of a few hundredths at
    most)."""
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    out = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        halves = rng.uniform(scale / 10, scale, (rows, cols // block)).astype(np.float16)
        out[..., at : at + 2] = halves.view(np.uint8).reshape(rows, cols // block, 2)
    for at in EXPONENT_FIELDS.get(qtype, ()):
        scales = rng.uniform(scale / 5, scale, (rows, cols // block))
        out[..., at] = 128 + np.floor(np.log2(scales)).astype(np.int64)
    return out.reshape(rows, -1)


# llama-quantize's type for a tensor whose rows are not whole 256-value blocks (its
# tensor_type_fallback): Gemma 4 26B-A4B's down projections, 704 and 2112 wide.
_K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m_types(spec: TensorSpec, shape: Shape) -> str | None:
    """The type llama.cpp's Q4_K_M gives a weight (llama-quantize's rules): Q6_K for the
    head (output.weight, or the tied embedding; an untied one llama.cpp makes Q4_K) and for
    attn_v and ffn_down in the first and last eighth of the layers and every third between;
    Q4_K elsewhere; a 32-value type where a row is not whole K-quant blocks; None (as
    written) for norms and tables."""
    qtype = _q4_k_m_type(spec, shape)
    if qtype is not None and spec.shape[-1] % 256:
        return _K_QUANT_FALLBACK[qtype]
    return qtype


def _q4_k_m_type(spec: TensorSpec, shape: Shape) -> str | None:
    if spec.kind != "weight":
        return None
    if spec.name in ("token_embd.weight", "output.weight", "per_layer_token_embd.weight"):
        return "Q6_K"  # Gemma 4's per-layer table is a token embedding to llama-quantize
    if spec.name == "per_layer_model_proj.weight":
        return None  # llama-quantize leaves it F16
    part = spec.name.split(".")[2]
    if part in ("attn_v", "ffn_down", "ffn_down_exps", "ffn_down_shexp"):
        i, n = int(spec.name.split(".")[1]), shape.layers
        if i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def mxfp4_moe_types(spec: TensorSpec, shape: Shape) -> str | None:
    """The types of ggml-org's gpt-oss GGUFs (llama-quantize's MXFP4_MOE): the experts
    MXFP4, every other weight Q8_0; None (as written) for norms, biases and sinks."""
    if spec.kind != "weight":
        return None
    return "MXFP4" if "_exps." in spec.name else "Q8_0"


# The layouts --random-blocks writes, by the llama-quantize type they stand for.
RANDOM_BLOCK_LAYOUTS: dict[str, Callable[[TensorSpec, Shape], str | None]] = {
    "Q4_K_M": q4_k_m_types,
    "MXFP4_MOE": mxfp4_moe_types,
}


def tensor_data(spec: TensorSpec, shape: Shape, seed: int, index: int) -> np.ndarray:
    """One tensor's values. Each weight has its own stream, seeded by (seed, its index), so a
    file is the same whatever order its tensors are made in.

    Llama's HF-to-GGUF converter permutes the q/k rows for llama.cpp's rope layout (and
    iterserve's loader undoes it); on random weights a permutation of rows is as random as
    the rows were, so nothing is permuted here."""
    if spec.kind == "norm":
        return np.ones(spec.shape, dtype=np.float32)
    if spec.kind == "rope_freqs":
        return proportional_rope_freqs(shape) if shape.full_every else llama3_rope_freqs(shape)
    rng = np.random.default_rng([seed, index])
    if spec.kind in ("bias", "router"):
        return rng.standard_normal(spec.shape, dtype=np.float32) * np.float32(WEIGHT_STD)
    return _random_weight(spec, rng)


def write_shaped_gguf(
    path: Path,
    preset: str | Shape,
    seed: int = 0,
    tokenizer: dict[str, Any] | None = None,
    blocks: Callable[[TensorSpec, Shape], str | None] | None = None,
    real_vocab: bool = False,
) -> Path:
    """Write a GGUF of `preset`'s shape with random weights to `path`: F16, or where
    `blocks` names a quantized type for a weight, random blocks of it. With `real_vocab`,
    the model's own vocabulary size and (un)tied head (Shape.vocab, Shape.tied).

    Tensor by tensor: every tensor's info is declared first, then each tensor's data is made
    and written, so at most one tensor (plus a 16 MiB chunk of draws) is in memory. Written to
    `path` + ".partial" and renamed at the end, so a file at `path` is always whole.
    `tokenizer`: the `tokenizer.*` keys (default: the bundled model's)."""
    shape = PRESETS[preset] if isinstance(preset, str) else preset
    name = preset if isinstance(preset, str) else shape.source
    tokenizer = tokenizer if tokenizer is not None else tokenizer_metadata()
    if real_vocab and shape.vocab is not None:
        tokenizer = resize_vocabulary(tokenizer, shape.vocab)
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    specs = tensor_specs(shape, vocab, head=real_vocab and not shape.tied)

    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, shape.arch)
    # The model's own name goes in the description: llama.cpp gives tokens of the real
    # vocabulary attributes by general.name (a "phi-3" name looks up "<s>", which the bundled
    # vocabulary has not, and the load fails).
    writer.add_name("random weights")
    writer.add_description(f"{name}: random weights in the shape of {shape.source}")
    writer.add_type("model")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    add_shape_metadata(writer, shape, vocab)
    for key, value in tokenizer.items():
        _add_value(writer, key, value)
    qtypes = {spec.name: blocks(spec, shape) if blocks else None for spec in specs}
    for spec in specs:
        qtype = qtypes[spec.name]
        if qtype is None:
            writer.add_tensor_info(spec.name, spec.shape, np.dtype(spec.dtype), spec.nbytes)
        else:
            kind = GGMLQuantizationType[qtype]
            block, nbytes = GGML_QUANT_SIZES[kind]
            size = math.prod(spec.shape) // block * nbytes
            byte_shape = (*spec.shape[:-1], spec.shape[-1] // block * nbytes)
            writer.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), size, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        for index, spec in enumerate(specs):
            qtype = qtypes[spec.name]
            if qtype is None:
                data = tensor_data(spec, shape, seed, index)
            else:
                rows, cols = math.prod(spec.shape[:-1]), spec.shape[-1]
                data = random_blocks(qtype, rows, cols, np.random.default_rng([seed, index]))
            writer.write_tensor_data(data)
            del data  # the next tensor is made only once this one is gone
    finally:
        writer.close()
    os.replace(partial, path)
    return path
