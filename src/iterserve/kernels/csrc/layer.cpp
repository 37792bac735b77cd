// One whole decoder layer of the Llama family in one call, for the engine's fast path.
//
//   x   = rms_norm(hidden) ; qkv = x W_qkv^T (+b) ; [per-head rms_norm(q, k) (Qwen3)] ;
//         rope(q, k) at each row's position
//   a   = attention(q, k, v) over the paged cache (this step's K/V stored first)
//   h   = hidden + a W_o^T (+b)
//   g,u = rms_norm(h) W_gate_up^T ; out = h + (silu(g) * u) W_down^T
//
// and Gemma's variants of it: GELU (tanh) for SiLU, "sandwich" norms on the attention's and the
// MLP's outputs before their residual adds (h = hidden + rms_norm(a W_o^T)), Gemma 2's
// attention logit soft-cap, and Gemma 3's sliding layers rotating by their own tables; and
// Mixtral's and Qwen3-MoE's, whose MLP is a mixture of experts (moe.cpp's experts_mlp); and
// LFM2's conv layers, a short convolution in place of attention (short_conv.cpp); and
// Ministral 3's attention temperature, each row's queries times a scale of its position; and
// Gemma 4's (decoder_layer only): values normed per head without a weight, layers that attend
// over an earlier layer's K/V (q alone projected, nothing stored: that layer stored this
// step's rows in the pool they share), full layers whose values are their keys as projected
// (q and k alone; the 31B's and 26B-A4B's), and the per-layer input each layer gates into its
// output before a scalar scales it,
//
//   out = (h + rms_norm((gelu(h W_plg^T) * per_layer_input) W_plp^T)) * layer_scalar;
//
// and Gemma 4 26B-A4B's experts beside the dense MLP (decoder_layer only), each output normed,
//
//   out = h + rms_norm(rms_norm(mlp(rms_norm(h))) + rms_norm(experts(rms_norm(h)))).
//
// The projections and attention are the kernels of linear.cpp and paged_attention.cpp; what
// this file adds is the glue between them (norms, rope, SiLU / GELU) and, above all, one dispatch
// per layer instead of ~9 (at one token a step's arithmetic is a few milliseconds and the
// per-op cost of ~270 calls (Python, dispatcher, buffer allocation) was a fifth of it), and
// one a step for all the layers (`decoder_stack`); the final norm of the rows the head reads
// is one call too (`norm_rows`).
//
// Rounding follows transformers' bf16 forward: norms in fp32, rounded, then times the bf16
// weight; SiLU rounded before the product with up; rope in fp32 rounded once (transformers
// rounds its two products and their sum separately: one bf16 rounding apart, as a compiled
// graph is). Hidden, head and intermediate sizes must be multiples of 16 (32 for head_dim);
// the model only takes this path when they are.

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

#include "ops.h"
#include "reused_empty.h"
#include "simd.h"
#include "strided_view.h"

namespace iterserve {
namespace {

using at::BFloat16;
using at::Tensor;

inline float to_float(BFloat16 v) { return static_cast<float>(v); }

// The mean of the squares of n values (n a multiple of 16), in fp32: every RMS norm's statistic.
inline float mean_square(const BFloat16* x, int64_t n) {
  F16 sum_sq = F16::zero();
  for (int64_t k = 0; k < n; k += 16) {
    const F16 v = load_bf16x16(x + k);
    sum_sq = fmadd(v, v, sum_sq);
  }
  return sum_sq.sum() / static_cast<float>(n);
}

// transformers' LlamaRMSNorm in bf16: normalise in fp32, round, multiply by the weight, round;
// with a residual (a sandwich norm's output added to the stream), that rounded output plus the
// residual, rounded again, as the eager layer rounds the two. One row of K values.
inline void norm_row(const BFloat16* row, const BFloat16* w, const BFloat16* res, BFloat16* dst,
                     int64_t K, double eps) {
  const F16 inv = F16::splat(1.0f / std::sqrt(mean_square(row, K) + static_cast<float>(eps)));
  for (int64_t k = 0; k < K; k += 16) {
    const F16 normed = round_bf16(load_bf16x16(row + k) * inv) * load_bf16x16(w + k);
    if (res) store_bf16x16(dst + k, round_bf16(normed) + load_bf16x16(res + k));
    else store_bf16x16(dst + k, normed);
  }
}

Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps,
                const Tensor* residual = nullptr) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 16 == 0, "decoder_layer: hidden size ", K, " is not a multiple of 16");
  Tensor out = empty_reused({M, K}, x.options());
  const BFloat16* w = weight.data_ptr<BFloat16>();
  const BFloat16* in = x.data_ptr<BFloat16>();
  const BFloat16* res = residual ? residual->data_ptr<BFloat16>() : nullptr;
  const int64_t ld_in = x.stride(0), ld_res = residual ? residual->stride(0) : 0;
  BFloat16* dst = out.data_ptr<BFloat16>();
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      norm_row(in + m * ld_in, w, res ? res + m * ld_res : nullptr, dst + m * K, K, eps);
  });
  return out;
}

// A block's input norm; an empty weight: none (OLMo 2 norms only the blocks' outputs).
Tensor pre_norm(const Tensor& x, const Tensor& weight, double eps) {
  return weight.numel() == 0 ? x : rms_norm(x, weight, eps);
}

// Rotate q and k in place: `heads` head_dim-wide slices at the start of each qkv row, at the
// row's position. cos and the sign-folded sin are [max_positions, rotated] tables (the first
// half of sin carries rotate_half's minus), so x' = x * cos + swap_halves(x) * sin over each
// head's first `rotated` dimensions (all of them but for a partial rotary: Phi-4-mini's 96 of
// 128); the rest of the head is left as it is. With `query_scales` (a float a row), the
// first `q_heads` heads (the queries) come out times their row's scale: Ministral 3's
// attention temperature, rope's product and the scale rounded once.
void rope_inplace(Tensor& qkv, int64_t heads, int64_t head_dim, const std::vector<int64_t>& pos,
                  const Tensor& cos, const Tensor& sin, const float* query_scales = nullptr,
                  int64_t q_heads = 0) {
  const int64_t M = qkv.size(0), rotated = cos.size(1), half = rotated / 2;
  TORCH_CHECK(half % 16 == 0 && rotated <= head_dim, "decoder_layer: rope over ", rotated,
              " of ", head_dim, " head dimensions: not a multiple of 32 up to head_dim");
  TORCH_CHECK(rotated > 0 || query_scales == nullptr,
              "decoder_layer: query scales on a layer without RoPE");
  if (rotated == 0) return;  // a layer without RoPE (SmolLM3's NoPE layers)
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const BFloat16* c = cos.data_ptr<BFloat16>() + pos[m] * rotated;
      const BFloat16* s = sin.data_ptr<BFloat16>() + pos[m] * rotated;
      BFloat16* row = qkv.data_ptr<BFloat16>() + m * qkv.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        BFloat16* x = row + h * head_dim;
        const bool scaled = query_scales != nullptr && h < q_heads;
        const F16 by = F16::splat(scaled ? query_scales[m] : 1.0f);
        for (int64_t d = 0; d < half; d += 16) {
          const F16 lo = load_bf16x16(x + d), hi = load_bf16x16(x + half + d);
          F16 new_lo = fmadd(lo, load_bf16x16(c + d), hi * load_bf16x16(s + d));
          F16 new_hi = fmadd(hi, load_bf16x16(c + half + d), lo * load_bf16x16(s + half + d));
          if (scaled) {
            new_lo = new_lo * by;
            new_hi = new_hi * by;
          }
          store_bf16x16(x + d, new_lo);
          store_bf16x16(x + half + d, new_hi);
        }
      }
    }
  });
}

// Chunks of 16 values a thread takes at least in the gated products. They are split by
// chunks, not by rows, so that one row's spreads over the threads too: a 1B's 8192 values at
// one row took 26.5 us by rows (one thread, the other waiting) and 17.4 us by chunks, of a
// ~1.4 ms layer (the two ways call by call in one process, a throwaway timed build; 2026-12-04,
// AVX2 Zen 3). Each value's arithmetic is its own, so the split changes no bit.
constexpr int64_t kGatedGrain = 64;

// act(g) * u for gate_up rows [g | u], each rounded as transformers' bf16 MLP does: the
// activation rounded, then its product with u. `gated(g, u)` gives that product from a
// chunk of 16 of each.
// The same for g and u apart: rows of I values each, with their own row strides.
template <typename Gated>
Tensor gated_pairs(const Tensor& g, const Tensor& u, Gated&& gated) {
  const int64_t M = g.size(0), I = g.size(1);
  TORCH_CHECK(I % 16 == 0, "decoder_layer: intermediate size ", I, " is not a multiple of 16");
  TORCH_CHECK(u.size(0) == M && u.size(1) == I && g.stride(1) == 1 && u.stride(1) == 1,
              "decoder_layer: the gated product's operands must be [rows, ", I,
              "] with contiguous rows");
  Tensor out = empty_reused({M, I}, g.options());
  const BFloat16* g0 = g.data_ptr<BFloat16>();
  const BFloat16* u0 = u.data_ptr<BFloat16>();
  BFloat16* out0 = out.data_ptr<BFloat16>();
  const int64_t chunks = I / 16, ld_g = g.stride(0), ld_u = u.stride(0);
  at::parallel_for(0, M * chunks, kGatedGrain, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t m = c / chunks, i = c % chunks * 16;
      store_bf16x16(out0 + m * I + i,
                    gated(load_bf16x16(g0 + m * ld_g + i), load_bf16x16(u0 + m * ld_u + i)));
    }
  });
  return out;
}

template <typename Gated>
Tensor gated_rows(const Tensor& gate_up, Gated&& gated) {
  const int64_t I = gate_up.size(1) / 2;
  return gated_pairs(columns(gate_up, 0, I), columns(gate_up, I, I), gated);
}

// Gelu: Gemma's GeGLU, gelu_tanh(g) = g sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3)
// (tanh's form 0.5 (1 + tanh(z)) is sigmoid(2z)); else SwiGLU's silu(g) = g sigmoid(g).
template <bool Gelu>
Tensor gated_mul_pairs(const Tensor& g, const Tensor& u) {
  const F16 two_c = F16::splat(2.0f * 0.7978845608028654f), cubic = F16::splat(0.044715f);
  return gated_pairs(g, u, [&](const F16& x, const F16& up) {
    F16 t = x;
    if constexpr (Gelu) t = two_c * fmadd(cubic * x * x, x, x);
    return round_bf16(x * sigmoid(t)) * up;
  });
}

template <bool Gelu>
Tensor gated_mul_rows(const Tensor& gate_up) {
  const int64_t I = gate_up.size(1) / 2;
  return gated_mul_pairs<Gelu>(columns(gate_up, 0, I), columns(gate_up, I, I));
}

// Rotary position of every row, from the step table (see ops.h).
std::vector<int64_t> positions_of(const Tensor& step, int64_t rows) {
  const StepTable table(step);
  const int32_t* shifts = table.rope_shifts();
  const Tensor lens_t = table.seq_lens(), starts_t = table.query_start_loc();
  const int32_t* lens = lens_t.data_ptr<int32_t>();
  const int32_t* starts = starts_t.data_ptr<int32_t>();
  const int64_t S = table.num_seqs();
  TORCH_CHECK(starts[S] == rows, "decoder_layer: the step has ", starts[S], " rows, hidden ",
              rows);
  std::vector<int64_t> pos(rows);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = starts[s + 1] - starts[s];
    const int64_t first = lens[s] - q_len + (shifts ? shifts[s] : 0);
    for (int64_t i = 0; i < q_len; ++i) pos[starts[s] + i] = first + i;
  }
  return pos;
}

// n values of x normed in place by w (n a multiple of 16), rounded as rms_norm is.
inline void rms_norm_span(BFloat16* x, int64_t n, const BFloat16* w, float eps) {
  const F16 inv = F16::splat(1.0f / std::sqrt(mean_square(x, n) + eps));
  for (int64_t d = 0; d < n; d += 16)
    store_bf16x16(x + d, round_bf16(load_bf16x16(x + d) * inv) * load_bf16x16(w + d));
}

// Gemma 4's values: each of the heads at `first_head` of every qkv row normed over head_dim
// with no weight, rounded as model/norms.py's rms_norm(v, None): the inverse rms rounded to
// bf16, then the product.
void value_norm_inplace(Tensor& qkv, int64_t first_head, int64_t heads, int64_t head_dim,
                        double eps) {
  const int64_t M = qkv.size(0);
  TORCH_CHECK(head_dim % 16 == 0, "decoder_layer: head_dim ", head_dim,
              " is not a multiple of 16");
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      BFloat16* row = qkv.data_ptr<BFloat16>() + m * qkv.stride(0) + first_head * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        BFloat16* x = row + h * head_dim;
        const float inv_rms = 1.0f / std::sqrt(mean_square(x, head_dim) + static_cast<float>(eps));
        const F16 inv = F16::splat(to_float(BFloat16(inv_rms)));
        for (int64_t d = 0; d < head_dim; d += 16) store_bf16x16(x + d, load_bf16x16(x + d) * inv);
      }
    }
  });
}

// q and k normed in place before RoPE. A [q_heads + kv_heads, head_dim] weight norms each head
// over head_dim by its row (Qwen3's, Gemma 3's: q_norm repeated per query head, then k_norm per
// kv head); a flat [(q_heads + kv_heads) * head_dim] one norms all of q's heads together and
// all of k's together (OLMo 2's, OLMoE's: q_norm over q_heads * head_dim, then k_norm).
void qk_norm_inplace(Tensor& qkv, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                     const Tensor& weight, double eps) {
  const int64_t M = qkv.size(0), heads = q_heads + kv_heads;
  const bool whole = weight.dim() == 1;
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.numel() == heads * head_dim,
              "decoder_layer: qk_norm must be bf16 [", heads, ", ", head_dim, "] or [",
              heads * head_dim, "]");
  const BFloat16* w = weight.data_ptr<BFloat16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      BFloat16* row = qkv.data_ptr<BFloat16>() + m * qkv.stride(0);
      if (whole) {
        rms_norm_span(row, q_heads * head_dim, w, e);
        rms_norm_span(row + q_heads * head_dim, kv_heads * head_dim, w + q_heads * head_dim, e);
        continue;
      }
      for (int64_t h = 0; h < heads; ++h)
        rms_norm_span(row + h * head_dim, head_dim, w + h * head_dim, e);
    }
  });
}

// A layer's mixture-of-experts MLP (moe.cpp's experts_mlp arguments), borrowed; gpt-oss's
// biases (router, gate+up, down) and clamped SwiGLU (limit > 0); Qwen2-MoE's shared expert's
// gate, bf16 [hidden] (the shared expert itself is the layer's gate_up and down segments).
struct LayerExperts {
  const Tensor& router;
  const Tensor& gate;
  const Tensor& up;
  const Tensor& down;
  std::array<int64_t, 3> formats;
  int64_t top_k;
  bool renormalize;
  std::optional<Tensor> router_bias, gate_up_bias, down_bias;
  double swiglu_alpha = 0.0, swiglu_limit = 0.0;
  std::optional<Tensor> shared_gate;
  // LFM2-MoE's routing: sigmoid scores, a selection bias, a scale on the weights.
  bool sigmoid_scores = false;
  std::optional<Tensor> selection_bias;
  double routed_scaling = 1.0;
  // Gemma 4 26B-A4B: the experts beside the layer's dense MLP (its gate_up and down), on
  // their own norm of the stream, each output normed; the router on a weightless norm of the
  // stream times `router_scale` times hidden^-0.5, each weight times its expert's scale (fp32);
  // GeGLU experts. None: the experts are the MLP.
  struct BesideDense {
    Tensor experts_in_norm, dense_out_norm, experts_out_norm, router_scale, expert_scales;
  };
  std::optional<BesideDense> beside;
};

// One layer's weights, borrowed from an op's arguments: the projections' (qkv, o, gate_up,
// down, and Gemma 4's per-layer input gate and projection) weight segments and their formats,
// projection i's being [first[i], first[i + 1]) of `weights` (4 and 5 empty without a
// per-layer input), and each projection's bias.
struct LayerWeights {
  const Tensor& input_norm;
  const Tensor& post_norm;
  double eps;
  at::TensorList weights;
  c10::IntArrayRef formats;
  std::array<int64_t, 7> first;
  std::array<std::optional<Tensor>, 6> biases;
  std::optional<Tensor> qk_norm;
  int64_t num_heads, num_kv_heads;
  double scale;
  int64_t sliding_window;
  // Gemma: the norms on the attention's and the MLP's outputs (none: Llama), GELU, and Gemma
  // 2's attention logit soft-cap (0: none).
  std::optional<Tensor> attn_out_norm, mlp_out_norm;
  bool gelu;
  double softcap;
  // gpt-oss's attention sinks, float32 [num_heads] (none: no sink).
  std::optional<Tensor> sinks;
  // A mixture-of-experts MLP in place of gate_up and down (moe.cpp), or none.
  const LayerExperts* experts = nullptr;
  // LFM2's conv layer: its short convolution's kernel, bf16 [hidden, width], in place of
  // attention (short_conv.cpp; qkv's segments are then its in_proj, o's its out_proj).
  std::optional<Tensor> conv_kernel = std::nullopt;
  // The step's rows' query scales, a float each (Ministral 3's attention temperature), or
  // none: borrowed from the op's arguments.
  const float* query_scales = nullptr;
  // Gemma 4: values normed per head; no K/V of its own (the pool holds its source layer's);
  // values that are the keys as projected, before their norm and rope (the full layers of the
  // 31B and 26B-A4B: qkv then has no v); the per-layer input [rows, size] gated into the
  // output, its norm, and the output's scalar.
  bool value_norm = false;
  bool shares_kv = false;
  bool keys_as_values = false;
  const Tensor* per_layer_input = nullptr;
  const Tensor* per_layer_norm = nullptr;
  const Tensor* layer_scalar = nullptr;
};

// Projection i's segments' index range from the counts of segments each projection has (4
// projections, or 6 with Gemma 4's per-layer input). A layer with experts has gate_up and
// down weights only for a shared expert (Qwen2-MoE's), else none (counts 0).
std::array<int64_t, 7> segment_starts(c10::IntArrayRef counts, int64_t first_segment,
                                      bool experts = false) {
  TORCH_CHECK(counts.size() == 4 || counts.size() == 6,
              "decoder_layer: 4 projections (qkv, o, gate_up, down), or 6 with a per-layer "
              "input's gate and projection");
  std::array<int64_t, 7> first{first_segment};
  for (size_t i = 0; i < 6; ++i) {
    const int64_t count = i < counts.size() ? counts[i] : 0;
    TORCH_CHECK(i >= counts.size() || count >= (experts && i >= 2 && i < 4 ? 0 : 1),
                "decoder_layer: projection ", i, " has ", count, " weight segments");
    first[i + 1] = first[i] + count;
  }
  TORCH_CHECK(!experts || (counts[2] == 0) == (counts[3] == 0),
              "decoder_layer: a layer with experts has both gate_up and down (a shared expert) "
              "or neither");
  return first;
}

void check_tables(const LayerWeights& w, const Tensor& key_cache, const Tensor& rope_cos,
                  const Tensor& rope_sin) {
  for (const Tensor* t : {&w.input_norm, &w.post_norm, &rope_cos, &rope_sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous(),
                "decoder_layer: norms and rope tables must be contiguous bf16");
  TORCH_CHECK(w.attn_out_norm.has_value() == w.mlp_out_norm.has_value(),
              "decoder_layer: sandwich norms come in pairs (attention and MLP outputs)");
  // The input norms are both there, or both empty where the outputs are normed (OLMo 2).
  const int64_t hidden = w.attn_out_norm ? w.attn_out_norm->numel() : w.input_norm.numel();
  TORCH_CHECK(w.post_norm.numel() == w.input_norm.numel() &&
                  (w.input_norm.numel() == hidden || (w.input_norm.numel() == 0 && w.attn_out_norm)),
              "decoder_layer: the input norms must both be of the hidden size, or both empty "
              "beside sandwich norms");
  for (const std::optional<Tensor>* t : {&w.attn_out_norm, &w.mlp_out_norm})
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kBFloat16 && (*t)->is_contiguous() &&
                                    (*t)->numel() == hidden),
                "decoder_layer: sandwich norms must be contiguous bf16 of the hidden size");
  TORCH_CHECK(rope_cos.size(1) <= cache_head_dim(key_cache) && rope_sin.sizes() == rope_cos.sizes(),
              "decoder_layer: rope tables must be [positions, rotated <= head_dim]");
}

// The LoRA slots of a layer's projections (decoder_layer's arguments; empty: none): each
// projection's A, then its parts' B's, in `lora`, projection i's A at lora_first[i], and
// the step's rows' slots.
struct LayerLora {
  at::TensorList lora;
  std::vector<int64_t> lora_first;
  const std::optional<Tensor>& lora_rows;
};

// Projection i of a layer: x W_i^T (+ its bias) (+ residual) (+ its LoRA deltas).
struct Projections {
  const LayerWeights& w;
  const LayerLora* lora;

  Tensor operator()(int64_t i, const Tensor& x, const std::optional<Tensor>& residual) const {
    const int64_t begin = w.first[i], count = w.first[i + 1] - begin;
    Tensor y = tiled_linear(x, w.weights.slice(begin, count), w.formats.slice(begin, count),
                            w.biases[i], residual);
    if (lora != nullptr && i + 1 < static_cast<int64_t>(lora->lora_first.size()) &&
        lora->lora_rows && lora->lora_rows->defined()) {
      const int64_t a = lora->lora_first[i], parts = lora->lora_first[i + 1] - a - 1;
      lora_add_(y, x, lora->lora[a], lora->lora.slice(a + 1, parts), *lora->lora_rows);
    }
    return y;
  }
};

// Each row of `act` times sigmoid(its row of x . gate), rounded as torch's bf16 ops round
// F.linear's output, the sigmoid and the product; the dot in fp32 in a fixed order, so a
// row's scale does not depend on the step's other rows. Qwen2-MoE's shared expert gate.
void gate_rows_(Tensor& act, const Tensor& x, const Tensor& gate) {
  TORCH_CHECK(gate.scalar_type() == at::kBFloat16 && gate.is_contiguous() &&
                  gate.numel() == x.size(1) && act.is_contiguous() && x.stride(1) == 1,
              "decoder_layer: a shared expert's gate must be contiguous bf16 of the hidden size");
  using at::BFloat16;
  const BFloat16* g = gate.data_ptr<BFloat16>();
  const int64_t K = x.size(1), N = act.size(1);
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const BFloat16* row = x.data_ptr<BFloat16>() + m * x.stride(0);
      float dot = 0.0f;
      for (int64_t k = 0; k < K; ++k) dot += static_cast<float>(row[k]) * static_cast<float>(g[k]);
      const float logit = static_cast<float>(BFloat16(dot));
      const float scale = static_cast<float>(BFloat16(1.0f / (1.0f + std::exp(-logit))));
      BFloat16* out = act.data_ptr<BFloat16>() + m * N;
      for (int64_t n = 0; n < N; ++n) out[n] = BFloat16(static_cast<float>(out[n]) * scale);
    }
  });
}

// Every value of x times s, rounded to bf16 (a bf16 tensor times a one-value bf16 one).
void scale_rows_(Tensor& x, float s) {
  const F16 by = F16::splat(s);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 16 == 0 && x.is_contiguous(), "decoder_layer: hidden size ", K,
              " is not a multiple of 16");
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      BFloat16* row = x.data_ptr<BFloat16>() + m * K;
      for (int64_t k = 0; k < K; k += 16) store_bf16x16(row + k, load_bf16x16(row + k) * by);
    }
  });
}

// The attention block's rows (before o): norm, q/k/v, q/k norms, rope, store and attend.
Tensor attend_block(const LayerWeights& w, const Projections& project, const Tensor& hidden,
                    const std::vector<int64_t>& pos, const Tensor& key_cache,
                    const Tensor& value_cache, const Tensor& slot_mapping, const Tensor& step,
                    const Tensor& rope_cos, const Tensor& rope_sin) {
  const int64_t M = hidden.size(0), head_dim = cache_head_dim(key_cache);
  Tensor qkv = project(0, pre_norm(hidden, w.input_norm, w.eps), std::nullopt);
  const int64_t q_size = w.num_heads * head_dim, kv_size = w.num_kv_heads * head_dim;
  // A layer reading its source layer's K/V projects q alone, one whose values are its keys q
  // and k (Gemma 4).
  const int64_t own_kv_heads = w.shares_kv ? 0 : w.num_kv_heads;
  const int64_t outputs = q_size + (w.keys_as_values ? 1 : 2) * own_kv_heads * head_dim;
  TORCH_CHECK(qkv.size(1) == outputs, "decoder_layer: qkv has ", qkv.size(1), " outputs, not ",
              outputs);
  const int64_t heads = w.num_heads + own_kv_heads;
  // Keys as values: the keys as they left the projection (their norm and rope are in place).
  Tensor values = w.keys_as_values ? qkv.narrow(1, q_size, kv_size).clone() : qkv;
  const int64_t v_first_head = w.keys_as_values ? 0 : heads;
  if (w.qk_norm && w.qk_norm->defined())
    qk_norm_inplace(qkv, w.num_heads, own_kv_heads, head_dim, *w.qk_norm, w.eps);
  rope_inplace(qkv, heads, head_dim, pos, rope_cos, rope_sin, w.query_scales, w.num_heads);
  const Tensor q = heads_of(qkv, 0, w.num_heads, head_dim);
  if (w.shares_kv) {
    const Tensor attn = attend_step(q, key_cache, value_cache, step, w.scale, w.sliding_window,
                                    w.softcap, w.sinks);
    return strided_view(attn, {M, q_size}, {q_size, 1});
  }
  if (w.value_norm) value_norm_inplace(values, v_first_head, w.num_kv_heads, head_dim, w.eps);
  const Tensor k = heads_of(qkv, q_size, w.num_kv_heads, head_dim);
  const Tensor v = heads_of(values, v_first_head * head_dim, w.num_kv_heads, head_dim);
  const Tensor attn = store_and_attend(q, k, v, key_cache, value_cache, slot_mapping, step,
                                       w.scale, w.sliding_window, w.softcap, w.sinks);
  return strided_view(attn, {M, q_size}, {q_size, 1});
}

// Gemma 4 26B-A4B's MLP block past the dense MLP's output `dense` (model/llama.py's
// _dense_and_experts, rounded as it is): the experts on their own norm of the stream `mid`,
// routed from its weightless norm times the router's scale and hidden^-0.5; each output
// normed, their sum normed and added to the stream.
Tensor dense_and_experts(const LayerWeights& w, const LayerExperts& e, const Tensor& dense,
                         const Tensor& mid) {
  const LayerExperts::BesideDense& b = *e.beside;
  TORCH_CHECK(w.mlp_out_norm, "decoder_layer: experts beside a dense MLP take its output norm");
  const Tensor routed =
      rms_norm(mid, b.router_scale, w.eps).mul_(1.0 / std::sqrt(static_cast<double>(mid.size(1))));
  const Tensor experts =
      experts_mlp(rms_norm(mid, b.experts_in_norm, w.eps), std::nullopt, e.router, e.top_k,
                  e.renormalize, e.gate, e.up, e.down, e.formats, std::nullopt, std::nullopt,
                  std::nullopt, 0.0, 0.0, false, std::nullopt, 1.0, routed, b.expert_scales,
                  /*gelu=*/true);
  const Tensor dense_normed = rms_norm(dense, b.dense_out_norm, w.eps);
  return rms_norm(rms_norm(experts, b.experts_out_norm, w.eps, &dense_normed), *w.mlp_out_norm,
                  w.eps, &mid);
}

// The layer itself, rows at positions `pos`.
Tensor run_layer(const LayerWeights& w, const LayerLora* lora, const Tensor& hidden,
                 const std::vector<int64_t>& pos, const Tensor& key_cache,
                 const Tensor& value_cache, const Tensor& slot_mapping, const Tensor& step,
                 const Tensor& rope_cos, const Tensor& rope_sin) {
  const Projections project{w, lora};
  // Each block's output joins the stream in its projection's epilogue, or after its norm.
  auto block_out = [&](int64_t i, const Tensor& x, const Tensor& residual,
                       const std::optional<Tensor>& out_norm) {
    if (!out_norm) return project(i, x, residual);
    return rms_norm(project(i, x, std::nullopt), *out_norm, w.eps, &residual);
  };
  // What the token-mixing block's output projection reads: attention's rows, or LFM2's
  // convolution's (its in_proj is the layer's first projection).
  const Tensor mixed =
      w.conv_kernel ? short_conv(project(0, pre_norm(hidden, w.input_norm, w.eps), std::nullopt),
                                 *w.conv_kernel, key_cache, slot_mapping, step)
                    : attend_block(w, project, hidden, pos, key_cache, value_cache, slot_mapping,
                                   step, rope_cos, rope_sin);
  const Tensor mid = block_out(1, mixed, hidden, w.attn_out_norm);
  const LayerExperts* e = w.experts;
  if (e != nullptr && !e->beside) {
    TORCH_CHECK(!w.mlp_out_norm, "decoder_layer: experts with a sandwich norm");
    const Tensor normed = pre_norm(mid, w.post_norm, w.eps);
    // A shared expert (Qwen2-MoE's): its output, gated row by row (before down, which a
    // row's scale passes through), joins the residual the routed experts then add onto.
    Tensor base = mid;
    if (w.first[3] > w.first[2]) {
      Tensor act = gated_mul(project(2, normed, std::nullopt), false);
      if (e->shared_gate) gate_rows_(act, normed, *e->shared_gate);
      base = project(3, act, mid);
    }
    return experts_mlp(normed, base, e->router, e->top_k, e->renormalize, e->gate, e->up,
                       e->down, e->formats, e->router_bias, e->gate_up_bias, e->down_bias,
                       e->swiglu_alpha, e->swiglu_limit, e->sigmoid_scores, e->selection_bias,
                       e->routed_scaling);
  }
  const Tensor gate_up = project(2, pre_norm(mid, w.post_norm, w.eps), std::nullopt);
  const Tensor act = gated_mul(gate_up, w.gelu);
  Tensor out = e != nullptr ? dense_and_experts(w, *e, project(3, act, std::nullopt), mid)
                            : block_out(3, act, mid, w.mlp_out_norm);
  if (w.per_layer_input != nullptr) {
    // Gemma 4: h + rms_norm((gelu(h W_plg^T) * input) W_plp^T), as model/llama.py rounds it.
    const Tensor gated = gated_mul_pairs<true>(project(4, out, std::nullopt), *w.per_layer_input);
    out = rms_norm(project(5, gated, std::nullopt), *w.per_layer_norm, w.eps, &out);
  }
  if (w.layer_scalar != nullptr) scale_rows_(out, to_float(w.layer_scalar->data_ptr<BFloat16>()[0]));
  return out;
}

// The step's query scales as the layers borrow them (none: nullptr), checked: a float a row.
const float* query_scales_of(const std::optional<Tensor>& scales, const Tensor& hidden) {
  if (!scales) return nullptr;
  TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                  scales->dim() == 1 && scales->size(0) == hidden.size(0),
              "decoder_layer: query_scales must be float32 [tokens]");
  return scales->data_ptr<float>();
}

// Every row's position, checked against the rope tables.
std::vector<int64_t> checked_positions(const Tensor& hidden, const Tensor& step,
                                       const Tensor& rope_cos) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16 &&
                  hidden.stride(1) == 1,
              "decoder_layer: hidden must be [tokens, hidden] bf16 with contiguous rows");
  std::vector<int64_t> pos = positions_of(step, hidden.size(0));
  for (int64_t p : pos)
    TORCH_CHECK(p >= 0 && p < rope_cos.size(0), "decoder_layer: position ", p,
                " is past the rope table's ", rope_cos.size(0));
  return pos;
}

}  // namespace

Tensor decoder_layer(const Tensor& hidden, const Tensor& input_norm, const Tensor& post_norm,
                     double eps, at::TensorList weights, c10::IntArrayRef formats,
                     c10::IntArrayRef segments, const c10::List<std::optional<Tensor>>& biases,
                     const std::optional<Tensor>& qk_norm,
                     const std::optional<Tensor>& attn_out_norm,
                     const std::optional<Tensor>& mlp_out_norm, bool gelu, double softcap,
                     const Tensor& key_cache, const Tensor& value_cache,
                     const Tensor& slot_mapping, const Tensor& step, const Tensor& rope_cos,
                     const Tensor& rope_sin, int64_t num_heads, int64_t num_kv_heads,
                     double scale, int64_t sliding_window, at::TensorList lora,
                     c10::IntArrayRef lora_parts, const std::optional<Tensor>& lora_rows,
                     at::TensorList experts, c10::IntArrayRef expert_formats, int64_t top_k,
                     const std::optional<Tensor>& sinks,
                     const std::optional<Tensor>& query_scales, bool value_norm,
                     bool shares_kv, const std::optional<Tensor>& per_layer_input,
                     const std::optional<Tensor>& per_layer_norm,
                     const std::optional<Tensor>& layer_scalar, bool keys_as_values) {
  TORCH_CHECK(biases.size() == segments.size() && weights.size() == formats.size(),
              "decoder_layer: 4 projections (qkv, o, gate_up, down; 6 with a per-layer "
              "input), each with its weight segments, their formats and a bias");
  LayerWeights w{input_norm, post_norm, eps, weights, formats,
                 segment_starts(segments, 0),
                 {biases.get(0), biases.get(1), biases.get(2), biases.get(3)},
                 qk_norm, num_heads, num_kv_heads, scale, sliding_window,
                 attn_out_norm, mlp_out_norm, gelu, softcap, sinks,
                 nullptr, std::nullopt, query_scales_of(query_scales, hidden)};
  TORCH_CHECK(w.first[6] == static_cast<int64_t>(weights.size()),
              "decoder_layer: segments count ", w.first[6], " weights, not ", weights.size());
  check_tables(w, key_cache, rope_cos, rope_sin);
  w.value_norm = value_norm;
  w.shares_kv = shares_kv;
  w.keys_as_values = keys_as_values;
  TORCH_CHECK(!(shares_kv && keys_as_values),
              "decoder_layer: a layer reading another's K/V has no keys of its own");
  TORCH_CHECK(per_layer_input.has_value() == (segments.size() == 6) &&
                  per_layer_input.has_value() == per_layer_norm.has_value(),
              "decoder_layer: a per-layer input comes with its norm and its two projections");
  if (per_layer_input) {
    TORCH_CHECK(per_layer_input->scalar_type() == at::kBFloat16 && per_layer_input->dim() == 2 &&
                    per_layer_input->size(0) == hidden.size(0) && per_layer_input->stride(1) == 1,
                "decoder_layer: per_layer_input must be bf16 [tokens, size] with contiguous rows");
    TORCH_CHECK(per_layer_norm->scalar_type() == at::kBFloat16 &&
                    per_layer_norm->is_contiguous() &&
                    per_layer_norm->numel() == hidden.size(1),
                "decoder_layer: per_layer_norm must be contiguous bf16 of the hidden size");
    w.biases[4] = biases.get(4);
    w.biases[5] = biases.get(5);
    w.per_layer_input = &*per_layer_input;
    w.per_layer_norm = &*per_layer_norm;
  }
  if (layer_scalar) {
    TORCH_CHECK(layer_scalar->scalar_type() == at::kBFloat16 && layer_scalar->numel() == 1,
                "decoder_layer: layer_scalar must be one bf16 value");
    w.layer_scalar = &*layer_scalar;
  }
  LayerLora slots{lora, {}, lora_rows};
  if (!lora_parts.empty()) {
    TORCH_CHECK(lora_parts.size() == 4, "decoder_layer: LoRA slots for the 4 projections");
    slots.lora_first.push_back(0);
    for (int64_t parts : lora_parts)
      slots.lora_first.push_back(slots.lora_first.back() + 1 + parts);
    TORCH_CHECK(slots.lora_first.back() == static_cast<int64_t>(lora.size()),
                "decoder_layer: lora_parts count ", slots.lora_first.back(),
                " slot tensors, not ", lora.size());
  }
  std::optional<LayerExperts> beside;
  if (!experts.empty()) {
    // Gemma 4 26B-A4B's: router tiles, gate, up, down stacks, the router's scale, the
    // experts' scales, the experts' input norm, the two outputs' norms.
    TORCH_CHECK(experts.size() == 9 && expert_formats.size() == 3 && top_k > 0,
                "decoder_layer: experts beside the dense MLP are 9 tensors (router, gate, up, "
                "down, router scale, expert scales, 3 norms), 3 formats and a top_k");
    const int64_t H = hidden.size(1);
    for (const Tensor& t : {experts[4], experts[6], experts[7], experts[8]})
      TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.is_contiguous() && t.numel() == H,
                  "decoder_layer: the router's scale and the experts' norms must be contiguous "
                  "bf16 of the hidden size");
    beside.emplace(LayerExperts{experts[0], experts[1], experts[2], experts[3],
                                {expert_formats[0], expert_formats[1], expert_formats[2]},
                                top_k, /*renormalize=*/true});
    beside->beside = LayerExperts::BesideDense{experts[6], experts[7], experts[8], experts[4],
                                               experts[5]};
    w.experts = &*beside;
  }
  const std::vector<int64_t> pos = checked_positions(hidden, step, rope_cos);
  return run_layer(w, &slots, hidden, pos, key_cache, value_cache, slot_mapping, step,
                   rope_cos, rope_sin);
}

// Every layer of a model in one call, each as decoder_layer (no LoRA): the step's arguments,
// then the layers' in lists, layer after layer (segments: 4 counts a layer; biases: 4 a
// layer). A step of one token then leaves Python once instead of once a layer: between two
// layer calls of a 1B Q4_K_M at one row, Python and the dispatcher took 140-270 us, run with
// caches the layer's 37 MB of weights had just swept (2026-11-29, avx512vnni).
//
// A layer with second_rope[l] = 1 rotates by the second tables: Gemma 3's sliding layers by
// their own RoPE base, SmolLM3's layers without RoPE by tables 0 wide. A layer whose
// router is given (Mixtral, Qwen3-MoE, gpt-oss) has a mixture of experts for its MLP: its
// next three `experts` (gate, up and down stacks, moe.cpp) in the next three
// `expert_formats`, and gate_up and down segments only for a shared expert (Qwen2-MoE's,
// its gate in `shared_gates`, else None); its three `expert_biases` (router, gate+up, down:
// gpt-oss's, else None) and the SwiGLU's clamp are experts_mlp's. gpt-oss's layers have
// `sinks` (None elsewhere). LFM2-MoE's routing (sigmoid scores, a layer's selection bias,
// the weights' scale) is experts_mlp's too. LFM2's conv layers have a `conv_kernels` entry (None for its
// attention layers): their qkv and o segments are the convolution's in_proj and out_proj,
// their caches its rows (short_conv.cpp).
Tensor decoder_stack(const Tensor& hidden, const Tensor& slot_mapping, const Tensor& step,
                     const Tensor& rope_cos, const Tensor& rope_sin,
                     const std::optional<Tensor>& second_rope_cos,
                     const std::optional<Tensor>& second_rope_sin, at::TensorList input_norms,
                     at::TensorList post_norms, double eps, at::TensorList weights,
                     c10::IntArrayRef formats, c10::IntArrayRef segments,
                     const c10::List<std::optional<Tensor>>& biases,
                     const c10::List<std::optional<Tensor>>& qk_norms,
                     const c10::List<std::optional<Tensor>>& attn_out_norms,
                     const c10::List<std::optional<Tensor>>& mlp_out_norms, bool gelu,
                     double softcap, at::TensorList key_caches, at::TensorList value_caches,
                     int64_t num_heads, int64_t num_kv_heads, double scale,
                     c10::IntArrayRef sliding_windows, c10::IntArrayRef second_rope,
                     const c10::List<std::optional<Tensor>>& routers, at::TensorList experts,
                     c10::IntArrayRef expert_formats, int64_t top_k, bool renormalize,
                     const c10::List<std::optional<Tensor>>& sinks,
                     const c10::List<std::optional<Tensor>>& expert_biases, double swiglu_alpha,
                     double swiglu_limit,
                     const c10::List<std::optional<Tensor>>& shared_gates,
                     bool sigmoid_scores,
                     const c10::List<std::optional<Tensor>>& selection_biases,
                     double routed_scaling,
                     const c10::List<std::optional<Tensor>>& conv_kernels,
                     const std::optional<Tensor>& query_scales) {
  const auto layers = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(post_norms.size() == layers && qk_norms.size() == layers &&
                  attn_out_norms.size() == layers && mlp_out_norms.size() == layers &&
                  key_caches.size() == layers && value_caches.size() == layers &&
                  sliding_windows.size() == layers && second_rope.size() == layers &&
                  segments.size() == 4 * layers && biases.size() == 4 * layers &&
                  weights.size() == formats.size() && routers.size() == layers &&
                  experts.size() == expert_formats.size() && sinks.size() == layers &&
                  expert_biases.size() == 3 * layers && shared_gates.size() == layers &&
                  selection_biases.size() == layers && conv_kernels.size() == layers,
              "decoder_stack: every list holds one entry a layer (segments and biases 4, "
              "expert biases 3), formats one a weight, expert formats one a stack");
  const bool any_second =
      std::any_of(second_rope.begin(), second_rope.end(), [](int64_t f) { return f != 0; });
  TORCH_CHECK(!any_second || (second_rope_cos && second_rope_sin),
              "decoder_stack: layers with second_rope need the second tables");
  const std::vector<int64_t> pos = checked_positions(hidden, step, rope_cos);
  if (any_second) checked_positions(hidden, step, *second_rope_cos);
  const float* q_scales = query_scales_of(query_scales, hidden);
  const LayersScope reuse_large;  // a prompt step's layers take each other's tensors
  Tensor h = hidden;
  int64_t first_segment = 0, first_stack = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const std::optional<Tensor> router = routers.get(l);
    std::optional<LayerExperts> moe;
    if (router) {
      TORCH_CHECK(first_stack + 3 <= static_cast<int64_t>(experts.size()), "decoder_stack: layer ",
                  l, "'s experts run past the ", experts.size(), " stacks given");
      moe.emplace(LayerExperts{*router, experts[first_stack], experts[first_stack + 1],
                               experts[first_stack + 2],
                               {expert_formats[first_stack], expert_formats[first_stack + 1],
                                expert_formats[first_stack + 2]},
                               top_k, renormalize, expert_biases.get(3 * l),
                               expert_biases.get(3 * l + 1), expert_biases.get(3 * l + 2),
                               swiglu_alpha, swiglu_limit, shared_gates.get(l),
                               sigmoid_scores, selection_biases.get(l), routed_scaling});
      first_stack += 3;
    }
    const LayerWeights w{input_norms[l], post_norms[l], eps, weights, formats,
                         segment_starts(segments.slice(4 * l, 4), first_segment, moe.has_value()),
                         {biases.get(4 * l), biases.get(4 * l + 1), biases.get(4 * l + 2),
                          biases.get(4 * l + 3)},
                         qk_norms.get(l), num_heads, num_kv_heads, scale, sliding_windows[l],
                         attn_out_norms.get(l), mlp_out_norms.get(l), gelu, softcap,
                         sinks.get(l), moe ? &*moe : nullptr, conv_kernels.get(l),
                         q_scales};
    TORCH_CHECK(w.first[6] <= static_cast<int64_t>(weights.size()), "decoder_stack: layer ", l,
                "'s segments run past the ", weights.size(), " weights");
    const Tensor& cos = second_rope[l] ? *second_rope_cos : rope_cos;
    const Tensor& sin = second_rope[l] ? *second_rope_sin : rope_sin;
    check_tables(w, key_caches[l], cos, sin);
    h = run_layer(w, nullptr, h, pos, key_caches[l], value_caches[l], slot_mapping, step, cos,
                  sin);
    first_segment = w.first[6];
  }
  TORCH_CHECK(first_segment == static_cast<int64_t>(weights.size()), "decoder_stack: ",
              first_segment, " segments counted, ", weights.size(), " weights given");
  TORCH_CHECK(first_stack == static_cast<int64_t>(experts.size()), "decoder_stack: ",
              first_stack, " expert stacks counted, ", experts.size(), " given");
  return h;
}

Tensor norm_rows(const Tensor& x, const Tensor& rows, const Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "norm_rows: x must be [tokens, hidden] bf16 with contiguous rows");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 16 == 0, "norm_rows: hidden size ", K, " is not a multiple of 16");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                  weight.numel() == K,
              "norm_rows: weight must be contiguous bf16 of the hidden size ", K);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong,
              "norm_rows: rows must be 1-D int64");
  const Tensor picked = rows.contiguous();
  const int64_t* row = picked.data_ptr<int64_t>();
  const int64_t R = picked.numel(), T = x.size(0);
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(row[r] >= 0 && row[r] < T, "norm_rows: row ", row[r], " is outside x's ", T);
  Tensor out = empty_reused({R, K}, x.options());
  const BFloat16* w = weight.data_ptr<BFloat16>();
  const BFloat16* in = x.data_ptr<BFloat16>();
  const int64_t ld_in = x.stride(0);
  BFloat16* dst = out.data_ptr<BFloat16>();
  at::parallel_for(0, R, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(in + row[r] * ld_in, w, nullptr, dst + r * K, K, eps);
  });
  return out;
}

Tensor gated_mul(const Tensor& gate_up, bool gelu) {
  return gelu ? gated_mul_rows<true>(gate_up) : gated_mul_rows<false>(gate_up);
}

Tensor clamped_swiglu(const Tensor& gate_up, double alpha, double limit) {
  const F16 a = F16::splat(static_cast<float>(alpha)), top = F16::splat(static_cast<float>(limit));
  const F16 bottom = F16::splat(static_cast<float>(-limit)), one = F16::splat(1.0f);
  return gated_rows(gate_up, [&](const F16& x, const F16& u) {
    const F16 g = minimum(x, top);
    const F16 glu = round_bf16(g * round_bf16(sigmoid(round_bf16(g * a))));
    return round_bf16(maximum(minimum(u, top), bottom) + one) * glu;
  });
}

// Which build this is (simd.h's kIsaName), so a caller can check the variant it loaded.
std::string isa() { return kIsaName; }

}  // namespace iterserve
