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
// Block formats run on int8 activations, as llama.cpp's do: each row quantized per block of
// 32 inputs (x ~ s xq), and per block of each tile the integer dot products of its values
// with xq, folded into fp32 with the block's scales (see blocks.h). The same arithmetic at
// every step size, in the same order for every row and output, whatever else shares the
// step: a request's logits do not depend on the batch.
//
//   - Few rows (decoding): each thread streams its tiles' blocks once, decoding them in
//     registers for every row of the step (`block_tiles`): weight bytes are the cost.
//   - Many rows (prefill, large batches): a few tiles at a time are decoded once into a
//     panel of bytes and scales that stays in L2 (`decode_panel`), and every group of rows
//     runs integer dot products over it (`panel_tiles`): the unpacking is paid once a step,
//     not once a row group, and the loop is dot products and loads.
#pragma once

#include "blocks.h"
#include "simd.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
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

  ITERSERVE_INLINE void store(int64_t row, int64_t n0, F16 acc) const {
    if (bias) acc = acc + load_bf16x16(bias + n0);
    if (residual) acc = acc + load_bf16x16(residual + row * ld_res + n0);
    if (out_f32)
      acc.store(out_f32 + row * ld_out + n0);
    else
      store_bf16x16(out + row * ld_out + n0, acc);
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
  // Block formats: the rows quantized ([M, K] int8), each block's scale s ([M, K/32]) and
  // s * sum(xq) per block ([M, K/32]) and per 16 inputs ([M, K/16]).
  const int8_t* xq;
  const float* scale;
  const float* sum32;
  const float* sum16;
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

// ---- bf16 and fp16 -------------------------------------------------------------------------

// bf16 tiles: [K/2, 16, 2] a tile, each output's two inputs side by side.
template <int MR, int NT>
inline void bf16_tiles(const Rows& rows, int64_t m0, const uint8_t* w, int64_t tile0,
                       const Epilogue& ep) {
  const int64_t K = rows.K, tile_elems = K * kTile;
  const auto* wt = reinterpret_cast<const at::BFloat16*>(w) + tile0 * tile_elems;
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

// fp16 tiles: [K/2, 2, 16] a tile (a pair's first inputs for the 16 outputs, then its
// second), widened to fp32 in registers: no CPU here has fp16 dot products.
template <int MR, int NT>
inline void f16_tiles(const Rows& rows, int64_t m0, const uint8_t* w, int64_t tile0,
                      const Epilogue& ep) {
  const int64_t K = rows.K, tile_elems = K * kTile;
  const auto* wt = reinterpret_cast<const c10::Half*>(w) + tile0 * tile_elems;
  F16 acc[MR][NT];
  zero_all(acc);
  for (int64_t k = 0; k < K; k += 2) {
    F16 first[NT], second[NT];
    for (int j = 0; j < NT; ++j) {
      first[j] = load_f16x16(wt + j * tile_elems + k * kTile);
      second[j] = load_f16x16(wt + j * tile_elems + k * kTile + kTile);
    }
    for (int r = 0; r < MR; ++r) {
      const float* x = rows.xf + (m0 + r) * rows.ld_xf + k;
      const F16 x0 = F16::splat(x[0]), x1 = F16::splat(x[1]);
      for (int j = 0; j < NT; ++j) acc[r][j] = fmadd(second[j], x1, fmadd(first[j], x0, acc[r][j]));
    }
  }
  store_all(ep, m0, tile0, acc);
}

// ---- activations for the block formats ---------------------------------------------------------

// One row quantized per block of 32 inputs: x ~ s q, q = round(x * 127 / max|x| over the
// block) in -127..127 (as llama.cpp quantizes activations for its block dot products: one
// scale a row measured twice the greedy disagreement with bf16 on the bundled model), with
// s * sum(q) per block (sum32) and per 16 inputs (sum16) for the formats' offsets.
inline void quantize_row(const at::BFloat16* x, int64_t K, int8_t* q, float* scale, float* sum32,
                         float* sum16) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const at::BFloat16* src = x + b * kBlock;
    const F16 lo = load_bf16x16(src), hi = load_bf16x16(src + 16);
    const float amax = maximum(abs(lo), abs(hi)).max();
    // A true division, as block_formats.quantize_activations rounds (127 / amax times x would
    // multiply by a rounded reciprocal); round half to even, as torch.round does.
    const F16 inv = F16::splat(amax > 0.0f ? 127.0f / amax : 0.0f);
    const I16 qlo = round_to_int(lo * inv), qhi = round_to_int(hi * inv);
    store_i8x16(q + b * kBlock, qlo);
    store_i8x16(q + b * kBlock + 16, qhi);
    const float s = amax / 127.0f;
    scale[b] = s;
    sum16[2 * b] = s * static_cast<float>(qlo.sum());
    sum16[2 * b + 1] = s * static_cast<float>(qhi.sum());
    sum32[b] = s * static_cast<float>((qlo + qhi).sum());
  }
}

// ---- block formats -------------------------------------------------------------------------

// A block's integer dot products folded into the fp32 sums: per half h of the block,
//   acc += (a_h s) dot_h  - o_h (s sum_h xq)
// The one place this arithmetic is written, so that both roads below give the same bits.
template <int H, bool Offset, int MR, int NT>
ITERSERVE_INLINE void fold(F16 (&acc)[MR][NT], const I16 (&dot)[H][MR][NT], const F16 (&a)[NT][H],
                           const F16 (&o)[NT][H], const Rows& rows, int64_t m0, int64_t blk) {
  const int64_t blocks = rows.K / kBlock;
  for (int r = 0; r < MR; ++r) {
    const int64_t at = (m0 + r) * blocks + blk;
    const F16 s = F16::splat(rows.scale[at]);
    F16 minus_sum[H];
    if constexpr (Offset) {
      for (int h = 0; h < H; ++h)
        minus_sum[h] = F16::splat(-(H == 1 ? rows.sum32[at] : rows.sum16[2 * at + h]));
    }
    for (int j = 0; j < NT; ++j) {
      for (int h = 0; h < H; ++h) acc[r][j] = fmadd(to_float(dot[h][r][j]), a[j][h] * s, acc[r][j]);
      if constexpr (Offset)
        for (int h = 0; h < H; ++h) acc[r][j] = fmadd(o[j][h], minus_sum[h], acc[r][j]);
    }
  }
}

// Row m0 + r's two activation quads (inputs 8c..8c+3, 8c+4..8c+7) of block blk.
ITERSERVE_INLINE void x_quads(const Rows& rows, int64_t m, int64_t blk, int c, int32_t* quads) {
  std::memcpy(quads, rows.xq + m * rows.K + blk * kBlock + 8 * c, 8);
}

template <bool Signed>
ITERSERVE_INLINE I16 dot_quads(const I16& acc, const Quads& w, const int32_t* x) {
  if constexpr (Signed) return dot_s8(acc, w.lo, w.hi, x[0], x[1]);
  else return dot_u8(acc, w.lo, w.hi, x[0], x[1]);
}

// Chunk C of block b of NT tiles (units at p[j]) against MR rows.
template <typename Codec, int C, int MR, int NT>
ITERSERVE_INLINE void chunk_dots(const Rows& rows, int64_t m0, int64_t blk, const uint8_t* const* p,
                                 int b, I16 (&dot)[Codec::kHalves][MR][NT]) {
  constexpr int h = Codec::kHalves == 2 ? C / 2 : 0;
  int32_t quads[MR][2];
  for (int r = 0; r < MR; ++r) x_quads(rows, m0 + r, blk, C, quads[r]);
  for (int j = 0; j < NT; ++j) {
    const Quads w = Codec::template chunk<C>(p[j], b);
    for (int r = 0; r < MR; ++r) dot[h][r][j] = dot_quads<Codec::kSigned>(dot[h][r][j], w, quads[r]);
  }
}

// Few rows: MR rows x NT tiles (from tile0), decoding each block in registers.
template <typename Codec, int MR, int NT>
inline void block_tiles(const Rows& rows, int64_t m0, const uint8_t* w, int64_t stride,
                        int64_t tile0, const Epilogue& ep) {
  constexpr int H = Codec::kHalves, kBlocks = Codec::kInputs / kBlock;
  const int64_t units = rows.K / Codec::kInputs;
  F16 acc[MR][NT];
  zero_all(acc);
  for (int64_t u = 0; u < units; ++u) {
    const uint8_t* p[NT];
    for (int j = 0; j < NT; ++j) p[j] = w + (tile0 + j) * stride + u * Codec::kBytes;
    for (int b = 0; b < kBlocks; ++b) {
      const int64_t blk = u * kBlocks + b;
      I16 dot[H][MR][NT];
      for (int h = 0; h < H; ++h) zero_all(dot[h]);
      chunk_dots<Codec, 0, MR, NT>(rows, m0, blk, p, b, dot);
      chunk_dots<Codec, 1, MR, NT>(rows, m0, blk, p, b, dot);
      chunk_dots<Codec, 2, MR, NT>(rows, m0, blk, p, b, dot);
      chunk_dots<Codec, 3, MR, NT>(rows, m0, blk, p, b, dot);
      F16 a[NT][H], o[NT][H];
      for (int j = 0; j < NT; ++j) Codec::scales(p[j], b, a[j], o[j]);
      fold<H, Codec::kOffset>(acc, dot, a, o, rows, m0, blk);
    }
  }
  store_all(ep, m0, tile0, acc);
}

// Many rows: a panel holds a few tiles' blocks decoded, per tile and block of 32 inputs:
// chunk c's lo and hi (64 bytes each, at 128 c), then a_h and o_h (16 fp32 each).
template <int H>
constexpr int64_t panel_block_bytes() { return 512 + 2 * 64 * H; }

template <typename Codec>
void decode_panel(const uint8_t* w, int64_t stride, int64_t tile0, int64_t tiles, int64_t K,
                  uint8_t* panel) {
  constexpr int H = Codec::kHalves, kBlocks = Codec::kInputs / kBlock;
  constexpr int64_t kBlockBytes = panel_block_bytes<H>();
  for (int64_t j = 0; j < tiles; ++j) {
    uint8_t* out = panel + j * (K / kBlock) * kBlockBytes;
    for (int64_t u = 0; u < K / Codec::kInputs; ++u) {
      const uint8_t* p = w + (tile0 + j) * stride + u * Codec::kBytes;
      for (int b = 0; b < kBlocks; ++b, out += kBlockBytes) {
        const Quads q[4] = {Codec::template chunk<0>(p, b), Codec::template chunk<1>(p, b),
                            Codec::template chunk<2>(p, b), Codec::template chunk<3>(p, b)};
        for (int c = 0; c < 4; ++c) {
          q[c].lo.store(out + 128 * c);
          q[c].hi.store(out + 128 * c + 64);
        }
        F16 a[H], o[H];
        Codec::scales(p, b, a, o);
        for (int h = 0; h < H; ++h) {
          a[h].store(reinterpret_cast<float*>(out + 512 + 128 * h));
          o[h].store(reinterpret_cast<float*>(out + 512 + 128 * h + 64));
        }
      }
    }
  }
}

template <bool Signed, int H, bool Offset, int MR, int NT>
inline void panel_tiles(const Rows& rows, int64_t m0, const uint8_t* panel, int64_t j0,
                        int64_t tile0, const Epilogue& ep) {
  constexpr int64_t kBlockBytes = panel_block_bytes<H>();
  const int64_t blocks = rows.K / kBlock, tile_bytes = blocks * kBlockBytes;
  F16 acc[MR][NT];
  zero_all(acc);
  const uint8_t* p = panel + j0 * tile_bytes;
  for (int64_t blk = 0; blk < blocks; ++blk, p += kBlockBytes) {
    I16 dot[H][MR][NT];
    for (int h = 0; h < H; ++h) zero_all(dot[h]);
    for (int c = 0; c < 4; ++c) {
      const int h = H == 2 ? c / 2 : 0;
      int32_t quads[MR][2];
      for (int r = 0; r < MR; ++r) x_quads(rows, m0 + r, blk, c, quads[r]);
      for (int j = 0; j < NT; ++j) {
        const uint8_t* q = p + j * tile_bytes + 128 * c;
        const Quads wv{I16::load(q), I16::load(q + 64)};
        for (int r = 0; r < MR; ++r) dot[h][r][j] = dot_quads<Signed>(dot[h][r][j], wv, quads[r]);
      }
    }
    F16 a[NT][H], o[NT][H];
    for (int j = 0; j < NT; ++j)
      for (int h = 0; h < H; ++h) {
        const auto* s = reinterpret_cast<const float*>(p + j * tile_bytes + 512 + 128 * h);
        a[j][h] = F16::load(s);
        o[j][h] = F16::load(s + kLanes);
      }
    fold<H, Offset>(acc, dot, a, o, rows, m0, blk);
  }
  store_all(ep, m0, tile0, acc);
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

// Steps of up to this many rows decode blocks in registers; larger ones through a panel.
constexpr int64_t kRegisterRows = 4;
// Tiles per pass of the register road: their weights (8 x 16 outputs x K inputs) stay in L2
// while every block of rows reads them, so a weight comes from memory once per step however
// many rows there are.
constexpr int64_t kTilesPerPass = 8;
// Bytes of a decoded panel: within L2 beside the rows.
constexpr int64_t kPanelBytes = 256 * 1024;
// Rows a panel pass takes together: registers for MR rows x NT tiles of sums.
template <int H>
constexpr int panel_rows() { return kParts == 1 ? 4 : 2; }
template <int H>
constexpr int panel_tiles_per_step() { return kParts == 1 ? (H == 1 ? 2 : 1) : 1; }

struct Segment {
  Format format;
  const uint8_t* data;
  int64_t stride;  // bytes a tile
  int64_t tiles;
  int64_t first;   // its first tile among all the weight's
};

// Calls run.template operator()<MR>(m) for every group of up to 4 rows, from m0 = 0.
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

// NT tiles a step, then single tiles to the end.
template <int NT, typename F>
ITERSERVE_INLINE void tile_steps(int64_t t_begin, int64_t t_end, F&& run) {
  int64_t t = t_begin;
  if constexpr (NT > 1)
    for (; t + NT <= t_end; t += NT) run(std::integral_constant<int, NT>{}, t);
  for (; t < t_end; ++t) run(std::integral_constant<int, 1>{}, t);
}

template <typename Codec>
void codec_range(const Segment& seg, const Rows& rows, int64_t M, int64_t t_begin, int64_t t_end,
                 const Epilogue& ep) {
  constexpr int H = Codec::kHalves;
  if (M <= kRegisterRows) {
    for (int64_t t0 = t_begin; t0 < t_end; t0 += kTilesPerPass) {
      const int64_t t1 = std::min(t0 + kTilesPerPass, t_end);
      row_groups<4>(M, [&](auto mr, int64_t m0) {
        constexpr int MR = decltype(mr)::value;
        tile_steps<tiles_per_step<MR, H>()>(t0, t1, [&](auto nt, int64_t t) {
          constexpr int NT = decltype(nt)::value;
          block_tiles<Codec, MR, NT>(rows, m0, seg.data, seg.stride, t, ep.shifted(seg.first));
        });
      });
    }
    return;
  }
  const int64_t panel_tile = (rows.K / kBlock) * panel_block_bytes<H>();
  const int64_t per_pass = std::clamp<int64_t>(kPanelBytes / panel_tile, 1, kTilesPerPass);
  thread_local std::vector<uint8_t> panel;
  if (static_cast<int64_t>(panel.size()) < per_pass * panel_tile) panel.resize(per_pass * panel_tile);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += per_pass) {
    const int64_t t1 = std::min(t0 + per_pass, t_end);
    decode_panel<Codec>(seg.data, seg.stride, t0, t1 - t0, rows.K, panel.data());
    row_groups<panel_rows<H>()>(M, [&](auto mr, int64_t m0) {
      constexpr int MR = decltype(mr)::value;
      tile_steps<panel_tiles_per_step<H>()>(t0, t1, [&](auto nt, int64_t t) {
        constexpr int NT = decltype(nt)::value;
        panel_tiles<Codec::kSigned, H, Codec::kOffset, MR, NT>(rows, m0, panel.data(), t - t0, t,
                                                                ep.shifted(seg.first));
      });
    });
  }
}

template <bool Half>
void dense_range(const Segment& seg, const Rows& rows, int64_t M, int64_t t_begin, int64_t t_end,
                 const Epilogue& ep) {
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTilesPerPass) {
    const int64_t t1 = std::min(t0 + kTilesPerPass, t_end);
    row_groups<4>(M, [&](auto mr, int64_t m0) {
      constexpr int MR = decltype(mr)::value;
      tile_steps<tiles_per_step<MR>()>(t0, t1, [&](auto nt, int64_t t) {
        constexpr int NT = decltype(nt)::value;
        if constexpr (Half) f16_tiles<MR, NT>(rows, m0, seg.data, t, ep.shifted(seg.first));
        else bf16_tiles<MR, NT>(rows, m0, seg.data, t, ep.shifted(seg.first));
      });
    });
  }
}

void segment_range(const Segment& seg, const Rows& rows, int64_t M, int64_t t_begin,
                   int64_t t_end, const Epilogue& ep) {
  if (seg.format == Format::kBf16) return dense_range<false>(seg, rows, M, t_begin, t_end, ep);
  if (seg.format == Format::kF16) return dense_range<true>(seg, rows, M, t_begin, t_end, ep);
  with_codec(seg.format, [&](auto codec) {
    codec_range<decltype(codec)>(seg, rows, M, t_begin, t_end, ep);
  });
}

// Thread i's share of all tiles, [bounds[i], bounds[i + 1]), by equal shares of the cost:
// bytes read at few rows (weights streamed once), outputs at many (arithmetic).
std::vector<int64_t> split_tiles(const std::vector<Segment>& segs, int64_t M, int threads) {
  double total = 0;
  std::vector<double> cost(segs.size());
  for (size_t s = 0; s < segs.size(); ++s) {
    cost[s] = M <= kRegisterRows ? static_cast<double>(segs[s].stride) : 1.0;
    total += cost[s] * static_cast<double>(segs[s].tiles);
  }
  std::vector<int64_t> bounds(threads + 1, 0);
  double done = 0;
  int next = 1;
  for (size_t s = 0; s < segs.size(); ++s)
    for (int64_t t = 0; t < segs[s].tiles; ++t) {
      while (next < threads && done >= total * next / threads) bounds[next++] = segs[s].first + t;
      done += cost[s];
    }
  const int64_t all = segs.empty() ? 0 : segs.back().first + segs.back().tiles;
  for (; next <= threads; ++next) bounds[next] = all;
  bounds[threads] = all;
  return bounds;
}

}  // namespace iterserve
