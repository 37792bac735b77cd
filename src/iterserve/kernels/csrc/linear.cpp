// Weight-streaming linear layers for the few-row steps of decoding (x [M, K] @ W[N, K]^T).
//
// At one to a few rows a step is nothing but reading weights, so these kernels read each
// weight once for every row of the step, in a layout made for AVX-512 BF16: outputs come in
// tiles of 16 (one fp32 register), and within a tile the weights of two consecutive inputs
// sit side by side, so `vdpbf16ps` with a broadcast pair of activations advances 16 outputs
// by two inputs at once with no horizontal sums. The weight formats:
//
//   bf16  [N/16, K/2, 16, 2] bf16                  the model's own weights
//   q4    [N/16, K/32, 256] uint8 + [N/16, K/32, 2, 16] fp16 (scale d, offset m)
//         GGUF Q4_0/Q4_1 blocks of 32 inputs: w = d * q + m, q in 0..15 (Q4_0: m = -8d)
//   q8    [N/16, K/32, 512] int8  + [N/16, K/32, 16] fp16 (scale d)
//         GGUF Q8_0 blocks: w = d * q
//   i8    [N/16, K/4, 16, 4] uint8 (q + 128) + [N] fp32 (scale s)
//         w = s * q, q in -127..127 per output row; four inputs side by side, as the
//         integer dot product `vpdpbusd` takes them (W8A8; see "i8" below)
//
// q4 and q8 weights are turned into exact bf16 integers in registers (0..15 by a table
// lookup, -128..127 by conversion), so every product x * q is exact in fp32 and the block's
// scale and offset are applied to the fp32 block sum: the result equals "dequantize to fp32,
// then matmul" up to the order of fp32 additions. i8 rounds the activations too (to 8 bits
// per block of 32 inputs) and is exact against that rounding. The residual (and bias) are
// added in fp32 before the single rounding to bf16 (none for fp32 output), as oneDNN's
// fused add does.
//
// The same kernel serves large steps too: each pass keeps a few tiles' weights in L2 while
// every block of rows reads them, and at 512 rows it runs at the machine's bf16 peak, level
// with oneDNN's GEMM (benchmarks/linear_kernels.py). For 4/8-bit weights, steps of more than
// `max_tile_rows` rows are compute-bound and the unpacking costs more than the bytes it
// saves, so they run the copy given as `wide_weight`: bf16, or i8 with the activations
// quantized too, whose integer dot products (`vpdpbusd`, 64 multiply-adds an instruction
// against `vdpbf16ps`'s 32) double the compute ceiling of those steps.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace iterserve {
namespace {

using at::Tensor;

constexpr int64_t kTile = 16;   // outputs per tile: one zmm of fp32 accumulators
constexpr int64_t kBlock = 32;  // inputs per quantization block

enum class Format : int64_t { kBf16 = 0, kQ4 = 1, kQ8 = 2, kI8 = 3 };

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// Two consecutive bf16 activations, broadcast to every 32-bit lane.
inline __m512bh pair_of(const at::BFloat16* x, int64_t k) {
  uint32_t bits;
  std::memcpy(&bits, x + k, sizeof(bits));
  return as_bh(_mm512_set1_epi32(static_cast<int>(bits)));
}

inline __m512 load_f16x16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Where a tile's outputs go: + bias + residual in fp32, then one rounding to bf16, or none
// (`out_f32`: logits, whose bf16 rounding, 1/8 apart near 16, makes ties of close calls).
struct Epilogue {
  at::BFloat16* out;
  float* out_f32;  // instead of `out`
  int64_t ld_out;
  const at::BFloat16* bias;      // [N] or nullptr
  const at::BFloat16* residual;  // [M, ld_res] or nullptr
  int64_t ld_res;

  inline void store(int64_t row, int64_t n0, __m512 acc) const {
    if (bias) acc = _mm512_add_ps(acc, load_bf16x16(bias + n0));
    if (residual) acc = _mm512_add_ps(acc, load_bf16x16(residual + row * ld_res + n0));
    if (out_f32)
      _mm512_storeu_ps(out_f32 + row * ld_out + n0, acc);
    else
      store_bf16x16(out + row * ld_out + n0, acc);
  }
};

struct Rows {
  const at::BFloat16* x;
  int64_t ld_x;
  const float* block_sums;  // [M, K/32] sum of each row's inputs per block (q4 only)
  // i8 only: the rows quantized ([M, K] int8), their blocks' scales ([M, K/32]) and the
  // offset each row's sums carry ([M]); see QuantizedRows.
  const int8_t* xq;
  const float* x_scales;
  const float* x_offsets;
};

// ---- bf16 -----------------------------------------------------------------------------

template <int MR, int NT>
inline void bf16_tiles(const Rows& rows, int64_t m0, const at::BFloat16* w, int64_t tile0,
                       int64_t K, const Epilogue& ep) {
  const int64_t tile_elems = K * kTile;
  const at::BFloat16* wt = w + tile0 * tile_elems;
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh wv[NT];
    for (int j = 0; j < NT; ++j)
      wv[j] = as_bh(_mm512_loadu_si512(wt + j * tile_elems + k * kTile));
    for (int r = 0; r < MR; ++r) {
      const __m512bh xv = pair_of(rows.x + (m0 + r) * rows.ld_x, k);
      for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) ep.store(m0 + r, (tile0 + j) * kTile, acc[r][j]);
}

// ---- q4 (GGUF Q4_0 / Q4_1) --------------------------------------------------------------

// A block's 256 bytes hold 16 outputs x 32 inputs as 4 chunks of 64 bytes, i.e. 32 16-bit
// words; word 2j+e of chunk c holds output j's input 2p+e for the four pairs p = 4c..4c+3,
// pair 4c+i in bits 4i..4i+3. Moving a nibble to bits 3..6 and setting 0x3F80 makes the
// bf16 number 1 + q/16 with no cross-lane shuffle (a shift and one ternary-logic op), so
//   sum_k x_k w_k = sum_k x_k (d q_k + m) = 16d * sum_k x_k (1 + q_k/16) + (m - 16d) * sum_k x_k
// where every product x_k (1 + q_k/16) is exact in fp32.
template <int I>
inline __m512bh q4_pair(__m512i words) {
  const __m512i field = _mm512_set1_epi16(0x0078);
  const __m512i one = _mm512_set1_epi16(0x3F80);
  const __m512i moved = I == 0 ? _mm512_slli_epi16(words, 3) : _mm512_srli_epi16(words, 4 * I - 3);
  return as_bh(_mm512_ternarylogic_epi32(moved, field, one, 0xEA));  // (moved & field) | one
}

template <int MR, int NT>
inline void q4_tiles(const Rows& rows, int64_t m0, const uint8_t* q, const at::Half* scales,
                     int64_t tile0, int64_t K, const Epilogue& ep) {
  const int64_t blocks = K / kBlock;
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 part[MR][NT];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NT; ++j) part[r][j] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      const int64_t k = b * kBlock + 8 * c;
      __m512bh xv[MR][4];
      for (int r = 0; r < MR; ++r)
        for (int i = 0; i < 4; ++i) xv[r][i] = pair_of(rows.x + (m0 + r) * rows.ld_x, k + 2 * i);
      for (int j = 0; j < NT; ++j) {
        const __m512i words = _mm512_loadu_si512(q + ((tile0 + j) * blocks + b) * 256 + c * 64);
        const __m512bh w0 = q4_pair<0>(words), w1 = q4_pair<1>(words);
        const __m512bh w2 = q4_pair<2>(words), w3 = q4_pair<3>(words);
        for (int r = 0; r < MR; ++r) {
          part[r][j] = _mm512_dpbf16_ps(part[r][j], w0, xv[r][0]);
          part[r][j] = _mm512_dpbf16_ps(part[r][j], w1, xv[r][1]);
          part[r][j] = _mm512_dpbf16_ps(part[r][j], w2, xv[r][2]);
          part[r][j] = _mm512_dpbf16_ps(part[r][j], w3, xv[r][3]);
        }
      }
    }
    for (int j = 0; j < NT; ++j) {
      const at::Half* s = scales + ((tile0 + j) * blocks + b) * 2 * kTile;
      const __m512 d16 = _mm512_mul_ps(load_f16x16(s), _mm512_set1_ps(16.0f));
      const __m512 offset = _mm512_sub_ps(load_f16x16(s + kTile), d16);
      for (int r = 0; r < MR; ++r) {
        const __m512 xsum = _mm512_set1_ps(rows.block_sums[(m0 + r) * blocks + b]);
        acc[r][j] = _mm512_fmadd_ps(part[r][j], d16, _mm512_fmadd_ps(offset, xsum, acc[r][j]));
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) ep.store(m0 + r, (tile0 + j) * kTile, acc[r][j]);
}

// ---- q8 (GGUF Q8_0) --------------------------------------------------------------------

// A block's 512 bytes are its 16 input pairs in order, 32 bytes each: outputs 0..7 (even,
// odd input) then outputs 8..15, the order vcvtne2ps2bf16 puts two converted halves in.
inline __m512bh q8_pair(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

template <int MR, int NT>
inline void q8_tiles(const Rows& rows, int64_t m0, const int8_t* q, const at::Half* scales,
                     int64_t tile0, int64_t K, const Epilogue& ep) {
  const int64_t blocks = K / kBlock;
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 part[MR][NT];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NT; ++j) part[r][j] = _mm512_setzero_ps();
    for (int p = 0; p < kBlock / 2; ++p) {
      const int64_t k = b * kBlock + 2 * p;
      for (int j = 0; j < NT; ++j) {
        const __m512bh wv = q8_pair(q + ((tile0 + j) * blocks + b) * 512 + p * 32);
        for (int r = 0; r < MR; ++r)
          part[r][j] = _mm512_dpbf16_ps(part[r][j], wv, pair_of(rows.x + (m0 + r) * rows.ld_x, k));
      }
    }
    for (int j = 0; j < NT; ++j) {
      const __m512 d = load_f16x16(scales + ((tile0 + j) * blocks + b) * kTile);
      for (int r = 0; r < MR; ++r) acc[r][j] = _mm512_fmadd_ps(part[r][j], d, acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) ep.store(m0 + r, (tile0 + j) * kTile, acc[r][j]);
}

// ---- i8 (W8A8) --------------------------------------------------------------------------

// Activations quantized per block of 32 inputs (as llama.cpp quantizes them for its 4-bit
// dot products; one scale per row measured twice the greedy disagreement with bf16 on the
// bundled model): x ~ s_b * q with q = round(x * 127 / max|x| over the block), q in
// -127..127. `vpdpbusd` multiplies unsigned by signed bytes, so the weights are stored as
// q_w + 128 and each row's sum picks up 128 * sum_b s_b * sum(q over b), which `offset`
// holds and the epilogue takes away: y = s_w * (sum_b s_b * dot_b - offset).
struct QuantizedRows {
  Tensor q;        // [M, K] int8
  Tensor scales;   // [M, K/32] fp32
  Tensor offsets;  // [M] fp32

  // Every element is written below: uninitialised buffers, no fill.
  QuantizedRows(const at::BFloat16* x, int64_t ld_x, int64_t M, int64_t K)
      : q(at::empty({M, K}, at::kChar)),
        scales(at::empty({M, K / kBlock}, at::kFloat)),
        offsets(at::empty({M}, at::kFloat)) {
    const int64_t blocks = K / kBlock;
    int8_t* q_data = q.data_ptr<int8_t>();
    float* scale_data = scales.data_ptr<float>();
    float* offset_data = offsets.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        float offset = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const at::BFloat16* src = x + m * ld_x + b * kBlock;
          const __m512 lo = load_bf16x16(src), hi = load_bf16x16(src + 16);
          const float amax =
              _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
          const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
          // Round half to even (the default rounding mode), as torch.round does.
          const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
          const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
          int8_t* dst = q_data + m * K + b * kBlock;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qlo));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qhi));
          const float scale = amax / 127.0f;
          scale_data[m * blocks + b] = scale;
          offset += scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
        }
        offset_data[m] = 128.0f * offset;
      }
    });
  }
};

template <int MR, int NT>
inline void i8_tiles(const Rows& rows, int64_t m0, const uint8_t* w, const float* w_scales,
                     int64_t tile0, int64_t K, const Epilogue& ep) {
  const int64_t tile_bytes = K * kTile, blocks = K / kBlock;
  const int8_t* xq = rows.xq;
  const uint8_t* wt = w + tile0 * tile_bytes;
  __m512 acc[MR][NT];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i part[MR][NT];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NT; ++j) part[r][j] = _mm512_setzero_si512();
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; k += 4) {
      __m512i wv[NT];
      for (int j = 0; j < NT; ++j) wv[j] = _mm512_loadu_si512(wt + j * tile_bytes + k * kTile);
      for (int r = 0; r < MR; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + (m0 + r) * K + k, sizeof(quad));
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int j = 0; j < NT; ++j) part[r][j] = _mm512_dpbusd_epi32(part[r][j], wv[j], xv);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 s = _mm512_set1_ps(rows.x_scales[(m0 + r) * blocks + b]);
      for (int j = 0; j < NT; ++j)
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[r][j]), s, acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 offset = _mm512_set1_ps(rows.x_offsets[m0 + r]);
    for (int j = 0; j < NT; ++j) {
      const int64_t n0 = (tile0 + j) * kTile;
      const __m512 y = _mm512_mul_ps(_mm512_sub_ps(acc[r][j], offset), _mm512_loadu_ps(w_scales + n0));
      ep.store(m0 + r, n0, y);
    }
  }
}

// ---- driver ----------------------------------------------------------------------------

struct Weights {
  Format format;
  const void* data;
  const void* scales;  // fp16 blocks (q4, q8), fp32 rows (i8)
  int64_t K;
};

// Tiles per register block: enough independent accumulators to hide the dot-product
// latency at one row, few enough that MR rows of them fit the 32 zmm registers.
template <int MR>
constexpr int tiles_per_step() {
  return MR <= 2 ? 4 : 2;
}

template <int MR, int NT>
inline void run_tiles(const Weights& w, const Rows& rows, int64_t m0, int64_t tile0,
                      const Epilogue& ep) {
  switch (w.format) {
    case Format::kBf16:
      bf16_tiles<MR, NT>(rows, m0, static_cast<const at::BFloat16*>(w.data), tile0, w.K, ep);
      break;
    case Format::kQ4:
      q4_tiles<MR, NT>(rows, m0, static_cast<const uint8_t*>(w.data),
                       static_cast<const at::Half*>(w.scales), tile0, w.K, ep);
      break;
    case Format::kQ8:
      q8_tiles<MR, NT>(rows, m0, static_cast<const int8_t*>(w.data),
                       static_cast<const at::Half*>(w.scales), tile0, w.K, ep);
      break;
    case Format::kI8:
      i8_tiles<MR, NT>(rows, m0, static_cast<const uint8_t*>(w.data),
                       static_cast<const float*>(w.scales), tile0, w.K, ep);
      break;
  }
}

template <int MR>
void rows_over_tiles(const Weights& w, const Rows& rows, int64_t m0, int64_t t_begin,
                     int64_t t_end, const Epilogue& ep) {
  constexpr int NT = tiles_per_step<MR>();
  int64_t t = t_begin;
  for (; t + NT <= t_end; t += NT) run_tiles<MR, NT>(w, rows, m0, t, ep);
  for (; t < t_end; ++t) run_tiles<MR, 1>(w, rows, m0, t, ep);
}

// Tiles per pass over the rows: their weights (8 x 16 outputs x K inputs, ~150 KB of bf16 at
// K = 576) stay in L2 while every block of rows reads them, so a weight comes from memory
// once per step however many rows there are. The loop the other way round streamed a
// vocabulary-sized head from DRAM once per 4 rows (2.5x slower than oneDNN at 64 rows).
constexpr int64_t kTilesPerPass = 8;

void tiles_range(const Weights& w, const Rows& rows, int64_t M, int64_t t_begin, int64_t t_end,
                 const Epilogue& ep) {
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTilesPerPass) {
    const int64_t t1 = std::min(t0 + kTilesPerPass, t_end);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) rows_over_tiles<4>(w, rows, m, t0, t1, ep);
    switch (M - m) {
      case 3: rows_over_tiles<3>(w, rows, m, t0, t1, ep); break;
      case 2: rows_over_tiles<2>(w, rows, m, t0, t1, ep); break;
      case 1: rows_over_tiles<1>(w, rows, m, t0, t1, ep); break;
      default: break;
    }
  }
}

}  // namespace

Tensor tiled_linear(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& scales,
                    const std::optional<Tensor>& bias, const std::optional<Tensor>& residual,
                    int64_t format, const std::optional<Tensor>& wide_weight,
                    const std::optional<Tensor>& wide_scales, int64_t wide_format,
                    int64_t max_tile_rows, bool fp32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "tiled_linear: x must be 2-D bf16 with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  if (wide_weight && wide_weight->defined() && M > max_tile_rows) {
    // Past a few rows a step is compute-bound and the 4/8-bit unpacking costs more than the
    // bytes it saves: run the wide copy (benchmarks/linear_kernels.py).
    return tiled_linear(x, *wide_weight, wide_scales, bias, residual, wide_format, std::nullopt,
                        std::nullopt, 0, 0, fp32_out);
  }
  const int64_t tiles = weight.size(0), N = tiles * kTile;
  const auto fmt = static_cast<Format>(format);
  TORCH_CHECK(fmt == Format::kBf16 ? K % 2 == 0 : K % kBlock == 0,
              "tiled_linear: K=", K, " does not fit the weight format");
  TORCH_CHECK(weight.is_contiguous(), "tiled_linear: weight must be contiguous");
  Tensor out = at::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  Epilogue ep{nullptr, nullptr, N, nullptr, nullptr, 0};
  if (fp32_out)
    ep.out_f32 = out.data_ptr<float>();
  else
    ep.out = out.data_ptr<at::BFloat16>();
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == N && bias->is_contiguous());
    ep.bias = bias->data_ptr<at::BFloat16>();
  }
  if (residual && residual->defined()) {
    TORCH_CHECK(residual->scalar_type() == at::kBFloat16 && residual->size(0) == M &&
                residual->size(1) == N && residual->stride(1) == 1);
    ep.residual = residual->data_ptr<at::BFloat16>();
    ep.ld_res = residual->stride(0);
  }
  Weights w{fmt, weight.data_ptr(), nullptr, K};
  Rows rows{x.data_ptr<at::BFloat16>(), x.stride(0), nullptr, nullptr, nullptr, nullptr};
  if (fmt == Format::kI8) {
    TORCH_CHECK(scales && scales->scalar_type() == at::kFloat && scales->numel() == N &&
                    scales->is_contiguous(),
                "tiled_linear: i8 weights need [N] fp32 scales");
    w.scales = scales->data_ptr<float>();
  } else if (fmt != Format::kBf16) {
    TORCH_CHECK(scales && scales->scalar_type() == at::kHalf && scales->is_contiguous());
    w.scales = scales->data_ptr<at::Half>();
  }
  std::vector<float> block_sums;
  if (fmt == Format::kQ4) {
    block_sums.resize(M * (K / kBlock));
    for (int64_t m = 0; m < M; ++m) {
      const at::BFloat16* row = rows.x + m * rows.ld_x;
      for (int64_t b = 0; b < K / kBlock; ++b) {
        __m512 sum = _mm512_add_ps(load_bf16x16(row + b * kBlock), load_bf16x16(row + b * kBlock + 16));
        block_sums[m * (K / kBlock) + b] = _mm512_reduce_add_ps(sum);
      }
    }
    rows.block_sums = block_sums.data();
  }
  std::optional<QuantizedRows> quantized;
  if (fmt == Format::kI8) {
    const QuantizedRows& q = quantized.emplace(rows.x, rows.ld_x, M, K);
    rows.xq = q.q.data_ptr<int8_t>();
    rows.x_scales = q.scales.data_ptr<float>();
    rows.x_offsets = q.offsets.data_ptr<float>();
  }
  // Split the tiles among threads; each thread reads its share of the weights once.
  const int64_t grain = std::max<int64_t>(1, tiles / (4 * at::get_num_threads()));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    tiles_range(w, rows, M, begin, end, ep);
  });
  return out;
}

// Activations as the i8 kernel quantizes them (for tests): (q [M, K] int8, scales [M, K/32]).
std::tuple<Tensor, Tensor> quantize_rows(const Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 &&
                  x.size(1) % kBlock == 0,
              "quantize_rows: x must be 2-D bf16 with contiguous rows of whole blocks");
  const QuantizedRows rows(x.data_ptr<at::BFloat16>(), x.stride(0), x.size(0), x.size(1));
  return {rows.q, rows.scales};
}

TORCH_LIBRARY_FRAGMENT(iterserve, m) {
  m.def(
      "tiled_linear(Tensor x, Tensor weight, Tensor? scales, Tensor? bias, Tensor? residual, "
      "int format, Tensor? wide_weight, Tensor? wide_scales, int wide_format, "
      "int max_tile_rows, bool fp32_out=False) -> Tensor");
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(iterserve, CPU, m) {
  m.impl("tiled_linear", &tiled_linear);
  m.impl("quantize_rows", &quantize_rows);
}

}  // namespace iterserve
