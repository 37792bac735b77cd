// The vector layer of the kernels (src/iterserve/kernels/csrc/simd.h) against scalar
// references, as a standalone program: tests/kernels/test_simd_layer.py compiles it for every ISA
// variant this machine runs and, with a cross compiler and qemu-user, for Arm64, where no
// torch build is at hand to load the kernels themselves. Prints one line per failed check
// and "ok <isa> <lanes per native vector>" when all pass; exits 1 on any failure.

#include "simd.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

using namespace iterserve;

namespace {

int failures = 0;

void check(bool ok, const char* what, int lane, double got, double want) {
  if (!ok) {
    ++failures;
    std::printf("FAIL %s lane %d: got %.9g want %.9g\n", what, lane, got, want);
  }
}

float bf16_round(float x) { return static_cast<float>(c10::BFloat16(x)); }

}  // namespace

int main() {
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  alignas(64) float a[kLanes], b[kLanes], out[kLanes];
  // bf16 widening, every bit pattern: MXFP4's scales include bf16's subnormals.
  for (uint32_t first = 0; first < 0x10000; first += kLanes) {
    c10::BFloat16 halves[kLanes];
    for (int i = 0; i < kLanes; ++i) halves[i].x = static_cast<uint16_t>(first + i);
    load_bf16x16(halves).store(out);
    for (int i = 0; i < kLanes; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &out[i], 4);
      check(bits == (first + i) << 16, "load_bf16x16", i, bits, (first + i) << 16);
    }
  }
  for (int round = 0; round < 200; ++round) {
    for (int i = 0; i < kLanes; ++i) a[i] = normal(rng), b[i] = normal(rng);
    // Ties and specials: round-to-nearest-even must pick the even neighbour.
    if (round == 0) {
      uint32_t tie = 0x3F808000u, odd_tie = 0x3F818000u;  // 1 + 2^-8, and the next odd one
      std::memcpy(&a[0], &tie, 4);
      std::memcpy(&a[1], &odd_tie, 4);
      a[2] = std::numeric_limits<float>::quiet_NaN();
      a[3] = std::numeric_limits<float>::infinity();
    }
    const F16 va = F16::load(a), vb = F16::load(b);

    // bf16 round trip (and rounding kept in fp32)
    c10::BFloat16 packed[kLanes];
    store_bf16x16(packed, va);
    load_bf16x16(packed).store(out);
    for (int i = 0; i < kLanes; ++i) {
      const float want = bf16_round(a[i]);
      check(std::isnan(want) ? std::isnan(out[i]) : out[i] == want, "bf16 round trip", i, out[i],
            want);
    }
    round_bf16(va).store(out);
    for (int i = 0; i < kLanes; ++i) {
      const float want = bf16_round(a[i]);
      check(std::isnan(want) ? std::isnan(out[i]) : out[i] == want, "round_bf16", i, out[i], want);
    }

    // exp for x <= 0: ~1 ulp of Cephes' polynomial; 0 for very negative x
    const F16 neg = F16::zero() - abs(va * F16::splat(10.0f));
    alignas(64) float x[kLanes];
    neg.store(x);
    exp_nonpositive(neg).store(out);
    for (int i = 0; i < kLanes; ++i) {
      if (std::isnan(x[i])) continue;
      const double want = std::exp(static_cast<double>(x[i]));
      const double err = std::abs(out[i] - want);
      check(err <= 4e-7 * want + 1e-44, "exp_nonpositive", i, out[i], want);
    }

    // fmadd, select, sums
    fmadd(va, vb, F16::splat(1.0f)).store(out);
    for (int i = 0; i < kLanes; ++i) {
      // One rounding where the CPU fuses; the generic build may round twice.
      const float want = std::fma(a[i], b[i], 1.0f);
      check(std::isnan(want) || out[i] == want || std::abs(out[i] - want) <= 1e-6f * (std::abs(want) + 1.0f),
            "fmadd", i, out[i], want);
    }
    select(less_than(va, vb), va, vb).store(out);
    for (int i = 0; i < kLanes; ++i) {
      const float want = a[i] < b[i] ? b[i] : a[i];
      check(std::isnan(a[i]) || out[i] == want, "select", i, out[i], want);
    }
    double total = 0.0;
    float top = b[0];
    for (int i = 0; i < kLanes; ++i) total += b[i], top = std::max(top, b[i]);
    check(std::abs(vb.sum() - total) <= 1e-4 * (1 + std::abs(total)), "sum", 0, vb.sum(), total);
    check(vb.max() == top, "max", 0, vb.max(), top);

    // rounding to int, half to even
    alignas(64) int32_t ints[kLanes];
    round_to_int(vb * F16::splat(4.0f)).store(ints);
    for (int i = 0; i < kLanes; ++i) {
      const float want = std::nearbyint(b[i] * 4.0f);
      check(ints[i] == static_cast<int32_t>(want), "round_to_int", i, ints[i], want);
    }

    // reduce16: lane j = sum of a[j]
    F16 rows[kLanes];
    alignas(64) float want16[kLanes];
    for (int j = 0; j < kLanes; ++j) {
      alignas(64) float row[kLanes];
      want16[j] = 0.0f;
      for (int i = 0; i < kLanes; ++i) row[i] = normal(rng), want16[j] += row[i];
      rows[j] = F16::load(row);
    }
    reduce16(rows).store(out);
    for (int j = 0; j < kLanes; ++j)
      check(std::abs(out[j] - want16[j]) <= 1e-4f * (1 + std::abs(want16[j])), "reduce16", j,
            out[j], want16[j]);

    // bf16 pair dot: lane j += w[2j] x0 + w[2j+1] x1
    c10::BFloat16 w[2 * kLanes];
    for (int i = 0; i < 2 * kLanes; ++i) w[i] = c10::BFloat16(normal(rng));
    c10::BFloat16 xb[2] = {c10::BFloat16(normal(rng)), c10::BFloat16(normal(rng))};
    const float xf[2] = {static_cast<float>(xb[0]), static_cast<float>(xb[1])};
    const F16 from_bf16 = pair_dot(vb, load_pairs(w), x_pair(xb));
    const F16 from_fp32 = pair_dot(vb, load_pairs(w), x_pair(xf));
    for (const F16* got : {&from_bf16, &from_fp32}) {
      got->store(out);
      for (int j = 0; j < kLanes; ++j) {
        const double want = b[j] + static_cast<double>(w[2 * j]) * xf[0] +
                            static_cast<double>(w[2 * j + 1]) * xf[1];
        check(std::abs(out[j] - want) <= 1e-5 * (1 + std::abs(want)), "pair_dot", j, out[j], want);
      }
    }

    // int8: widened pairs, stores, dot products
    int8_t bytes[2 * kLanes];
    for (int i = 0; i < 2 * kLanes; ++i) bytes[i] = static_cast<int8_t>(rng() % 255 - 127);
    alignas(64) int32_t lanes[kLanes];
    widen_i8_pairs(bytes).store(lanes);
    for (int j = 0; j < kLanes; ++j) {
      const int32_t lo = static_cast<int16_t>(lanes[j] & 0xFFFF), hi = lanes[j] >> 16;
      check(lo == bytes[2 * j] && hi == bytes[2 * j + 1], "widen_i8_pairs", j, lo, bytes[2 * j]);
    }
    load_i8x16(bytes).store(out);
    for (int j = 0; j < kLanes; ++j) check(out[j] == bytes[j], "load_i8x16", j, out[j], bytes[j]);
    int8_t stored[kLanes];
    for (int j = 0; j < kLanes; ++j) lanes[j] = bytes[j];
    store_i8x16(stored, I16::load(lanes));
    for (int j = 0; j < kLanes; ++j)
      check(stored[j] == bytes[j], "store_i8x16", j, stored[j], bytes[j]);
    // signed weight bytes (Q8_0's, the IQ4 tables'): stored + kSignedBias, -127..127 in value,
    // against int8 activations at the extremes of vpmaddubsw's pair sums
    alignas(64) uint8_t signed_lo[4 * kLanes], signed_hi[4 * kLanes];
    for (int i = 0; i < 4 * kLanes; ++i) {
      const int lo = round % 2 ? (i % 3 ? 127 : -127) : static_cast<int>(rng() % 255) - 127;
      const int hi = round % 2 ? -127 : static_cast<int>(rng() % 255) - 127;
      signed_lo[i] = static_cast<uint8_t>(lo + kSignedBias);
      signed_hi[i] = static_cast<uint8_t>(hi + kSignedBias);
    }
    int8_t xq[8];
    for (int t = 0; t < 8; ++t)
      xq[t] = static_cast<int8_t>(round % 2 ? (t % 2 ? 127 : -127) : rng() % 255 - 127);
    dot_s8(I16::splat(7), I16::load(signed_lo), I16::load(signed_hi), xq).store(lanes);
    for (int j = 0; j < kLanes; ++j) {
      // What the kernels fold: sum (w + kSignedBias) x, the bias taken away by the caller.
      int32_t want = 7;
      for (int t = 0; t < 4; ++t)
        want += signed_lo[4 * j + t] * int32_t{xq[t]} * (kSignedBias ? 1 : 0) +
                int8_t(signed_lo[4 * j + t]) * int32_t{xq[t]} * (kSignedBias ? 0 : 1) +
                signed_hi[4 * j + t] * int32_t{xq[4 + t]} * (kSignedBias ? 1 : 0) +
                int8_t(signed_hi[4 * j + t]) * int32_t{xq[4 + t]} * (kSignedBias ? 0 : 1);
      check(lanes[j] == want, "dot_s8", j, lanes[j], want);
    }

    // 16-entry byte tables (the IQ4 formats' values): each byte's low nibble picks an entry
    alignas(64) int8_t table[4 * kLanes];
    alignas(64) uint8_t index[4 * kLanes], looked[4 * kLanes];
    for (int i = 0; i < 4 * kLanes; ++i) table[i] = static_cast<int8_t>(i % 16 * 13 - 100);
    for (int i = 0; i < 4 * kLanes; ++i) index[i] = static_cast<uint8_t>(rng() % 16);
    lookup16(I16::load(table), I16::load(index)).store(looked);
    for (int i = 0; i < 4 * kLanes; ++i)
      check(int8_t(looked[i]) == table[index[i]], "lookup16", i, int8_t(looked[i]), table[index[i]]);

    // 6-bit bytes (0..63, the widest unsigned values the block formats build) against int8 activations, at the
    // extremes that bring vpmaddubsw's pair sums nearest its int16 limit
    alignas(64) uint8_t wide_lo[4 * kLanes], wide_hi[4 * kLanes];
    for (int i = 0; i < 4 * kLanes; ++i)
      wide_lo[i] = round % 2 ? 63 : rng() % 64, wide_hi[i] = round % 2 ? 63 : rng() % 64;
    int8_t xs6[8];
    for (int t = 0; t < 8; ++t)
      xs6[t] = static_cast<int8_t>(round % 2 ? (round % 4 == 1 ? 127 : -127) : rng() % 255 - 127);
    dot_u8(I16::splat(-5), I16::load(wide_lo), I16::load(wide_hi), xs6).store(lanes);
    for (int j = 0; j < kLanes; ++j) {
      int32_t want = -5;
      for (int t = 0; t < 4; ++t)
        want += wide_lo[4 * j + t] * xs6[t] + wide_hi[4 * j + t] * xs6[4 + t];
      check(lanes[j] == want, "dot_u8", j, lanes[j], want);
    }

    // fp16 loads, logical shifts
    c10::Half halves[kLanes];
    for (int j = 0; j < kLanes; ++j) halves[j] = c10::Half(b[j]);
    load_f16x16(halves).store(out);
    for (int j = 0; j < kLanes; ++j)
      check(out[j] == static_cast<float>(halves[j]), "load_f16x16", j, out[j], halves[j]);
    shift_right<9>(float_to_bits(va)).store(lanes);
    for (int j = 0; j < kLanes; ++j) {
      uint32_t bits;
      std::memcpy(&bits, &a[j], 4);
      check(static_cast<uint32_t>(lanes[j]) == bits >> 9, "shift_right", j, lanes[j], bits >> 9);
    }
  }
  if (failures) return 1;
  std::printf("ok %s %d\n", kIsaName, kNative);
  return 0;
}
