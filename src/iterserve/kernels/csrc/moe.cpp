// A mixture-of-experts MLP (model/moe.py's SparseMoeBlock.run) in one call: route each token
// to its top-k experts, run every expert that has tokens once over them (gate+up, SwiGLU,
// down: linear.cpp's projections in the experts' own formats), weight the outputs and add
// them onto the residual.
//
// What it saves: dispatch, ~40 calls a layer from Python op by op (router, softmax, sort,
// gather, two projections and the SwiGLU per expert, scatter), which a batched decode felt
// (Qwen3-30B-A3B at batch 16: 36.4 -> 40.9 tok/s); and a choice of how the threads share the
// experts, which one sequence felt (its 8 experts' 16 small projections each split between the
// threads, a parallel region and a wait each: 10.4 tok/s; whole experts a thread: 11.8;
// docs/benchmarks.md). It also lets the fused layers (layer.cpp) take a layer of experts.
// The arithmetic is the eager block's, op for op (routing in fp32, outputs weighted in fp32
// and rounded once, index_add onto the residual in expert order), but for SwiGLU (GeGLU:
// Gemma 4's), which is the fused layer's (gated_mul; gpt-oss's clamped_swiglu).

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <array>
#include <vector>

#include <ATen/Parallel.h>

#include "blocks.h"
#include "ops.h"

namespace iterserve {
namespace {

using at::BFloat16;
using at::Tensor;

// (token, expert) pairs up to which a step weights and scatters the experts' outputs in one
// loop on one thread rather than seven ops (a one-sequence decode step of Qwen3-30B-A3B has 8
// in each of its 48 layers).
constexpr int64_t kFewPairs = 128;

// Every expert's projections as stacks [experts, tiles, bytes a tile], one format a stack:
// gate and up (the two segments of an expert's gate+up projection) and down; gpt-oss's
// biases [experts, outputs] and clamped SwiGLU (limit > 0); Gemma 4's GeGLU.
struct ExpertWeights {
  const Tensor& gate;
  const Tensor& up;
  const Tensor& down;
  std::array<int64_t, 3> formats;
  const std::optional<Tensor>& gate_up_bias;
  const std::optional<Tensor>& down_bias;
  double alpha, limit;
  bool gelu;

  static std::optional<Tensor> row(const std::optional<Tensor>& bias, int64_t e) {
    if (!bias) return std::nullopt;
    return bias->select(0, e);
  }
  Tensor gate_up(int64_t e, const Tensor& x) const {
    return tiled_linear(x, {gate[e], up[e]}, {formats[0], formats[1]}, row(gate_up_bias, e),
                        std::nullopt);
  }
  Tensor activate(const Tensor& gate_up) const {
    return limit > 0 ? clamped_swiglu(gate_up, alpha, limit) : gated_mul(gate_up, gelu);
  }
  Tensor project_down(int64_t e, const Tensor& x) const {
    return tiled_linear(x, {down[e]}, {formats[2]}, row(down_bias, e), std::nullopt);
  }
};

// Each row's top_k experts and their weights (fp32), as model/moe.py's `route`: a softmax
// over all experts, the top k, and (renormalize) those k over their sum; or (sigmoid) each
// expert's sigmoid, the top k of sigmoid + selection_bias where one is given (the bias picks,
// the sigmoids weigh), and (renormalize) those k over their sum + 1e-6 (transformers'
// LFM2-MoE); then times `scaling`.
std::tuple<Tensor, Tensor> route(const Tensor& logits, int64_t top_k, bool renormalize,
                                 bool sigmoid, const std::optional<Tensor>& selection_bias,
                                 double scaling) {
  Tensor weights, experts;
  if (!sigmoid) {
    std::tie(weights, experts) = at::topk(at::softmax(logits, -1), top_k, -1);
    if (renormalize) weights = weights / weights.sum(-1, true);
  } else {
    const Tensor scores = at::sigmoid(logits);
    if (selection_bias) {
      experts = std::get<1>(at::topk(scores + *selection_bias, top_k, -1));
      weights = scores.gather(1, experts);
    } else {
      std::tie(weights, experts) = at::topk(scores, top_k, -1);
    }
    if (renormalize) weights = weights / (weights.sum(-1, true) + 1e-6);
  }
  if (scaling != 1.0) weights = weights * scaling;
  return {weights, experts};
}

}  // namespace

Tensor experts_mlp(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& router,
                   int64_t top_k, bool renormalize, const Tensor& gate, const Tensor& up,
                   const Tensor& down, c10::IntArrayRef formats,
                   const std::optional<Tensor>& router_bias,
                   const std::optional<Tensor>& gate_up_bias,
                   const std::optional<Tensor>& down_bias, double swiglu_alpha,
                   double swiglu_limit, bool sigmoid_scores,
                   const std::optional<Tensor>& selection_bias, double routed_scaling,
                   const std::optional<Tensor>& router_input,
                   const std::optional<Tensor>& expert_scales, bool gelu) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "experts_mlp: x must be 2-D bf16 with contiguous rows");
  TORCH_CHECK(formats.size() == 3, "experts_mlp: one format each for gate, up and down");
  const ExpertWeights experts_w{gate, up, down, {formats[0], formats[1], formats[2]},
                                gate_up_bias, down_bias, swiglu_alpha, swiglu_limit, gelu};
  const int64_t E = gate.size(0), T = x.size(0);
  for (const Tensor* t : {&gate, &up, &down})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == E && t->scalar_type() == at::kByte,
                "experts_mlp: weights must be [", E, " experts, tiles, bytes] uint8 stacks");
  for (const std::optional<Tensor>* bias : {&gate_up_bias, &down_bias})
    TORCH_CHECK(!*bias || ((*bias)->dim() == 2 && (*bias)->size(0) == E &&
                           (*bias)->scalar_type() == at::kBFloat16 && (*bias)->is_contiguous()),
                "experts_mlp: expert biases must be [", E, " experts, outputs] bf16");
  TORCH_CHECK(0 < top_k && top_k <= E, "experts_mlp: top_k ", top_k, " of ", E, " experts");
  TORCH_CHECK(!selection_bias || (sigmoid_scores && selection_bias->dim() == 1 &&
                                  selection_bias->size(0) == E &&
                                  selection_bias->scalar_type() == at::kFloat),
              "experts_mlp: a selection bias is fp32 [", E, " experts], with sigmoid scores");
  TORCH_CHECK(!expert_scales || (expert_scales->dim() == 1 && expert_scales->size(0) == E &&
                                 expert_scales->scalar_type() == at::kFloat),
              "experts_mlp: expert scales are fp32 [", E, " experts]");
  TORCH_CHECK(!router_input || (router_input->sizes() == x.sizes() &&
                                router_input->scalar_type() == at::kBFloat16 &&
                                router_input->stride(1) == 1),
              "experts_mlp: the router's input must be bf16 rows shaped as x");

  // Routing (`route`, above) from the logits rounded to bf16 as F.linear's are, from the
  // router's bf16 tiles: each row summed in one order whatever the step's size. The router
  // reads x, or rows of its own (Gemma 4's: the stream through the router's norm); Gemma 4
  // then multiplies each weight by its expert's scale.
  TORCH_CHECK(router.dim() == 2 && router.scalar_type() == at::kByte &&
                  router.size(0) * kTile >= E,
              "experts_mlp: the router must be bf16 tiles [tiles, bytes] uint8 for ", E,
              " experts");
  const Tensor logits = tiled_linear(router_input ? *router_input : x, {router},
                                     {static_cast<int64_t>(Format::kBf16)}, router_bias,
                                     std::nullopt)
                            .narrow(1, 0, E);
  auto [weights, experts] = route(logits.to(at::kFloat), top_k, renormalize, sigmoid_scores,
                                  selection_bias, routed_scaling);
  if (expert_scales)
    weights = weights * expert_scales->index_select(0, experts.flatten()).view_as(weights);

  // The T*k (token, expert) pairs in expert order, stably (pair i is token i / k): each
  // expert's rows one consecutive run of the gathered activations.
  const Tensor flat = experts.flatten().contiguous();
  const int64_t* ids = flat.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < T * top_k; ++i) ++start[ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  Tensor order = at::empty({T * top_k}, at::kLong);
  int64_t* order_p = order.data_ptr<int64_t>();
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < T * top_k; ++i) order_p[next[ids[i]]++] = i;
  // One token's experts all take x itself (below): no rows to gather.
  const Tensor token_rows = T == 1 ? Tensor() : at::floor_divide(order, top_k);
  const Tensor routed = T == 1 ? Tensor() : x.index_select(0, token_rows);

  std::vector<int64_t> hit;
  int64_t most_rows = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1] == start[e]) continue;
    hit.push_back(e);
    most_rows = std::max(most_rows, start[e + 1] - start[e]);
  }
  const auto n_hit = static_cast<int64_t>(hit.size());
  std::vector<Tensor> outputs(n_hit);
  auto run_expert = [&](int64_t i) {
    const int64_t e = hit[i];
    const Tensor rows = routed.narrow(0, start[e], start[e + 1] - start[e]);
    outputs[i] = experts_w.project_down(e, experts_w.activate(experts_w.gate_up(e, rows)));
  };
  if (T == 1) {
    // One token: every expert it is routed to takes the same row, so their gate+up
    // projections are one call over all their segments (one stream of bytes shared evenly
    // between the threads, one parallel region), then each thread takes whole experts' down.
    std::vector<Tensor> segments, biases;
    std::vector<int64_t> segment_formats;
    for (const int64_t e : hit) {
      segments.insert(segments.end(), {gate[e], up[e]});
      segment_formats.insert(segment_formats.end(), {formats[0], formats[1]});
      if (gate_up_bias) biases.push_back(gate_up_bias->select(0, e));
    }
    const std::optional<Tensor> bias =
        gate_up_bias ? std::optional<Tensor>(at::cat(biases)) : std::nullopt;
    const Tensor gate_ups = tiled_linear(x, segments, segment_formats, bias, std::nullopt);
    const Tensor acts = experts_w.activate(gate_ups.view({n_hit, -1}));
    at::parallel_for(0, n_hit, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        outputs[i] = experts_w.project_down(hit[i], acts.narrow(0, i, 1));
    });
  } else if (most_rows <= kRegisterRows) {
    // Decode: each expert a few rows, bound by its weights' bytes, all experts alike in size.
    // Each thread takes whole experts (the kernels inside run on it alone): long streams of
    // one expert's weights after another, rather than every expert's two small projections
    // split between the threads, a parallel region and its wait each.
    at::parallel_for(0, n_hit, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) run_expert(i);
    });
  } else {
    for (int64_t i = 0; i < n_hit; ++i) run_expert(i);
  }
  // Weighted in fp32 and rounded once to the model dtype, as transformers does, then added
  // onto the residual pair by pair in expert order, as index_add does.
  const Tensor base = residual ? *residual : at::zeros_like(x);
  if (T > 1 && T * top_k > kFewPairs) {  // (one token: no token_rows)
    const Tensor pair_weights = weights.flatten().index_select(0, order).unsqueeze(1);
    const Tensor weighted = (at::cat(outputs).to(at::kFloat) * pair_weights).to(x.scalar_type());
    return base.index_add(0, token_rows, weighted);
  }
  // A few pairs: the same arithmetic in one loop, not seven ops (index_add of bf16 sums a
  // row's additions in fp32 and rounds once).
  Tensor sums = base.to(at::kFloat).contiguous();
  const Tensor pair_weight = weights.contiguous();
  const float* w = pair_weight.data_ptr<float>();
  const int64_t H = x.size(1);
  for (int64_t i = 0; i < n_hit; ++i) {
    const int64_t e = hit[i];
    for (int64_t p = start[e]; p < start[e + 1]; ++p) {
      const int64_t pair = order_p[p];
      const float weight = w[pair];
      const BFloat16* y = outputs[i].data_ptr<BFloat16>() + (p - start[e]) * outputs[i].stride(0);
      float* o = sums.data_ptr<float>() + pair / top_k * H;
      for (int64_t h = 0; h < H; ++h)
        o[h] += static_cast<float>(BFloat16(static_cast<float>(y[h]) * weight));
    }
  }
  return sums.to(x.scalar_type());
}

}  // namespace iterserve
