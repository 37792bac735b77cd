// The projections: y = x W^T (+ bias) (+ residual), x [M, K] bf16, W [N, K] in tiles of 16
// output rows in one of blocks.h's formats, at every step size from one row to thousands (the
// loops: tiles.h).
//
// A weight is one or more segments (consecutive output rows, each in its own format: a fused
// q/k/v whose v is Q6_K and q, k Q4_K), run in one call. A step of a few rows, bound by the
// bytes it reads, splits them equally among the threads, a thread done with its share taking
// the last tiles of another's; past that, threads claim the output tiles a pass at a time as
// they finish the last, so neither a segment of denser blocks nor a slower core leaves the
// other threads waiting (thread_shares.h).
//
// Results equal "dequantize, then matmul against the int8-rounded activations" up to fp32
// rounding; the dense ones equal the fp32 matmul rounded once to bf16. The bias and residual
// are added in fp32 before that single rounding (none for fp32 output).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "ops.h"
#include "reused_empty.h"
#include "thread_shares.h"
#include "tiles.h"

#include <atomic>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace iterserve {
namespace {

using at::Tensor;

// Inputs a thread quantizes at least (a row of 2048 takes ~1 us, a parallel region a few):
// with a grain of 16 rows a batch-16 decode step quantized on one thread while the other
// waited, ~4% of that thread's time on a 1B Q4_K_M (perf, 2026-11-29, avx512bf16).
constexpr int64_t kQuantizeGrainInputs = 16384;

// x's rows quantized per unit (tiles.h QuantizedBuffers), the rows spread over the threads.
// A buffer of kMappedBytes and more (an 8B's down projection past ~2,300 rows) is a tensor,
// `memory`, which a layers' scope keeps from layer to layer as it does the step's others
// (reused_empty.h).
QuantizedBuffers quantized(const at::BFloat16* x, int64_t ld_x, int64_t M, int64_t K,
                           int64_t unit, Tensor& memory) {
  const int64_t bytes = QuantizedBuffers::bytes(M, K, unit);
  if (bytes >= kMappedBytes) memory = empty_reused({bytes}, at::TensorOptions(at::kChar));
  QuantizedBuffers q(M, K, unit, memory.defined() ? memory.data_ptr<int8_t>() : nullptr);
  const int64_t grain = std::max<int64_t>(1, kQuantizeGrainInputs / K);
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) q.row(x + m * ld_x, K, m);
  });
  return q;
}

}  // namespace

Tensor tiled_linear(const Tensor& x, at::TensorList weights, c10::IntArrayRef formats,
                    const std::optional<Tensor>& bias, const std::optional<Tensor>& residual,
                    bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "tiled_linear: x must be 2-D bf16 with contiguous rows");
  TORCH_CHECK(!weights.empty() && weights.size() == formats.size(),
              "tiled_linear: one format per weight segment");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<Segment> segs;
  bool any_dense = false, per32 = false, per256 = false;
  int64_t tiles = 0;
  for (size_t s = 0; s < weights.size(); ++s) {
    const Tensor& w = weights[s];
    const auto f = static_cast<Format>(formats[s]);
    const int64_t bytes = tile_bytes(f, K);
    TORCH_CHECK(bytes > 0, "tiled_linear: K=", K, " does not fit weight format ", formats[s]);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                    w.size(1) == bytes,
                "tiled_linear: segment ", s, " must be [tiles, ", bytes, "] uint8 for K=", K);
    segs.push_back({f, w.data_ptr<uint8_t>(), bytes, w.size(0), tiles});
    tiles += w.size(0);
    if (f == Format::kBf16 || f == Format::kF16) any_dense = true;
    else
      with_codec(f, [&](auto codec) { (decltype(codec)::kInputs == 256 ? per256 : per32) = true; });
  }
  const int64_t N = tiles * kTile;
  Tensor out = empty_reused({M, N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  Epilogue ep{nullptr, nullptr, N, nullptr, nullptr, 0};
  if (fp32_out)
    ep.out_f32 = out.data_ptr<float>();
  else
    ep.out = out.data_ptr<at::BFloat16>();
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous(),
                "tiled_linear: bias must be [", N, "] bf16");
    ep.bias = bias->data_ptr<at::BFloat16>();
  }
  if (residual && residual->defined()) {
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->size(0) == M &&
                    residual->size(1) == N && residual->stride(1) == 1,
                "tiled_linear: residual must be [", M, ", ", N, "] bf16");
    ep.residual = residual->data_ptr<at::BFloat16>();
    ep.ld_res = residual->stride(0);
  }
  Rows rows{K, nullptr, 0, nullptr, 0, {}, {}};
  Tensor x_float;
  if (any_dense) {
    // The rows as pair_dot takes them (x itself, or widened to fp32 once here), and fp32 rows
    // for the fp16 tiles.
    x_float = x.to(at::kFloat);
    rows.xf = x_float.data_ptr<float>();
    rows.ld_xf = x_float.stride(0);
    const Tensor& pairs = kBf16Dot ? x : x_float;
    rows.xp = static_cast<const XElem*>(pairs.data_ptr());
    rows.ld_xp = pairs.stride(0);
  }
  // The activations each block format pairs with (tile_bytes checked that K fits them).
  std::optional<QuantizedBuffers> q32, q256;
  Tensor q32_memory, q256_memory;
  const auto* xb = x.data_ptr<at::BFloat16>();
  if (per32) rows.per32 = q32.emplace(quantized(xb, x.stride(0), M, K, 32, q32_memory)).view;
  if (per256)
    rows.per256 = q256.emplace(quantized(xb, x.stride(0), M, K, 256, q256_memory)).view;
  const int64_t threads_wanted = at::get_num_threads();
  if (M <= kRegisterRows) {
    // Bound by the bytes it reads: an equal share of them a thread, read in lanes, the
    // slower thread's last steps taken by the faster (thread_shares.h).
    const int threads = static_cast<int>(std::max<int64_t>(1, std::min(threads_wanted, tiles)));
    Shares shares(segs, threads, M);
    auto run_step = [&](const LaneStep& step) { lane_step(segs[step.seg], rows, M, step, ep); };
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) shares.run(static_cast<int>(i), run_step);
    });
    return out;
  }
  // Bound by arithmetic: threads claim the tiles a pass at a time (thread_shares.h `chunks`), each
  // its next pass before it starts the current one, whose last blocks prefetch it; past
  // kSweepRowBlock rows, every pass of one block of rows, then of the next.
  const std::vector<Chunk> work = chunks(segs);
  const auto passes = static_cast<int64_t>(work.size());
  const int64_t count = passes * ((M + kSweepRowBlock - 1) / kSweepRowBlock);
  std::atomic<int64_t> claimed{0};
  auto span_of = [&](int64_t c) {
    if (c >= count) return Span{};
    const Chunk& chunk = work[c % passes];
    const Segment& seg = segs[chunk.seg];
    return Span{seg.data + chunk.t_begin * seg.stride, seg.data + chunk.t_end * seg.stride};
  };
  at::parallel_for(0, std::min(threads_wanted, count), 1, [&](int64_t, int64_t) {
    int64_t c = claimed.fetch_add(1);
    while (c < count) {
      const int64_t after = claimed.fetch_add(1);
      const Chunk& chunk = work[c % passes];
      const int64_t m0 = c / passes * kSweepRowBlock;
      segment_range(segs[chunk.seg], rows.from(m0), std::min(kSweepRowBlock, M - m0),
                    chunk.t_begin, chunk.t_end, ep.from_row(m0), span_of(after));
      c = after;
    }
  });
  return out;
}

// Activations as the block formats quantize them, per unit of 32 or 256 inputs (for tests):
// (q [M, K] int8, scales [M, K/unit]).
std::tuple<Tensor, Tensor> quantize_rows(const Tensor& x, int64_t unit) {
  TORCH_CHECK(unit == 32 || unit == 256, "quantize_rows: unit must be 32 or 256");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  x.size(1) % unit == 0,
              "quantize_rows: x must be 2-D bf16 with contiguous rows of whole units");
  const int64_t M = x.size(0), K = x.size(1);
  Tensor memory;
  const auto rows = quantized(x.data_ptr<at::BFloat16>(), x.stride(0), M, K, unit, memory);
  Tensor q = at::empty({M, K}, at::kChar), s = at::empty({M, K / unit}, at::kFloat);
  for (int64_t m = 0; m < M; ++m)
    std::memcpy(q.data_ptr<int8_t>() + m * K, rows.view.xq + m * rows.view.ld, K);
  std::memcpy(s.data_ptr<float>(), rows.view.scale, M * K / unit * sizeof(float));
  return {q, s};
}

}  // namespace iterserve
