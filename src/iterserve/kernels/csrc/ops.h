// The kernels' entry points: the ops library.cpp registers, and what the kernel files share.
//
// The kernel files include ATen's Tensor and the few ATen ops they call, not <ATen/ATen.h> or
// <torch/library.h>: those two headers are ~9 s of a file's compile at -O3 (AVX2 flags,
// 2026-12-01), and each ISA variant compiles every file. Only library.cpp includes the
// registration machinery.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "strided_view.h"

// The torch library namespace the ops register in: one per ISA variant (iterserve_avx2, ...),
// so that several variants can be loaded in one process (the tests compare them). The build
// sets it; see kernels/__init__.py.
#ifndef ITERSERVE_OPS
#define ITERSERVE_OPS iterserve
#endif

namespace iterserve {

// Rows a thread takes at least in the layers' glue (norms, rope, SiLU, the short convolution):
// a row's is a few microseconds, so a decode batch of 16 splits across the threads (a grain
// of 16 ran it on one).
constexpr int64_t kRowGrain = 4;

// One engine step's sequences, packed in one int32 tensor shared by every layer's call
// (model/attention_metadata.py builds it), so a compiled graph sees one input of one dynamic
// length rather than several of independent shapes:
//   [S, max_blocks, block_tables (S x max_blocks), seq_lens (S), query_start_loc (S+1)]
// and, where some sequence's rotary positions are shifted (the text after a Qwen-VL image,
// whose rows turn by grid positions; or a step holding such an image, where the rope tables
// are the step's own rows and each shift puts a row at its row), rope_shifts (S).
// Query row i of sequence s sits at position
// seq_lens[s] - q_len + i, where q_len = query_start_loc[s+1] - query_start_loc[s], and
// turns by that position plus its sequence's rope shift.
class StepTable {
 public:
  static constexpr int64_t kHeader = 2;

  explicit StepTable(const at::Tensor& step) : step_(step) {
    TORCH_CHECK(step.dim() == 1 && step.scalar_type() == at::kInt && step.is_contiguous() &&
                    step.numel() >= kHeader,
                "the step table must be a packed 1-D int32 tensor");
    const int32_t* p = step.data_ptr<int32_t>();
    num_seqs_ = p[0];
    width_ = p[1];
    const int64_t unshifted = kHeader + num_seqs_ * width_ + 2 * num_seqs_ + 1;
    TORCH_CHECK(num_seqs_ >= 0 && width_ >= 0 &&
                    (step.numel() == unshifted || step.numel() == unshifted + num_seqs_),
                "the step table holds ", step.numel(), " values, not the ", unshifted,
                " (or ", unshifted + num_seqs_, " with rope shifts) that ", num_seqs_,
                " sequences of up to ", width_, " blocks need");
    shifted_ = step.numel() != unshifted;
  }
  int64_t num_seqs() const { return num_seqs_; }
  // Each sequence's rope shift, or a null pointer where none is shifted.
  const int32_t* rope_shifts() const {
    return shifted_ ? step_.data_ptr<int32_t>() + kHeader + num_seqs_ * width_ + 2 * num_seqs_ + 1
                    : nullptr;
  }
  at::Tensor block_tables() const {
    return strided_view(step_, {num_seqs_, width_}, {width_, 1}, kHeader);
  }
  at::Tensor seq_lens() const {
    return strided_view(step_, {num_seqs_}, {1}, kHeader + num_seqs_ * width_);
  }
  at::Tensor query_start_loc() const {
    return strided_view(step_, {num_seqs_ + 1}, {1}, kHeader + num_seqs_ * width_ + num_seqs_);
  }

 private:
  at::Tensor step_;
  int64_t num_seqs_, width_;
  bool shifted_ = false;
};

// The 8-bit KV cache (--kv-cache-dtype int8). A row of an int8 cache is a llama.cpp-style q8
// block the size of the row: head_dim int8 values q, then their fp32 scale s (value = s * q,
// s = max|row| / 127). One scale per token and kv head because rows are written one token at
// a time: a scale per block would have to change as the block fills. So an int8 cache is
// [kv_heads, blocks, block_size, head_dim + 4] bytes, and its head_dim is size(3) - 4.
constexpr int64_t kRowScaleBytes = 4;
inline bool is_int8_cache(const at::Tensor& cache) { return cache.scalar_type() == at::kChar; }
inline int64_t cache_head_dim(const at::Tensor& cache) {
  return is_int8_cache(cache) ? cache.size(3) - kRowScaleBytes : cache.size(3);
}

// linear.cpp: x [M, K] bf16 @ W^T (+ bias) (+ residual), W's output rows in segments, each
// [tiles, bytes a tile] uint8 in one of blocks.h's formats. The result is bf16, or fp32 with
// `fp32_out`.
at::Tensor tiled_linear(const at::Tensor& x, at::TensorList weights, c10::IntArrayRef formats,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual, bool fp32_out = false);

// layer.cpp: act(g) * u for gate_up rows [g | u] (act: tanh-approximated GELU, or SiLU),
// rounded as transformers' bf16 MLP rounds them.
at::Tensor gated_mul(const at::Tensor& gate_up, bool gelu);
// layer.cpp: gpt-oss's SwiGLU of gate_up rows [g | u]: (clamp(u, -limit, limit) + 1) times
// min(g, limit) sigmoid(alpha min(g, limit)), rounded as transformers' bf16 experts round it.
at::Tensor clamped_swiglu(const at::Tensor& gate_up, double alpha, double limit);

// moe.cpp: a mixture-of-experts MLP, residual + the weighted outputs of each row's top_k
// experts (router: its bf16 tiles; gate, up, down: [experts, tiles, bytes] stacks in
// `formats`). gpt-oss: biases for the router (padded to its tiles' rows), gate+up [experts,
// 2 x width] and down [experts, hidden], all bf16, and its clamped SwiGLU where
// swiglu_limit > 0. LFM2-MoE: sigmoid scores, a selection bias (fp32 [experts]) that picks
// the top k but does not weigh them, and a scale on the weights. Gemma 4: the router's own
// input rows (`router_input`, shaped as x), a scale a weight by its expert (`expert_scales`,
// fp32 [experts]) and GeGLU experts (`gelu`).
at::Tensor experts_mlp(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                       const at::Tensor& router, int64_t top_k, bool renormalize,
                       const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                       c10::IntArrayRef formats,
                       const std::optional<at::Tensor>& router_bias = std::nullopt,
                       const std::optional<at::Tensor>& gate_up_bias = std::nullopt,
                       const std::optional<at::Tensor>& down_bias = std::nullopt,
                       double swiglu_alpha = 0.0, double swiglu_limit = 0.0,
                       bool sigmoid_scores = false,
                       const std::optional<at::Tensor>& selection_bias = std::nullopt,
                       double routed_scaling = 1.0,
                       const std::optional<at::Tensor>& router_input = std::nullopt,
                       const std::optional<at::Tensor>& expert_scales = std::nullopt,
                       bool gelu = false);

// paged_attention.cpp: store the step's K/V into the pool, then attend every query row
// (`softcap`: Gemma 2's attention logit soft-cap, 0: none; `sinks`: gpt-oss's attention
// sinks, float32 [num_heads]).
at::Tensor store_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& slot_mapping, const at::Tensor& step,
                            double scale, int64_t sliding_window, double softcap,
                            const std::optional<at::Tensor>& sinks);

// paged_attention.cpp: every query row over the pool as it is, the step's K/V already in it
// (Gemma 4's layers that read an earlier layer's K/V: that layer stored this step's rows).
at::Tensor attend_step(const at::Tensor& q, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& step, double scale,
                       int64_t sliding_window, double softcap,
                       const std::optional<at::Tensor>& sinks);

// short_conv.cpp: LFM2's convolution of a step's in_proj rows [B | C | x]: B * x stored in
// the layer's pool rows (its slots), then C times each row's causal convolution over its
// predecessors' stored rows and its own (kernel bf16 [hidden, width]).
at::Tensor short_conv(const at::Tensor& bcx, const at::Tensor& kernel, const at::Tensor& cache,
                      const at::Tensor& slot_mapping, const at::Tensor& step);

// lora.cpp: y[r] += row r's adapter's delta, x[r] A[slot]^T then each part's B[slot] into its
// columns of y (row_slots[r] = -1: none).
void lora_add_(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
               at::TensorList b_parts, const at::Tensor& row_slots);

// argmax.cpp: each row's first index of its maximum (or of its first NaN), as torch.argmax.
at::Tensor argmax_rows(const at::Tensor& logits);

// layer.cpp: which build this is (simd.h's kIsaName).
std::string isa();

// layer.cpp: one decoder layer (its weights in segments of `weights`, its norms, its KV
// pools), and every layer of a model in one call; the file's head says what each computes.
// decoder_layer's `experts` (empty: none) are Gemma 4 26B-A4B's beside the dense MLP: the
// router's bf16 tiles, the gate, up and down stacks (`expert_formats`), the router's input
// scale, the experts' scales (fp32), the experts' input norm and the two outputs' norms.
at::Tensor decoder_layer(
    const at::Tensor& hidden, const at::Tensor& input_norm, const at::Tensor& post_norm,
    double eps, at::TensorList weights, c10::IntArrayRef formats, c10::IntArrayRef segments,
    const c10::List<std::optional<at::Tensor>>& biases, const std::optional<at::Tensor>& qk_norm,
    const std::optional<at::Tensor>& attn_out_norm, const std::optional<at::Tensor>& mlp_out_norm,
    bool gelu, double softcap, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& slot_mapping, const at::Tensor& step, const at::Tensor& rope_cos,
    const at::Tensor& rope_sin, int64_t num_heads, int64_t num_kv_heads, double scale,
    int64_t sliding_window, at::TensorList lora, c10::IntArrayRef lora_parts,
    const std::optional<at::Tensor>& lora_rows, at::TensorList experts,
    c10::IntArrayRef expert_formats, int64_t top_k, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& query_scales, bool value_norm, bool shares_kv,
    const std::optional<at::Tensor>& per_layer_input,
    const std::optional<at::Tensor>& per_layer_norm,
    const std::optional<at::Tensor>& layer_scalar, bool keys_as_values);
at::Tensor decoder_stack(
    const at::Tensor& hidden, const at::Tensor& slot_mapping, const at::Tensor& step,
    const at::Tensor& rope_cos, const at::Tensor& rope_sin,
    const std::optional<at::Tensor>& second_rope_cos,
    const std::optional<at::Tensor>& second_rope_sin, at::TensorList input_norms,
    at::TensorList post_norms, double eps, at::TensorList weights, c10::IntArrayRef formats,
    c10::IntArrayRef segments, const c10::List<std::optional<at::Tensor>>& biases,
    const c10::List<std::optional<at::Tensor>>& qk_norms,
    const c10::List<std::optional<at::Tensor>>& attn_out_norms,
    const c10::List<std::optional<at::Tensor>>& mlp_out_norms, bool gelu, double softcap,
    at::TensorList key_caches, at::TensorList value_caches, int64_t num_heads,
    int64_t num_kv_heads, double scale, c10::IntArrayRef sliding_windows,
    c10::IntArrayRef second_rope, const c10::List<std::optional<at::Tensor>>& routers,
    at::TensorList experts, c10::IntArrayRef expert_formats, int64_t top_k, bool renormalize,
    const c10::List<std::optional<at::Tensor>>& sinks,
    const c10::List<std::optional<at::Tensor>>& expert_biases, double swiglu_alpha,
    double swiglu_limit, const c10::List<std::optional<at::Tensor>>& shared_gates,
    bool sigmoid_scores, const c10::List<std::optional<at::Tensor>>& selection_biases,
    double routed_scaling, const c10::List<std::optional<at::Tensor>>& conv_kernels,
    const std::optional<at::Tensor>& query_scales);

// layer.cpp: the rows `rows` of x RMS-normed as the layers' norms round them (a model's
// final norm, of the rows the head or pooling reads).
at::Tensor norm_rows(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& weight,
                     double eps);

// linear.cpp: activations as the block formats quantize them, per unit of 32 or 256 inputs.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t unit);

// paged_attention.cpp: every query row over its sequence's context in the paged pool.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           double scale, int64_t sliding_window, double softcap,
                           const std::optional<at::Tensor>& sinks);

// paged_attention.cpp: the head sizes the attention loops are built for (attention_plan.h).
std::vector<int64_t> attention_head_dims();

// read_probe.cpp: a buffer read as the decode loops read a weight (for the bandwidth figure).
int64_t read_probe(const at::Tensor& buffer, int64_t threads);

// repack.cpp: a GGUF tensor's rows into tiles, tiles back to values, and a format's sizes.
void repack_gguf(const at::Tensor& raw, int64_t format, int64_t K,
                 const std::optional<at::Tensor>& rows, at::Tensor& out, int64_t first_tile);
at::Tensor dequantize_rows(const at::Tensor& tiles, int64_t format, int64_t K,
                           const at::Tensor& rows, bool bf16_out);
std::tuple<int64_t, int64_t, int64_t> format_sizes(int64_t format);

}  // namespace iterserve
