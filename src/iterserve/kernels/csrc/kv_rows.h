// A row of the 8-bit KV pool (ops.h: its values, then their fp32 scale), written as
// model/kv_cache_format.py writes one: shared by the attention's K/V (paged_attention.cpp)
// and LFM2's convolution rows (short_conv.cpp).
#pragma once

#include <cstring>

#include "simd.h"

namespace iterserve {

inline F16 load16(const at::BFloat16* p) { return load_bf16x16(p); }
inline F16 load16(const float* p) { return F16::load(p); }

// One row of D values (a multiple of 16) -> its int8 values and scale: s = max|x| / 127 and
// q = round(x * (127 / max|x|)), half to even.
template <typename T>
void quantize_row(const T* x, int64_t D, int8_t* dst) {
  F16 amax = F16::zero();
  for (int64_t d = 0; d < D; d += 16) amax = maximum(amax, abs(load16(x + d)));
  const float top = amax.max();
  const F16 inv = F16::splat(top > 0.0f ? 127.0f / top : 0.0f);
  for (int64_t d = 0; d < D; d += 16) store_i8x16(dst + d, round_to_int(load16(x + d) * inv));
  const float scale = top / 127.0f;
  std::memcpy(dst + D, &scale, sizeof(float));
}

}  // namespace iterserve
