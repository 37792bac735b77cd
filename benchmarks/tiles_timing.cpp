// The projection loops alone (kernels/csrc/tiles.h), timed on one thread: one weight [N, K]
// of random blocks in a format, M rows, best of `reps` calls. What docs/benchmarks.md's
// standalone figures come from; the loops are the kernels' own, with no torch runtime.
//
//   g++ -O3 -std=c++17 -DCPU_CAPABILITY=AVX512 -DCPU_CAPABILITY_AVX512 -mavx512f -mavx512bw \
//       -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c -fno-ipa-pure-const -fno-ipa-modref \
//       -Isrc/iterserve/kernels/csrc -I$TORCH/include -I$TORCH/include/torch/csrc/api/include \
//       -o /tmp/tiles_timing benchmarks/tiles_timing.cpp
//   (AVX2: -DCPU_CAPABILITY=AVX2 -DCPU_CAPABILITY_AVX2 -mavx2 -mfma -mf16c; TORCH is
//   .venv/lib/python3.11/site-packages/torch)
//   taskset -c 1 /tmp/tiles_timing <format code> <N> <K> <M> [reps]
//
// Format codes: blocks.h `Format` (Q4_0 10, Q8_0 14, Q4_K 22, Q6_K 24, ...). The check (the
// finite outputs' sum and count, and a hash of every output's bits) is the same for two
// builds that compute alike.
#include "gguf_repack.h"
#include "tiles.h"
#include "tiles_inputs.h"
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
using namespace iterserve;
int main(int argc, char** argv) {
  const auto f = static_cast<Format>(atoi(argv[1]));
  const int64_t N = atol(argv[2]), K = atol(argv[3]), M = atol(argv[4]);
  const int reps = argc > 5 ? atoi(argv[5]) : 5;
  const int64_t bytes = tile_bytes(f, K), tiles = N / kTile;
  const TilesInputs inputs(tiles * bytes, M, K);
  uint8_t* packed_p = inputs.weight;
  const std::vector<at::BFloat16>& x = inputs.x;
  QuantizedBuffers q(M, K, unit_inputs(f));
  for (int64_t m = 0; m < M; ++m) q.row(x.data() + m * K, K, m);
  Rows rows{K, nullptr, 0, nullptr, 0, {}, {}};
  (q.view.unit == 256 ? rows.per256 : rows.per32) = q.view;
  std::vector<float> out(M * N);
  Epilogue ep{nullptr, out.data(), N, nullptr, nullptr, 0};
  const Segment seg{f, packed_p, bytes, tiles, 0};
  double best = 1e9;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t m0 = 0; m0 < M; m0 += kSweepRowBlock)  // as linear.cpp runs many rows
      segment_range(seg, rows.from(m0), std::min(kSweepRowBlock, M - m0), 0, tiles,
                    ep.from_row(m0));
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
  }
  double sum = 0; long nf = 0; for (float v : out) if (std::isfinite(v) && std::fabs(v) < 1e30) sum += v, ++nf;
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the outputs' bits
  for (float v : out) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    hash = (hash ^ bits) * 1099511628211ull;
  }
  printf("fmt %d N %ld K %ld M %ld: %.2f ms, %.1f GOP/s (chk %g %ld %016llx)\n", (int)f, N, K, M,
         best * 1e3, 2.0 * M * N * K / best / 1e9, sum, nf, (unsigned long long)hash);
}
