// The projection kernels' loops, for every weight format (blocks.h) and row count: what
// linear.cpp runs on a thread's share of a weight's tiles, with no ATen runtime in them, so
// that a standalone program (tests/kernels/blocks_check.cpp) runs the very same code where no
// torch build is at hand (Arm64 under qemu).
//
// Dense formats (bf16, fp16) keep each pair of inputs of 16 outputs side by side, so one
// `pair_dot` with a broadcast pair of activations advances 16 outputs by two inputs with no
// horizontal sums (one `vdpbf16ps` with AVX-512 BF16; elsewhere two FMAs on the pair widened
// once, against activations widened to fp32 once a call).
//
// Block formats run on int8 activations, as llama.cpp's do: each row quantized per unit of
// the format (x ~ s xq, one s per 32 inputs for the 32-input formats, per 256 for the
// K-quants, as llama.cpp's q8_0 and q8_K), and per block of each tile the integer dot
// products of its values with xq, folded into fp32 with the block's scales (see blocks.h),
// and the unit's sum scaled by s. The same arithmetic at every step size, in the same order
// for every row and output, whatever else shares the step: a request's logits do not depend
// on the batch.
//
//   - A step of up to 4 rows, bound by the bytes it reads, streams each thread's tiles once,
//     decoding every block in registers for its rows (`block_tiles`), the tiles taken side by
//     side from lanes that each run as one stream (`LaneRun`).
//   - A step of more rows is bound by the arithmetic: each block of two tiles is decoded into
//     registers once, with its scales, and every row of the step takes its dot products against
//     it in turn, the rows' fp32 sums waiting in L1 between blocks (`sweep_tiles`). Unpacking
//     planes and building scales is then paid once a step, not once a row group; a thread
//     takes the tiles a pass of 8 at a time, which stay in L2 while slabs of 16-64 rows read them,
//     so a weight comes from memory once a step.
#pragma once

#include "blocks.h"
#include "simd.h"

#include <algorithm>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <array>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace iterserve {

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

  // The same outputs, their columns counted from tile `first` (a segment's own tiles).
  Epilogue shifted(int64_t first) const {
    Epilogue e = *this;
    const int64_t n0 = first * kTile;
    if (e.out) e.out += n0;
    if (e.out_f32) e.out_f32 += n0;
    if (e.bias) e.bias += n0;
    if (e.residual) e.residual += n0;
    return e;
  }

  // The same outputs, rows counted from row `first`.
  Epilogue from_row(int64_t first) const {
    Epilogue e = *this;
    if (e.out) e.out += first * ld_out;
    if (e.out_f32) e.out_f32 += first * ld_out;
    if (e.residual) e.residual += first * ld_res;
    return e;
  }

  ITERSERVE_INLINE void store(int64_t row, int64_t n0, F16 acc) const {
    if (bias) acc = acc + load_bf16x16(bias + n0);
    if (residual) acc = acc + load_bf16x16(residual + row * ld_res + n0);
    if (out_f32)
      acc.store(out_f32 + row * ld_out + n0);
    else
      store_bf16x16(out + row * ld_out + n0, acc);
  }
};

// Rows quantized for the block formats, per unit of `unit` inputs (32 or 256): xq [M, K]
// int8 with x ~ s xq, its rows `ld` bytes apart (`padded_row_bytes`), s [M, K / unit], and
// the negated sums of xq per 16 inputs [M, K / 16] and per 32 [M, K / 32], in int32, times
// 2^kSumShift<H>: what the biases and offsets take away (blocks.h); for units of 256, also the
// per-32 sums of blocks 2q and 2q + 1 as one word of 16-bit halves [M, K / 64]
// (|sum| <= 32 * 127), for the integer offsets (`UnitOffsets`).
//
// The sums are kept times the largest bias of the formats that start their dot products from
// them (per 16 inputs Q6_K's 32, per 32 the signed formats' 128 with VNNI), so that those
// formats' start is a broadcast from memory, where it was a broadcast and a shift: a vector
// instruction a row, half and block beside Q6_K's 8 dot products, on the pipes they share
// (`start_dots`). The sweep on one thread (benchmarks/tiles_ab.cpp: the loops before and after
// alternating in one process, the same output bits; a 1B's shapes, 2026-12-05, avx512bf16): at
// 128 rows Q6_K 1.04-1.06x, IQ4_XS 1.03-1.05x, Q8_0 1.02-1.04x, Q4_0 1.0-1.02x, Q4_K level;
// at 16 rows Q6_K 1.04-1.05x; the AVX2 build there Q6_K 1.07x, the others level; one row
// level. Smaller biases shift right (exact: the sums are multiples of 2^kSumShift), and the
// block offsets that read the sums take 2^-kSumShift into their scale, once a block
// (`block_scales`; the same products, so the same bits).
template <int H>
constexpr int kSumShift = H == 1 ? 7 : 5;

struct QuantizedX {
  int64_t unit = 0;
  const int8_t* xq = nullptr;
  const float* scale = nullptr;
  const int32_t* neg_sum16 = nullptr;
  const int32_t* neg_sum32 = nullptr;
  const int32_t* neg_sum_pairs = nullptr;
  int64_t ld = 0;

  // Row m's negated sum of xq over block blk (H = 1) or its half h (H = 2), times
  // 2^kSumShift<H>.
  template <int H>
  ITERSERVE_INLINE int32_t neg_sum(int64_t m, int64_t blk, int h, int64_t K) const {
    return H == 1 ? neg_sum32[m * (K / 32) + blk] : neg_sum16[m * (K / 16) + 2 * blk + h];
  }

  QuantizedX from(int64_t first, int64_t K) const {
    if (!xq) return *this;
    return {unit, xq + first * ld, scale + first * (K / unit), neg_sum16 + first * (K / 16),
            neg_sum32 + first * (K / 32),
            neg_sum_pairs ? neg_sum_pairs + first * (K / 64) : nullptr, ld};
  }
};

// The step's rows in the forms the kernels read.
struct Rows {
  int64_t K;
  // Dense formats: the rows as pair_dot reads them (x itself, or x in fp32), and fp32 rows.
  const XElem* xp;
  int64_t ld_xp;
  const float* xf;
  int64_t ld_xf;
  ITERSERVE_INLINE XPair pair(int64_t m, int64_t k) const { return x_pair(xp + m * ld_xp + k); }
  // Block formats: the rows quantized per unit of 32 inputs and of 256 (QuantizedX; those
  // the step's formats take).
  QuantizedX per32, per256;

  template <int Unit>
  ITERSERVE_INLINE const QuantizedX& quantized() const {
    static_assert(Unit == 32 || Unit == 256);
    if constexpr (Unit == 32) return per32;
    else return per256;
  }

  // The same rows from row `first` on.
  Rows from(int64_t first) const {
    Rows r = *this;
    if (xp) r.xp = xp + first * ld_xp;
    if (xf) r.xf = xf + first * ld_xf;
    r.per32 = per32.from(first, K);
    r.per256 = per256.from(first, K);
    return r;
  }
};

// ---- the accumulators every format shares -------------------------------------------------
//
// Accumulators are std::arrays made without a loop (zeros<N>(), izeros<N>()), flat, indexed
// [r * NT + j], and every loop over them is unrolled in full (ITERSERVE_UNROLL): otherwise GCC
// keeps them on the stack and every multiply-add loads and stores one (seen in an earlier
// loop's assembly: 8 of 8 accumulators spilled).

template <int... I>
ITERSERVE_INLINE std::array<I16, sizeof...(I)> izeros(std::integer_sequence<int, I...>) {
  return {{((void)I, I16::zero())...}};
}
template <int N>
ITERSERVE_INLINE std::array<I16, N> izeros() {
  return izeros(std::make_integer_sequence<int, N>{});
}

// Row m0 + r's outputs of tile tile0 + j * lane, through the epilogue.
template <int MR, int NT>
ITERSERVE_INLINE void store_all(const Epilogue& ep, int64_t m0, int64_t tile0, int64_t lane,
                                const std::array<F16, MR * NT>& acc) {
  ITERSERVE_UNROLL for (int r = 0; r < MR; ++r)
    ITERSERVE_UNROLL for (int j = 0; j < NT; ++j)
      ep.store(m0 + r, (tile0 + j * lane) * kTile, acc[r * NT + j]);
}

// ---- bf16 and fp16 -------------------------------------------------------------------------

// bf16 tiles: [K/2, 16, 2] a tile, each output's two inputs side by side. The NT tiles are
// tile0, tile0 + lane, ... (a few rows' lanes, below; lane 1 elsewhere).
template <int MR, int NT>
inline void bf16_tiles(const Rows& rows, int64_t m0, const uint8_t* w, int64_t tile0,
                       int64_t lane, const Epilogue& ep) {
  const int64_t K = rows.K, tile_elems = K * kTile;
  const auto* wt = reinterpret_cast<const at::BFloat16*>(w) + tile0 * tile_elems;
  auto acc = zeros<MR * NT>();
  for (int64_t k = 0; k < K; k += 2) {
    Pairs wv[NT];
    ITERSERVE_UNROLL for (int j = 0; j < NT; ++j)
      wv[j] = load_pairs(wt + j * lane * tile_elems + k * kTile);
    ITERSERVE_UNROLL for (int r = 0; r < MR; ++r) {
      const XPair xv = rows.pair(m0 + r, k);
      ITERSERVE_UNROLL for (int j = 0; j < NT; ++j)
        acc[r * NT + j] = pair_dot(acc[r * NT + j], wv[j], xv);
    }
  }
  store_all<MR, NT>(ep, m0, tile0, lane, acc);
}

// fp16 tiles: [K/2, 2, 16] a tile (a pair's first inputs for the 16 outputs, then its
// second), widened to fp32 in registers: no CPU here has fp16 dot products.
template <int MR, int NT>
inline void f16_tiles(const Rows& rows, int64_t m0, const uint8_t* w, int64_t tile0,
                      int64_t lane, const Epilogue& ep) {
  const int64_t K = rows.K, tile_elems = K * kTile;
  const auto* wt = reinterpret_cast<const c10::Half*>(w) + tile0 * tile_elems;
  auto acc = zeros<MR * NT>();
  for (int64_t k = 0; k < K; k += 2) {
    F16 first[NT], second[NT];
    ITERSERVE_UNROLL for (int j = 0; j < NT; ++j) {
      first[j] = load_f16x16(wt + j * lane * tile_elems + k * kTile);
      second[j] = load_f16x16(wt + j * lane * tile_elems + k * kTile + kTile);
    }
    ITERSERVE_UNROLL for (int r = 0; r < MR; ++r) {
      const float* x = rows.xf + (m0 + r) * rows.ld_xf + k;
      const F16 x0 = F16::splat(x[0]), x1 = F16::splat(x[1]);
      ITERSERVE_UNROLL for (int j = 0; j < NT; ++j)
        acc[r * NT + j] = fmadd(second[j], x1, fmadd(first[j], x0, acc[r * NT + j]));
    }
  }
  store_all<MR, NT>(ep, m0, tile0, lane, acc);
}

// ---- activations for the block formats ---------------------------------------------------------

// One row quantized per unit of `unit` inputs: x ~ s q, q = round(x * 127 / max|x| over the
// unit) in -127..127 (as llama.cpp quantizes activations for its block dot products: one
// scale a row measured twice the greedy disagreement with bf16 on the bundled model), with
// -sum(q) per 16 and per 32 inputs, times 2^kSumShift (and, given neg_sum_pairs, per 32 as
// 16-bit pairs of blocks).
inline void quantize_row(const at::BFloat16* x, int64_t K, int64_t unit, int8_t* q, float* scale,
                         int32_t* neg_sum16, int32_t* neg_sum32, int32_t* neg_sum_pairs) {
  int32_t previous = 0;  // the last block's sum
  for (int64_t u = 0; u < K / unit; ++u) {
    F16 most = F16::zero();
    for (int64_t i = u * unit; i < (u + 1) * unit; i += 16)
      most = maximum(most, abs(load_bf16x16(x + i)));
    const float amax = most.max();
    // A true division, as block_formats.quantize_activations rounds (127 / amax times x would
    // multiply by a rounded reciprocal); round half to even, as torch.round does.
    const F16 inv = F16::splat(amax > 0.0f ? 127.0f / amax : 0.0f);
    for (int64_t b = u * unit / kBlock; b < (u + 1) * unit / kBlock; ++b) {
      const I16 lo = round_to_int(load_bf16x16(x + b * kBlock) * inv);
      const I16 hi = round_to_int(load_bf16x16(x + b * kBlock + 16) * inv);
      store_i8x16(q + b * kBlock, lo);
      store_i8x16(q + b * kBlock + 16, hi);
      const int32_t sum_lo = lo.sum(), sum_hi = hi.sum();
      neg_sum16[2 * b] = -sum_lo * (1 << kSumShift<2>);
      neg_sum16[2 * b + 1] = -sum_hi * (1 << kSumShift<2>);
      neg_sum32[b] = -(sum_lo + sum_hi) * (1 << kSumShift<1>);
      // Made from the sums in registers: read back from neg_sum32, a pair's load waited on
      // the two stores just made.
      if (neg_sum_pairs && b % 2 == 1)
        neg_sum_pairs[b / 2] = static_cast<int32_t>(
            static_cast<uint16_t>(-previous) | static_cast<uint32_t>(-(sum_lo + sum_hi)) << 16);
      previous = sum_lo + sum_hi;
    }
    scale[u] = amax / 127.0f;
  }
}

// Bytes from one row's int8 activations to the next's: K rounded up to an odd number of cache
// lines. A many-row sweep reads one block (32 bytes) of every row of its slab in turn; rows
// a multiple of 4 KiB apart all fall into one set of the L1 cache (8 ways on Zen 3 and 4, 12
// on Zen 5 and recent Intel cores), which then evicts each before its next block is read,
// and rows 2 or 3 KiB apart into 2 or 4 sets. An odd number of lines apart, 64 rows take 64
// sets. The sweep with rows padded so, against rows K apart (benchmarks/tiles_timing.cpp,
// one thread, 2026-12-04, AVX2 on Zen 3, two builds 3 times in turns, the same output bits):
// Q4_K at 128 rows, K = 4096 1.26-1.31x, 8192 1.25-1.27x, 14336 1.05-1.08x, 2048 1.04-1.06x,
// 3072 1.00-1.04x; at 16 rows, K = 4096 1.17-1.22x (Q6_K 1.09-1.10x); Q4_0 and Q8_0 at 128
// rows, K = 4096 1.12-1.16x and 1.08-1.09x. A 7B body's 128-token prompts ran 1.17-1.26x
// faster in the engine (docs/benchmarks.md, 2026-12-04).
inline int64_t padded_row_bytes(int64_t K) {
  const int64_t lines = (K + 63) / 64;
  return 64 * (lines % 2 ? lines : lines + 1);
}

// QuantizedX in one buffer, for M rows of K inputs; rows are quantized one by one (`row`), so
// that a caller can spread them over threads. One allocation, not one an array: a one-row step
// allocates it for every projection.
class QuantizedBuffers {
 public:
  // The buffer's size.
  static int64_t bytes(int64_t M, int64_t K, int64_t unit) {
    const int64_t pairs = unit == 256 ? M * K / 64 : 0;
    return M * padded_row_bytes(K) + 4 * (M * K / unit + M * K / 16 + M * K / kBlock + pairs);
  }
  // In `memory` (bytes(M, K, unit) of them, 64-byte aligned, the caller's), or in a buffer of
  // its own.
  QuantizedBuffers(int64_t M, int64_t K, int64_t unit, int8_t* memory = nullptr) {
    if (!memory) {
      bytes_.reset(new (std::align_val_t{64}) int8_t[bytes(M, K, unit)]);
      memory = bytes_.get();
    }
    // ld is a multiple of 64, so the arrays after the rows' bytes stay aligned.
    const int64_t ld = padded_row_bytes(K);
    const int64_t scales = M * K / unit, sums16 = M * K / 16, sums32 = M * K / kBlock;
    const int64_t pairs = unit == 256 ? M * K / 64 : 0;
    rows_ = memory;
    scale_ = reinterpret_cast<float*>(memory + M * ld);
    neg_sum16_ = reinterpret_cast<int32_t*>(scale_ + scales);
    neg_sum32_ = neg_sum16_ + sums16;
    neg_sum_pairs_ = pairs ? neg_sum32_ + sums32 : nullptr;
    view = {unit, rows_, scale_, neg_sum16_, neg_sum32_, neg_sum_pairs_, ld};
  }
  // Row m, from x (its K inputs).
  void row(const at::BFloat16* x, int64_t K, int64_t m) {
    const int64_t unit = view.unit;
    quantize_row(x, K, unit, rows_ + m * view.ld, scale_ + m * (K / unit),
                 neg_sum16_ + m * (K / 16), neg_sum32_ + m * (K / kBlock),
                 neg_sum_pairs_ ? neg_sum_pairs_ + m * (K / 64) : nullptr);
  }

  QuantizedX view;  // the arrays below, read-only

 private:
  struct AlignedFree {
    void operator()(int8_t* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<int8_t[], AlignedFree> bytes_;  // the buffer, if it is its own
  // The buffer: the rows' bytes, then the scales and sums, written through these.
  int8_t* rows_;
  float* scale_;
  int32_t *neg_sum16_, *neg_sum32_, *neg_sum_pairs_;
};

// ---- block formats -------------------------------------------------------------------------

// A block's integer dot products (dot[(h * MR + r) * NT + j]) start from the format's bias
// times the rows' negated sums of xq (h: the block's halves, or the block), exact in int32.
template <typename Codec, int MR, int NT>
ITERSERVE_INLINE std::array<I16, Codec::kHalves * MR * NT> start_dots(const QuantizedX& x,
                                                                     int64_t m0, int64_t blk,
                                                                     int64_t K) {
  constexpr int H = Codec::kHalves;
  auto dot = izeros<H * MR * NT>();
  if constexpr (Codec::kBias != 0) {
    static_assert((Codec::kBias & (Codec::kBias - 1)) == 0, "a bias is a power of two");
    constexpr int kShift = __builtin_ctz(Codec::kBias) - kSumShift<H>;
    ITERSERVE_UNROLL for (int r = 0; r < MR; ++r)
      ITERSERVE_UNROLL for (int h = 0; h < H; ++h) {
        I16 start = I16::splat(x.neg_sum<H>(m0 + r, blk, h, K));
        if constexpr (kShift > 0) start = shift_left<kShift>(start);
        if constexpr (kShift < 0) start = shift_right_signed<-kShift>(start);
        ITERSERVE_UNROLL for (int j = 0; j < NT; ++j) dot[(h * MR + r) * NT + j] = start;
      }
  }
  return dot;
}

// Block b's scales and offsets of NT tiles (units at p[j]) into a[j * H + h], o[j * H + h],
// the offsets that meet the activations' sums (fold_block) times 2^-kSumShift, as the sums
// are kept (QuantizedX): exact, so o times a sum is the same product.
template <typename Codec, int NT>
ITERSERVE_INLINE std::array<std::array<F16, Codec::kHalves * NT>, 2> block_scales(
    const uint8_t* const* p, int b) {
  constexpr int H = Codec::kHalves;
  std::array<std::array<F16, H * NT>, 2> scales;  // a, o
  auto &a = scales[0], &o = scales[1];
  ITERSERVE_UNROLL for (int j = 0; j < NT; ++j) Codec::scales(p[j], b, &a[j * H], &o[j * H]);
  if constexpr (Codec::kOffset && !Codec::kUnitOffsets)
    ITERSERVE_UNROLL for (int i = 0; i < NT * H; ++i)
      o[i] = o[i] * F16::splat(1.0f / (1 << kSumShift<H>));
  return scales;
}

// A block's dot products folded into its unit's fp32 sums, with the tiles' scales and
// offsets (a[j * H + h], o[j * H + h]): per half h of the block,
//   unit += a_h dot_h  + o_h (-sum_h xq)    (a unit's first block sets it: unit = ...)
// and, at a unit's last block, the unit's sums into the row's: acc += s unit. The one place
// this arithmetic is written, so that both roads below give the same bits.
template <typename Codec, int MR, int NT, bool First>
ITERSERVE_INLINE void fold_block(std::array<F16, MR * NT>& unit,
                                 const std::array<I16, Codec::kHalves * MR * NT>& dot,
                                 const F16* a, const F16* o, const QuantizedX& x, int64_t m0,
                                 int64_t blk, int64_t K) {
  constexpr int H = Codec::kHalves;
  ITERSERVE_UNROLL for (int r = 0; r < MR; ++r) {
    constexpr bool kBlockOffsets = Codec::kOffset && !Codec::kUnitOffsets;
    F16 neg_sum[H];
    if constexpr (kBlockOffsets)
      ITERSERVE_UNROLL for (int h = 0; h < H; ++h)
        neg_sum[h] = to_float(I16::splat(x.neg_sum<H>(m0 + r, blk, h, K)));
    ITERSERVE_UNROLL for (int j = 0; j < NT; ++j) {
      F16& sum = unit[r * NT + j];
      ITERSERVE_UNROLL for (int h = 0; h < H; ++h) {
        const F16 d = to_float(dot[(h * MR + r) * NT + j]);
        sum = First && h == 0 ? d * a[j * H + h] : fmadd(d, a[j * H + h], sum);
      }
      if constexpr (kBlockOffsets)
        ITERSERVE_UNROLL for (int h = 0; h < H; ++h) sum = fmadd(o[j * H + h], neg_sum[h], sum);
    }
  }
}

// A unit's offsets taken away at its end, for the codecs that keep them as small integers
// (kUnitOffsets; Q4_K's o = dmin mn): unit += dmin * sum over its blocks of mn (-sum xq), the
// sum exact in int32 (8 x 63 x 4064 at most), 16-bit pairs of blocks at a time (`dot_i16`).
// Made from NT tiles' units (at p[j]): their mn pairs and dmin, read once for every row.
// Against one multiply-add a block, the many-row loops ran Q4_K 1.05x faster
// (benchmarks/tiles_timing.cpp, 2048 x 2048, 16 and 128 rows, 2026-11-30, avx512bf16): they
// are bound by the pipe that multiply-adds and dot products share.
template <typename Codec, int NT>
struct UnitOffsets {
  static constexpr int kPairs = Codec::kInputs / kBlock / 2;
  I16 pairs[kPairs * NT];
  F16 scale[NT];

  ITERSERVE_INLINE explicit UnitOffsets(const uint8_t* const* p) {
    ITERSERVE_UNROLL for (int j = 0; j < NT; ++j) {
      scale[j] = Codec::offset_scale(p[j]);
      ITERSERVE_UNROLL for (int q = 0; q < kPairs; ++q)
        pairs[q * NT + j] = Codec::offset_pairs(p[j], q);
    }
  }
  // Into rows m0.. m0 + MR - 1's sums of unit u.
  template <int MR>
  ITERSERVE_INLINE void fold(std::array<F16, MR * NT>& unit, const QuantizedX& x, int64_t m0,
                             int64_t u, int64_t K) const {
    ITERSERVE_UNROLL for (int r = 0; r < MR; ++r) {
      const int32_t* sums = x.neg_sum_pairs + (m0 + r) * (K / 64) + u * kPairs;
      ITERSERVE_UNROLL for (int j = 0; j < NT; ++j) {
        I16 dot = I16::zero();
        ITERSERVE_UNROLL for (int q = 0; q < kPairs; ++q)
          dot = dot_i16(dot, pairs[q * NT + j], I16::splat(sums[q]));
        unit[r * NT + j] = fmadd(scale[j], to_float(dot), unit[r * NT + j]);
      }
    }
  }
};

template <typename Codec, int MR, int NT>
ITERSERVE_INLINE void fold_unit(std::array<F16, MR * NT>& acc,
                                const std::array<F16, MR * NT>& unit, const QuantizedX& x,
                                int64_t m0, int64_t u, int64_t K) {
  ITERSERVE_UNROLL for (int r = 0; r < MR; ++r) {
    const F16 s = F16::splat(x.scale[(m0 + r) * (K / Codec::kInputs) + u]);
    ITERSERVE_UNROLL for (int j = 0; j < NT; ++j)
      acc[r * NT + j] = fmadd(unit[r * NT + j], s, acc[r * NT + j]);
  }
}

// Row m's activations of chunk c of block blk (inputs 8c..8c+7).
ITERSERVE_INLINE const int8_t* x_chunk(const QuantizedX& x, int64_t m, int64_t blk, int c) {
  return x.xq + m * x.ld + blk * kBlock + 8 * c;
}

template <bool Signed>
ITERSERVE_INLINE I16 dot_quads(const I16& acc, const Quads& w, const int8_t* x) {
  if constexpr (Signed) return dot_s8(acc, w.lo, w.hi, x);
  else return dot_u8(acc, w.lo, w.hi, x);
}

// How many of a block's chunks add up in 16-bit lanes before they are widened to int32
// (simd.h `dot_u8_16`) on AVX2 and AVX-512 without VNNI: a half's (4 / kHalves) for values of
// at most 4 bits (Q4_0, Q4_1, Q4_K; Q3_K's and Q2_K's halves), two for 5 bits (Q5_0, Q5_1,
// Q5_K); 1, every chunk widened, for Q6_K, the signed formats and wherever the dot products
// sum in int32 as they multiply (VNNI, Arm). Against widening every chunk
// (benchmarks/tiles_timing.cpp, one thread, builds in turns, the same output bits,
// 2026-12-04, AVX2 on AMD Zen 3; best against best, two sets of runs): 14336 x 4096 at 128
// rows Q4_K 1.13-1.15x, Q4_0 1.06-1.07x, at 16 rows 1.06-1.10x and 1.03-1.05x; 2048 x 2048 at
// 128 rows Q3_K 1.11-1.24x, Q2_K 1.08x; from cache, four rows 1.15x (Q4_K, Q4_0), one row of
// Q4_K 1.07x. Q5_K 14336 x 4096, with 2 rows a sweep group (sweep_rows), in five pairs of
// turns: 1.12-1.14x at 128 rows (one pair 1.04x), 1.14-1.16x at 16, 1.05x at 4, one row level;
// Q5_0 1.14x at 128 rows; 2 rows a group alone gave Q5_K 1.06-1.09x.
template <typename Codec>
constexpr int kChunksIn16Bits =
    Codec::kSigned ? 1 : std::min(chunks_in_16_bits(Codec::kMaxValue), 4 / Codec::kHalves);
// Whether those 16-bit sums are widened before a half's last chunk (the 5-bit formats), so
// that they and the int32 dot products are live at once.
template <typename Codec>
constexpr bool kSumsBesideDots =
    kChunksIn16Bits<Codec> > 1 && kChunksIn16Bits<Codec> < 4 / Codec::kHalves;

// Chunk C of a block of NT tiles (w[j], decoded) against MR rows, into the block's int32 dot
// products, or (Sums16) into 16-bit sums of the same shape.
template <typename Codec, int C, int MR, int NT, bool Sums16>
ITERSERVE_INLINE void chunk_dots(const QuantizedX& x, int64_t m0, int64_t blk, const Quads* w,
                                 std::array<I16, Codec::kHalves * MR * NT>& dot) {
  constexpr int h = Codec::kHalves == 2 ? C / 2 : 0;
  ITERSERVE_UNROLL for (int j = 0; j < NT; ++j)
    ITERSERVE_UNROLL for (int r = 0; r < MR; ++r) {
      I16& d = dot[(h * MR + r) * NT + j];
      const int8_t* xc = x_chunk(x, m0 + r, blk, C);
      if constexpr (Sums16) d = dot_u8_16(d, w[j].lo, w[j].hi, xc);
      else d = dot_quads<Codec::kSigned>(d, w[j], xc);
    }
}

// A block's integer dot products of NT tiles against MR rows: start_dots plus its 4 chunks,
// chunk C's values decoded by quads(integral_constant C) (NT Quads).
template <typename Codec, int MR, int NT, typename ChunkQuads>
ITERSERVE_INLINE std::array<I16, Codec::kHalves * MR * NT> block_dots(const QuantizedX& x,
                                                                     int64_t m0, int64_t blk,
                                                                     int64_t K,
                                                                     ChunkQuads&& quads) {
  constexpr int G = kChunksIn16Bits<Codec>, N = Codec::kHalves * MR * NT;
  if constexpr (G == 1) {
    auto dot = start_dots<Codec, MR, NT>(x, m0, blk, K);
    auto run = [&](auto c) ITERSERVE_INLINE_LAMBDA {
      chunk_dots<Codec, decltype(c)::value, MR, NT, false>(x, m0, blk, quads(c).data(), dot);
    };
    run(std::integral_constant<int, 0>{});
    run(std::integral_constant<int, 1>{});
    run(std::integral_constant<int, 2>{});
    run(std::integral_constant<int, 3>{});
    return dot;
  } else {
    std::array<I16, N> dot, sums = izeros<N>();
    auto run = [&](auto c) ITERSERVE_INLINE_LAMBDA {
      constexpr int C = decltype(c)::value;
      chunk_dots<Codec, C, MR, NT, true>(x, m0, blk, quads(c).data(), sums);
      if constexpr (C == 3 || (kSumsBesideDots<Codec> && C % G == G - 1)) {
        // The start at the first widening: its registers are free while the chunks run.
        if constexpr (C == (kSumsBesideDots<Codec> ? G - 1 : 3))
          dot = start_dots<Codec, MR, NT>(x, m0, blk, K);
        ITERSERVE_UNROLL for (int i = 0; i < N; ++i) dot[i] = widen_16(dot[i], sums[i]);
        if constexpr (C < 3) sums = izeros<N>();
      }
    };
    run(std::integral_constant<int, 0>{});
    run(std::integral_constant<int, 1>{});
    run(std::integral_constant<int, 2>{});
    run(std::integral_constant<int, 3>{});
    return dot;
  }
}

// Chunk c of block b of NT tiles (units at p[j]), decoded.
template <typename Codec, int NT, int C>
ITERSERVE_INLINE std::array<Quads, NT> decoded_chunk(const uint8_t* const* p, int b,
                                                     std::integral_constant<int, C>) {
  std::array<Quads, NT> w;
  ITERSERVE_UNROLL for (int j = 0; j < NT; ++j) w[j] = Codec::template chunk<C>(p[j], b);
  return w;
}

// Each of NT tiles' units (at p[j]) `Units` units ahead, a few lines a block: the hardware's
// streams alone left one-row steps at 81-92% of the memory's speed and four-row steps at
// 60-73% (benchmarks/linear_kernels.py; standalone: 7.5 -> 6.1 ms at 1 row, 9.8 -> 7.4 at 4;
// Intel Cascade Lake). Some AMD cores need no help with AVX-512's one or two rows, where
// these instructions only cost issue slots (few_rows_prefetch). Into L1, or with Locality 2
// into L2 (few_rows_units_far).
template <typename Codec, int NT, int Locality = 3>
ITERSERVE_INLINE void prefetch_units(const uint8_t* const* p, int b, int64_t units) {
  constexpr int kBlocks = Codec::kInputs / kBlock;
  constexpr int64_t kLines = (Codec::kBytes + 63) / 64, kEach = (kLines + kBlocks - 1) / kBlocks;
  const int64_t ahead = units * Codec::kBytes + b * kEach * 64;
  ITERSERVE_UNROLL for (int j = 0; j < NT; ++j)
    ITERSERVE_UNROLL for (int i = 0; i < kEach; ++i)
      __builtin_prefetch(p[j] + ahead + i * 64, 0, Locality);
}

// Whether this is an AMD core, and its family (Zen 4: 25, Zen 5: 26): the loops' rules below
// were measured per core.
inline bool amd_cpu() {
#if defined(__x86_64__)
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
#else
  return false;
#endif
}

inline int cpu_family() {
#if defined(__x86_64__)
  static const int family = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
    const int base = (eax >> 8) & 0xf;
    return base == 0xf ? base + static_cast<int>((eax >> 20) & 0xff) : base;
  }();
  return family;
#else
  return 0;
#endif
}

// AMD Zen 5 or later: the core several few-row rules below were measured on apart.
inline bool amd_zen5_or_later() { return amd_cpu() && cpu_family() >= 26; }

// How many units ahead a few rows' step prefetches: one (two from two rows on), and for the
// small units of the 32-input formats (288-544 bytes a tile) as many as make ~2 KB. One
// 288-byte unit ahead was too near on AMD Zen 3, AVX2 (benchmarks/stream_timing.cpp, two
// threads over a 1B's 16 layers, builds in turns, 2026-12-04): one row of Q4_0 read at
// 0.74-0.85 of a plain read, Q5_0 0.64-0.74, Q4_1 0.69-0.80, IQ4_NL 0.73-0.85; ~2 KB ahead,
// 0.95-0.97, 0.87-1.01, 0.88-0.98, 0.91-0.99 (one row of Q4_0 1.06-1.25x faster, Q5_0
// 1.19-1.53x, two rows 1.15-1.21x / 1.14-1.15x); Q8_0 (3 units) level, four rows 0.9-1.2x.
// On AMD Zen 5 ~7 KB (Q4_K 3 units, Q6_K 2, Q4_0 24). Its memory reads in spells, 44-55 GB/s
// while other tenants hold it and 82-87 when not, and one stream a thread (few_rows_in_lanes)
// with one unit in flight kept up with the slow spells only (benchmarks/stream_timing.cpp
// SHARES=1, two threads over a 1B's 16 layers, builds in turns, 2026-12-08, avx512bf16; the
// share of a plain read of the same bytes, medians of ~20 runs a spell at one row, 3-7 at two
// and four; fast spells, then slow): one row of Q4_K 0.82 -> 0.94 and 0.97 -> 0.95 (two units
// ahead 0.91), Q6_K 0.88-0.92 -> 0.95 and 0.97 -> 0.96; two rows of Q4_K 0.81 -> 0.88 and
// 0.96 -> 0.94; four rows of Q4_K 0.73 -> 0.80 and 0.95 -> 0.92, Q4_0 0.62 -> 0.81 and 0.86
// -> 0.95, Q8_0 0.74 -> 0.82 and 0.93 -> 0.90; one row of Q5_K, Q3_K, Q2_K and IQ4_XS
// 0.93-0.97 -> 0.96-0.98 in slow spells; the AVX2 build level in slow spells. In the engine
// (benchmarks/big_models.py, fresh processes in turns, batch-1 segments by the spell of the
// readings around them): an 8B Q4_K_M 13.5 -> 15.3 tok/s in fast spells (0.72 -> 0.82 of
// the reading), ~9.9 in slow ones either way; a 1B Q4_K_M's 0.76 -> 0.80 and 0.85 -> 0.84;
// Qwen3-30B-A3B's 22.0 -> 22.2 in slow spells; the bundled model's batch 1 level, batch 4
// 1.02-1.04x (decode_speed.py).
// ITERSERVE_PREFETCH_AHEAD (bytes) forces a distance.
inline int64_t few_rows_bytes_ahead() {
  static const int64_t bytes = []() -> int64_t {
    if (const char* forced = std::getenv("ITERSERVE_PREFETCH_AHEAD")) return std::atoll(forced);
    return amd_zen5_or_later() ? 7168 : 2048;
  }();
  return bytes;
}

template <typename Codec, int MR>
inline int64_t few_rows_units_ahead() {
  static const int64_t units =
      std::max<int64_t>(MR == 1 ? 1 : 2, few_rows_bytes_ahead() / Codec::kBytes);
  return units;
}

// How many units ahead a few rows' step also asks for its tiles into L2 (where
// few_rows_prefetch_far): ~8 KB a lane, past the L1 prefetch. On an Intel Emerald Rapids
// (benchmarks/stream_timing.cpp, two threads over a 1B's 16 layers, with and without,
// alternating in one process, 8-20 alternations, 2026-12-05, avx512bf16) the L1 prefetch
// alone left one row at 0.87-0.92 of a 4-lane read of the same bytes (read_probe's way) and
// this beside it 0.92-1.0: one row Q4_K 1.05-1.07x, Q6_K 1.07-1.10x, Q5_K 1.07x, Q4_0
// 1.05x, Q4_1 and Q5_0 1.06x, IQ4_XS 1.05x, Q8_0 1.03x, Q2_K and Q3_K level (their loops'
// arithmetic bounds them); two rows 1.06-1.09x, four 1.03-1.06x; an 8B's layers at one row
// Q4_K 1.05x, Q6_K 1.10x; the AVX2 build there 1.09-1.24x. 4, 16 and 32 KB ahead did as well
// as 8.
template <typename Codec, int MR>
inline int64_t few_rows_units_far() {
  constexpr int64_t kBytesFar = 8192;
  static const int64_t units =
      std::max<int64_t>(few_rows_units_ahead<Codec, MR>() + 1, kBytesFar / Codec::kBytes);
  return units;
}

// Whether one- and two-row steps of a codec prefetch their tiles (prefetch_units); steps of
// more rows always do. The hardware's streams alone serve some cores better:
//   - AMD Zen 4 with AVX-512 (four tiles a step: four streams a thread;
//     benchmarks/stream_timing.cpp, 2 threads, runs in turns, 2026-11-29): without them
//     Q4_K's one-row step streamed 1.14x faster while another tenant held the memory at
//     34 GB/s and 1.32x when it read at 58, Q6_K's 1.2x, two rows 1.17x; four rows lost
//     (0.92x).
//   - AMD Zen 5 (2026-12-02, the same loops with and without, alternating within one
//     process, 13-15 runs of 20-30 alternations): the K-quants gain from them, Q6_K one row
//     a median 1.10x (0.96-1.31), Q4_K 1.02x (0.96-1.36), Q5_K 1.03-1.07x, two rows
//     1.07-1.31x; Q4_0 and Q8_0 lose a little (0.92-1.0: their loops already stream at
//     0.94-0.98 of a plain read, and a 288-byte unit ahead is too near to help). In the
//     engine (benchmarks/big_models.py, in turns): a 1B's Q4_K_M batch 1 1.13x in the
//     median of 10 pairs, an 8B's neutral (6 pairs, the same mean; loops alone 0.99-1.10x).
//     With one stream a thread and ~7 KB ahead (few_rows_bytes_ahead; 2026-12-08,
//     stream_timing.cpp SHARES=1, in turns, medians by spell: fast, then slow) the 32-input
//     formats gain too: one row of Q4_0 0.82 -> 0.92 and 0.94 -> 0.96 of a plain read, Q5_0
//     0.82 -> 0.93 and 0.91 -> 0.96, IQ4_NL 0.84 -> 0.91 and 0.94 -> 0.95, Q4_1 0.86 ->
//     0.91 and level, two rows of Q4_0 0.72 -> 0.93 and 0.88 -> 0.96; all but Q8_0, whose
//     loop reads at 0.96-0.99 without them (one row 0.93 and 0.97 with, two 0.96 and 0.95).
//   - The AVX2 build (one tile a step) on Zen 4 kept Q6_K's one row 1.33x faster with them
//     and Q4_K level; on Intel Cascade Lake they made one row 1.23x faster; on AMD Zen 3, an
//     AVX2-only core (2026-12-04, in turns), one row read at 0.87-0.97 of a plain read with
//     them and 0.76-0.86 without (Q4_K, Q6_K), Q4_0 and Q8_0 level, and a farther distance
//     (2-16 units ahead) no better than one.
// ITERSERVE_PREFETCH (0, 1 or 2) forces either way (2: with the L2 prefetch too).
template <typename Codec>
inline bool few_rows_prefetch() {
  static const bool on = [] {
    if (const char* forced = std::getenv("ITERSERVE_PREFETCH")) return forced[0] != '0';
#if defined(CPU_CAPABILITY_AVX512)
    if (amd_cpu()) return amd_zen5_or_later() && Codec::kFormat != Format::kQ8_0;
#endif
    return true;
  }();
  return on;
}

// Whether the few rows' steps that prefetch into L1 also ask farther ahead into L2
// (few_rows_units_far): measured on Intel only, so on Intel's x86 cores by default;
// ITERSERVE_PREFETCH=2 turns it on elsewhere, 0 or 1 off.
inline bool few_rows_prefetch_far() {
  static const bool on = [] {
    if (const char* forced = std::getenv("ITERSERVE_PREFETCH")) return forced[0] == '2';
#if defined(__x86_64__)
    return !amd_cpu();
#else
    return false;
#endif
  }();
  return on;
}

// A span of bytes: what a thread reads after its current pass (empty: nothing known).
struct Span {
  const uint8_t* begin = nullptr;
  const uint8_t* end = nullptr;
};

// Bytes a thread reads next (its next pass of tiles), asked for a few cache lines at a time
// while it computes this pass, so that the next pass finds its weights in L2: without it a
// 16-row step waited on memory while it decoded and computed while memory idled
// (benchmarks/linear_kernels.py).
struct Prefetcher {
  const uint8_t* next = nullptr;
  const uint8_t* end = nullptr;
  int64_t each = 0;  // lines a step: the next pass's lines / this pass's steps, rounded up

  Prefetcher(Span bytes, int64_t steps)
      : next(bytes.begin), end(bytes.end),
        each(steps > 0 ? ((bytes.end - bytes.begin) / 64 + steps - 1) / steps : 0) {}
  ITERSERVE_INLINE void step() {
    for (int64_t i = 0; i < each && next < end; ++i, next += 64) __builtin_prefetch(next, 0, 2);
  }
};

// Calls run(p, b, blk) for every block of NT tiles (tile0, tile0 + lane, ...) of K inputs, in
// order: p[j] tile j's unit, b the block within it, blk the block's number among all.
template <typename Codec, int NT, typename F>
ITERSERVE_INLINE void for_each_block(int64_t K, const uint8_t* w, int64_t stride, int64_t tile0,
                                     int64_t lane, F&& run) {
  constexpr int kBlocks = Codec::kInputs / kBlock;
  for (int64_t u = 0; u < K / Codec::kInputs; ++u) {
    const uint8_t* p[NT];
    ITERSERVE_UNROLL for (int j = 0; j < NT; ++j)
      p[j] = w + (tile0 + j * lane) * stride + u * Codec::kBytes;
    for (int b = 0; b < kBlocks; ++b)
      run(static_cast<const uint8_t* const*>(p), b, u * kBlocks + b);
  }
}

// Few rows: MR rows x NT tiles (tile0, tile0 + lane, ...), decoding each block in registers.
template <typename Codec, int MR, int NT>
inline void block_tiles(const Rows& rows, int64_t m0, const uint8_t* w, int64_t stride,
                        int64_t tile0, int64_t lane, const Epilogue& ep) {
  constexpr int H = Codec::kHalves, kBlocks = Codec::kInputs / kBlock;
  // A copy the loops' stores cannot alias (they are of vector types, which alias anything).
  const QuantizedX x = rows.quantized<Codec::kInputs>();
  const int64_t K = rows.K;
  auto acc = zeros<MR * NT>();
  std::array<F16, MR * NT> unit;
  const bool prefetch = MR > 2 || few_rows_prefetch<Codec>();
  const bool far = prefetch && few_rows_prefetch_far();
  const int64_t ahead = few_rows_units_ahead<Codec, MR>();
  const int64_t farther = few_rows_units_far<Codec, MR>();
  // Inlined into the block loop, so that the sums stay in registers from block to block (as
  // a call the lambda kept them in memory: one-row Q4_K steps ran 1.3x slower in cache).
  auto block = [&](const uint8_t* const* p, int b, int64_t blk) ITERSERVE_INLINE_LAMBDA {
    if (prefetch) prefetch_units<Codec, NT>(p, b, ahead);
    if (far) prefetch_units<Codec, NT, 2>(p, b, farther);
    // Each chunk decoded as it is used.
    const auto dot = block_dots<Codec, MR, NT>(
        x, m0, blk, K, [&](auto c) { return decoded_chunk<Codec, NT>(p, b, c); });
    const auto scales = block_scales<Codec, NT>(p, b);
    const F16 *a = scales[0].data(), *o = scales[1].data();
    if (b == 0) fold_block<Codec, MR, NT, true>(unit, dot, a, o, x, m0, blk, K);
    else fold_block<Codec, MR, NT, false>(unit, dot, a, o, x, m0, blk, K);
    if (b == kBlocks - 1) {
      if constexpr (Codec::kUnitOffsets)
        UnitOffsets<Codec, NT>(p).template fold<MR>(unit, x, m0, blk / kBlocks, K);
      fold_unit<Codec, MR, NT>(acc, unit, x, m0, blk / kBlocks, K);
    }
  };
  for_each_block<Codec, NT>(rows.K, w, stride, tile0, lane, block);
  store_all<MR, NT>(ep, m0, tile0, lane, acc);
}

// Calls run.template operator()<MR>(m) for every group of up to MaxRows rows, from m0 = 0.
template <int MaxRows, typename F>
ITERSERVE_INLINE void row_groups(int64_t M, F&& run) {
  int64_t m = 0;
  for (; m + MaxRows <= M; m += MaxRows) run(std::integral_constant<int, MaxRows>{}, m);
  switch (M - m) {
    case 3: if constexpr (MaxRows > 3) run(std::integral_constant<int, 3>{}, m); break;
    case 2: if constexpr (MaxRows > 2) run(std::integral_constant<int, 2>{}, m); break;
    case 1: if constexpr (MaxRows > 1) run(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// Many rows: NT tiles (from tile0) against M rows, groups of up to MR at a time. Each block
// of the tiles is decoded once, into registers (or, where 16 of them do not fit, the stack:
// L1), and every row group takes its dot products against it; the rows' sums wait in `acc`
// ([M * NT], L1), and a 256-input unit's in `units` until its last block. Against decoding
// each block once every 4 rows (2026-11-29, avx512vnni, a standalone timing of these loops,
// one thread, 2048 x 2048, 16 / 64 / 128 rows): Q6_K 1.3-1.5x / 1.36x / 1.38x, Q4_K
// 1.1-1.2x / 1.12x / 1.09x (both against their earlier panel roads past 9 and 32 rows), Q8_0
// 1.09x at 16 rows, Q4_0 0.96x.
template <typename Codec, int MR, int NT>
inline void sweep_tiles(const Rows& rows, int64_t M, const uint8_t* w, int64_t stride,
                        int64_t tile0, const Epilogue& ep, F16* acc, F16* units,
                        Prefetcher& ahead) {
  constexpr int H = Codec::kHalves, kBlocks = Codec::kInputs / kBlock;
  // A copy the loops' stores cannot alias (they are of vector types, which alias anything).
  const QuantizedX x = rows.quantized<Codec::kInputs>();
  const int64_t K = rows.K;
  for (int64_t i = 0; i < M * NT; ++i) acc[i] = F16::zero();
  auto block = [&](const uint8_t* const* p, int b, int64_t blk) {
    ahead.step();
    prefetch_units<Codec, NT>(p, b, 1);
    const std::array<std::array<Quads, NT>, 4> q{
        decoded_chunk<Codec, NT>(p, b, std::integral_constant<int, 0>{}),
        decoded_chunk<Codec, NT>(p, b, std::integral_constant<int, 1>{}),
        decoded_chunk<Codec, NT>(p, b, std::integral_constant<int, 2>{}),
        decoded_chunk<Codec, NT>(p, b, std::integral_constant<int, 3>{})};
    const auto scales = block_scales<Codec, NT>(p, b);
    const F16 *a = scales[0].data(), *o = scales[1].data();
    row_groups<MR>(M, [&](auto mr, int64_t m0) {
      constexpr int R = decltype(mr)::value;
      const auto dot = block_dots<Codec, R, NT>(
          x, m0, blk, K, [&](auto c) -> const std::array<Quads, NT>& { return q[c]; });
      std::array<F16, R * NT> unit;
      if (b == 0) {
        fold_block<Codec, R, NT, true>(unit, dot, a, o, x, m0, blk, K);
      } else {
        ITERSERVE_UNROLL for (int i = 0; i < R * NT; ++i) unit[i] = units[m0 * NT + i];
        fold_block<Codec, R, NT, false>(unit, dot, a, o, x, m0, blk, K);
      }
      if constexpr (kBlocks == 1) {  // a one-block unit goes straight into the rows' sums
        std::array<F16, R * NT> sums;
        ITERSERVE_UNROLL for (int i = 0; i < R * NT; ++i) sums[i] = acc[m0 * NT + i];
        fold_unit<Codec, R, NT>(sums, unit, x, m0, blk, K);
        ITERSERVE_UNROLL for (int i = 0; i < R * NT; ++i) acc[m0 * NT + i] = sums[i];
      } else {
        ITERSERVE_UNROLL for (int i = 0; i < R * NT; ++i) units[m0 * NT + i] = unit[i];
      }
    });
    if constexpr (kBlocks > 1) {  // at a unit's end, its sums into the rows', row by row
      if (b != kBlocks - 1) return;
      [[maybe_unused]] const auto offsets = [&] {
        if constexpr (Codec::kUnitOffsets) return UnitOffsets<Codec, NT>(p);
        else return 0;
      }();
      for (int64_t m = 0; m < M; ++m) {
        std::array<F16, NT> sums, unit;
        ITERSERVE_UNROLL for (int j = 0; j < NT; ++j) {
          sums[j] = acc[m * NT + j];
          unit[j] = units[m * NT + j];
        }
        if constexpr (Codec::kUnitOffsets) offsets.template fold<1>(unit, x, m, blk / kBlocks, K);
        fold_unit<Codec, 1, NT>(sums, unit, x, m, blk / kBlocks, K);
        ITERSERVE_UNROLL for (int j = 0; j < NT; ++j) acc[m * NT + j] = sums[j];
      }
    }
  };
  for_each_block<Codec, NT>(rows.K, w, stride, tile0, 1, block);
  for (int64_t m = 0; m < M; ++m)
    ITERSERVE_UNROLL for (int j = 0; j < NT; ++j) ep.store(m, (tile0 + j) * kTile, acc[m * NT + j]);
}

// ---- driver ----------------------------------------------------------------------------

// Tiles per register block: enough independent accumulators to hide the dot-product latency
// at one row, few enough that MR rows of them (and H halves of integer sums) fit the
// registers (32 zmm, each an F16; 16 ymm on AVX2, two to an F16).
template <int MR, int H = 1>
constexpr int tiles_per_step() {
  if constexpr (kParts == 1) return std::max(1, std::min(4, 8 / (MR * H)));
  return 1;
}

// Tiles a thread takes at a time: their weights (8 x 16 outputs x K inputs) stay in L2 while
// every slab of rows reads them, so a weight comes from memory once per step however many rows
// there are.
constexpr int64_t kTilesPerPass = 8;
// Rows a sweep takes through a pass at a time (a slab): at most 64, whose fp32 sums (64 bytes
// a tile) stay in L1 from one block to the next, and as many as keep the slab's int8
// activations (K bytes a row) within a budget, since every tile step reads them all again.
// Never under 16, so that a batch-16 decode step decodes its weights once. The budget is the
// machine's (benchmarks/tiles_timing.cpp, one thread, a 2048 x 8192 weight):
//   - Intel Cascade Lake (2026-11-29, avx512vnni): 128 KiB of L2. At 512 rows slabs of 16 rows
//     ran 1.2-1.3x faster than of 64, and a 4096 x 4096 weight 1.14x in slabs of 32 (256 KiB:
//     no gain, 64 KiB: less).
//   - AMD Zen 5 (2026-11-30, avx512bf16): 512 KiB, 64 rows: Q6_K 1.13-1.19x and Q4_K
//     1.03-1.11x at 128 and 512 rows, the AVX2 build on the same core 1.02-1.08x; in the engine
//     (a 1B's 128- and 512-token prompts, runs in turns) 1.02-1.07x, an 8B's 1.01-1.03x. Its
//     cores take two dot products a cycle, so decoding a block once for 16 rows costs more
//     beside them, and its L3 (32 MiB a CCD) serves the slab's re-reads.
// Zen 4 shares Zen 5's caches and takes the same budget: 256 KiB and 1 MiB, and passes of 4
// or 16 tiles, were level with it within 2% at 128 and 512 rows (2026-12-06, avx512bf16):
// its sweeps are bound by their arithmetic.
constexpr int64_t kSweepRows = 64;
// Rows a many-row step takes through every pass of its weight before the next rows
// (linear.cpp): a pass's sweep reads all its rows' activations again (K bytes a row), which
// past a few hundred rows no longer stay in L2 and come from L3 at every pass. In blocks of
// 512 rows the weight comes from memory once a block instead, a read small beside 512 rows'
// arithmetic. One thread, 2048 rows (tiles_timing.cpp with and without the blocks, three
// pairs in turns, the same output bits; 2026-12-06, AMD Zen 4, avx512bf16), 16384 x 2048 and
// 2048 x 8192: Q6_K 285-307 GOP/s whole, 316-331 in blocks of 512 (as fast as one step of 512
// rows; blocks of 256 300-329); Q4_K 327-339 and 348-351. In the engine (a 1B Q6_K's
// 16 prompts of 128 tokens with --max-num-batched-tokens 2048, five pairs of runs in turns,
// with glibc's mmap threshold raised so that the step's fresh 64 MB outputs did not fault
// in every call): 1.02x (1.00-1.14).
constexpr int64_t kSweepRowBlock = 512;
inline int64_t sweep_activation_bytes() { return amd_cpu() ? 512 * 1024 : 128 * 1024; }
inline int64_t sweep_slab_rows(int64_t K) {
  return std::clamp<int64_t>(sweep_activation_bytes() / K / 4 * 4, 16, kSweepRows);
}
// A sweep's tiles at a time and rows a group: two tiles' decoded blocks (16 registers) with
// 2-3 rows' integer sums fill AVX-512's 32; elsewhere one tile's, its blocks held in L1.
// Q6_K's, Q3_K's and Q2_K's halves of a block take twice the sums, so 2 rows a group
// (1.15x 4 rows on Q6_K at 16 rows, the timing above sweep_tiles; forced AVX2 on the same
// machine: 4 rows a group for the others kept Q4_0 and Q4_K at the register road's speed,
// where 2 made Q4_0 0.9x). AVX2 with AVX-VNNI, whose dot products are a third of AVX2's
// instructions, takes two tiles and 2 rows a group: Q4_0, Q4_K, Q6_K and Q8_0 1.03-1.08x
// one tile and 4 rows at 16 and 128 rows (benchmarks/tiles_timing.cpp, 2048 x 2048, one
// thread, 3 runs in turns, 2026-12-02, Zen 5), where plain AVX2 was level with it. The 5-bit
// formats' 16-bit sums beside their dot products (kSumsBesideDots) take 2 rows a group too
// (Q5_K 1.06-1.09x on its own, kChunksIn16Bits' timing; Q4_K at 2 rows: 0.86-0.95x).
// AVX-512's other one-half formats take 3 rows a group, not 4: at 4 the two tiles' 16
// decoded registers, the 8 sums and the broadcast activations needed more than 32, and a
// sum went to the stack and back every group. At 3 (the same bits; one thread, 2048 x 2048,
// 16 / 128 / 512 rows, two runs in turns, 2026-12-06, AMD Zen 4): avx512bf16 Q8_0
// 1.06-1.09x, Q4_K 1.01-1.03x, Q4_0 1.01-1.02x, Q5_K 1.01-1.04x, IQ4_XS 1.03-1.08x; without
// VNNI (avx512) 0.98-1.05x. Q6_K, Q3_K and Q2_K keep 2 rows of two tiles (one tile and 4
// rows: 0.96-1.01x); plain AVX2 keeps 4 (at 3: Q4_K 0.98x, Q4_0 1.05-1.09x).
constexpr int sweep_tiles_per_step() { return kParts == 1 || kAvxVnni ? 2 : 1; }
template <typename Codec>
constexpr int sweep_rows() {
  if (Codec::kHalves != 1 || kAvxVnni || kSumsBesideDots<Codec>) return 2;
  return kParts == 1 ? 3 : 4;
}

struct Segment {
  Format format;
  const uint8_t* data;
  int64_t stride;  // bytes a tile
  int64_t tiles;
  int64_t first;   // its first tile among all the weight's
};

// NT tiles a step, then single tiles to the end.
template <int NT, typename F>
ITERSERVE_INLINE void tile_steps(int64_t t_begin, int64_t t_end, F&& run) {
  int64_t t = t_begin;
  if constexpr (NT > 1)
    for (; t + NT <= t_end; t += NT) run(std::integral_constant<int, NT>{}, t);
  for (; t < t_end; ++t) run(std::integral_constant<int, 1>{}, t);
}

// Tile steps tile_steps<NT> makes of n tiles.
template <int NT>
constexpr int64_t tile_step_count(int64_t n) { return n / NT + n % NT; }

// ---- a few rows: lanes ---------------------------------------------------------------------
//
// A step of up to 4 rows reads each tile once and is bound by the memory. Its loops take NT
// tiles at a time (tiles_per_step), each tile read as a stream of its own; NT adjacent tiles
// a step made each thread start NT new streams every step (4 x 18 KB of Q4_K at K = 2048),
// and every new stream costs the hardware prefetcher its start. So a thread's tiles of a
// segment are cut into NT lanes of equal length, walked side by side (`LaneRun`): step i
// takes tile i of every lane, and each lane is one stream from its first tile to its last.
// Two threads over a 1B's 16 layers of projections (benchmarks/stream_timing.cpp,
// 2026-12-01, avx512bf16, Zen 5, in turns): Q4_K 12.7-12.9 -> 12.0-12.4 ms, Q6_K 18.2-18.5
// -> 16.8-17.0, Q4_0 12.2 -> 10.8-11.1, 0.97-1.0 of a plain read of the same bytes; one
// 310 MB weight of K = 512 read at 0.76 of the plain read before and 0.89-0.95 after. One
// tile a step (AVX2, Arm, and 3-4 rows of Q6_K) was one stream a thread already, and on AMD
// Zen 5 a thread's tiles go one after another, one stream a thread (`few_rows_in_lanes`).

// A few rows' step: `width` tiles of segment `seg`, `lane` apart (first, first + lane, ...;
// the segment's own tile numbers), side by side; or, at width 1, `count` tiles from `first`
// one after another.
struct LaneStep {
  int64_t seg;
  int64_t first;
  int64_t lane;
  int width;
  int count;
};

// Tiles a step of single tiles takes (one stream whatever their number): enough that the
// steps' dispatch and the shares' atomic take stay small beside a bundled model's 5 KB tiles.
constexpr int kSingleTiles = 4;

// Calls run(mr) with M (1..4) as a compile-time constant.
template <typename F>
ITERSERVE_INLINE void few_rows(int64_t M, F&& run) {
  switch (M) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    default: return run(std::integral_constant<int, 4>{});
  }
}

// Whether a few rows' steps walk lanes (above) or a thread's tiles one after another, one
// stream a thread. AMD Zen 5's memory serves the one stream better (2026-12-07, avx512bf16,
// benchmarks/stream_timing.cpp SHARES=1: two threads over a 1B's 16 layers, split as the
// engine splits them, builds in turns; share of a plain read of the same bytes, lanes -> one
// after another): one row in spells of 44-51 GB/s Q4_K 0.84-0.93 -> 0.97-1.06, Q6_K
// 0.84-0.92 -> 0.97-1.00, Q4_0 and Q8_0 0.94-0.99 -> 0.96-1.01, an 8B's layers Q4_K and Q6_K
// 0.86-0.95 -> 0.98-1.01; in spells of 77-81 Q6_K 0.81 -> 0.89, Q4_0 0.80 -> 0.92; two rows
// 0.75-0.91 -> 0.88-0.97, four 0.90-0.96 -> 0.94-0.98. In cache the lanes' four tiles a
// step run faster (Q4_K 249 against 175 GB/s): it is the memory, not the loops' work. In
// the engine (benchmarks/big_models.py, fresh processes in turns, batch-1 segments read in
// spells under 60 GB/s) a 1B Q4_K_M's batch 1 44.4 -> 51.7 tok/s (medians; 0.72 -> 0.83 of
// the readings beside them), an 8B's 9.0 -> 9.2 (0.81 -> 0.85), Qwen3-30B-A3B's 18.2-19.3 ->
// 21.2-22.2 (its experts: 48 tiles each), the bundled model's 1.06-1.10x (decode_speed.py).
// The lanes were measured on the other cores against 4 adjacent tiles a step, not one, so
// they keep them. ITERSERVE_LANES (0 or 1) forces either way.
inline bool few_rows_in_lanes() {
  static const bool on = [] {
    if (const char* forced = std::getenv("ITERSERVE_LANES")) return forced[0] != '0';
    return !amd_zen5_or_later();
  }();
  return on;
}

// Tiles a few-row step of M rows takes at a time in a format.
inline int few_rows_width(Format format, int64_t M) {
  if (!few_rows_in_lanes()) return 1;
  int width = 1;
  few_rows(M, [&](auto mr) {
    constexpr int MR = decltype(mr)::value;
    if (format == Format::kBf16 || format == Format::kF16) {
      width = tiles_per_step<MR>();
      return;
    }
    with_codec(format, [&](auto codec) {
      width = tiles_per_step<MR, decltype(codec)::kHalves>();
    });
  });
  return width;
}

// Bytes a step takes at most in the last quarter of a run (at least one tile). A thread done
// with its share takes half of what is left of the other's, from its back, then waits for the
// step that thread has in hand; a step of 4 lanes of a down projection's 74-107 KB tiles
// (K = 8192) left it waiting 12-18 us a call at one row, and steps of ~32 KB 4 (a 1B Q4_K_M,
// AVX-512 BF16, 2026-12-05; the down projection's whole call ~450 us).
constexpr int64_t kFineStepBytes = 32768;

// Tiles [t_begin, t_end) of segment `seg` as few-row steps, numbered from 0: `width` lanes of
// equal length side by side, then the tiles left over one after another, kSingleTiles a step.
// A run that threads share (`stride`: its tiles' bytes; 0: a run of one thread's own) keeps
// its last quarter out of the lanes, one tile after another in steps of up to
// kFineStepBytes.
struct LaneRun {
  int64_t seg, t_begin, t_end, fine_begin, fine, per_lane;
  int width;

  LaneRun(int64_t seg, int64_t t_begin, int64_t t_end, int width, int64_t stride = 0)
      : seg(seg), t_begin(t_begin), t_end(t_end),
        fine_begin(t_end - (stride > 0 ? (t_end - t_begin) / 4 : 0)),
        fine(stride > 0 ? std::clamp<int64_t>(kFineStepBytes / stride, 1, kSingleTiles) : 1),
        per_lane(width > 1 ? (fine_begin - t_begin) / width : 0), width(width) {}
  int64_t steps() const {
    return per_lane + coarse_steps() + ceil_div(t_end - fine_begin, fine);
  }
  LaneStep step(int64_t i) const {
    if (i < per_lane) return {seg, t_begin + i, per_lane, width, 1};
    i -= per_lane;
    if (i < coarse_steps())
      return singles(lanes_end() + i * kSingleTiles, kSingleTiles, fine_begin);
    return singles(fine_begin + (i - coarse_steps()) * fine, fine, t_end);
  }

 private:
  static int64_t ceil_div(int64_t n, int64_t d) { return (n + d - 1) / d; }
  int64_t lanes_end() const { return t_begin + width * per_lane; }
  // The tiles between the lanes and the last quarter, kSingleTiles a step.
  int64_t coarse_steps() const { return ceil_div(fine_begin - lanes_end(), kSingleTiles); }
  // Up to `count` tiles from t, one after another, none from `end` on.
  LaneStep singles(int64_t t, int64_t count, int64_t end) const {
    return {seg, t, 1, 1, static_cast<int>(std::min(count, end - t))};
  }
};

// One few-row step of the M rows (M <= kRegisterRows) on segment `seg`.
inline void lane_step(const Segment& seg, const Rows& rows, int64_t M, const LaneStep& step,
                      const Epilogue& ep) {
  const Epilogue out = ep.shifted(seg.first);
  few_rows(M, [&](auto mr) {
    constexpr int MR = decltype(mr)::value;
    auto run = [&](auto nt, auto tiles) {
      constexpr int NT = decltype(nt)::value;
      if (NT > 1 && step.width == NT) return tiles(nt, step.first, step.lane);
      for (int64_t t = step.first; t < step.first + step.count; ++t)
        tiles(std::integral_constant<int, 1>{}, t, int64_t{1});
    };
    if (seg.format == Format::kBf16 || seg.format == Format::kF16) {
      const bool half = seg.format == Format::kF16;
      run(std::integral_constant<int, tiles_per_step<MR>()>{},
          [&](auto nt, int64_t t, int64_t lane) {
            constexpr int NT = decltype(nt)::value;
            if (half) f16_tiles<MR, NT>(rows, 0, seg.data, t, lane, out);
            else bf16_tiles<MR, NT>(rows, 0, seg.data, t, lane, out);
          });
      return;
    }
    with_codec(seg.format, [&](auto codec) {
      using Codec = decltype(codec);
      run(std::integral_constant<int, tiles_per_step<MR, Codec::kHalves>()>{},
          [&](auto nt, int64_t t, int64_t lane) {
            block_tiles<Codec, MR, decltype(nt)::value>(rows, 0, seg.data, seg.stride, t, lane,
                                                        out);
          });
    });
  });
}

// ---- many rows -----------------------------------------------------------------------------

// Many rows (M > kRegisterRows) over tiles [t_begin, t_end) of a block segment, a pass at a
// time: each pass swept in slabs of rows, while the pass's blocks prefetch the next pass's
// weights (or `after`'s, past the last) into L2.
template <typename Codec>
void codec_range(const Segment& seg, const Rows& rows, int64_t M, int64_t t_begin, int64_t t_end,
                 const Epilogue& ep, Span after) {
  const Epilogue out = ep.shifted(seg.first);
  constexpr int NT = sweep_tiles_per_step();
  // The rows' sums, then their units' (see sweep_tiles).
  thread_local std::vector<F16> sums;
  if (static_cast<int64_t>(sums.size()) < 2 * kSweepRows * NT) sums.resize(2 * kSweepRows * NT);
  const int64_t per_slab = sweep_slab_rows(rows.K);
  const int64_t blocks = rows.K / kBlock, slabs = (M + per_slab - 1) / per_slab;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTilesPerPass) {
    const int64_t t1 = std::min(t0 + kTilesPerPass, t_end);
    const int64_t t2 = std::min(t1 + kTilesPerPass, t_end);
    const Span next =
        t1 >= t_end ? after : Span{seg.data + t1 * seg.stride, seg.data + t2 * seg.stride};
    Prefetcher ahead(next, slabs * tile_step_count<NT>(t1 - t0) * blocks);
    for (int64_t m0 = 0; m0 < M; m0 += per_slab) {
      const Rows slab = rows.from(m0);
      const Epilogue slab_out = out.from_row(m0);
      const int64_t slab_rows = std::min(per_slab, M - m0);
      tile_steps<NT>(t0, t1, [&](auto nt, int64_t t) {
        sweep_tiles<Codec, sweep_rows<Codec>(), decltype(nt)::value>(
            slab, slab_rows, seg.data, seg.stride, t, slab_out, sums.data(),
            sums.data() + kSweepRows * NT, ahead);
      });
    }
  }
}

// Many rows of a dense segment: passes of tiles, groups of 4 rows over each.
template <bool Half>
void dense_range(const Segment& seg, const Rows& rows, int64_t M, int64_t t_begin, int64_t t_end,
                 const Epilogue& ep) {
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTilesPerPass) {
    const int64_t t1 = std::min(t0 + kTilesPerPass, t_end);
    row_groups<4>(M, [&](auto mr, int64_t m0) {
      constexpr int MR = decltype(mr)::value;
      tile_steps<tiles_per_step<MR>()>(t0, t1, [&](auto nt, int64_t t) {
        constexpr int NT = decltype(nt)::value;
        if constexpr (Half) f16_tiles<MR, NT>(rows, m0, seg.data, t, 1, ep.shifted(seg.first));
        else bf16_tiles<MR, NT>(rows, m0, seg.data, t, 1, ep.shifted(seg.first));
      });
    });
  }
}

// Tiles [t_begin, t_end) of a segment against M rows, by either road: a few rows in lanes,
// many in passes.
void segment_range(const Segment& seg, const Rows& rows, int64_t M, int64_t t_begin,
                   int64_t t_end, const Epilogue& ep, Span after = {}) {
  if (M <= kRegisterRows) {
    const LaneRun run(0, t_begin, t_end, few_rows_width(seg.format, M));
    for (int64_t i = 0; i < run.steps(); ++i) lane_step(seg, rows, M, run.step(i), ep);
    return;
  }
  if (seg.format == Format::kBf16) return dense_range<false>(seg, rows, M, t_begin, t_end, ep);
  if (seg.format == Format::kF16) return dense_range<true>(seg, rows, M, t_begin, t_end, ep);
  with_codec(seg.format, [&](auto codec) {
    codec_range<decltype(codec)>(seg, rows, M, t_begin, t_end, ep, after);
  });
}

}  // namespace iterserve
