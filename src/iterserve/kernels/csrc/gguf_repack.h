// GGUF's blocks -> the tile layouts of blocks.h: every row's blocks parsed into one plain form
// (`RowUnit`: each input's value as the kernels see it, the scales as bytes, the fp16 scales
// as bits), then 16 rows at a time laid into planes. No ATen runtime: repack.cpp runs it on
// tensors, tests/kernels/blocks_check.cpp where no torch build is at hand.
#pragma once

#include "blocks.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace iterserve {

// One row's GGUF block in the kernels' terms: values u (unsigned, or signed for kSigned
// formats; the IQ4 and MXFP4 tables' indices), per block/half scale bytes sc and minimum bytes
// mn, fp16 bits d and dmin (or o); MXFP4's d as bf16 bits.
struct RowUnit {
  uint8_t u[256];
  uint8_t sc[16];
  uint8_t mn[16];
  uint16_t d, d2;
};

inline uint16_t half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// An E8M0 exponent e as the bf16 bits of llama.cpp's scale for it (ggml_e8m0_to_fp32_half):
// 2^(e - 128), whose fp32 bits' low half is zero, the subnormals of e = 0, 1 included.
inline uint16_t e8m0_half_bf16_bits(uint8_t e) {
  return static_cast<uint16_t>(e < 2 ? 0x20 << e : (e - 1) << 7);
}

inline uint64_t load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);
  return w;
}

inline void store64(uint8_t* p, uint64_t w) { std::memcpy(p, &w, 8); }

inline void or_bytes(uint8_t* p, uint64_t w) { store64(p, load64(p) | w); }

// The 8 bits of `bits` as 8 bytes of 0 or 1, bit i in byte i.
inline uint64_t spread_bits(uint8_t bits) {
  const uint64_t each = (bits * 0x0101010101010101ULL) & 0x8040201008040201ULL;  // byte i: bit i
  return ((each + 0x7F7F7F7F7F7F7F7FULL) >> 7) & 0x0101010101010101ULL;  // nonzero -> 1
}

// 32 values from 16 bytes of nibbles: the low nibbles are inputs 0-15, the high 16-31.
inline void split_nibbles(const uint8_t* qs, uint8_t* u) {
  for (int j = 0; j < 16; ++j) u[j] = qs[j] & 15, u[j + 16] = qs[j] >> 4;
}

// Q4_K/Q5_K's 12 bytes of 6-bit scales and minimums, 8 of each.
inline void k_scales(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63, mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}

// Parsers of one GGUF block (the file's layouts, ggml-common.h's block_* structs).
inline void parse(Format f, const uint8_t* b, RowUnit& r) {
  switch (f) {
    case Format::kQ4_0:  // d, qs[16]
    case Format::kIQ4_NL:
      r.d = half_bits(b);
      split_nibbles(b + 2, r.u);
      break;
    case Format::kMXFP4:  // e, qs[16]
      r.d = e8m0_half_bf16_bits(b[0]);
      split_nibbles(b + 1, r.u);
      break;
    case Format::kQ4_1:  // d, m, qs[16]; o = -m
      r.d = half_bits(b), r.d2 = half_bits(b + 2) ^ 0x8000;
      split_nibbles(b + 4, r.u);
      break;
    case Format::kQ5_0:
    case Format::kQ5_1: {  // d, [m,] qh[4], qs[16]
      const bool has_m = f == Format::kQ5_1;
      r.d = half_bits(b);
      if (has_m) r.d2 = half_bits(b + 2) ^ 0x8000;
      uint32_t qh;
      std::memcpy(&qh, b + (has_m ? 4 : 2), 4);
      split_nibbles(b + (has_m ? 8 : 6), r.u);
      for (int j = 0; j < 32; j += 8) or_bytes(r.u + j, spread_bits(static_cast<uint8_t>(qh >> j)) << 4);
      break;
    }
    case Format::kQ8_0:  // d, qs[32] signed
      r.d = half_bits(b);
      std::memcpy(r.u, b + 2, 32);
      break;
    case Format::kQ2_K: {  // scales[16], qs[64], d, dmin
      const uint8_t* qs = b + 16;
      for (int n = 0; n < 2; ++n)
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 32; ++l) r.u[128 * n + 32 * s + l] = (qs[32 * n + l] >> (2 * s)) & 3;
      std::memcpy(r.sc, b, 16);
      r.d = half_bits(b + 80), r.d2 = half_bits(b + 82);
      break;
    }
    case Format::kQ3_K: {  // hmask[32], qs[64], scales[12], d; value = u - 4
      const uint8_t *hmask = b, *qs = b + 32, *packed = b + 96;
      for (int n = 0; n < 2; ++n)
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 32; ++l)
            r.u[128 * n + 32 * s + l] = static_cast<uint8_t>(
                ((qs[32 * n + l] >> (2 * s)) & 3) | (((hmask[l] >> (4 * n + s)) & 1) << 2));
      for (int i = 0; i < 16; ++i) {
        const int low = i < 8 ? packed[i] & 15 : packed[i - 8] >> 4;
        const int high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        r.sc[i] = static_cast<uint8_t>(static_cast<int8_t>((low | high << 4) - 32));
      }
      r.d = half_bits(b + 108);
      break;
    }
    case Format::kQ4_K:
    case Format::kQ5_K: {  // d, dmin, scales[12], [qh[32],] qs[128]
      r.d = half_bits(b), r.d2 = half_bits(b + 2);
      k_scales(b + 4, r.sc, r.mn);
      const bool five = f == Format::kQ5_K;
      const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 32; ++l) {
          r.u[64 * i + l] = qs[32 * i + l] & 15;
          r.u[64 * i + 32 + l] = qs[32 * i + l] >> 4;
        }
      if (five)
        for (int blk = 0; blk < 8; ++blk)
          for (int l = 0; l < 32; ++l) r.u[32 * blk + l] |= ((qh[l] >> blk) & 1) << 4;
      break;
    }
    case Format::kQ6_K: {  // ql[128], qh[64], scales[16] signed, d; value = u - 32
      const uint8_t *ql = b, *qh = b + 128;
      constexpr uint64_t kNibbles = 0x0F0F0F0F0F0F0F0F, kCrumbs = 0x0303030303030303;
      for (int n = 0; n < 2; ++n)
        for (int s = 0; s < 4; ++s)
          for (int l = 0; l < 32; l += 8) {  // eight inputs a word
            const uint64_t low = load64(ql + 64 * n + l + 32 * (s & 1)) >> (s < 2 ? 0 : 4);
            const uint64_t high = load64(qh + 32 * n + l) >> (2 * s);
            store64(r.u + 128 * n + 32 * s + l, (low & kNibbles) | (high & kCrumbs) << 4);
          }
      std::memcpy(r.sc, b + 192, 16);
      r.d = half_bits(b + 208);
      break;
    }
    case Format::kIQ4_XS: {  // d, scales_h (u16), scales_l[4], qs[128]
      r.d = half_bits(b);
      const uint16_t high = half_bits(b + 2);
      for (int ib = 0; ib < 8; ++ib) {
        const int low = (b[4 + ib / 2] >> (4 * (ib % 2))) & 15;
        r.sc[ib] = static_cast<uint8_t>(static_cast<int8_t>((low | ((high >> (2 * ib)) & 3) << 4) - 32));
        split_nibbles(b + 8 + 16 * ib, r.u + 32 * ib);
      }
      break;
    }
    default: std::abort();  // callers check gguf_block_bytes(f) > 0 first
  }
}

// GGUF bytes of one block of each format (ggml's type sizes).
inline int64_t gguf_block_bytes(Format f) {
  switch (f) {
    case Format::kQ4_0: case Format::kIQ4_NL: return 18;
    case Format::kMXFP4: return 17;
    case Format::kQ4_1: return 20;
    case Format::kQ5_0: return 22;
    case Format::kQ5_1: return 24;
    case Format::kQ8_0: return 34;
    case Format::kQ2_K: return 84;
    case Format::kQ3_K: return 110;
    case Format::kQ4_K: return 144;
    case Format::kQ5_K: return 176;
    case Format::kQ6_K: return 210;
    case Format::kIQ4_XS: return 136;
    default: return -1;
  }
}

// ---- planes (the layouts blocks.h reads) -------------------------------------------------------

using Rows16 = RowUnit[kTile];

// Row j's inputs k..k+3 (of the unit) as one word, byte i input k+i, each shifted right by
// `shift` (at most 4) and masked by `mask`'s byte: the planes below are made four inputs at a
// time, a byte's bits never crossing into the next (Q4_K 2.4x the byte-at-a-time loops, Q6_K
// 2.3x, one thread: docs/benchmarks.md, "Loading big files").
inline uint32_t values4(const Rows16& r, int j, int k, int shift, uint32_t mask) {
  uint32_t w;
  std::memcpy(&w, r[j].u + k, 4);
  return (w >> shift) & mask;
}

inline void put_word(uint8_t* out, uint32_t w) { std::memcpy(out, &w, 4); }

inline void put_nibbles(const Rows16& r, int blk, int shift, uint8_t* out) {
  for (int c = 0; c < 4; ++c)
    for (int j = 0; j < kTile; ++j) {
      const int k = 32 * blk + 8 * c;
      put_word(out + 64 * c + 4 * j,
               values4(r, j, k, shift, 0x0F0F0F0F) | values4(r, j, k + 4, shift, 0x0F0F0F0F) << 4);
    }
}

inline void put_bits(const Rows16& r, int blk, int shift, uint8_t* out) {
  for (int j = 0; j < kTile; ++j) {
    uint32_t w = 0;
    for (int c = 0; c < 4; ++c)
      for (int e = 0; e < 2; ++e)
        w |= values4(r, j, 32 * blk + 8 * c + 4 * e, shift, 0x01010101) << (2 * c + e);
    put_word(out + 4 * j, w);
  }
}

inline void put_crumbs(const Rows16& r, int blk, int shift, uint8_t* out) {
  for (int v = 0; v < 2; ++v)
    for (int j = 0; j < kTile; ++j) {
      uint32_t w = 0;
      for (int half = 0; half < 2; ++half)
        for (int e = 0; e < 2; ++e) {
          const int k = 32 * blk + 8 * (2 * v + half) + 4 * e;
          w |= values4(r, j, k, shift, 0x03030303) << (2 * (2 * half + e));
        }
      put_word(out + 64 * v + 4 * j, w);
    }
}

// Each byte of `w` plus `bias` (mod 256), no carry between bytes.
inline uint32_t add_bytes(uint32_t w, int bias) {
  const uint32_t b = 0x01010101u * static_cast<uint8_t>(bias);
  return ((w & 0x7F7F7F7F) + (b & 0x7F7F7F7F)) ^ ((w ^ b) & 0x80808080);
}

inline void put_bytes(const Rows16& r, int blk, int bias, uint8_t* out) {
  for (int c = 0; c < 4; ++c)
    for (int e = 0; e < 2; ++e)
      for (int j = 0; j < kTile; ++j)
        put_word(out + 128 * c + 64 * e + 4 * j,
                 add_bytes(values4(r, j, 32 * blk + 8 * c + 4 * e, 0, 0xFFFFFFFF), bias));
}

inline void put_halves(const Rows16& r, bool second, uint8_t* out) {
  for (int j = 0; j < kTile; ++j) std::memcpy(out + 2 * j, second ? &r[j].d2 : &r[j].d, 2);
}

template <int N>
inline void put_scale_bytes(const Rows16& r, uint8_t* out) {
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < kTile; ++j) out[16 * i + j] = r[j].sc[i];
}

// 16 parsed rows -> one unit of the format's tile layout (blocks.h's offsets).
inline void pack(Format f, const Rows16& r, uint8_t* out) {
  switch (f) {
    case Format::kQ4_0:
    case Format::kIQ4_NL:
    case Format::kMXFP4:
      put_nibbles(r, 0, 0, out);
      put_halves(r, false, out + Q4_0::kD);
      break;
    case Format::kQ4_1:
      put_nibbles(r, 0, 0, out);
      put_halves(r, false, out + Q4_1::kD);
      put_halves(r, true, out + Q4_1::kO);
      break;
    case Format::kQ5_0:
    case Format::kQ5_1:
      put_nibbles(r, 0, 0, out);
      put_bits(r, 0, 4, out + Q5_0::kBits);
      put_halves(r, false, out + Q5_0::kD);
      if (f == Format::kQ5_1) put_halves(r, true, out + Q5_1::kO);
      break;
    case Format::kQ8_0:
      put_bytes(r, 0, kSignedBias, out);
      put_halves(r, false, out + Q8_0::kD);
      break;
    case Format::kQ2_K:
      put_scale_bytes<16>(r, out);
      put_halves(r, false, out + Q2_K::kD);
      put_halves(r, true, out + Q2_K::kD + 32);
      for (int blk = 0; blk < 8; ++blk)
        put_crumbs(r, blk, 0, out + Q2_K::kData + Q2_K::kBlockBytes * blk);
      break;
    case Format::kQ3_K:
      put_scale_bytes<16>(r, out);
      put_halves(r, false, out + Q3_K::kD);
      std::memset(out + Q3_K::kD + 32, 0, Q3_K::kData - Q3_K::kD - 32);  // the header's padding
      for (int blk = 0; blk < 8; ++blk) {
        uint8_t* block = out + Q3_K::kData + Q3_K::kBlockBytes * blk;
        put_crumbs(r, blk, 0, block);
        put_bits(r, blk, 2, block + 128);
      }
      break;
    case Format::kQ4_K:
    case Format::kQ5_K: {
      const bool five = f == Format::kQ5_K;
      put_scale_bytes<8>(r, out);
      for (int q = 0; q < 4; ++q)  // mn as pairs (blocks.h Q4_K)
        for (int j = 0; j < kTile; ++j)
          for (int e = 0; e < 2; ++e) out[Q4_K::kMn + 32 * q + 2 * j + e] = r[j].mn[2 * q + e];
      put_halves(r, false, out + Q4_K::kD);
      put_halves(r, true, out + Q4_K::kD + 32);
      const int64_t block_bytes = five ? Q5_K::kBlockBytes : Q4_K::kBlockBytes;
      for (int blk = 0; blk < 8; ++blk) {
        uint8_t* block = out + Q4_K::kData + block_bytes * blk;
        put_nibbles(r, blk, 0, block);
        if (five) put_bits(r, blk, 4, block + 256);
      }
      break;
    }
    case Format::kQ6_K:
      put_scale_bytes<16>(r, out);
      put_halves(r, false, out + Q6_K::kD);
      std::memset(out + Q6_K::kD + 32, 0, Q6_K::kData - Q6_K::kD - 32);  // the header's padding
      for (int blk = 0; blk < 8; ++blk) {
        uint8_t* block = out + Q6_K::kData + Q6_K::kBlockBytes * blk;
        put_nibbles(r, blk, 0, block);
        put_crumbs(r, blk, 4, block + 256);
      }
      break;
    case Format::kIQ4_XS:
      put_scale_bytes<8>(r, out);
      put_halves(r, false, out + IQ4_XS::kD);
      std::memset(out + IQ4_XS::kD + 32, 0, IQ4_XS::kData - IQ4_XS::kD - 32);  // padding
      for (int blk = 0; blk < 8; ++blk)
        put_nibbles(r, blk, 0, out + IQ4_XS::kData + IQ4_XS::kBlockBytes * blk);
      break;
    default: std::abort();  // callers check gguf_block_bytes(f) > 0 first
  }
}

inline int64_t unit_inputs(Format f) {
  int64_t inputs = -1;
  with_codec(f, [&](auto codec) { inputs = decltype(codec)::kInputs; });
  return inputs;
}

// Rows [16 t, 16 t + 16) of `src` (rows of GGUF blocks, `ld` bytes apart; `row_of[i]`: the
// source row of output row i, or null for i itself; a row outside 0..N-1: zeros) as tile t.
inline void repack_tile(Format f, const uint8_t* src, int64_t ld, int64_t N, const int64_t* row_of,
                        int64_t K, int64_t t, uint8_t* tile) {
  const int64_t units = K / unit_inputs(f), block_bytes = gguf_block_bytes(f);
  const int64_t unit_bytes = tile_bytes(f, K) / units;
  const uint8_t* rows[kTile];  // each row's blocks, or null for a padding row
  for (int j = 0; j < kTile; ++j) {
    const int64_t row = row_of ? row_of[t * kTile + j] : t * kTile + j;
    rows[j] = row < 0 || row >= N ? nullptr : src + row * ld;
  }
  RowUnit parsed[kTile];
  for (int64_t u = 0; u < units; ++u) {
    for (int j = 0; j < kTile; ++j) {
      if (rows[j] == nullptr) {
        std::memset(&parsed[j], 0, sizeof(RowUnit));  // a padding row: d = 0, weights 0
        continue;
      }
      // The file's bytes come once, from memory (a read's buffer): 16 rows are 16 streams,
      // more than the hardware's prefetchers follow, so each row's block two ahead is asked for.
      if (u + 2 < units)
        for (int64_t line = 0; line < block_bytes; line += 64)
          __builtin_prefetch(rows[j] + (u + 2) * block_bytes + line);
      parse(f, rows[j] + u * block_bytes, parsed[j]);
    }
    pack(f, parsed, tile + u * unit_bytes);
  }
}

}  // namespace iterserve
