// GGUF's quantized weight formats as the kernels keep them: one codec a type, as llama.cpp's
// type traits are. Each re-lays the file's blocks (repack.cpp, once at load) into tiles of 16
// output rows, so that one 64-byte load gives 16 rows' weights for 4 inputs each, and decodes
// them in registers (linear.cpp) into what every format has in common:
//
//   for each block of 32 inputs and chunk c of 8 (inputs 8c..8c+7): the 16 rows' values as
//   bytes, `lo` (inputs 8c..8c+3) and `hi` (8c+4..8c+7), 4 bytes to a row's 32-bit lane;
//   for the block (or each half of 16 inputs) a per-row scale a, and either a bias the
//   format fixes (kBias) or a per-row offset o (kOffset), such that
//
//       w = a (value - kBias)   or   w = a value - o
//
// Against activations quantized to int8 (x ~ s xq, one s a unit of the format: tiles.h) a
// block's contribution is then s (a (value . xq - kBias sum xq) - o sum xq): integer dot
// products that start from -kBias sum xq (exact in int32), one fp32 multiply-add per block,
// one for the offset, and one for s per unit. Exactly the dequantized weights (the `gguf`
// package's) times the int8-rounded activations, up to fp32 rounding
// (tests/kernels/test_block_formats.py).
//
// A tile's bytes are its units one after the other, a unit being 16 rows x one GGUF block
// (32 or 256 inputs, kInputs), kBytes long. Within a unit the values sit in planes:
//
//   nibbles  4 bits a value, 64 bytes a chunk: row j's byte t holds input 8c+t in its low
//            nibble and 8c+4+t in its high one, so lo = byte & 15 and hi = byte >> 4;
//   crumbs   2 bits, 64 bytes per two chunks: row j's byte t holds, at bits 2f, field
//            f = 2 (c mod 2) + e of chunks 2v, 2v+1 (e = 0: input 8c+t, e = 1: 8c+4+t);
//   bits     1 bit, 64 bytes a block: row j's byte t holds, at bit 2c + e, that of input
//            8c + 4e + t;
//   bytes    8 bits, 128 bytes a chunk: lo's 64 bytes, then hi's.
//
// so that a shift and a mask (one ternary-logic op on AVX-512) put a value's high bits over its
// low ones. Scales are fp16 (MXFP4's bf16) and byte vectors of 16 lanes. Every format's bytes
// a weight are the file's, but where 6-bit scales are kept as bytes and headers padded to 64
// bytes (Q4_K, Q5_K: +2.3-2.8%; Q6_K +1%, IQ4_XS +2.9%, Q3_K +5.5%) and where MXFP4's exponent
// byte is kept as a 16-bit scale (+5.9%).
//
// Signed values (Q8_0's bytes, the IQ4 and MXFP4 tables') are stored + kSignedBias (128 with
// VNNI, see simd.h), their bias.
#pragma once

#include "simd.h"

#include <cstdint>

namespace iterserve {

// Every kernel weight format (model/block_formats.py names them); codes are part of the ops'
// interface. Dense formats first.
enum class Format : int64_t {
  kBf16 = 0,
  kF16 = 1,
  kQ4_0 = 10,
  kQ4_1 = 11,
  kQ5_0 = 12,
  kQ5_1 = 13,
  kQ8_0 = 14,
  kIQ4_NL = 15,
  kMXFP4 = 16,
  kQ2_K = 20,
  kQ3_K = 21,
  kQ4_K = 22,
  kQ5_K = 23,
  kQ6_K = 24,
  kIQ4_XS = 25,
};

constexpr int64_t kTile = 16;   // output rows a tile: one I16/F16 of lanes
constexpr int64_t kBlock = 32;  // inputs a block: what one activation scale covers
// Steps of up to this many rows are one row group, bound by the bytes they read; larger ones
// are bound by arithmetic (tiles.h sweep_tiles).
constexpr int64_t kRegisterRows = 4;

// A chunk's 16 rows' values (see above).
struct Quads {
  I16 lo, hi;
};

// ---- planes ------------------------------------------------------------------------------

ITERSERVE_INLINE I16 splat_bytes(uint32_t byte) { return I16::splat(static_cast<int32_t>(byte * 0x01010101u)); }

// a shifted left by N bits, or right by -N (32-bit lanes; callers mask what crosses bytes).
template <int N>
ITERSERVE_INLINE I16 shift_by(const I16& a) {
  if constexpr (N > 0) return shift_left<N>(a);
  else if constexpr (N < 0) return shift_right<-N>(a);
  else return a;
}

ITERSERVE_INLINE Quads nibbles(const uint8_t* chunk) {
  const I16 raw = I16::load(chunk), mask = splat_bytes(0x0F);
  return {raw & mask, shift_right<4>(raw) & mask};
}

// Field F (0..3) of a crumb plane, moved to bits At, At+1 of each byte, the rest cleared.
template <int F, int At>
ITERSERVE_INLINE I16 crumb(const I16& plane) {
  return shift_by<At - 2 * F>(plane) & splat_bytes(3u << At);
}

// Bit F of a bit plane, moved to bit At; `low` ORed in (one vpternlogd on AVX-512).
template <int F, int At>
ITERSERVE_INLINE I16 with_bit(const I16& plane, const I16& low) {
  return and_or(shift_by<At - F>(plane), splat_bytes(1u << At), low);
}
template <int F, int At>
ITERSERVE_INLINE I16 with_crumb(const I16& plane, const I16& low) {
  return and_or(shift_by<At - 2 * F>(plane), splat_bytes(3u << At), low);
}

// ---- the formats ---------------------------------------------------------------------------

// Each is a struct of statics:
//   kFormat, kInputs (a unit's inputs), kBytes (a unit's bytes), kHalves (1: a scale and offset
//   per block of 32, 2: per 16 inputs), kSigned (values are signed bytes: dot_s8), kMaxValue
//   (the largest value, what bounds the dot products' 16-bit sums: chunks_in_16_bits),
//   kBias (a power of two, or 0) or kOffset (a per-row offset o);
//   template <int C> Quads chunk(p, b): block b's chunk C;
//   void scales(p, b, a, o): block b's a[kHalves], and o[kHalves] if kOffset;
//   kUnitOffsets: the offsets are o = dmin mn, one dmin a unit and small integers mn a block,
//   which the loops take away once a unit, as integer dot products of mn with the activations'
//   sums, rather than one multiply-add a block (tiles.h `UnitOffsets`): then also
//   I16 offset_pairs(p, q), blocks 2q and 2q + 1's mn as 16-bit pairs, and F16
//   offset_scale(p), dmin.

// w = d (q - 8), q 4 bits.                                   [nibbles 256 | d 32]
struct Q4_0 {
  static constexpr Format kFormat = Format::kQ4_0;
  static constexpr int kInputs = 32, kHalves = 1;
  static constexpr int64_t kD = 256, kBytes = kD + 32;
  static constexpr bool kSigned = false, kOffset = false, kUnitOffsets = false;
  static constexpr int kBias = 8;
  static constexpr int kMaxValue = 15;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int) { return nibbles(p + 64 * C); }
  static ITERSERVE_INLINE void scales(const uint8_t* p, int, F16* a, F16*) {
    a[0] = load_f16x16(reinterpret_cast<const c10::Half*>(p + kD));
  }
};

// w = d q + m, q 4 bits; o = -m is stored.                   [nibbles 256 | d 32 | -m 32]
struct Q4_1 : Q4_0 {
  static constexpr Format kFormat = Format::kQ4_1;
  static constexpr int64_t kO = Q4_0::kD + 32, kBytes = kO + 32;
  static constexpr bool kOffset = true;
  static constexpr int kBias = 0;
  static ITERSERVE_INLINE void scales(const uint8_t* p, int, F16* a, F16* o) {
    a[0] = load_f16x16(reinterpret_cast<const c10::Half*>(p + kD));
    o[0] = load_f16x16(reinterpret_cast<const c10::Half*>(p + kO));
  }
};

// w = d (q - 16), q 5 bits.                                   [nibbles 256 | bits 64 | d 32]
struct Q5_0 {
  static constexpr Format kFormat = Format::kQ5_0;
  static constexpr int kInputs = 32, kHalves = 1;
  static constexpr int64_t kBits = 256, kD = kBits + 64, kBytes = kD + 32;
  static constexpr bool kSigned = false, kOffset = false, kUnitOffsets = false;
  static constexpr int kBias = 16;
  static constexpr int kMaxValue = 31;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int) {
    const Quads low = nibbles(p + 64 * C);
    const I16 bits = I16::load(p + kBits);
    return {with_bit<2 * C, 4>(bits, low.lo), with_bit<2 * C + 1, 4>(bits, low.hi)};
  }
  static ITERSERVE_INLINE void scales(const uint8_t* p, int, F16* a, F16*) {
    a[0] = load_f16x16(reinterpret_cast<const c10::Half*>(p + kD));
  }
};

// w = d q + m, q 5 bits.                            [nibbles 256 | bits 64 | d 32 | -m 32]
struct Q5_1 : Q5_0 {
  static constexpr Format kFormat = Format::kQ5_1;
  static constexpr int64_t kO = Q5_0::kD + 32, kBytes = kO + 32;
  static constexpr bool kOffset = true;
  static constexpr int kBias = 0;
  static ITERSERVE_INLINE void scales(const uint8_t* p, int, F16* a, F16* o) {
    a[0] = load_f16x16(reinterpret_cast<const c10::Half*>(p + kD));
    o[0] = load_f16x16(reinterpret_cast<const c10::Half*>(p + kO));
  }
};

// w = d q, q signed 8 bits.                                        [bytes 512 | d 32]
struct Q8_0 {
  static constexpr Format kFormat = Format::kQ8_0;
  static constexpr int kInputs = 32, kHalves = 1;
  static constexpr int64_t kD = 512, kBytes = kD + 32;
  static constexpr bool kSigned = true, kOffset = false, kUnitOffsets = false;
  static constexpr int kBias = kSignedBias;
  static constexpr int kMaxValue = 127;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int) {
    return {I16::load(p + 128 * C), I16::load(p + 128 * C + 64)};
  }
  static ITERSERVE_INLINE void scales(const uint8_t* p, int, F16* a, F16*) {
    a[0] = load_f16x16(reinterpret_cast<const c10::Half*>(p + kD));
  }
};

// The 4-bit indices' values of IQ4 and of MXFP4 (e2m1's values, doubled), and the tables the
// kernels look them up in: + kSignedBias, repeated in each 16 bytes (see byte lookups in
// simd.h), built at compile time so that loops load them from constant memory.
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};
constexpr int8_t kMXFP4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
struct ByteTable {
  alignas(64) int8_t bytes[4 * kLanes];
};
constexpr ByteTable make_byte_table(const int8_t (&values)[16]) {
  ByteTable table{};
  for (int i = 0; i < 4 * kLanes; ++i)
    table.bytes[i] = static_cast<int8_t>(values[i % 16] + kSignedBias);
  return table;
}
inline constexpr ByteTable kIQ4Table = make_byte_table(kIQ4Values);
inline constexpr ByteTable kMXFP4Table = make_byte_table(kMXFP4Values);

ITERSERVE_INLINE Quads table_values(const ByteTable& table, const uint8_t* chunk) {
  const Quads index = nibbles(chunk);
  const I16 bytes = I16::load(table.bytes);
  return {lookup16(bytes, index.lo), lookup16(bytes, index.hi)};
}

// w = d table[q], q a 4-bit index.                                 [nibbles 256 | d 32]
struct IQ4_NL : Q8_0 {
  static constexpr Format kFormat = Format::kIQ4_NL;
  static constexpr int64_t kD = 256, kBytes = kD + 32;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int) {
    return table_values(kIQ4Table, p + 64 * C);
  }
  static ITERSERVE_INLINE void scales(const uint8_t* p, int, F16* a, F16*) {
    a[0] = load_f16x16(reinterpret_cast<const c10::Half*>(p + kD));
  }
};

// w = d table[q], q a 4-bit index, d = 2^(e - 128) from the file's E8M0 byte e (2^-127 and
// 2^-128 for e = 1, 0: llama.cpp's subnormals). d is kept as bf16, which holds every one of
// them exactly (fp16 holds none below 2^-24 or above 2^15), and widened in one load as the
// others' fp16 scales are.                                         [nibbles 256 | d 32]
struct MXFP4 : IQ4_NL {
  static constexpr Format kFormat = Format::kMXFP4;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int) {
    return table_values(kMXFP4Table, p + 64 * C);
  }
  static ITERSERVE_INLINE void scales(const uint8_t* p, int, F16* a, F16*) {
    a[0] = load_bf16x16(reinterpret_cast<const c10::BFloat16*>(p + kD));
  }
};

// The K-quants: super-blocks of 256 inputs (8 blocks) with fp16 d (and dmin) per row, read
// again for every block: GCC 12 at -O3 lost a block loop's stores when the two were held in
// registers across it (AVX2, a loop decoding Q5_K tiles; reproduced outside the kernels), and the
// reload is two conversions a block.
//
// A K-quant unit is a header of its scales (a multiple of 64 bytes, padded where needed),
// then each block's planes one after the other: a tile is read as one ascending stream. With
// the scales after the values, each unit was read in two places at once and one decode step
// of Q4_K streamed at 59% of the memory's speed against 91% for Q4_0, whose scales follow
// their own block (benchmarks/linear_kernels.py, 2026-11-28, avx512vnni).
ITERSERVE_INLINE F16 half_lanes(const uint8_t* p) {
  return load_f16x16(reinterpret_cast<const c10::Half*>(p));
}

// w = d sc q - dmin mn, q 4 bits, sc and mn 6 bits a block; mn kept as pairs (blocks 2q and
// 2q + 1 side by side, 2 bytes a row) for the loops' integer offsets (kUnitOffsets).
//                [sc 8 x 16 | mn 4 x 16 x 2 | d 32 | dmin 32] then 8 x [nibbles 256]
struct Q4_K {
  static constexpr Format kFormat = Format::kQ4_K;
  static constexpr int kInputs = 256, kHalves = 1;
  static constexpr int64_t kMn = 128, kD = 256, kData = 320, kBlockBytes = 256;
  static constexpr int64_t kBytes = kData + 8 * kBlockBytes;
  static constexpr bool kSigned = false, kOffset = true, kUnitOffsets = true;
  static constexpr int kBias = 0;
  static constexpr int kMaxValue = 15;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int b) {
    return nibbles(p + kData + kBlockBytes * b + 64 * C);
  }
  static ITERSERVE_INLINE I16 offset_pairs(const uint8_t* p, int q) {
    return widen_i8_pairs(reinterpret_cast<const int8_t*>(p + kMn + 32 * q));  // mn < 64
  }
  static ITERSERVE_INLINE F16 offset_scale(const uint8_t* p) { return half_lanes(p + kD + 32); }
  static ITERSERVE_INLINE void scales(const uint8_t* p, int b, F16* a, F16* o) {
    a[0] = half_lanes(p + kD) * load_u8x16(p + 16 * b);
    const I16 pairs = offset_pairs(p, b / 2);
    const I16 mn = b % 2 ? shift_right<16>(pairs) : pairs & I16::splat(0xffff);
    o[0] = offset_scale(p) * to_float(mn);
  }
};

// Q4_K with a fifth bit.   [sc 8 x 16 | mn 8 x 16 | d | dmin] then 8 x [nibbles 256 | bits 64]
struct Q5_K : Q4_K {
  static constexpr Format kFormat = Format::kQ5_K;
  static constexpr int kMaxValue = 31;
  static constexpr int64_t kBlockBytes = 320, kBytes = kData + 8 * kBlockBytes;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int b) {
    const uint8_t* block = p + kData + kBlockBytes * b;
    const Quads low = nibbles(block + 64 * C);
    const I16 bits = I16::load(block + 256);
    return {with_bit<2 * C, 4>(bits, low.lo), with_bit<2 * C + 1, 4>(bits, low.hi)};
  }
};

// w = d sc (q - 32), q 6 bits, sc signed 8 bits per 16 inputs.
//                    [sc 16 x 16 | d 32 | 32 unused] then 8 x [nibbles 256 | crumbs 128]
struct Q6_K {
  static constexpr Format kFormat = Format::kQ6_K;
  static constexpr int kInputs = 256, kHalves = 2;
  static constexpr int64_t kD = 256, kData = 320, kBlockBytes = 384;
  static constexpr int64_t kBytes = kData + 8 * kBlockBytes;
  static constexpr bool kSigned = false, kOffset = false, kUnitOffsets = false;
  static constexpr int kBias = 32;
  static constexpr int kMaxValue = 63;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int b) {
    const uint8_t* block = p + kData + kBlockBytes * b;
    const Quads low = nibbles(block + 64 * C);
    const I16 high = I16::load(block + 256 + 64 * (C / 2));
    constexpr int F = 2 * (C % 2);
    return {with_crumb<F, 4>(high, low.lo), with_crumb<F + 1, 4>(high, low.hi)};
  }
  static ITERSERVE_INLINE void scales(const uint8_t* p, int b, F16* a, F16*) {
    const auto* sc = reinterpret_cast<const int8_t*>(p + 32 * b);
    for (int h = 0; h < 2; ++h) a[h] = half_lanes(p + kD) * load_i8x16(sc + 16 * h);
  }
};

// w = d sc q - dmin mn, q 2 bits, sc and mn 4 bits per 16 inputs (one byte: sc | mn << 4).
//                            [sc|mn 16 x 16 | d 32 | dmin 32] then 8 x [crumbs 128]
struct Q2_K {
  static constexpr Format kFormat = Format::kQ2_K;
  static constexpr int kInputs = 256, kHalves = 2;
  static constexpr int64_t kD = 256, kData = 320, kBlockBytes = 128;
  static constexpr int64_t kBytes = kData + 8 * kBlockBytes;
  static constexpr bool kSigned = false, kOffset = true, kUnitOffsets = false;
  static constexpr int kBias = 0;
  static constexpr int kMaxValue = 3;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int b) {
    const I16 plane = I16::load(p + kData + kBlockBytes * b + 64 * (C / 2));
    constexpr int F = 2 * (C % 2);
    return {crumb<F, 0>(plane), crumb<F + 1, 0>(plane)};
  }
  static ITERSERVE_INLINE void scales(const uint8_t* p, int b, F16* a, F16* o) {
    for (int h = 0; h < 2; ++h) {
      const F16 packed = load_u8x16(p + 32 * b + 16 * h);
      const F16 mn = floor(packed * F16::splat(1.0f / 16.0f));
      a[h] = half_lanes(p + kD) * fmadd(mn, F16::splat(-16.0f), packed);
      o[h] = half_lanes(p + kD + 32) * mn;
    }
  }
};

// w = d sc (q - 4), q 3 bits (2 low, 1 high), sc signed per 16 inputs.
//                      [sc 16 x 16 | d 32 | 32 unused] then 8 x [crumbs 128 | bits 64]
struct Q3_K {
  static constexpr Format kFormat = Format::kQ3_K;
  static constexpr int kInputs = 256, kHalves = 2;
  static constexpr int64_t kD = 256, kData = 320, kBlockBytes = 192;
  static constexpr int64_t kBytes = kData + 8 * kBlockBytes;
  static constexpr bool kSigned = false, kOffset = false, kUnitOffsets = false;
  static constexpr int kBias = 4;
  static constexpr int kMaxValue = 7;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int b) {
    const uint8_t* block = p + kData + kBlockBytes * b;
    const I16 plane = I16::load(block + 64 * (C / 2));
    const I16 bits = I16::load(block + 128);
    constexpr int F = 2 * (C % 2);
    return {with_bit<2 * C, 2>(bits, crumb<F, 0>(plane)),
            with_bit<2 * C + 1, 2>(bits, crumb<F + 1, 0>(plane))};
  }
  static ITERSERVE_INLINE void scales(const uint8_t* p, int b, F16* a, F16*) {
    const auto* sc = reinterpret_cast<const int8_t*>(p + 32 * b);
    for (int h = 0; h < 2; ++h) a[h] = half_lanes(p + kD) * load_i8x16(sc + 16 * h);
  }
};

// w = d sc table[q], q a 4-bit index, sc signed (6 bits - 32) a block.
//                                  [sc 8 x 16 | d 32 | 32 unused] then 8 x [nibbles 256]
struct IQ4_XS {
  static constexpr Format kFormat = Format::kIQ4_XS;
  static constexpr int kInputs = 256, kHalves = 1;
  static constexpr int64_t kD = 128, kData = 192, kBlockBytes = 256;
  static constexpr int64_t kBytes = kData + 8 * kBlockBytes;
  static constexpr bool kSigned = true, kOffset = false, kUnitOffsets = false;
  static constexpr int kBias = kSignedBias;
  static constexpr int kMaxValue = 127;
  template <int C>
  static ITERSERVE_INLINE Quads chunk(const uint8_t* p, int b) {
    return table_values(kIQ4Table, p + kData + kBlockBytes * b + 64 * C);
  }
  static ITERSERVE_INLINE void scales(const uint8_t* p, int b, F16* a, F16*) {
    a[0] = half_lanes(p + kD) * load_i8x16(reinterpret_cast<const int8_t*>(p + 16 * b));
  }
};

template <typename F>
inline bool with_codec(Format format, F&& f) {
  switch (format) {
    case Format::kQ4_0: f(Q4_0{}); return true;
    case Format::kQ4_1: f(Q4_1{}); return true;
    case Format::kQ5_0: f(Q5_0{}); return true;
    case Format::kQ5_1: f(Q5_1{}); return true;
    case Format::kQ8_0: f(Q8_0{}); return true;
    case Format::kIQ4_NL: f(IQ4_NL{}); return true;
    case Format::kMXFP4: f(MXFP4{}); return true;
    case Format::kQ2_K: f(Q2_K{}); return true;
    case Format::kQ3_K: f(Q3_K{}); return true;
    case Format::kQ4_K: f(Q4_K{}); return true;
    case Format::kQ5_K: f(Q5_K{}); return true;
    case Format::kQ6_K: f(Q6_K{}); return true;
    case Format::kIQ4_XS: f(IQ4_XS{}); return true;
    default: return false;
  }
}

// Row `lane` of a tile (K inputs, in a block format) as the weights the kernels multiply:
// a value times its scale less its offset, through the codec's own decoder.
template <typename Codec>
inline void decode_row(const uint8_t* tile, int64_t K, int lane, float* out) {
  constexpr int H = Codec::kHalves;
  for (int64_t u = 0; u < K / Codec::kInputs; ++u) {
    const uint8_t* p = tile + u * Codec::kBytes;
    for (int blk = 0; blk < Codec::kInputs / kBlock; ++blk) {
      alignas(64) uint8_t values[4][2][4 * kLanes];
      const Quads quads[4] = {Codec::template chunk<0>(p, blk), Codec::template chunk<1>(p, blk),
                              Codec::template chunk<2>(p, blk), Codec::template chunk<3>(p, blk)};
      for (int c = 0; c < 4; ++c) quads[c].lo.store(values[c][0]), quads[c].hi.store(values[c][1]);
      F16 a[H], o[H];
      Codec::scales(p, blk, a, o);
      alignas(64) float as[H][kLanes], os[H][kLanes];
      for (int h = 0; h < H; ++h) {
        a[h].store(as[h]);
        if constexpr (Codec::kOffset) o[h].store(os[h]);
      }
      float* w = out + u * Codec::kInputs + blk * kBlock;
      for (int k = 0; k < kBlock; ++k) {
        const int h = H == 2 ? k / 16 : 0;
        const uint8_t byte = values[k / 8][k % 8 / 4][4 * lane + k % 4];
        // Signed values are stored as they are, or + 128 with VNNI (their bias).
        const float v = Codec::kSigned && kSignedBias == 0
                            ? static_cast<float>(static_cast<int8_t>(byte))
                            : static_cast<float>(byte);
        // The bias is taken away before the scale multiplies, as the loops take it from the
        // integer sums: d v - d kBias overflows where d (v - kBias) does not (MXFP4's d
        // reaches 2^127, and v is + 128 with VNNI).
        if constexpr (Codec::kOffset) w[k] = as[h][lane] * v - os[h][lane];
        else w[k] = as[h][lane] * (v - static_cast<float>(Codec::kBias));
      }
    }
  }
}

inline void decode_row(Format format, const uint8_t* tile, int64_t K, int lane, float* out) {
  with_codec(format, [&](auto codec) { decode_row<decltype(codec)>(tile, K, lane, out); });
}

// Bytes a tile of 16 rows holds for K inputs, in any format; -1 if K does not fit it.
inline int64_t tile_bytes(Format format, int64_t K) {
  if (format == Format::kBf16 || format == Format::kF16) return K % 2 ? -1 : 2 * kTile * K;
  int64_t bytes = -1;
  with_codec(format, [&](auto codec) {
    using C = decltype(codec);
    if (K % C::kInputs == 0) bytes = K / C::kInputs * C::kBytes;
  });
  return bytes;
}

}  // namespace iterserve
