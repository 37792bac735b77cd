// Greedy sampling's argmax over a step's logit rows, as torch.argmax answers it: the first index
// of a row's maximum, or of its first NaN.
//
// Why its own op: right after a forward has streamed the weights through the caches, each torch
// op the sampler calls costs tens of microseconds, and the exact argmax in torch took five (the
// chunk maxima, then the best chunk's). Greedy sampling, timed around Sampler.__call__ in
// benchmarks/decode_speed.py's run_batch (one row, 2026-11-30, avx512bf16): a Gemma 3 270M step
// (262,144 logits) 185-230 -> 147-157 us, a Llama 1B's (49,152) 209-222 -> 95-110 us. One pass
// here: each of 16 lanes keeps its largest value and where it first saw it, compared as floats
// (a vocabulary's indices are exact in fp32), so no second pass looks for the maximum's place.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "ops.h"
#include "simd.h"

#include <cmath>
#include <cstdint>

namespace iterserve {
namespace {

using at::Tensor;

// Rows a thread takes at least: a row of 50-260K logits is 5-30 us.
constexpr int64_t kLogitRowGrain = 4;

int64_t argmax_row(const float* x, int64_t n) {
  int64_t best = 0;
  int64_t i = 0;
  if (n >= kLanes) {
    float lane_index[kLanes];
    for (int j = 0; j < kLanes; ++j) lane_index[j] = static_cast<float>(j);
    const F16 step = F16::splat(static_cast<float>(kLanes));
    F16 where = F16::load(lane_index);
    F16 value = F16::load(x);
    F16 at = where;
    F16 nan_seen = value;  // maximum() keeps a NaN once one is in
    for (i = kLanes; i + kLanes <= n; i += kLanes) {
      where = where + step;
      const F16 v = F16::load(x + i);
      const F16 larger = less_than(value, v);  // strictly: a lane keeps its first maximum
      value = select(larger, value, v);
      at = select(larger, at, where);
      nan_seen = maximum(nan_seen, v);
    }
    if (std::isnan(nan_seen.max())) {
      for (int64_t k = 0; k < n; ++k)
        if (std::isnan(x[k])) return k;
    }
    float values[kLanes], places[kLanes];
    value.store(values);
    at.store(places);
    for (int j = 1; j < kLanes; ++j)
      if (values[j] > values[best] || (values[j] == values[best] && places[j] < places[best]))
        best = j;
    best = static_cast<int64_t>(places[best]);
  }
  // The tail past whole vectors (or a short row): its first NaN is the row's, since one
  // before it would have returned above.
  for (; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

}  // namespace

Tensor argmax_rows(const Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
                  logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 24),
              "argmax_rows: logits must be [rows, n] float32 with contiguous rows, 0 < n < 2^24");
  const int64_t M = logits.size(0), n = logits.size(1);
  Tensor out = at::empty({M}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* best = out.data_ptr<int64_t>();
  at::parallel_for(0, M, kLogitRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) best[m] = argmax_row(x + m * logits.stride(0), n);
  });
  return out;
}

}  // namespace iterserve
