// The paged attention loops: what one work item of a plan (attention_plan.h) computes, for
// every ISA and head size. paged_attention.cpp describes the layout and the plan.
//
// One source, every ISA. The kernels are written in simd.h's 16-lane vectors (F16: one zmm
// on AVX-512, two ymm on AVX2, four q registers on NEON), so a score tile is 16 keys and a
// 32-dim chunk of a row is two F16s everywhere. Only the AVX-512 BF16 build has code of its
// own (`#if` blocks): `vdpbf16ps` dot products of bf16 pairs.
//
// Every query's arithmetic is the same whatever else shares its item: the same kernels, the
// same order of its sums, for a decode row, a speculative verify row or a prefill chunk's
// row, however many rows the item holds. So a row's output does not depend on how its prompt
// was chunked, whether a prefix came from the cache, or what shared the step (projections
// keep rows apart too, linear.cpp): a greedy answer is the same from a cold and a warm prefix
// cache. Faster roads for items of many queries (a transposed score tile, bf16 P.V) rounded
// differently and were removed: whole prefills measured no slower without them (docs/kernels.md).
//
// Scores. A dot product of a key row with a query gives 16 lane-wise partial sums per key,
// which need a horizontal sum; done one key at a time that costs more than the dot product.
//   - The tree (every build, any M): 16 keys' partial-sum vectors are summed across lanes
//     together by a transpose-and-add tree (`reduce16`). With AVX-512 BF16 a key's partial
//     sums are `vdpbf16ps` of its raw bf16 pairs with the query's; elsewhere bf16 keys are
//     widened to fp32 (a shift and a mask: even and odd dims in separate vectors, two FMAs
//     per 32 dims against the query, widened the same way once per item), and each widened
//     key serves a block of queries, so a GQA group widens it once.
// P.V keeps probabilities in fp32: each V row is widened to fp32 (even and odd dims apart,
// undone when the row is written) and FMA'd into register-resident accumulators for a block
// of queries, so V is read once per block. How much of a row a block holds follows the
// registers: AVX-512's 32 take the whole row for up to 12 / (head_dim / 32) queries; AVX2's
// 16 ymm (and NEON's 32 q registers: 8 F16s either way) take 16 dims for 4 queries, the keys
// being walked once per 16 dims. fp32 caches take the same paths as bf16 without the bf16
// instructions (plain loads and FMAs).
//
// Where the time goes (Zen 4, one thread, K/V in cache): decode with SmolLM2's group of 3
// costs ~27 cycles per key per kv head (~9 per key and query) with AVX-512 BF16, about half
// of it the fp32 P.V FMAs (figures from before items of many queries lost their own
// kernels, 2026-12-02). The AVX2 build, on the same machine, takes ~1.4-1.6x the AVX-512 BF16
// time for decode. From DRAM, reading blocks scattered over a large
// pool runs at ~5-15 GB/s here, well below sequential bandwidth, so big batches are bound by
// memory latency: K/V rows are prefetched into L2 a fixed distance ahead, and each thread
// claims its next item early to prefetch its start.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>

#include "attention_plan.h"
#include "ops.h"
#include "simd.h"

#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace iterserve::attention {

using at::BFloat16;

constexpr int kTile = 16;                // keys per score tile: one F16 of scores

// Keys are read in block-sized runs from scattered blocks, too short for the hardware
// prefetcher to get ahead, so every loop over keys asks for the rows this far ahead itself.
constexpr int64_t kPrefetchKeys = 64;

// Into L2 (locality 2: prefetcht1 on x86, pldl2keep on Arm): an L1 prefetch waits for one of
// the core's few L1 miss buffers and measured no faster than none; L2 prefetches 64 keys
// ahead read scattered blocks ~1.3-1.5x faster.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
}

// Calls f(std::integral_constant<int, size>{}) for 1 <= size <= MAX: a block's size becomes a
// compile-time constant, so its accumulators can be registers.
template <int MAX, typename F>
inline void with_block_size(int size, F&& f) {
  if constexpr (MAX > 1) {
    if (size < MAX) return with_block_size<MAX - 1>(size, std::forward<F>(f));
  }
  f(std::integral_constant<int, MAX>{});
}

// Calls f(first, size) for M queries cut into blocks of at most MB, as even as can be
// (M = 9, MB = 8 runs as 5 + 4, not 8 + 1), size as a compile-time constant.
template <int MB, typename F>
inline void for_each_query_block(int M, F&& f) {
  const int blocks = (M + MB - 1) / MB;
  for (int b = 0, m = 0; b < blocks; ++b) {
    const int size = (M - m) / (blocks - b) + ((M - m) % (blocks - b) != 0);
    with_block_size<MB>(size, [&](auto mb) { f(m, mb); });
    m += size;
  }
}

// ---- 1. scores: S[m][col + j] = q_m . key_j for the 16 keys at element offsets off[j] ----

// 32 dims of a key or query row as the tree's dot products take them. bf16: simd.h's `Pairs`
// (key) and `XPair` (query), raw bits for `vdpbf16ps` or else widened to fp32 even and odd
// dims; fp32: two F16s as the dims lie (key and query split alike, any split would do).
struct Halves {
  F16 first, second;
};

inline Pairs key_chunk(const BFloat16* p) { return load_pairs(p); }
inline Halves key_chunk(const float* p) { return {F16::load(p), F16::load(p + 16)}; }
inline Halves key_chunk(const int8_t* p) { return {load_i8x16(p), load_i8x16(p + 16)}; }

inline XPair query_chunk(const BFloat16* p) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  return XPair{load_pairs(p).raw};
#else
  const Pairs w = load_pairs(p);
  return XPair{w.even, w.odd};
#endif
}
inline Halves query_chunk(const float* p) { return key_chunk(p); }

// Against an int8 cache fp32 queries meet keys widened to fp32 as their dims lie (bf16
// queries take the 16-bit path further down).
inline Halves query_halves(const float* p) { return key_chunk(p); }

template <typename T, typename C>
inline auto make_query_chunk(const T* p) {
  if constexpr (std::is_same_v<C, int8_t> && std::is_same_v<T, float>) return query_halves(p);
  else return query_chunk(p);
}

// How a query row of type T is held for the score tree against a cache of type C.
template <typename T, typename C>
using QueryChunk = decltype(make_query_chunk<T, C>(static_cast<const T*>(nullptr)));

inline F16 chunk_dot(const F16& acc, const Pairs& k, const XPair& q) { return pair_dot(acc, k, q); }
inline F16 chunk_dot(const F16& acc, const Halves& k, const Halves& q) {
  return fmadd(k.second, q.second, fmadd(k.first, q.first, acc));
}

// Queries per tree block. Where a key chunk is used as loaded (raw bf16 for `vdpbf16ps`, fp32
// as FMA memory operands) one query at a time keeps its 16 keys' partial sums in registers
// (AVX-512); where keys are widened (bf16 without bf16 dot products, int8 everywhere), each
// widened chunk serves a block of queries, each with its accumulator in registers beside it:
// 8 in AVX-512's 32 zmm, 2 in AVX2's 16 ymm (a widened chunk takes 4, an accumulator 2).
// AVX2 took 4 before: its accumulators, the widened chunk and the queries' chunks did not fit,
// and the tree spilled to the stack every key (`perf annotate`: its time spread over stack
// stores and reloads). 2 a block widens each key twice for a group of 4 queries and spills
// less (the tree's instructions with a stack operand: 292 against 892). A decode over 1,024
// keys, one thread, 4 layers (K/V in cache): 1.16-1.21x for the Llama 3.2 1B's group of 4 at
// head_dim 64, 1.08-1.18x for Llama 3.1 8B's at 128, 1.17-1.21x
// for Qwen2.5 3B's group of 8, level for Llama 3.2 3B's 3; a 128-row prompt chunk over 512
// keys 1.12-1.18x (1B) and 1.27-1.45x (3B); the 1B's 16 layers on two threads 1.09-1.14x at
// 1 x 1,024 keys, 1.07-1.08x at 16 x 256 (benchmarks/attention_kernel.py --shape, two builds
// in turns, 2026-12-04, AVX2 on AMD Zen 3). Each query's sums are the same either way: the
// same bits. NEON (32 q registers, 8 F16s) keeps 4: not measured.
template <typename C>
constexpr int kTreeQueries =
    std::is_same_v<C, float> || (std::is_same_v<C, BFloat16> && kBf16Dot) ? 1
    : kParts == 1                                                          ? 8
    : kParts == 2                                                          ? 2
                                                                           : 4;

// Bytes of one cache row: head_dim values, and for int8 their fp32 scale (ops.h).
template <typename C>
constexpr int64_t row_bytes(int64_t head_dim) {
  return head_dim * static_cast<int64_t>(sizeof(C)) +
         (std::is_same_v<C, int8_t> ? kRowScaleBytes : 0);
}

// The scales of int8 rows, stored after each row's head_dim values.
inline float row_scale(const int8_t* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, row + head_dim, sizeof(float));
  return scale;
}

// The loops below unroll a row's 32-dim chunks in full up to 256 dims. A wider row (512:
// Gemma 4's full layers) runs as a loop over spans of 2 chunks, left rolled: unrolled whole,
// its instantiations alone took as long to compile as those of every other head size
// (attention_bf16.cpp 31.7 -> 57.9 s, AVX2, -O3; spans of 8 45.4 s, of 4 39.7, of 2 36.8;
// each measured once, no script).
template <int NC>
constexpr int kSpan = NC <= 8 ? NC : 2;

// body(c0, first) for the spans [c0, c0 + kSpan<NC>) of a row's NC chunks; `first`: c0 == 0.
template <int NC, typename F>
inline void for_each_span(F&& body) {
  static_assert(NC % kSpan<NC> == 0, "a row is whole spans");
  if constexpr (NC == kSpan<NC>) {
    body(0, true);
  } else {
    for (int c0 = 0; c0 < NC; c0 += kSpan<NC>) body(c0, c0 == 0);
  }
}

// Per key and query a 16-lane vector of partial sums; then, per query, 16 keys' vectors are
// summed across lanes together. q: the block's QB queries' chunks, [QB][NC]. An int8 key's
// dot products are of its int8 values, times its scale once summed.
template <typename C, typename QC, int NC, int QB>
inline void scores_tree(const C* cache, const int64_t* off, const QC* q, float* S, int64_t ldS) {
  auto dots = zeros<QB * kTile>();  // [QB][kTile]
  for_each_span<NC>([&](int c0, bool first) {
    ITERSERVE_UNROLL for (int j = 0; j < kTile; ++j) {
      const C* key = cache + off[j] + 32 * c0;
      auto acc = zeros<QB>();
      ITERSERVE_UNROLL for (int c = 0; c < kSpan<NC>; ++c) {
        const auto k = key_chunk(key + 32 * c);
        ITERSERVE_UNROLL for (int i = 0; i < QB; ++i)
          acc[i] = chunk_dot(acc[i], k, q[i * NC + c0 + c]);
      }
      ITERSERVE_UNROLL for (int i = 0; i < QB; ++i)
        dots[i * kTile + j] = first ? acc[i] : dots[i * kTile + j] + acc[i];
    }
  });
  if constexpr (std::is_same_v<C, int8_t>) {
    alignas(64) float scales[kTile];
    for (int j = 0; j < kTile; ++j) scales[j] = row_scale(cache + off[j], 32 * NC);
    const F16 vscales = F16::load(scales);
    ITERSERVE_UNROLL for (int i = 0; i < QB; ++i)
      (reduce16(&dots[i * kTile]) * vscales).store(S + i * ldS);
  } else {
    ITERSERVE_UNROLL for (int i = 0; i < QB; ++i) reduce16(&dots[i * kTile]).store(S + i * ldS);
  }
}

// Against an int8 pool, bf16 queries are put on a 16-bit grid (q ~ s_q * q16, s_q = max|q| /
// 32767, one scale a row) once per item, and a key's 32 int8 dims, sign-extended to words
// (one instruction), meet a query's in one 16-bit dot product (simd.h dot_i16: `vpdpwssd`,
// `vpmaddwd`): the int8 key no longer becomes fp32 or bf16 (four widenings and, with bf16
// dot products, a narrowing per 32 dims). The sums are exact in int32 and scaled once
// summed. A bf16 query carries 8 significant bits, so the 16-bit grid moves it by at most
// 2^-16 of the row's largest value (tests/kernels/test_attention_kernel.py puts its
// reference queries on the same grid). fp32 queries keep the exact fp32 path.
// benchmarks/attention_kernel.py --int8-cache measures it.
template <typename T, typename C>
constexpr bool kInt16Queries = std::is_same_v<T, BFloat16> && std::is_same_v<C, int8_t>;
// Queries a block, their accumulators in registers beside the widened key: 4, and 2 on AVX2
// (two ymm a query), where 4 measured slower: a decode over 1,024 keys of an int8 pool 1.20x
// for Qwen2.5 3B's group of 8, 1.07-1.10x for the Llama 1B's 4, a 128-row prompt chunk
// 1.04-1.09x, the same bits (benchmarks/attention_kernel.py --int8-cache --threads 1, two
// builds in turns, 2026-12-04, AVX2 on AMD Zen 3). Other ISAs not measured.
constexpr int kInt16QueryBlock = kParts == 2 ? 2 : 4;

// An item's queries on the 16-bit grid: row m's head_dim words at words + m * head_dim, and
// its scale.
struct Int16Queries {
  const int16_t* words;
  const float* scales;
};

template <int NC, int QB>
inline void scores_int16_queries(const int8_t* cache, const int64_t* off, const Int16Queries& q,
                                 int m0, float* S, int64_t ldS) {
  auto dots = zeros<QB * kTile>();  // [QB][kTile]
  for_each_span<NC>([&](int c0, bool first) {
    ITERSERVE_UNROLL for (int j = 0; j < kTile; ++j) {
      const int8_t* key = cache + off[j] + 32 * c0;
      I16 acc[QB];
      ITERSERVE_UNROLL for (int i = 0; i < QB; ++i) acc[i] = I16::zero();
      ITERSERVE_UNROLL for (int c = 0; c < kSpan<NC>; ++c) {
        const I16 k = widen_i8_pairs(key + 32 * c);
        ITERSERVE_UNROLL for (int i = 0; i < QB; ++i)
          acc[i] = dot_i16(acc[i], k, I16::load(q.words + (m0 + i) * 32 * NC + 32 * (c0 + c)));
      }
      ITERSERVE_UNROLL for (int i = 0; i < QB; ++i)
        dots[i * kTile + j] = first ? to_float(acc[i]) : dots[i * kTile + j] + to_float(acc[i]);
    }
  });
  alignas(64) float scales[kTile];
  for (int j = 0; j < kTile; ++j) scales[j] = row_scale(cache + off[j], 32 * NC);
  const F16 vscales = F16::load(scales);
  ITERSERVE_UNROLL for (int i = 0; i < QB; ++i)
    (reduce16(&dots[i * kTile]) * vscales * F16::splat(q.scales[m0 + i])).store(S + i * ldS);
}

// ---- 2. softmax over one query's keys [a, b) of a partition's n16 (padded) scores ----------

// Scores become exp(scale * s - max) inside [a, b) and 0 outside (with a soft-cap, scale * s
// is capped first: every partition of a query caps alike, so their merge holds); returns
// (max, sum).
inline void softmax_row(float* s, int64_t n16, int64_t a, int64_t b, float scale, float softcap,
                        float* max_out, float* sum_out) {
  if (a >= b) {  // none of this query's keys fall in the partition
    std::memset(s, 0, n16 * sizeof(float));
    *max_out = -std::numeric_limits<float>::infinity();
    *sum_out = 0.0f;
    return;
  }
  static constexpr float kLaneIndex[kTile] = {0, 1, 2,  3,  4,  5,  6,  7,
                                              8, 9, 10, 11, 12, 13, 14, 15};
  const F16 lanes = F16::load(kLaneIndex);
  const F16 fa = F16::splat(static_cast<float>(a)), fb = F16::splat(static_cast<float>(b));
  // Lanes of tile t outside [a, b) replaced by `fill` (indices are small: exact in fp32).
  const auto outside = [&](int64_t t, const F16& x, const F16& fill) {
    if (t >= a && t + kTile <= b) return x;  // whole tile inside
    const F16 idx = lanes + F16::splat(static_cast<float>(t));
    return select(less_than(idx, fb), fill, select(less_than(idx, fa), x, fill));
  };
  const int64_t t0 = a & ~int64_t{15}, t1 = (b + 15) & ~int64_t{15};
  if (softcap > 0.0f) {
    // Gemma 2: scores -> softcap * tanh(scale * s / softcap), the softmax's input as it stands.
    const F16 inv = F16::splat(scale / softcap), cap = F16::splat(softcap);
    for (int64_t t = t0; t < t1; t += kTile) (cap * tanh(F16::load(s + t) * inv)).store(s + t);
    scale = 1.0f;
  }
  const F16 vscale = F16::splat(scale);
  const F16 ninf = F16::splat(-std::numeric_limits<float>::infinity());
  F16 vmax = ninf;
  for (int64_t t = t0; t < t1; t += kTile)
    vmax = maximum(vmax, outside(t, F16::load(s + t) * vscale, ninf));
  const float mx = vmax.max();
  const F16 neg_mx = F16::splat(-mx);
  F16 vsum = F16::zero();
  for (int64_t t = 0; t < n16; t += kTile) {
    if (t < t0 || t >= t1) {
      F16::zero().store(s + t);
      continue;
    }
    const F16 e = outside(t, exp_nonpositive(fmadd(F16::load(s + t), vscale, neg_mx)), F16::zero());
    vsum = vsum + e;
    e.store(s + t);
  }
  *max_out = mx;
  *sum_out = vsum.sum();
}

// ---- 3. P.V: acc[i][:] = sum_k P[i][k] * v_k for a block of MB queries ----------------------

// A V row as fp32 is 2 * NC pieces of 16 lanes. For bf16, piece 2c holds the even dims of
// the 32-dim chunk c and piece 2c + 1 the odd ones (a shift or a mask, no shuffles;
// `store_row` puts them back in order); fp32 pieces are the dims as they lie.
inline F16 widen_piece(const BFloat16* row, int piece) {
  const I16 bits = I16::load(row + 32 * (piece / 2));
  return bits_to_float(piece % 2 == 0 ? shift_left<16>(bits)
                                      : bits & I16::splat(static_cast<int32_t>(0xFFFF0000u)));
}
inline F16 widen_piece(const float* row, int piece) { return F16::load(row + 16 * piece); }
inline F16 widen_piece(const int8_t* row, int piece) { return load_i8x16(row + 16 * piece); }

// A P.V block keeps MB queries' accumulators for PB pieces of the row in registers. AVX-512's
// 32 registers take the whole row (PB = 2 * NC) for 12 / NC queries, a wider row's span at
// a time (512: 4 pieces, kSpan) for one. AVX2's 16 ymm (and NEON's 32 q registers: 8 F16s
// either way) take one piece for 4 queries (4 accumulators, the widened piece, 4
// probabilities: 14 ymm). A whole 32-dim chunk for 3 queries needs 17: the
// accumulator spilled then chains every key through a store and a reload, and a decode step
// measured ~15% slower than walking the V rows once per piece (each row is read 2 * NC times,
// from L1 or L2 after the first).
template <int NC>
constexpr int kPvPieces = kParts == 1 ? 2 * kSpan<NC> : 1;
template <int NC>
constexpr int kPvQueries = kParts == 1 ? (NC >= 12 ? 1 : 12 / NC) : 4;

// MB queries' sums over n keys, PB pieces of the row at a time, into acc_out [MB, 32 * NC].
// An int8 V row's scale multiplies its probabilities (p_k s_k) as the row is read, so that
// P.V runs on the int8 values as they are; the softmax sums stay those of the p_k. (Reading
// the scales in a pass of their own touched every V row before its prefetch: 15% of an
// int8 pool's attention at batch 64, benchmarks/attention_kernel.py --int8-cache.)
template <typename C, int NC, int MB>
inline void pv_block(const C* cache, const int64_t* off, int64_t n, const float* P, int64_t ldP,
                     float* acc_out) {
  constexpr int PB = kPvPieces<NC>;
  static_assert(2 * kSpan<NC> % PB == 0, "a span is whole blocks of pieces");
  for_each_span<NC>([&](int c0, bool) {
    ITERSERVE_UNROLL for (int r0 = 2 * c0; r0 < 2 * (c0 + kSpan<NC>); r0 += PB) {
      auto acc = zeros<MB * PB>();  // [MB][PB]
      for (int64_t k = 0; k < n; ++k) {
        if (r0 == 0 && k + kPrefetchKeys < n)  // the later passes find the rows in cache
          prefetch_row(cache + off[k + kPrefetchKeys], row_bytes<C>(32 * NC));
        auto v = zeros<PB>();
        ITERSERVE_UNROLL for (int r = 0; r < PB; ++r) v[r] = widen_piece(cache + off[k], r0 + r);
        float row_weight = 1.0f;
        if constexpr (std::is_same_v<C, int8_t>) row_weight = row_scale(cache + off[k], 32 * NC);
        ITERSERVE_UNROLL for (int i = 0; i < MB; ++i) {
          const F16 p = F16::splat(std::is_same_v<C, int8_t> ? P[i * ldP + k] * row_weight
                                                             : P[i * ldP + k]);
          ITERSERVE_UNROLL for (int r = 0; r < PB; ++r)
            acc[i * PB + r] = fmadd(v[r], p, acc[i * PB + r]);
        }
      }
      ITERSERVE_UNROLL for (int i = 0; i < MB; ++i)
        ITERSERVE_UNROLL for (int r = 0; r < PB; ++r)
          acc[i * PB + r].store(acc_out + i * 32 * NC + 16 * (r0 + r));
    }
  });
}

// ---- 4. output rows -----------------------------------------------------------------------

// Lanes of `even` and `odd` interleaved: (e0 o0 e1 o1 .. e7 o7), (e8 o8 .. e15 o15).
inline std::pair<F16, F16> interleave(const F16& even, const F16& odd) {
  Vec parts[2 * kParts];
  for (int i = 0; i < kParts; ++i)
    std::tie(parts[2 * i], parts[2 * i + 1]) = at::vec::interleave2(even.v[i], odd.v[i]);
  F16 first, second;
  for (int i = 0; i < kParts; ++i) {
    first.v[i] = parts[i];
    second.v[i] = parts[kParts + i];
  }
  return {first, second};
}

// acc (fp32, in the order widen_piece left it for a cache of type C: even and odd dims apart
// for bf16, as they lie otherwise) * inv -> one row of out, rounded once.
template <typename C, int NC>
inline void store_row(BFloat16* dst, const float* acc, float inv) {
  const F16 vinv = F16::splat(inv);
  for (int c = 0; c < NC; ++c) {
    F16 first = F16::load(acc + 32 * c) * vinv, second = F16::load(acc + 32 * c + 16) * vinv;
    if constexpr (std::is_same_v<C, BFloat16>) std::tie(first, second) = interleave(first, second);
    store_bf16x16(dst + 32 * c, first);
    store_bf16x16(dst + 32 * c + 16, second);
  }
}

template <typename C, int NC>
inline void store_row(float* dst, const float* acc, float inv) {
  const F16 vinv = F16::splat(inv);
  for (int c = 0; c < 2 * NC; ++c) (F16::load(acc + 16 * c) * vinv).store(dst + 16 * c);
}

// Per-thread scratch, kept between calls (sizes only grow), so steady state allocates nothing.
struct Scratch {
  std::vector<int64_t> offsets;   // [part_keys + 16] element offsets of the keys' rows
  std::vector<float> scores;      // [M, round_up(part_keys, 16)]
  std::vector<float> acc;         // [M, head_dim]
  std::vector<float> maxima, sums;
  std::vector<int16_t> q16_words;  // kInt16Queries: [M, head_dim] the queries on the grid
  std::vector<float> q16_scales;   // [M]
  std::vector<const void*> queries;
  // [M, head_dim / 32] the queries as the score tree takes them
  std::vector<QueryChunk<BFloat16, BFloat16>> bf16_queries;
  std::vector<Halves> f32_queries;
  void fit(int64_t M, int64_t keys16, int64_t head_dim) {
    if (offsets.size() < static_cast<size_t>(keys16 + kTile)) offsets.resize(keys16 + kTile);
    if (scores.size() < static_cast<size_t>(M * keys16)) scores.resize(M * keys16);
    if (acc.size() < static_cast<size_t>(M * head_dim)) acc.resize(M * head_dim);
    if (maxima.size() < static_cast<size_t>(M)) maxima.resize(M), sums.resize(M);
    if (queries.size() < static_cast<size_t>(M)) queries.resize(M);
  }
  template <typename QC>
  QC* query_chunks(int64_t M, int64_t head_dim) {
    auto& chunks = [this]() -> auto& {
      if constexpr (std::is_same_v<QC, Halves>) return f32_queries;
      else return bf16_queries;
    }();
    if (chunks.size() < static_cast<size_t>(M * head_dim / 32)) chunks.resize(M * head_dim / 32);
    return chunks.data();
  }
};

inline void key_offsets(const int32_t* table, int64_t head_base, int64_t block_size,
                        int64_t row_stride, int64_t k0, int64_t n, int64_t* out) {
  int64_t b = k0 / block_size, in_block = k0 % block_size;
  int64_t base = (head_base + table[b]) * block_size;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = (base + in_block) * row_stride;
    if (++in_block == block_size && i + 1 < n) {
      in_block = 0;
      base = (head_base + table[++b]) * block_size;
    }
  }
}

template <typename T, typename C, int NC>
void merge_partitions(const Plan& plan, const Group& g, std::vector<float>& acc) {
  const int64_t D = plan.head_dim, M = g.rows * plan.group_size;
  T* out = static_cast<T*>(plan.out);
  for (int64_t m = 0; m < M; ++m) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < g.parts; ++p)
      top = std::max(top, plan.partial_max[g.slot + p * M + m]);
    std::fill(acc.begin(), acc.begin() + D, 0.0f);
    float total = 0.0f;
    for (int64_t p = 0; p < g.parts; ++p) {
      const int64_t slot = g.slot + p * M + m;
      if (plan.partial_sum[slot] == 0.0f) continue;  // no keys of this query in the partition
      const float w = std::exp(plan.partial_max[slot] - top);
      total += w * plan.partial_sum[slot];
      const F16 vw = F16::splat(w);
      const float* part = plan.partial_acc + slot * D;
      for (int64_t d = 0; d < D; d += 16)
        fmadd(F16::load(part + d), vw, F16::load(acc.data() + d)).store(acc.data() + d);
    }
    const int64_t row = g.row0 + m / plan.group_size;
    const int64_t head = g.kv_head * plan.group_size + m % plan.group_size;
    store_row<C, NC>(out + (row * plan.num_heads + head) * D, acc.data(),
                     1.0f / with_sink(plan, head, total, top));
  }
}

// The first keys an item will read, asked for while the previous item still computes.
template <typename C>
void prefetch_item(const Plan& plan, const Item& item) {
  const Group& g = plan.groups[item.group];
  const int64_t k0 = g.key_lo + item.part * plan.part_keys;
  const int64_t n = std::min({g.key_hi - k0, plan.part_keys, kPrefetchKeys});
  int64_t off[kPrefetchKeys];
  key_offsets(plan.tables + g.seq * plan.table_stride, g.kv_head * plan.num_blocks,
              plan.block_size, plan.row_stride, k0, n, off);
  const C* keys = static_cast<const C*>(plan.key_cache);
  for (int64_t i = 0; i < n; ++i) prefetch_row(keys + off[i], row_bytes<C>(plan.head_dim));
}

// The item's M queries on the 16-bit grid, in the scratch: q16 = round(q * (32767 / max|q|)),
// half to even, computed in fp32.
inline Int16Queries quantize_queries(const BFloat16* const* qp, int M, int64_t D, Scratch& sc) {
  if (sc.q16_words.size() < static_cast<size_t>(M * D)) sc.q16_words.resize(M * D);
  if (sc.q16_scales.size() < static_cast<size_t>(M)) sc.q16_scales.resize(M);
  alignas(64) int32_t lanes[kTile];
  for (int m = 0; m < M; ++m) {
    F16 amax = F16::zero();
    for (int64_t d = 0; d < D; d += 16) amax = maximum(amax, abs(load_bf16x16(qp[m] + d)));
    const float top = amax.max();
    const F16 inv = F16::splat(top > 0.0f ? 32767.0f / top : 0.0f);
    for (int64_t d = 0; d < D; d += 16) {
      round_to_int(load_bf16x16(qp[m] + d) * inv).store(lanes);
      for (int j = 0; j < kTile; ++j) sc.q16_words[m * D + d + j] = static_cast<int16_t>(lanes[j]);
    }
    sc.q16_scales[m] = top / 32767.0f;
  }
  return {sc.q16_words.data(), sc.q16_scales.data()};
}

// ---- one item ----------------------------------------------------------------------------

// T: the type of q and out (the model's); C: the cache's (T, or int8).
template <typename T, typename C, int NC>
void run_item(const Plan& plan, const Item& item, const Item* next, bool first, Scratch& sc) {
  const Group& g = plan.groups[item.group];
  const int64_t D = plan.head_dim, G = plan.group_size;
  const int M = static_cast<int>(g.rows * G);
  const int64_t k0 = g.key_lo + item.part * plan.part_keys;
  const int64_t n = std::min(g.key_hi, k0 + plan.part_keys) - k0;
  const int64_t n16 = (n + kTile - 1) / kTile * kTile;
  sc.fit(M, n16, D);

  const T* q = static_cast<const T*>(plan.q);
  const T** qp = reinterpret_cast<const T**>(sc.queries.data());
  QueryChunk<T, C>* qc = sc.query_chunks<QueryChunk<T, C>>(M, D);
  for (int m = 0; m < M; ++m) {
    qp[m] = q + (g.row0 + m / G) * plan.q_row_stride + (g.kv_head * G + m % G) * plan.q_head_stride;
    if constexpr (!kInt16Queries<T, C>)
      for (int c = 0; c < NC; ++c) qc[m * NC + c] = make_query_chunk<T, C>(qp[m] + 32 * c);
  }

  int64_t* off = sc.offsets.data();
  key_offsets(plan.tables + g.seq * plan.table_stride, g.kv_head * plan.num_blocks,
              plan.block_size, plan.row_stride, k0, n, off);
  for (int64_t i = n; i < n16; ++i) off[i] = off[0];  // pad the last tile with a real row

  // 1. scores
  const C* keys = static_cast<const C*>(plan.key_cache);
  const C* values = static_cast<const C*>(plan.value_cache);
  const int64_t bytes = row_bytes<C>(D);
  float* S = sc.scores.data();
  if (first)  // later items were prefetched by the one before
    for (int64_t t = 0; t < std::min(n, kPrefetchKeys); ++t) prefetch_row(keys + off[t], bytes);
  Int16Queries q16{};
  if constexpr (kInt16Queries<T, C>) q16 = quantize_queries(qp, M, D, sc);
  for (int64_t t = 0; t < n16; t += kTile) {
    for (int64_t k = t + kPrefetchKeys; k < std::min(n, t + kPrefetchKeys + kTile); ++k)
      prefetch_row(keys + off[k], bytes);
    if constexpr (kInt16Queries<T, C>) {
      for_each_query_block<kInt16QueryBlock>(M, [&](int m, auto qb) {
        scores_int16_queries<NC, decltype(qb)::value>(keys, off + t, q16, m, S + m * n16 + t, n16);
      });
    } else {
      for_each_query_block<kTreeQueries<C>>(M, [&](int m, auto qb) {
        scores_tree<C, QueryChunk<T, C>, NC, decltype(qb)::value>(keys, off + t, qc + m * NC,
                                                                  S + m * n16 + t, n16);
      });
    }
  }

  // 2. softmax, each query over its own window (while the first V rows arrive)
  for (int64_t t = 0; t < std::min(n, kPrefetchKeys); ++t) prefetch_row(values + off[t], bytes);
  for (int m = 0; m < M; ++m) {
    const auto [lo, hi] = key_window(g.first_pos + m / G, plan.window);
    const int64_t a = std::clamp<int64_t>(lo - k0, 0, n), b = std::clamp<int64_t>(hi - k0, 0, n);
    softmax_row(S + m * n16, n16, a, b, plan.scale, plan.softcap, &sc.maxima[m], &sc.sums[m]);
  }

  // 3. P.V, in blocks of queries whose accumulators fit the registers
  if (next != nullptr) prefetch_item<C>(plan, *next);
  for_each_query_block<kPvQueries<NC>>(M, [&](int m, auto mb) {
    pv_block<C, NC, decltype(mb)::value>(values, off, n, S + m * n16, n16, sc.acc.data() + m * D);
  });

  // 4. out, or this partition's share of it
  if (g.parts == 1) {
    T* out = static_cast<T*>(plan.out);
    for (int m = 0; m < M; ++m) {
      const int64_t row = g.row0 + m / G, head = g.kv_head * G + m % G;
      store_row<C, NC>(out + (row * plan.num_heads + head) * D, sc.acc.data() + m * D,
                       1.0f / with_sink(plan, head, sc.sums[m], sc.maxima[m]));
    }
    return;
  }
  const int64_t slot = g.slot + item.part * M;
  std::memcpy(plan.partial_acc + slot * D, sc.acc.data(), M * D * sizeof(float));
  std::memcpy(plan.partial_max + slot, sc.maxima.data(), M * sizeof(float));
  std::memcpy(plan.partial_sum + slot, sc.sums.data(), M * sizeof(float));
  // acq_rel: the last finisher sees every other partition's writes.
  if (plan.done[item.group].fetch_add(1, std::memory_order_acq_rel) == g.parts - 1)
    merge_partitions<T, C, NC>(plan, g, sc.acc);
}

template <typename T, typename C, int NC>
void run_plan(const Plan& plan, bool parallel) {
  const int64_t count = static_cast<int64_t>(plan.items.size());
  if (!parallel) {  // in order, so each wave ends before the next takes its slots
    thread_local Scratch sc;
    for (int64_t i = 0; i < count; ++i)
      run_item<T, C, NC>(plan, plan.items[i], i + 1 < count ? &plan.items[i + 1] : nullptr,
                         i == 0, sc);
    return;
  }
  int64_t begin = 0;
  for (const int64_t end : plan.wave_ends) {
    std::atomic<int64_t> next{begin};
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), end - begin);
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      thread_local Scratch sc;
      // Claim the next item before running this one, so its first rows can be prefetched.
      int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      for (bool first = true; i < end; first = false) {
        const int64_t j = next.fetch_add(1, std::memory_order_relaxed);
        run_item<T, C, NC>(plan, plan.items[i], j < end ? &plan.items[j] : nullptr, first, sc);
        i = j;
      }
    });
    begin = end;
  }
}

// The plan's head size among those built (attention_plan.h `BuiltHeadDims`), 32 dims a chunk.
template <typename T, typename C, int64_t... D>
void run_plan_for_head_dim(const Plan& plan, bool parallel, std::integer_sequence<int64_t, D...>) {
  const bool ran =
      ((plan.head_dim == D && (run_plan<T, C, static_cast<int>(D / 32)>(plan, parallel), true)) ||
       ...);
  TORCH_CHECK(ran, "paged_attention: head_dim ", plan.head_dim, " is not built");
}

template <typename T>
void run_items(const Plan& plan, bool int8_cache, bool parallel) {
  if (int8_cache) run_plan_for_head_dim<T, int8_t>(plan, parallel, BuiltHeadDims{});
  else run_plan_for_head_dim<T, T>(plan, parallel, BuiltHeadDims{});
}

}  // namespace iterserve::attention
