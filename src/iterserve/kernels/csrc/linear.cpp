// Weight-streaming linear layers for the few-row steps of decoding (x [M, K] @ W[N, K]^T).
//
// At one to a few rows a step is nothing but reading weights, so these kernels read each
// weight once for every row of the step. Outputs come in tiles of 16 (one F16 of simd.h: a
// zmm on AVX-512, two ymm on AVX2), and within a tile the weights of two consecutive inputs
// sit side by side, so one `pair_dot` with a broadcast pair of activations advances 16
// outputs by two inputs with no horizontal sums: one `vdpbf16ps` on AVX-512 BF16; elsewhere
// the pair is widened to fp32 once (a shift and a mask) and every row of the step takes two
// FMAs on it, against activations widened to fp32 once per call. Every CPU reads the same
// layouts. The weight formats:
//
//   bf16  [N/16, K/2, 16, 2] bf16                  the model's own weights
//   q4    [N/16, K/32, 256] uint8 + [N/16, K/32, 2, 16] fp16 (scale d, offset m)
//         GGUF Q4_0/Q4_1 blocks of 32 inputs: w = d * q + m, q in 0..15 (Q4_0: m = -8d)
//   q8    [N/16, K/32, 512] int8  + [N/16, K/32, 16] fp16 (scale d)
//         GGUF Q8_0 blocks: w = d * q
//   qk    [N/16, K/32, 256 + 64h + 48] uint8 + [N/16, K/S, 2, 16] fp16 (d, dmin)
//         GGUF K-quants (Q4_K, Q5_K, Q6_K) and Q5_0/Q5_1: w = d sc (q - z) - dmin mn, q of
//         4 + h bits, sc per 16 inputs and mn per 32 as bytes, d and dmin per super-block of
//         S inputs (model/kquant.py has the byte layout)
//   qk-int8  the qk bytes with the high bits in planes beside the nibble bytes, run on int8
//         activations (see qk_tiles_int8): the one kernel for qk blocks
//   i8    [N/16, K/4, 16, 4] uint8 (q + 128) + [N] fp32 (scale s)
//         w = s * q, q in -127..127 per output row; four inputs side by side, as the
//         integer dot product `vpdpbusd` takes them (W8A8; see "i8" below)
//
// q4 and q8 weights are turned into exact bf16 (or fp32) numbers in registers, so every product x * q is exact in fp32 and the block's
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
// against `vdpbf16ps`'s 32; `vpmaddubsw` + `vpmaddwd` on AVX2) raise the compute ceiling of
// those steps.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace iterserve {
namespace {

using at::Tensor;

constexpr int64_t kTile = 16;   // outputs per tile: one zmm of fp32 accumulators
constexpr int64_t kBlock = 32;  // inputs per quantization block

// 4 was an exact bf16 kernel for the qk blocks, which lost to qk-int8 everywhere.
enum class Format : int64_t { kBf16 = 0, kQ4 = 1, kQ8 = 2, kI8 = 3, kQKInt8 = 5 };

// What `pair_dot` reads activations as: bf16 as they come with bf16 dot products, else fp32
// (widened once per call).
using XElem = std::conditional_t<kBf16Dot, at::BFloat16, float>;

// Where a tile's outputs go: + bias + residual in fp32, then one rounding to bf16, or none
// (`out_f32`: logits, whose bf16 rounding, 1/8 apart near 16, makes ties of close calls).
struct Epilogue {
  at::BFloat16* out;
  float* out_f32;  // instead of `out`
  int64_t ld_out;
  const at::BFloat16* bias;      // [N] or nullptr
  const at::BFloat16* residual;  // [M, ld_res] or nullptr
  int64_t ld_res;

  ITERSERVE_INLINE void store(int64_t row, int64_t n0, F16 acc) const {
    if (bias) acc = acc + load_bf16x16(bias + n0);
    if (residual) acc = acc + load_bf16x16(residual + row * ld_res + n0);
    if (out_f32)
      acc.store(out_f32 + row * ld_out + n0);
    else
      store_bf16x16(out + row * ld_out + n0, acc);
  }
};

struct Rows {
  const at::BFloat16* x;
  int64_t ld_x;
  const XElem* xp;  // the rows as pair_dot reads them: x itself, or x in fp32
  int64_t ld_xp;
  ITERSERVE_INLINE XPair pair(int64_t m, int64_t k) const { return x_pair(xp + m * ld_xp + k); }
  const float* block_sums;  // [M, K/32] sum of each row's inputs per block (q4 only)
  const float* half_sums;   // [M, K/16] the same per 16 inputs, of the int8 rows (qk-int8)
  // i8 only: the rows quantized ([M, K] int8), their blocks' scales ([M, K/32]) and the
  // offset each row's sums carry ([M]); see QuantizedRows.
  const int8_t* xq;
  const float* x_scales;
  const float* x_offsets;
};

// ---- the accumulators every format shares -------------------------------------------------

// MR rows x NT tiles of 16 sums (fp32 F16 or int32 I16), all zero.
template <typename V, int MR, int NT>
ITERSERVE_INLINE void zero_all(V (&sums)[MR][NT]) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) sums[r][j] = V::zero();
}

// Row m0 + r's outputs of tile tile0 + j, through the epilogue.
template <int MR, int NT>
ITERSERVE_INLINE void store_all(const Epilogue& ep, int64_t m0, int64_t tile0,
                                const F16 (&acc)[MR][NT]) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NT; ++j) ep.store(m0 + r, (tile0 + j) * kTile, acc[r][j]);
}

// ---- bf16 -----------------------------------------------------------------------------

template <int MR, int NT>
inline void bf16_tiles(const Rows& rows, int64_t m0, const at::BFloat16* w, int64_t tile0,
                       int64_t K, const Epilogue& ep) {
  const int64_t tile_elems = K * kTile;
  const at::BFloat16* wt = w + tile0 * tile_elems;
  F16 acc[MR][NT];
  zero_all(acc);
  for (int64_t k = 0; k < K; k += 2) {
    Pairs wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = load_pairs(wt + j * tile_elems + k * kTile);
    for (int r = 0; r < MR; ++r) {
      const XPair xv = rows.pair(m0 + r, k);
      for (int j = 0; j < NT; ++j) acc[r][j] = pair_dot(acc[r][j], wv[j], xv);
    }
  }
  store_all(ep, m0, tile0, acc);
}

// ---- q4 (GGUF Q4_0 / Q4_1) --------------------------------------------------------------

// A block's 256 bytes hold 16 outputs x 32 inputs as 4 chunks of 64 bytes, i.e. 32 16-bit
// words; word 2j+e of chunk c holds output j's input 2p+e for the four pairs p = 4c..4c+3,
// pair 4c+i in bits 4i..4i+3. The two roads below differ in how a chunk's products are
// summed and how a block's scale d and offset m apply to the sums; q4_tiles walks the
// blocks for both.
//
// Q4Bf16, exact: moving a nibble to bits 3..6 and setting 0x3F80 makes the bf16 number
// 1 + q/16 with no cross-lane shuffle (a shift and one ternary-logic op), so
//   sum_k x_k w_k = sum_k x_k (d q_k + m) = 16d * sum_k x_k (1 + q_k/16) + (m - 16d) * sum_k x_k
// where every product x_k (1 + q_k/16) is exact in fp32.
// (Shifting 32-bit lanes moves bits across the two words, but only into bits the mask drops.)
struct Q4Bf16 {
  using Sums = F16;

  template <int I>
  static ITERSERVE_INLINE Pairs pair(const I16& words) {
    const I16 field = I16::splat(0x00780078);
    const I16 one = I16::splat(0x3F803F80);
    const I16 moved = I == 0 ? shift_left<3>(words) : shift_right<4 * I - 3>(words);
    return pairs_from_bits((moved & field) | one);
  }

  // Inputs k..k+7 of rows m0.., against chunk j of `chunks` (one a tile, `stride` bytes apart).
  template <int MR, int NT>
  static ITERSERVE_INLINE void chunk(const Rows& rows, int64_t m0, int64_t k, int64_t /*K*/,
                                     const uint8_t* chunks, int64_t stride, F16 (&part)[MR][NT]) {
    XPair xv[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < 4; ++i) xv[r][i] = rows.pair(m0 + r, k + 2 * i);
    for (int j = 0; j < NT; ++j) {
      const I16 words = I16::load(chunks + j * stride);
      const Pairs w[4] = {pair<0>(words), pair<1>(words), pair<2>(words), pair<3>(words)};
      for (int r = 0; r < MR; ++r)
        for (int i = 0; i < 4; ++i) part[r][j] = pair_dot(part[r][j], w[i], xv[r][i]);
    }
  }

  // acc plus a row's block `at` ((row, block) in Rows' per-block arrays) of scale d, offset m.
  static ITERSERVE_INLINE F16 fold(const Rows& rows, int64_t at, const F16& part, const F16& d,
                                   const F16& m, const F16& acc) {
    const F16 d16 = d * F16::splat(16.0f);
    const F16 xsum = F16::splat(rows.block_sums[at]);
    return fmadd(part, d16, fmadd(m - d16, xsum, acc));
  }
};

// Q4Int8: without bf16 dot products the exact road unpacks each nibble to fp32 and spends
// an FMA on it, which makes a one-row step compute-bound; this one multiplies the nibbles
// as bytes by the activations quantized to int8 per block of 32 (as the i8 format does,
// and as llama.cpp's 4-bit kernels do), four products an instruction lane (simd.h's dot_q4):
//   sum_k x_k w_k ~ d * s_x * sum_k q_k xq_k + m * sum_k x_k
// with the block sum of x exact. A chunk's lane dword holds inputs (0, 4, 1, 5) of its 8 in
// its bytes' low nibbles and (2, 6, 3, 7) in the high ones (see the layout above), so the
// rows are quantized in that order (QuantizedRows with `q4_order`).
struct Q4Int8 {
  using Sums = I16;

  template <int MR, int NT>
  static ITERSERVE_INLINE void chunk(const Rows& rows, int64_t m0, int64_t k, int64_t K,
                                     const uint8_t* chunks, int64_t stride, I16 (&part)[MR][NT]) {
    for (int j = 0; j < NT; ++j) {
      const Q4Chunk w = load_q4_chunk(chunks + j * stride);
      for (int r = 0; r < MR; ++r) {
        int32_t quads[2];
        std::memcpy(quads, rows.xq + (m0 + r) * K + k, sizeof(quads));
        part[r][j] = dot_q4(part[r][j], w, quads[0], quads[1]);
      }
    }
  }

  static ITERSERVE_INLINE F16 fold(const Rows& rows, int64_t at, const I16& part, const F16& d,
                                   const F16& m, const F16& acc) {
    const F16 xsum = F16::splat(rows.block_sums[at]);
    return fmadd(to_float(q4_block_sums(part)), d * F16::splat(rows.x_scales[at]),
                 fmadd(m, xsum, acc));
  }
};

// q4 on this CPU: exact bf16 products where it has bf16 dot products, int8 ones elsewhere.
using Q4Road = std::conditional_t<kBf16Dot, Q4Bf16, Q4Int8>;
constexpr bool kQ4Int8 = std::is_same_v<Q4Road, Q4Int8>;

template <typename Road, int MR, int NT>
inline void q4_tiles(const Rows& rows, int64_t m0, const uint8_t* q, const at::Half* scales,
                     int64_t tile0, int64_t K, const Epilogue& ep) {
  const int64_t blocks = K / kBlock, stride = blocks * 256;
  F16 acc[MR][NT];
  zero_all(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    typename Road::Sums part[MR][NT];
    zero_all(part);
    for (int c = 0; c < 4; ++c) {
      const uint8_t* chunks = q + (tile0 * blocks + b) * 256 + c * 64;
      Road::template chunk<MR, NT>(rows, m0, b * kBlock + 8 * c, K, chunks, stride, part);
    }
    for (int j = 0; j < NT; ++j) {
      const at::Half* s = scales + ((tile0 + j) * blocks + b) * 2 * kTile;
      const F16 d = load_f16x16(s), m = load_f16x16(s + kTile);
      for (int r = 0; r < MR; ++r)
        acc[r][j] = Road::fold(rows, (m0 + r) * blocks + b, part[r][j], d, m, acc[r][j]);
    }
  }
  store_all(ep, m0, tile0, acc);
}

// ---- q8 (GGUF Q8_0) --------------------------------------------------------------------

// A block's 512 bytes are its 16 input pairs in order, 32 bytes each: outputs 0..7 (even,
// odd input) then outputs 8..15, the order vcvtne2ps2bf16 puts two converted halves in.
ITERSERVE_INLINE Pairs q8_pair(const int8_t* p) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  const __m512 lo = load_i8x16(p).v[0], hi = load_i8x16(p + 16).v[0];
  return Pairs{_mm512_cvtne2ps_pbh(hi, lo)};
#else
  // Each lane's two bytes widened to 16 bits each, then each half to fp32 (exact).
  const I16 words = widen_i8_pairs(p);
  return Pairs{to_float(shift_right_signed<16>(shift_left<16>(words))),
               to_float(shift_right_signed<16>(words))};
#endif
}

template <int MR, int NT>
inline void q8_tiles(const Rows& rows, int64_t m0, const int8_t* q, const at::Half* scales,
                     int64_t tile0, int64_t K, const Epilogue& ep) {
  const int64_t blocks = K / kBlock;
  F16 acc[MR][NT];
  zero_all(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    F16 part[MR][NT];
    zero_all(part);
    for (int p = 0; p < kBlock / 2; ++p) {
      const int64_t k = b * kBlock + 2 * p;
      for (int j = 0; j < NT; ++j) {
        const Pairs wv = q8_pair(q + ((tile0 + j) * blocks + b) * 512 + p * 32);
        for (int r = 0; r < MR; ++r) part[r][j] = pair_dot(part[r][j], wv, rows.pair(m0 + r, k));
      }
    }
    for (int j = 0; j < NT; ++j) {
      const F16 d = load_f16x16(scales + ((tile0 + j) * blocks + b) * kTile);
      for (int r = 0; r < MR; ++r) acc[r][j] = fmadd(part[r][j], d, acc[r][j]);
    }
  }
  store_all(ep, m0, tile0, acc);
}

// ---- qk (GGUF K-quants, Q5_0/Q5_1) ---------------------------------------------------------

// Bytes of a qk block of 32 inputs: their low nibbles, their high bits, and the scales.
constexpr int64_t qk_block_bytes(int bits) { return 256 + 64 * (bits - 4) + 48; }

// a shifted left by N bits, or right by -N.
template <int N>
ITERSERVE_INLINE I16 shift_by(const I16& a) {
  if constexpr (N > 0) return shift_left<N>(a);
  else if constexpr (N < 0) return shift_right<-N>(a);
  else return a;
}

// The qk blocks on int8 activations ("qk-int8", the int8 road as q4's Q4Int8 takes it): the
// activations quantized per block of 32 (QuantizedRows, in q4 order), each weight's q a whole
// unsigned byte built in registers, 4 products an instruction lane (simd.h's dot_u8). The
// bytes are qk's but for the high bits, laid out beside the nibble bytes they complete: in
// plane P (64 bytes; one for 5 bits, two for 6), byte t holds the high bits of byte t's low
// and high nibble of chunks c = P (4/h) .. (P + 1) (4/h) - 1 at bits h (2 (c mod 4/h) + e),
// e = 0 for the low nibble. One shift moves them under bit 4; a 32-bit shift carries bits
// across bytes only outside the mask. Per 16 inputs, with x ~ s xq,
//   sum x w ~ a s sum q xq - (a z + dmin mn) s sum xq,     a = d sc,
// the sums of xq per 16 from QuantizedRows: exact against the dequantized weights times the
// quantized activations (tests/model/test_kquant.py), as llama.cpp's K-quant dots are.
constexpr int32_t byte_mask(int bits, int at) {
  return static_cast<int32_t>((((1u << bits) - 1) << at) * 0x01010101u);
}

template <int B, int C, int MR, int NT>
ITERSERVE_INLINE void qk_int8_chunk(const Rows& rows, int64_t m0, const uint8_t* const* blk,
                                    int64_t k, int64_t K, I16 (&part)[MR][NT]) {
  constexpr int kHigh = B - 4, kPerPlane = kHigh ? 4 / kHigh : 4;
  constexpr int kFromLo = kHigh * 2 * (C % kPerPlane), kFromHi = kFromLo + kHigh;
  int32_t quads[MR][2];
  for (int r = 0; r < MR; ++r) std::memcpy(quads[r], rows.xq + (m0 + r) * K + k + 8 * C, 8);
  for (int j = 0; j < NT; ++j) {
    const I16 raw = I16::load(blk[j] + C * 64);
    const I16 nibble = I16::splat(byte_mask(4, 0));
    I16 lo = raw & nibble, hi = shift_right<4>(raw) & nibble;
    if constexpr (kHigh > 0) {
      const I16 plane = I16::load(blk[j] + 256 + (C / kPerPlane) * 64);
      const I16 top = I16::splat(byte_mask(kHigh, 4));
      lo = and_or(shift_by<4 - kFromLo>(plane), top, lo);
      hi = and_or(shift_by<4 - kFromHi>(plane), top, hi);
    }
    for (int r = 0; r < MR; ++r) part[r][j] = dot_u8(part[r][j], lo, hi, quads[r][0], quads[r][1]);
  }
}

template <int B, int MR, int NT>
inline void qk_tiles_int8(const Rows& rows, int64_t m0, const uint8_t* q, const at::Half* supers,
                          int64_t blocks_per_super, float zero, int64_t tile0, int64_t K,
                          const Epilogue& ep) {
  constexpr int64_t kBytes = qk_block_bytes(B), kScalesAt = kBytes - 48;
  // GGUF's 6-bit blocks (Q6_K) are the ones with a scale per 16 inputs and a zero point (32)
  // but no minimum; every other type here has one scale per 32 inputs (both sc bytes equal),
  // no zero point, and a minimum (KQuantWeight.tiles checks it), so its two halves' integer
  // sums are added before the one conversion.
  constexpr bool kPer16 = B == 6;
  const int64_t blocks = K / kBlock, n_supers = blocks / blocks_per_super;
  F16 acc[MR][NT];
  zero_all(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk[NT];
    for (int j = 0; j < NT; ++j) blk[j] = q + ((tile0 + j) * blocks + b) * kBytes;
    I16 first[MR][NT], second[MR][NT];  // inputs 0-15 and 16-31
    zero_all(first);
    zero_all(second);
    qk_int8_chunk<B, 0, MR, NT>(rows, m0, blk, b * kBlock, K, first);
    qk_int8_chunk<B, 1, MR, NT>(rows, m0, blk, b * kBlock, K, first);
    qk_int8_chunk<B, 2, MR, NT>(rows, m0, blk, b * kBlock, K, second);
    qk_int8_chunk<B, 3, MR, NT>(rows, m0, blk, b * kBlock, K, second);
    // Per row: the block's activation scale and -z s sum(xq) (Q6_K) or -s sum(xq) per half.
    F16 sx[MR], sum0[MR], sum1[MR];
    for (int r = 0; r < MR; ++r) {
      const int64_t at = (m0 + r) * blocks + b;
      sx[r] = F16::splat(rows.x_scales[at]);
      const float s0 = rows.half_sums[2 * at], s1 = rows.half_sums[2 * at + 1];
      sum0[r] = F16::splat(kPer16 ? -zero * s0 : -(s0 + s1));
      sum1[r] = F16::splat(-zero * s1);
    }
    for (int j = 0; j < NT; ++j) {
      const at::Half* s = supers + ((tile0 + j) * n_supers + b / blocks_per_super) * 2 * kTile;
      const F16 d = load_f16x16(s);
      const auto* sc = reinterpret_cast<const int8_t*>(blk[j] + kScalesAt);
      const F16 a0 = d * load_i8x16(sc);
      if constexpr (kPer16) {
        // a0 (s q.xq - z s sum xq) + a1 (...), per half.
        const F16 a1 = d * load_i8x16(sc + 16);
        for (int r = 0; r < MR; ++r) {
          const F16 h0 = fmadd(to_float(first[r][j]), sx[r], sum0[r]);
          const F16 h1 = fmadd(to_float(second[r][j]), sx[r], sum1[r]);
          acc[r][j] = fmadd(a1, h1, fmadd(a0, h0, acc[r][j]));
        }
      } else {
        // a s q.xq - dmin mn s sum xq over the 32 inputs.
        const F16 mins = load_f16x16(s + kTile) * load_i8x16(sc + 32);  // mn <= 63
        for (int r = 0; r < MR; ++r) {
          const F16 dots = to_float(first[r][j] + second[r][j]);
          acc[r][j] = fmadd(mins, sum0[r], fmadd(dots, a0 * sx[r], acc[r][j]));
        }
      }
    }
  }
  store_all(ep, m0, tile0, acc);
}

// ---- i8 (W8A8) --------------------------------------------------------------------------

// Activations quantized per block of 32 inputs (as llama.cpp quantizes them for its 4-bit
// dot products; one scale per row measured twice the greedy disagreement with bf16 on the
// bundled model): x ~ s_b * q with q = round(x * 127 / max|x| over the block), q in
// -127..127. `vpdpbusd` multiplies unsigned by signed bytes, so the weights are stored as
// q_w + 128 and each row's sum picks up 128 * sum_b s_b * sum(q over b), which `offset`
// holds and the epilogue takes away: y = s_w * (sum_b s_b * dot_b - offset).
constexpr int kQ4Order[8] = {0, 4, 1, 5, 2, 6, 3, 7};

struct QuantizedRows {
  Tensor q;        // [M, K] int8
  Tensor scales;   // [M, K/32] fp32
  Tensor offsets;  // [M] fp32
  Tensor half_sums;  // [M, K/16] fp32: s * (sum of q over 16 inputs), if asked for (qk-int8)

  // Every element is written below: uninitialised buffers, no fill. `q4_order`: each 8
  // inputs stored as (0, 4, 1, 5, 2, 6, 3, 7), the order Q4Int8 reads them in.
  QuantizedRows(const at::BFloat16* x, int64_t ld_x, int64_t M, int64_t K, bool q4_order = false,
                bool with_half_sums = false)
      : q(at::empty({M, K}, at::kChar)),
        scales(at::empty({M, K / kBlock}, at::kFloat)),
        offsets(at::empty({M}, at::kFloat)),
        half_sums(at::empty({with_half_sums ? M : 0, K / 16}, at::kFloat)) {
    const int64_t blocks = K / kBlock;
    int8_t* q_data = q.data_ptr<int8_t>();
    float* scale_data = scales.data_ptr<float>();
    float* offset_data = offsets.data_ptr<float>();
    float* half_sum_data = with_half_sums ? half_sums.data_ptr<float>() : nullptr;
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        float offset = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const at::BFloat16* src = x + m * ld_x + b * kBlock;
          const F16 lo = load_bf16x16(src), hi = load_bf16x16(src + 16);
          const float amax = maximum(abs(lo), abs(hi)).max();
          const F16 inv = F16::splat(amax > 0.0f ? 127.0f / amax : 0.0f);
          // Round half to even, as torch.round does.
          const I16 qlo = round_to_int(lo * inv), qhi = round_to_int(hi * inv);
          int8_t* dst = q_data + m * K + b * kBlock;
          store_i8x16(dst, qlo);
          store_i8x16(dst + 16, qhi);
          if (q4_order) {
            int8_t natural[kBlock];
            std::memcpy(natural, dst, kBlock);
            for (int c = 0; c < kBlock; c += 8)
              for (int t = 0; t < 8; ++t) dst[c + t] = natural[c + kQ4Order[t]];
          }
          const float scale = amax / 127.0f;
          scale_data[m * blocks + b] = scale;
          if (half_sum_data) {
            half_sum_data[2 * (m * blocks + b)] = scale * static_cast<float>(qlo.sum());
            half_sum_data[2 * (m * blocks + b) + 1] = scale * static_cast<float>(qhi.sum());
          }
          if (kI8Biased) offset += scale * static_cast<float>((qlo + qhi).sum());
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
  F16 acc[MR][NT];
  zero_all(acc);
  for (int64_t b = 0; b < blocks; ++b) {
    I16 part[MR][NT];
    zero_all(part);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; k += 4) {
      I8Quads wv[NT];
      for (int j = 0; j < NT; ++j) wv[j] = load_i8_quads(wt + j * tile_bytes + k * kTile);
      for (int r = 0; r < MR; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + (m0 + r) * K + k, sizeof(quad));
        for (int j = 0; j < NT; ++j) part[r][j] = dot_i8(part[r][j], wv[j], quad);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const F16 s = F16::splat(rows.x_scales[(m0 + r) * blocks + b]);
      for (int j = 0; j < NT; ++j) acc[r][j] = fmadd(to_float(part[r][j]), s, acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const F16 offset = F16::splat(rows.x_offsets[m0 + r]);
    for (int j = 0; j < NT; ++j) {
      const int64_t n0 = (tile0 + j) * kTile;
      ep.store(m0 + r, n0, (acc[r][j] - offset) * F16::load(w_scales + n0));
    }
  }
}

// ---- driver ----------------------------------------------------------------------------

struct Weights {
  Format format;
  const void* data;
  const void* scales;  // fp16 blocks (q4, q8, qk super-blocks), fp32 rows (i8)
  int64_t K;
  int qk_bits;                // qk only: bits of q,
  int64_t qk_blocks_per_super;  // blocks of 32 inputs per (d, dmin),
  float qk_zero;              // and the zero point z
};

// Calls f(std::integral_constant<int, B>{}) for a qk format's bit width B (4, 5 or 6).
template <typename F>
ITERSERVE_INLINE void with_qk_bits(int bits, F&& f) {
  if (bits == 4) f(std::integral_constant<int, 4>{});
  else if (bits == 5) f(std::integral_constant<int, 5>{});
  else f(std::integral_constant<int, 6>{});
}

// Tiles per register block: enough independent accumulators to hide the dot-product
// latency at one row, few enough that MR rows of them fit the registers (32 zmm, each an F16;
// 16 ymm on AVX2, two to an F16, and a widened weight pair takes four).
template <int MR>
constexpr int tiles_per_step() {
  if constexpr (kParts == 1) return MR <= 2 ? 4 : 2;
  return 1;
}

template <int MR, int NT>
inline void run_tiles(const Weights& w, const Rows& rows, int64_t m0, int64_t tile0,
                      const Epilogue& ep) {
  switch (w.format) {
    case Format::kBf16:
      bf16_tiles<MR, NT>(rows, m0, static_cast<const at::BFloat16*>(w.data), tile0, w.K, ep);
      break;
    case Format::kQ4:
      q4_tiles<Q4Road, MR, NT>(rows, m0, static_cast<const uint8_t*>(w.data),
                               static_cast<const at::Half*>(w.scales), tile0, w.K, ep);
      break;
    case Format::kQ8:
      q8_tiles<MR, NT>(rows, m0, static_cast<const int8_t*>(w.data),
                       static_cast<const at::Half*>(w.scales), tile0, w.K, ep);
      break;
    case Format::kQKInt8:
      with_qk_bits(w.qk_bits, [&](auto bits) {
        qk_tiles_int8<decltype(bits)::value, MR, NT>(
            rows, m0, static_cast<const uint8_t*>(w.data), static_cast<const at::Half*>(w.scales),
            w.qk_blocks_per_super, w.qk_zero, tile0, w.K, ep);
      });
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
  // qk's zero point rides in the code's high bits: format = 5 + 256 z.
  const auto fmt = static_cast<Format>(format & 0xFF);
  const int64_t qk_zero = format >> 8;
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
  Weights w{fmt, weight.data_ptr(), nullptr, K, 0, 1, 0.0f};
  Rows rows{x.data_ptr<at::BFloat16>(), x.stride(0), nullptr, 0, nullptr, nullptr, nullptr,
            nullptr, nullptr};
  // The rows as pair_dot takes them: x itself, or widened to fp32 once here.
  const Tensor x_pairs = kBf16Dot ? x : x.to(at::kFloat);
  rows.xp = static_cast<const XElem*>(x_pairs.data_ptr());
  rows.ld_xp = x_pairs.stride(0);
  if (fmt == Format::kI8) {
    TORCH_CHECK(scales && scales->scalar_type() == at::kFloat && scales->numel() == N &&
                    scales->is_contiguous(),
                "tiled_linear: i8 weights need [N] fp32 scales");
    w.scales = scales->data_ptr<float>();
  } else if (fmt != Format::kBf16) {
    TORCH_CHECK(scales && scales->scalar_type() == at::kHalf && scales->is_contiguous());
    w.scales = scales->data_ptr<at::Half>();
  }
  TORCH_CHECK(fmt == Format::kBf16 || fmt == Format::kQ4 || fmt == Format::kQ8 ||
                  fmt == Format::kI8 || fmt == Format::kQKInt8,
              "tiled_linear: unknown weight format ", format & 0xFF);
  if (fmt == Format::kQKInt8) {
    // Bits from the block's bytes, the super-block size from the scales' shape.
    const int64_t bytes = weight.size(2);
    TORCH_CHECK(weight.dim() == 3 && weight.size(1) == K / kBlock && (bytes - 304) % 64 == 0 &&
                    bytes >= 304 && bytes <= 432 && scales->dim() == 4 &&
                    (K / kBlock) % scales->size(1) == 0,
                "tiled_linear: qk weights need [N/16, K/32, 256 + 64h + 48] bytes and "
                "[N/16, K/S, 2, 16] scales");
    w.qk_bits = static_cast<int>(4 + (bytes - 304) / 64);
    w.qk_blocks_per_super = (K / kBlock) / scales->size(1);
    w.qk_zero = static_cast<float>(qk_zero);
  }
  std::vector<float> block_sums;
  if (fmt == Format::kQ4) {
    block_sums.resize(M * (K / kBlock));
    for (int64_t m = 0; m < M; ++m) {
      const at::BFloat16* row = rows.x + m * rows.ld_x;
      for (int64_t b = 0; b < K / kBlock; ++b) {
        block_sums[m * (K / kBlock) + b] =
            (load_bf16x16(row + b * kBlock) + load_bf16x16(row + b * kBlock + 16)).sum();
      }
    }
    rows.block_sums = block_sums.data();
  }
  std::optional<QuantizedRows> quantized;
  const bool q4_order = (kQ4Int8 && fmt == Format::kQ4) || fmt == Format::kQKInt8;
  if (fmt == Format::kI8 || q4_order) {
    const QuantizedRows& q =
        quantized.emplace(rows.x, rows.ld_x, M, K, q4_order, fmt == Format::kQKInt8);
    rows.xq = q.q.data_ptr<int8_t>();
    rows.x_scales = q.scales.data_ptr<float>();
    rows.x_offsets = q.offsets.data_ptr<float>();
    if (fmt == Format::kQKInt8) rows.half_sums = q.half_sums.data_ptr<float>();
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

TORCH_LIBRARY_FRAGMENT(ITERSERVE_OPS, m) {
  m.def(
      "tiled_linear(Tensor x, Tensor weight, Tensor? scales, Tensor? bias, Tensor? residual, "
      "int format, Tensor? wide_weight, Tensor? wide_scales, int wide_format, "
      "int max_tile_rows, bool fp32_out=False) -> Tensor");
  m.def("quantize_rows(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(ITERSERVE_OPS, CPU, m) {
  m.impl("tiled_linear", &tiled_linear);
  m.impl("quantize_rows", &quantize_rows);
}

}  // namespace iterserve
