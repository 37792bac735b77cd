// The vector layer every kernel file is written in: 16 fp32 lanes (`F16`) and 16 int32 lanes
// (`I16`) made of however many of the CPU's own vectors that takes (one zmm on AVX-512, two
// ymm on AVX2, four q registers on Arm NEON), on top of torch's `at::vec::Vectorized`.
//
// The kernels' tiles are 16 outputs or 16 keys wide on every CPU, so one weight layout and one
// kernel source serve every ISA; the compiler keeps an F16 in 1, 2 or 4 registers. The build
// (kernels/__init__.py) compiles this source once per ISA with that ISA's flags and
// CPU_CAPABILITY, which selects at::vec's implementation.
//
// Most operations are at::vec's. Written per ISA here, where at::vec has no equivalent:
//   - `pair_dot`: 16 outputs += w(2 inputs) . x(2 inputs) for bf16 weight pairs. AVX-512 BF16
//     has an instruction for it (`vdpbf16ps`); elsewhere the pair is widened to two fp32
//     vectors (a shift and a mask) and takes two FMAs.
//   - the int8 dot products of weights kept in GGUF blocks (`dot_u8`, `dot_s8`): VNNI
//     `vpdpbusd` with AVX-512 VNNI or AVX-VNNI, `vpmaddubsw` + `vpmaddwd` on AVX2, `sdot` on
//     Arm with the dot-product extension, a plain loop elsewhere; and `lookup16` (a byte
//     table, for the IQ4 formats' values).
//   - lane-wise bit tricks that at::vec spells slowly (bf16 <-> fp32, sums across lanes).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cstdint>
#include <utility>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#define ITERSERVE_ARM_DOT 1  // sdot: four int8 products a 32-bit lane an instruction
#endif

// Every primitive is forced inline: GCC otherwise keeps some as calls from the big kernel
// loops, and a call there sends the accumulators through memory (measured: the AVX2 bf16
// projection at 4 rows ran 4x slower than at 1 row). The generic build (no vector ISA:
// at::vec's scalar loops) has no vector registers to keep accumulators in, and forced
// inlining and full unrolls (ITERSERVE_UNROLL below) only multiply its compile time there
// (the attention loops: minutes), so it leaves both to the compiler.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2) || defined(__aarch64__)
#define ITERSERVE_VECTOR_BUILD 1
#define ITERSERVE_INLINE inline __attribute__((always_inline))
#define ITERSERVE_INLINE_LAMBDA __attribute__((always_inline))
#else
#define ITERSERVE_INLINE inline
#define ITERSERVE_INLINE_LAMBDA
#endif

namespace iterserve {

using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;

constexpr int kLanes = 16;
constexpr int kNative = Vec::size();
static_assert(kLanes % kNative == 0, "16 lanes must be whole native vectors");
constexpr int kParts = kLanes / kNative;

// The CPU has bf16 pair dot products (vdpbf16ps): the bf16 paths use them directly.
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// The name of the ISA this file was compiled for (reported by the `isa` op).
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
constexpr const char* kIsaName = "avx512bf16";
#elif defined(__AVX512VNNI__) && defined(CPU_CAPABILITY_AVX512)
constexpr const char* kIsaName = "avx512vnni";
#elif defined(CPU_CAPABILITY_AVX512)
constexpr const char* kIsaName = "avx512";
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVXVNNI__)
constexpr const char* kIsaName = "avx2vnni";
#elif defined(CPU_CAPABILITY_AVX2)
constexpr const char* kIsaName = "avx2";
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
constexpr const char* kIsaName = "neondot";
#elif defined(__aarch64__)
constexpr const char* kIsaName = "neon";
#else
constexpr const char* kIsaName = "generic";
#endif

struct I16;

// 16 fp32 lanes.
struct F16 {
  Vec v[kParts];

  ITERSERVE_INLINE static F16 zero() { return splat(0.0f); }
  ITERSERVE_INLINE static F16 splat(float x) {
    F16 r;
    for (int i = 0; i < kParts; ++i) r.v[i] = Vec(x);
    return r;
  }
  ITERSERVE_INLINE static F16 load(const float* p) {
    F16 r;
    for (int i = 0; i < kParts; ++i) r.v[i] = Vec::loadu(p + i * kNative);
    return r;
  }
  ITERSERVE_INLINE void store(float* p) const {
    for (int i = 0; i < kParts; ++i) v[i].store(p + i * kNative);
  }
  // The sum and the maximum of the 16 lanes (a shuffle tree on x86 and Arm).
  ITERSERVE_INLINE float sum() const {
    Vec s = v[0];
    for (int i = 1; i < kParts; ++i) s = s + v[i];
    return at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, s);
  }
  ITERSERVE_INLINE float max() const {
    Vec s = v[0];
    for (int i = 1; i < kParts; ++i) s = at::vec::maximum(s, v[i]);
    return at::vec::vec_reduce_all<float>(
        [](const Vec& x, const Vec& y) { return at::vec::maximum(x, y); }, s);
  }
};

// 16 int32 lanes (bit patterns, quantized sums).
struct I16 {
  IVec v[kParts];

  ITERSERVE_INLINE static I16 zero() { return splat(0); }
  ITERSERVE_INLINE static I16 splat(int32_t x) {
    I16 r;
    for (int i = 0; i < kParts; ++i) r.v[i] = IVec(x);
    return r;
  }
  ITERSERVE_INLINE static I16 load(const void* p) {
    I16 r;
    for (int i = 0; i < kParts; ++i)
      r.v[i] = IVec::loadu(static_cast<const int32_t*>(p) + i * kNative);
    return r;
  }
  ITERSERVE_INLINE void store(void* p) const {
    for (int i = 0; i < kParts; ++i) v[i].store(static_cast<int32_t*>(p) + i * kNative);
  }
  // The sum of the 16 lanes: a shuffle tree on x86, where a store and 16 reloads (waiting on
  // it) made quantize_row 3% of a 1B's batch-16 step (perf, 2026-11-30, avx512bf16).
  ITERSERVE_INLINE int32_t sum() const {
#if defined(CPU_CAPABILITY_AVX512)
    return _mm512_reduce_add_epi32(v[0]);
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i both = _mm256_add_epi32(v[0], v[1]);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
#else
    alignas(64) int32_t lanes[kLanes];
    store(lanes);
    int32_t s = 0;
    for (int i = 0; i < kLanes; ++i) s += lanes[i];
    return s;
#endif
  }
};

#define ITERSERVE_LANEWISE(T, name, expr)        \
  ITERSERVE_INLINE T name(const T& a, const T& b) {  \
    T r;                                         \
    for (int i = 0; i < kParts; ++i) r.v[i] = (expr); \
    return r;                                    \
  }
ITERSERVE_LANEWISE(F16, operator+, a.v[i] + b.v[i])
ITERSERVE_LANEWISE(F16, operator-, a.v[i] - b.v[i])
ITERSERVE_LANEWISE(F16, operator*, a.v[i] * b.v[i])
ITERSERVE_LANEWISE(F16, operator/, a.v[i] / b.v[i])
ITERSERVE_LANEWISE(F16, maximum, at::vec::maximum(a.v[i], b.v[i]))
ITERSERVE_LANEWISE(F16, minimum, at::vec::minimum(a.v[i], b.v[i]))
ITERSERVE_LANEWISE(I16, operator+, a.v[i] + b.v[i])
ITERSERVE_LANEWISE(I16, operator-, a.v[i] - b.v[i])
ITERSERVE_LANEWISE(I16, operator&, a.v[i] & b.v[i])
ITERSERVE_LANEWISE(I16, operator|, a.v[i] | b.v[i])
#undef ITERSERVE_LANEWISE

// (a & mask) | b in one instruction where there is one (vpternlogd), for building numbers
// from bit fields.
ITERSERVE_INLINE I16 and_or(const I16& a, const I16& mask, const I16& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return I16{{IVec(_mm512_ternarylogic_epi32(a.v[0], mask.v[0], b.v[0], 0xEA))}};
#else
  return (a & mask) | b;
#endif
}

// Arrays of accumulators must end up in registers. GCC keeps such an array in memory (a store
// and a reload per use) unless every loop indexing it is unrolled in full early, hence
// ITERSERVE_UNROLL on those loops, and unless it is built without a loop: `F16 acc[N];` runs
// each element's constructor (at::vec zeroes a vector) in one, so arrays are `zeros<N>()`.
#ifdef ITERSERVE_VECTOR_BUILD
#define ITERSERVE_UNROLL _Pragma("GCC unroll 32")
#else
#define ITERSERVE_UNROLL
#endif

template <int... I>
ITERSERVE_INLINE std::array<F16, sizeof...(I)> zeros(std::integer_sequence<int, I...>) {
  return {{((void)I, F16::zero())...}};
}
template <int N>
ITERSERVE_INLINE std::array<F16, N> zeros() {
  return zeros(std::make_integer_sequence<int, N>{});
}

// a * b + c, one rounding.
ITERSERVE_INLINE F16 fmadd(const F16& a, const F16& b, const F16& c) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = at::vec::fmadd(a.v[i], b.v[i], c.v[i]);
  return r;
}

ITERSERVE_INLINE F16 abs(const F16& a) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = a.v[i].abs();
  return r;
}

ITERSERVE_INLINE F16 floor(const F16& a) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = a.v[i].floor();
  return r;
}

// Lanes where `mask` is all ones take b, the others a (masks come from the comparisons).
ITERSERVE_INLINE F16 select(const F16& mask, const F16& a, const F16& b) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = Vec::blendv(a.v[i], b.v[i], mask.v[i]);
  return r;
}
ITERSERVE_INLINE F16 less_than(const F16& a, const F16& b) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = a.v[i] < b.v[i];
  return r;
}

// Shifts by a constant (at::vec's operators shift by a vector of counts, which costs a
// register to hold them).
template <int N>
ITERSERVE_INLINE I16 shift_left(const I16& a) {
#if defined(CPU_CAPABILITY_AVX512)
  return I16{{IVec(_mm512_slli_epi32(a.v[0], N))}};
#elif defined(CPU_CAPABILITY_AVX2)
  I16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = IVec(_mm256_slli_epi32(a.v[i], N));
  return r;
#else
  I16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = a.v[i] << IVec(N);
  return r;
#endif
}
// Logical (zero-filling) right shift by a constant.
template <int N>
ITERSERVE_INLINE I16 shift_right(const I16& a) {
#if defined(CPU_CAPABILITY_AVX512)
  return I16{{IVec(_mm512_srli_epi32(a.v[0], N))}};
#elif defined(CPU_CAPABILITY_AVX2)
  I16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = IVec(_mm256_srli_epi32(a.v[i], N));
  return r;
#else
  alignas(64) uint32_t lanes[kLanes];
  a.store(lanes);
  for (int i = 0; i < kLanes; ++i) lanes[i] >>= N;
  return I16::load(lanes);
#endif
}
// Arithmetic (sign-filling) right shift.
template <int N>
ITERSERVE_INLINE I16 shift_right_signed(const I16& a) {
#if defined(CPU_CAPABILITY_AVX512)
  return I16{{IVec(_mm512_srai_epi32(a.v[0], N))}};
#elif defined(CPU_CAPABILITY_AVX2)
  I16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = IVec(_mm256_srai_epi32(a.v[i], N));
  return r;
#else
  I16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = a.v[i] >> IVec(N);
  return r;
#endif
}

ITERSERVE_INLINE F16 bits_to_float(const I16& a) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = at::vec::cast<float>(a.v[i]);
  return r;
}
ITERSERVE_INLINE I16 float_to_bits(const F16& a) {
  I16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = at::vec::cast<int32_t>(a.v[i]);
  return r;
}
// int32 -> fp32 values.
ITERSERVE_INLINE F16 to_float(const I16& a) {
  F16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = at::vec::convert<float>(a.v[i]);
  return r;
}
// fp32 -> int32, rounding half to even (as torch.round does).
ITERSERVE_INLINE I16 round_to_int(const F16& a) {
  I16 r;
  for (int i = 0; i < kParts; ++i) r.v[i] = at::vec::convert_to_int_of_same_size(a.v[i].round());
  return r;
}

// ---- bf16 and fp16 ------------------------------------------------------------------------

// 16 bf16 values <-> 16 fp32 lanes (widening is exact; narrowing rounds to nearest even).
ITERSERVE_INLINE F16 load_bf16x16(const c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return F16{{Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)))}};
#elif defined(CPU_CAPABILITY_AVX2)
  F16 r;
  for (int i = 0; i < 2; ++i) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * i));
    r.v[i] = Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
  return r;
#elif defined(__aarch64__)
  const auto* halves = reinterpret_cast<const uint16_t*>(p);
  I16 bits;
  for (int i = 0; i < kParts; ++i)
    bits.v[i] = IVec(vreinterpretq_s32_u32(vshll_n_u16(vld1_u16(halves + 4 * i), 16)));
  return bits_to_float(bits);
#else
  alignas(64) uint32_t lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = static_cast<uint32_t>(p[i].x) << 16;
  return bits_to_float(I16::load(lanes));
#endif
}

// Round each lane to bf16 (nearest even; NaN stays NaN), as bits in the high half of a lane.
ITERSERVE_INLINE I16 bf16_bits(const F16& a) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  const __m256i packed = (__m256i)_mm512_cvtneps_pbh(a.v[0]);
  return I16{{IVec(_mm512_slli_epi32(_mm512_cvtepu16_epi32(packed), 16))}};
#else
  const I16 bits = float_to_bits(a);
  // Round to nearest even: add 0x7FFF plus the lowest kept bit, then drop the low half.
  const I16 lsb = shift_right<16>(bits) & I16::splat(1);
  I16 rounded = (bits + I16::splat(0x7FFF) + lsb) & I16::splat(static_cast<int32_t>(0xFFFF0000u));
  // NaN: keep it a (quiet) NaN rather than let the carry turn it into infinity.
  F16 r;
  for (int i = 0; i < kParts; ++i) {
    const Vec nan = a.v[i] != a.v[i];
    r.v[i] = Vec::blendv(at::vec::cast<float>(rounded.v[i]), Vec(std::numeric_limits<float>::quiet_NaN()), nan);
  }
  return float_to_bits(r);
#endif
}

// bf16 rounding of each lane, kept in fp32 (what storing and reloading would give).
ITERSERVE_INLINE F16 round_bf16(const F16& a) { return bits_to_float(bf16_bits(a)); }

ITERSERVE_INLINE void store_bf16x16(c10::BFloat16* p, const F16& a) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(a.v[0]));
#elif defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(a).v[0], 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const I16 bits = shift_right<16>(bf16_bits(a));
  // packus saturates to 0..65535 per 128-bit lane: the halves come out interleaved.
  const __m256i packed = _mm256_packus_epi32(bits.v[0], bits.v[1]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
#else
  alignas(64) uint32_t lanes[kLanes];
  bf16_bits(a).store(lanes);
  for (int i = 0; i < kLanes; ++i) p[i].x = static_cast<uint16_t>(lanes[i] >> 16);
#endif
}

ITERSERVE_INLINE F16 load_f16x16(const c10::Half* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return F16{{Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))))}};
#elif defined(CPU_CAPABILITY_AVX2)
  F16 r;
  for (int i = 0; i < 2; ++i)
    r.v[i] = Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * i))));
  return r;
#else
  alignas(64) float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(p[i]);
  return F16::load(lanes);
#endif
}

// 16 int8 values as fp32 lanes.
ITERSERVE_INLINE F16 load_i8x16(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return F16{{Vec(_mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))))}};
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return F16{{Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw))),
              Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))))}};
#else
  alignas(64) float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(p[i]);
  return F16::load(lanes);
#endif
}

// ---- bf16 pair dot products ---------------------------------------------------------------

// 16 lanes of bf16 pairs (lane j: the weights of output j for two consecutive inputs, the
// first in the low half), ready for `pair_dot`. With bf16 dot products the raw bits; otherwise
// widened once to fp32 (even = first input, odd = second), so that several rows reuse them.
struct Pairs {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  __m512bh raw;
#else
  F16 even, odd;
#endif
};

ITERSERVE_INLINE Pairs pairs_from_bits(const I16& bits) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  return Pairs{(__m512bh)(__m512i)bits.v[0]};
#else
  return Pairs{bits_to_float(shift_left<16>(bits)),
               bits_to_float(bits & I16::splat(static_cast<int32_t>(0xFFFF0000u)))};
#endif
}

ITERSERVE_INLINE Pairs load_pairs(const c10::BFloat16* p) { return pairs_from_bits(I16::load(p)); }

// Two consecutive activations, as `pair_dot` takes them.
struct XPair {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  __m512bh raw;
#else
  F16 first, second;
#endif
};

ITERSERVE_INLINE XPair x_pair(const c10::BFloat16* x) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  uint32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return XPair{(__m512bh)_mm512_set1_epi32(static_cast<int>(bits))};
#else
  return XPair{F16::splat(static_cast<float>(x[0])), F16::splat(static_cast<float>(x[1]))};
#endif
}

// Two consecutive activations already widened to fp32 (the portable path widens a step's
// rows once, not once per weight tile).
ITERSERVE_INLINE XPair x_pair(const float* x) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  const uint32_t bits =
      c10::BFloat16(x[0]).x | static_cast<uint32_t>(c10::BFloat16(x[1]).x) << 16;
  return XPair{(__m512bh)_mm512_set1_epi32(static_cast<int>(bits))};
#else
  return XPair{F16::splat(x[0]), F16::splat(x[1])};
#endif
}

// acc + w.first * x.first + w.second * x.second, lane by lane.
ITERSERVE_INLINE F16 pair_dot(const F16& acc, const Pairs& w, const XPair& x) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  return F16{{Vec(_mm512_dpbf16_ps(acc.v[0], w.raw, x.raw))}};
#else
  return fmadd(w.odd, x.second, fmadd(w.even, x.first, acc));
#endif
}

// ---- int8 dot products (weights in GGUF blocks against int8 activations) --------------------

// The block formats (blocks.h) hand the kernels each chunk of 8 inputs of 16 rows as bytes, 4 a
// 32-bit lane: `lo` the chunk's inputs 0-3, `hi` its inputs 4-7, one lane a row. Activations
// come quantized to int8 (-127..127): the 8 of a chunk, read where they lie, 4 broadcast to
// every lane against lo and 4 against hi.
//
// Two kinds of weight bytes:
//   - unsigned values of at most 6 bits (0..63: Q2_K-Q6_K, Q4_x, Q5_x), zero points applied
//     by the caller through the activations' sums: `dot_u8`, on every ISA;
//   - signed bytes (-127..127: Q8_0, the IQ4 tables' values): `dot_s8`. VNNI's `vpdpbusd`
//     (AVX-512's or AVX-VNNI's) multiplies unsigned by signed bytes only, so there the
//     formats store them + 128 (kSignedBias) and the caller takes 128 * sum(x) away; AVX2 and
//     AVX-512 without VNNI move the activations' signs onto the weights (vpmaddubsw's
//     unsigned operand must be |x|); Arm's `sdot` takes signed bytes as they are.
#if defined(__AVX512VNNI__) && defined(CPU_CAPABILITY_AVX512)
#define ITERSERVE_VNNI 1
constexpr int kSignedBias = 128;
#elif defined(__AVXVNNI__) && defined(CPU_CAPABILITY_AVX2)
// AVX-VNNI: the same dot products on ymm, VEX-encoded (Intel's cores since Alder Lake and
// its E-core Xeons, which have no AVX-512; AMD's since Zen 4).
#define ITERSERVE_AVX_VNNI 1
constexpr int kSignedBias = 128;
#else
constexpr int kSignedBias = 0;
#endif
#if defined(ITERSERVE_AVX_VNNI)
constexpr bool kAvxVnni = true;
#else
constexpr bool kAvxVnni = false;
#endif

// 4 activation bytes as one int32, read where they lie: broadcast from memory (a load-port
// broadcast, or VNNI's embedded one), never through a general register, whose broadcast takes
// the vector port the kernels' other work needs.
ITERSERVE_INLINE int32_t quad_at(const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, sizeof(quad));
  return quad;
}

// Without VNNI each `dot_u8` widens its 16-bit pair sums to int32 with a `vpmaddwd`, which
// competes with the `vpmaddubsw`s for the vector multiply pipes: 6 of a chunk's 10
// instructions on AVX2 multiply. Where a format's values are small, several chunks' pair sums
// add up in 16-bit lanes first (`dot_u8_16`) and are widened once (`widen_16`): each chunk adds
// 4 products of at most max * 127 to a lane, so `chunks_in_16_bits(max)` chunks stay under the
// 32767 where they would saturate; the same integers, so the same bits. The sums are added
// with saturating adds (`vpaddsw`), which never saturate here: GCC reorders plain integer adds
// freely, and took every product of a row group before any sum (the sweep's 4 rows spilled
// 20 registers a block, 0.8x slower than widening each chunk).
#if (defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)) && \
    !defined(ITERSERVE_VNNI) && !defined(ITERSERVE_AVX_VNNI)
constexpr bool kSums16 = true;
#else
constexpr bool kSums16 = false;  // VNNI and Arm's sdot sum in int32 as they multiply
#endif
constexpr int chunks_in_16_bits(int max_value) {
  return kSums16 ? 32767 / (4 * 127 * max_value) : 1;
}

// Each 16-bit lane (two a row): its pair's products of lo with the 4 int8 at x plus its
// pair's of hi with the 4 at x + 4; kSums16 builds only.
ITERSERVE_INLINE I16 pair_sums_u8(const I16& lo, const I16& hi, const int8_t* x) {
#if defined(CPU_CAPABILITY_AVX512)
  return I16{{IVec(_mm512_add_epi16(_mm512_maddubs_epi16(lo.v[0], _mm512_set1_epi32(quad_at(x))),
                                    _mm512_maddubs_epi16(hi.v[0], _mm512_set1_epi32(quad_at(x + 4)))))}};
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i xl = _mm256_set1_epi32(quad_at(x)), xh = _mm256_set1_epi32(quad_at(x + 4));
  I16 r;
  for (int i = 0; i < 2; ++i)
    r.v[i] = IVec(_mm256_add_epi16(_mm256_maddubs_epi16(lo.v[i], xl), _mm256_maddubs_epi16(hi.v[i], xh)));
  return r;
#else
  static_assert(!kSums16);
  (void)lo, (void)hi, (void)x;
  return I16::zero();
#endif
}

// Each 16-bit lane of `acc` plus its pairs' products of lo with the 4 int8 at x
// and of hi with the 4 at x + 4; kSums16 builds only.
ITERSERVE_INLINE I16 dot_u8_16(const I16& acc, const I16& lo, const I16& hi, const int8_t* x) {
  const I16 pairs = pair_sums_u8(lo, hi, x);
  I16 r;
  for (int i = 0; i < kParts; ++i) {
#if defined(CPU_CAPABILITY_AVX512)
    r.v[i] = IVec(_mm512_adds_epi16(acc.v[i], pairs.v[i]));
#elif defined(CPU_CAPABILITY_AVX2)
    r.v[i] = IVec(_mm256_adds_epi16(acc.v[i], pairs.v[i]));
#else
    r.v[i] = acc.v[i];
#endif
  }
  return r;
}

// Each lane of `acc` plus the sum of its two 16-bit halves in `sums`.
ITERSERVE_INLINE I16 widen_16(const I16& acc, const I16& sums) {
#if defined(CPU_CAPABILITY_AVX512)
  return I16{{IVec(_mm512_add_epi32(acc.v[0], _mm512_madd_epi16(sums.v[0], _mm512_set1_epi16(1))))}};
#elif defined(CPU_CAPABILITY_AVX2)
  I16 r;
  for (int i = 0; i < 2; ++i)
    r.v[i] = IVec(_mm256_add_epi32(acc.v[i], _mm256_madd_epi16(sums.v[i], _mm256_set1_epi16(1))));
  return r;
#else
  static_assert(!kSums16);
  (void)sums;
  return acc;
#endif
}

// Each lane of `acc` plus lo's 4 bytes times the 4 int8 at x plus hi's times the 4 at x + 4,
// exactly, in int32, for unsigned weight bytes of at most 63 (any byte with VNNI). Without
// VNNI the `vpmaddubsw` pair sums reach 2 * 63 * 127 = 16002 and lo + hi 32004, under the 32767
// it saturates at, and are widened to int32 at once (`vpmaddwd`).
ITERSERVE_INLINE I16 dot_u8(const I16& acc, const I16& lo, const I16& hi, const int8_t* x) {
#if defined(ITERSERVE_VNNI)
  const __m512i sum = _mm512_dpbusd_epi32(acc.v[0], lo.v[0], _mm512_set1_epi32(quad_at(x)));
  return I16{{IVec(_mm512_dpbusd_epi32(sum, hi.v[0], _mm512_set1_epi32(quad_at(x + 4))))}};
#elif defined(CPU_CAPABILITY_AVX512)
  return widen_16(acc, pair_sums_u8(lo, hi, x));
#elif defined(ITERSERVE_AVX_VNNI)
  const __m256i xl = _mm256_set1_epi32(quad_at(x)), xh = _mm256_set1_epi32(quad_at(x + 4));
  I16 r;
  for (int i = 0; i < 2; ++i)
    r.v[i] = IVec(
        _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc.v[i], lo.v[i], xl), hi.v[i], xh));
  return r;
#elif defined(CPU_CAPABILITY_AVX2)
  return widen_16(acc, pair_sums_u8(lo, hi, x));
#elif defined(ITERSERVE_ARM_DOT)
  // Bytes of at most 63 read the same as signed: sdot's signed x signed products are exact.
  const int8x16_t xl = vreinterpretq_s8_s32(vld1q_dup_s32(reinterpret_cast<const int32_t*>(x)));
  const int8x16_t xh =
      vreinterpretq_s8_s32(vld1q_dup_s32(reinterpret_cast<const int32_t*>(x + 4)));
  I16 r;
  for (int i = 0; i < 4; ++i) {
    const int32x4_t sum = vdotq_s32(acc.v[i], vreinterpretq_s8_s32(lo.v[i]), xl);
    r.v[i] = IVec(vdotq_s32(sum, vreinterpretq_s8_s32(hi.v[i]), xh));
  }
  return r;
#else
  const int8_t *xl = x, *xh = x + 4;
  alignas(64) uint8_t wl[4 * kLanes], wh[4 * kLanes];
  alignas(64) int32_t lanes[kLanes];
  lo.store(wl);
  hi.store(wh);
  acc.store(lanes);
  for (int j = 0; j < kLanes; ++j)
    for (int t = 0; t < 4; ++t)
      lanes[j] += wl[4 * j + t] * static_cast<int32_t>(xl[t]) +
                  wh[4 * j + t] * static_cast<int32_t>(xh[t]);
  return I16::load(lanes);
#endif
}

// The same for signed weight bytes (-127..127), stored + kSignedBias: with VNNI the sum of
// (w + 128) x, which the caller corrects; elsewhere sum w x itself.
ITERSERVE_INLINE I16 dot_s8(const I16& acc, const I16& lo, const I16& hi, const int8_t* x) {
#if defined(ITERSERVE_VNNI) || defined(ITERSERVE_AVX_VNNI)
  return dot_u8(acc, lo, hi, x);
#elif defined(CPU_CAPABILITY_AVX512)
  // No vpsignb on zmm: negate the weights where x is negative, a masked subtract.
  const __m512i xl = _mm512_set1_epi32(quad_at(x)), xh = _mm512_set1_epi32(quad_at(x + 4));
  const __m512i zero = _mm512_setzero_si512();
  const __m512i wl = _mm512_mask_sub_epi8(lo.v[0], _mm512_movepi8_mask(xl), zero, lo.v[0]);
  const __m512i wh = _mm512_mask_sub_epi8(hi.v[0], _mm512_movepi8_mask(xh), zero, hi.v[0]);
  // Each of the two pair sums reaches 2 * 127 * 127: widened to int32 apart.
  const __m512i ones = _mm512_set1_epi16(1);
  const __m512i sum = _mm512_add_epi32(
      _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(xl), wl), ones),
      _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(xh), wh), ones));
  return I16{{IVec(_mm512_add_epi32(acc.v[0], sum))}};
#elif defined(CPU_CAPABILITY_AVX2)
  // vpmaddubsw multiplies unsigned by signed bytes and saturates pair sums at 16 bits, so the
  // activations' signs move onto the weights: |x| (<= 127) times sign(x) * w (|.| <= 127)
  // sums pairs to at most 2 * 127 * 127, in range; lo and hi are widened apart.
  const __m256i xl = _mm256_set1_epi32(quad_at(x)), xh = _mm256_set1_epi32(quad_at(x + 4));
  const __m256i al = _mm256_sign_epi8(xl, xl), ah = _mm256_sign_epi8(xh, xh);
  const __m256i ones = _mm256_set1_epi16(1);
  I16 r;
  for (int i = 0; i < 2; ++i) {
    const __m256i pl = _mm256_maddubs_epi16(al, _mm256_sign_epi8(lo.v[i], xl));
    const __m256i ph = _mm256_maddubs_epi16(ah, _mm256_sign_epi8(hi.v[i], xh));
    r.v[i] = IVec(_mm256_add_epi32(
        acc.v[i], _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones))));
  }
  return r;
#elif defined(ITERSERVE_ARM_DOT)
  const int8x16_t xl = vreinterpretq_s8_s32(vld1q_dup_s32(reinterpret_cast<const int32_t*>(x)));
  const int8x16_t xh =
      vreinterpretq_s8_s32(vld1q_dup_s32(reinterpret_cast<const int32_t*>(x + 4)));
  I16 r;
  for (int i = 0; i < 4; ++i) {
    const int32x4_t sum = vdotq_s32(acc.v[i], vreinterpretq_s8_s32(lo.v[i]), xl);
    r.v[i] = IVec(vdotq_s32(sum, vreinterpretq_s8_s32(hi.v[i]), xh));
  }
  return r;
#else
  const int8_t *xl = x, *xh = x + 4;
  alignas(64) int8_t wl[4 * kLanes], wh[4 * kLanes];
  alignas(64) int32_t lanes[kLanes];
  lo.store(wl);
  hi.store(wh);
  acc.store(lanes);
  for (int j = 0; j < kLanes; ++j)
    for (int t = 0; t < 4; ++t)
      lanes[j] += wl[4 * j + t] * static_cast<int32_t>(xl[t]) +
                  wh[4 * j + t] * static_cast<int32_t>(xh[t]);
  return I16::load(lanes);
#endif
}

// Each byte of `index` (0..15) replaced by that entry of `table`, a 16-byte table repeated in
// every 16 bytes of the I16 (x86's byte shuffles look up within 128-bit lanes; Arm's tbl reads
// one q register).
ITERSERVE_INLINE I16 lookup16(const I16& table, const I16& index) {
#if defined(CPU_CAPABILITY_AVX512)
  return I16{{IVec(_mm512_shuffle_epi8(table.v[0], index.v[0]))}};
#elif defined(CPU_CAPABILITY_AVX2)
  I16 r;
  for (int i = 0; i < 2; ++i) r.v[i] = IVec(_mm256_shuffle_epi8(table.v[i], index.v[i]));
  return r;
#elif defined(__aarch64__)
  const uint8x16_t t = vreinterpretq_u8_s32(table.v[0]);
  I16 r;
  for (int i = 0; i < kParts; ++i)
    r.v[i] = IVec(vreinterpretq_s32_u8(vqtbl1q_u8(t, vreinterpretq_u8_s32(index.v[i]))));
  return r;
#else
  alignas(64) uint8_t t[4 * kLanes], idx[4 * kLanes], out[4 * kLanes];
  table.store(t);
  index.store(idx);
  for (int i = 0; i < 4 * kLanes; ++i) out[i] = t[idx[i] & 15];
  return I16::load(out);
#endif
}

// 16 unsigned bytes as fp32 lanes.
ITERSERVE_INLINE F16 load_u8x16(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return F16{{Vec(_mm512_cvtepi32_ps(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))))}};
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return F16{{Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw))),
              Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8))))}};
#else
  alignas(64) float lanes[kLanes];
  for (int i = 0; i < kLanes; ++i) lanes[i] = static_cast<float>(p[i]);
  return F16::load(lanes);
#endif
}

// 16 int32 lanes in -128..127 stored as 16 int8.
ITERSERVE_INLINE void store_i8x16(int8_t* p, const I16& a) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a.v[0]));
#elif defined(CPU_CAPABILITY_AVX2)
  // Packing works within 128-bit halves: words hold lanes 0-3, 8-11 | 4-7, 12-15, and the
  // bytes come out as dwords of lanes 0-3, 8-11, 4-7, 12-15, put in order by the shuffle.
  const __m256i words = _mm256_packs_epi32(a.v[0], a.v[1]);
  const __m128i lo = _mm256_castsi256_si128(words), hi = _mm256_extracti128_si256(words, 1);
  const __m128i bytes = _mm_packs_epi16(lo, hi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0)));
#else
  alignas(64) int32_t lanes[kLanes];
  a.store(lanes);
  for (int i = 0; i < kLanes; ++i) p[i] = static_cast<int8_t>(lanes[i]);
#endif
}

// 32 int8 weights of 16 lanes' input pairs (lane j: bytes 2j, 2j+1 of the lane's half: lanes
// 0..7 in the first 16 bytes, 8..15 in the next) as bf16-style pairs for `pair_dot`.
ITERSERVE_INLINE I16 widen_i8_pairs(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return I16{{IVec(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))))}};
#elif defined(CPU_CAPABILITY_AVX2)
  return I16{{IVec(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))),
              IVec(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))))}};
#else
  alignas(64) int16_t words[2 * kLanes];
  for (int i = 0; i < 2 * kLanes; ++i) words[i] = p[i];
  return I16::load(words);
#endif
}

// Lane j += a's words (2j, 2j+1) times b's, summed: 16-bit products in 32-bit lanes
// (`vpdpwssd` with AVX-512 VNNI, `vpmaddwd` + add elsewhere on x86, widening multiplies and a
// pairwise add on Arm). The words of `widen_i8_pairs` and of 32 int16 values loaded in
// memory order line up lane for lane.
ITERSERVE_INLINE I16 dot_i16(const I16& acc, const I16& a, const I16& b) {
#if defined(__AVX512VNNI__) && defined(CPU_CAPABILITY_AVX512)
  return I16{{IVec(_mm512_dpwssd_epi32(acc.v[0], a.v[0], b.v[0]))}};
#elif defined(CPU_CAPABILITY_AVX512)
  return I16{{IVec(_mm512_add_epi32(acc.v[0], _mm512_madd_epi16(a.v[0], b.v[0])))}};
#elif defined(ITERSERVE_AVX_VNNI)
  I16 r;
  for (int i = 0; i < 2; ++i) r.v[i] = IVec(_mm256_dpwssd_avx_epi32(acc.v[i], a.v[i], b.v[i]));
  return r;
#elif defined(CPU_CAPABILITY_AVX2)
  I16 r;
  for (int i = 0; i < 2; ++i) r.v[i] = IVec(_mm256_add_epi32(acc.v[i], _mm256_madd_epi16(a.v[i], b.v[i])));
  return r;
#elif defined(__aarch64__)
  I16 r;
  for (int i = 0; i < kParts; ++i) {
    const int16x8_t x = vreinterpretq_s16_s32(a.v[i]), y = vreinterpretq_s16_s32(b.v[i]);
    const int32x4_t lo = vmull_s16(vget_low_s16(x), vget_low_s16(y));
    const int32x4_t hi = vmull_high_s16(x, y);
    r.v[i] = IVec(vaddq_s32(acc.v[i], vpaddq_s32(lo, hi)));
  }
  return r;
#else
  alignas(64) int16_t x[2 * kLanes], y[2 * kLanes];
  alignas(64) int32_t lanes[kLanes];
  a.store(x);
  b.store(y);
  acc.store(lanes);
  for (int j = 0; j < kLanes; ++j)
    lanes[j] += int32_t{x[2 * j]} * y[2 * j] + int32_t{x[2 * j + 1]} * y[2 * j + 1];
  return I16::load(lanes);
#endif
}

// ---- sums across lanes ---------------------------------------------------------------------

// Lane j of the result = the sum of the 16 lanes of a[j].
ITERSERVE_INLINE F16 reduce16(const F16* a) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x, y, x, y] partials of keys 2i, 2i+1
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].v[0], a[2 * i + 1].v[0]),
                         _mm512_unpackhi_ps(a[2 * i].v[0], a[2 * i + 1].v[0]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: keys 4i..4i+3
    const __m512d lo = _mm512_castps_pd(b[2 * i]), hi = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: keys 8i..8i+3 twice, then 8i+4..8i+7 twice
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return F16{{Vec(_mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                                _mm512_shuffle_f32x4(d[0], d[1], 0xDD)))}};
#elif defined(CPU_CAPABILITY_AVX2)
  // Each key's two halves added, then three rounds of horizontal adds over 8 keys at a time;
  // hadd works within 128-bit lanes, so the last step swaps and adds the lanes.
  F16 r;
  for (int half = 0; half < 2; ++half) {
    __m256 s[8];
    for (int i = 0; i < 8; ++i) s[i] = _mm256_add_ps(a[8 * half + i].v[0], a[8 * half + i].v[1]);
    const __m256 h0 = _mm256_hadd_ps(s[0], s[1]), h1 = _mm256_hadd_ps(s[2], s[3]);
    const __m256 h2 = _mm256_hadd_ps(s[4], s[5]), h3 = _mm256_hadd_ps(s[6], s[7]);
    const __m256 g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);
    // g0 lane L: keys 0..3 partial over 128-bit lane L; g1: keys 4..7.
    const __m256 lo = _mm256_permute2f128_ps(g0, g1, 0x20);
    const __m256 hi = _mm256_permute2f128_ps(g0, g1, 0x31);
    r.v[half] = Vec(_mm256_add_ps(lo, hi));
  }
  return r;
#else
  alignas(64) float lanes[kLanes];
  alignas(64) float out[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    a[j].store(lanes);
    float s = 0.0f;
    for (int i = 0; i < kLanes; ++i) s += lanes[i];
    out[j] = s;
  }
  return F16::load(out);
#endif
}

// ---- exp --------------------------------------------------------------------------------

// exp for x <= 0 (and -inf): Cephes' expf polynomial (~1 ulp), times 2^n. 2^n is built as
// two powers of two so that neither leaves the normal range for n down to -150; the product
// rounds once, as a scale instruction would.
ITERSERVE_INLINE F16 exp_nonpositive(const F16& in) {
#if defined(CPU_CAPABILITY_AVX512)
  // The same polynomial and results in ~12 fewer instructions: `vscalefps` applies 2^n with
  // one rounding, the max needs no NaN handling (the input is never NaN).
  const __m512 x = _mm512_max_ps(in.v[0], _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return F16{{Vec(_mm512_scalef_ps(p, n))}};
#else
  const F16 x = maximum(in, F16::splat(-104.0f));  // exp(-104) underflows to 0; no -inf - -inf
  const I16 n = round_to_int(x * F16::splat(1.44269504088896341f));
  const F16 nf = to_float(n);
  F16 r = fmadd(nf, F16::splat(-0.693359375f), x);
  r = fmadd(nf, F16::splat(2.12194440e-4f), r);
  F16 p = F16::splat(1.9875691500e-4f);
  p = fmadd(p, r, F16::splat(1.3981999507e-3f));
  p = fmadd(p, r, F16::splat(8.3334519073e-3f));
  p = fmadd(p, r, F16::splat(4.1665795894e-2f));
  p = fmadd(p, r, F16::splat(1.6666665459e-1f));
  p = fmadd(p, r, F16::splat(5.0000001201e-1f));
  p = fmadd(p, r * r, r + F16::splat(1.0f));
  const I16 half = shift_right_signed<1>(n);
  const I16 rest = n - half;
  const F16 scale_a = bits_to_float(shift_left<23>(half + I16::splat(127)));
  const F16 scale_b = bits_to_float(shift_left<23>(rest + I16::splat(127)));
  return (p * scale_a) * scale_b;
#endif
}

// sigmoid and tanh from e = exp(-|t|) (or exp(-2|y|)), which never overflows:
//   sigmoid(t) = 1 / (1 + e) for t >= 0, e / (1 + e) below;
//   tanh(y)    = sign(y) (1 - e) / (1 + e).
// The activations' (SiLU, GELU-tanh: layer.cpp) and Gemma 2's attention soft-cap's
// (attention_loops.h).
ITERSERVE_INLINE F16 sigmoid(const F16& t) {
  const F16 one = F16::splat(1.0f), zero = F16::zero();
  const F16 e = exp_nonpositive(zero - abs(t));
  return select(less_than(t, zero), one, e) / (one + e);
}
ITERSERVE_INLINE F16 tanh(const F16& y) {
  const F16 one = F16::splat(1.0f), zero = F16::zero();
  const F16 e = exp_nonpositive(abs(y) * F16::splat(-2.0f));
  const F16 tanh_abs = (one - e) / (one + e);
  return select(less_than(y, zero), tanh_abs, zero - tanh_abs);
}

}  // namespace iterserve
