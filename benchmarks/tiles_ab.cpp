// The projection loops (kernels/csrc/tiles.h) of two trees in one process, called in
// alternation on the same weight and rows: the median of the ratios of adjacent calls
// (earlier / this tree), and whether the two gave the same output bits. On a shared machine
// whose speed drifts for minutes at a time, adjacent calls meet the same spell where builds run
// in turns (benchmarks/tiles_timing.cpp) often do not. One thread, the inputs of
// benchmarks/tiles_inputs.h.
//
//   git worktree add /tmp/earlier <rev>          # the tree to compare against
//   mkdir -p /tmp/tiles_ab && ln -sfn /tmp/earlier/src/iterserve/kernels/csrc /tmp/tiles_ab/earlier
//   g++ -O3 -std=c++17 <tiles_timing.cpp's ISA flags> -I/tmp/tiles_ab \
//       -Isrc/iterserve/kernels/csrc -I$TORCH/include -I$TORCH/include/torch/csrc/api/include \
//       -o /tmp/tiles_ab/run benchmarks/tiles_ab.cpp
//   taskset -c 1 /tmp/tiles_ab/run <format code> <N> <K> <M> [calls, 20]
//
// The earlier tree's headers are compiled into namespace iterserve_earlier.
#define iterserve iterserve_earlier
#include <earlier/gguf_repack.h>
#include <earlier/tiles.h>
#undef iterserve
#include "gguf_repack.h"
#include "tiles.h"
#include "tiles_inputs.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// One tree's call: its own quantized rows and outputs over the shared weight.
template <typename QuantizedBuffers, typename Rows, typename Epilogue, typename Segment,
          typename Format>
struct Call {
  QuantizedBuffers q;
  Rows rows{};
  std::vector<float> out;
  Epilogue ep{};
  Segment seg{};

  Call(int f, int64_t N, int64_t K, int64_t M, int64_t unit, const at::BFloat16* x,
       const uint8_t* weight, int64_t bytes)
      : q(M, K, unit), out(M * N) {
    for (int64_t m = 0; m < M; ++m) q.row(x + m * K, K, m);
    rows.K = K;
    (unit == 256 ? rows.per256 : rows.per32) = q.view;
    ep.out_f32 = out.data();
    ep.ld_out = N;
    seg = Segment{static_cast<Format>(f), weight, bytes, N / 16, 0};
  }
};

template <typename F>
double seconds(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s <format code> <N> <K> <M> [calls]\n", argv[0]);
    return 2;
  }
  const int f = std::atoi(argv[1]);
  const int64_t N = std::atol(argv[2]), K = std::atol(argv[3]), M = std::atol(argv[4]);
  const int calls = argc > 5 ? std::atoi(argv[5]) : 20;
  const auto format = static_cast<iterserve::Format>(f);
  const int64_t bytes = iterserve::tile_bytes(format, K), unit = iterserve::unit_inputs(format);
  const TilesInputs inputs((N / 16) * bytes, M, K);
  const uint8_t* weight = inputs.weight;
  const at::BFloat16* x = inputs.x.data();

  namespace e = iterserve_earlier;
  namespace t = iterserve;
  Call<e::QuantizedBuffers, e::Rows, e::Epilogue, e::Segment, e::Format> earlier(
      f, N, K, M, unit, x, weight, bytes);
  Call<t::QuantizedBuffers, t::Rows, t::Epilogue, t::Segment, t::Format> now(
      f, N, K, M, unit, x, weight, bytes);
  std::vector<double> ratios, t_earlier, t_now;
  for (int c = 0; c < calls; ++c) {
    // Which goes first alternates: the second call finds the weight in the caches the first
    // filled.
    double a = 0, b = 0;
    auto run_earlier = [&] {
      a = seconds([&] { e::segment_range(earlier.seg, earlier.rows, M, 0, N / 16, earlier.ep); });
    };
    auto run_now = [&] {
      b = seconds([&] { t::segment_range(now.seg, now.rows, M, 0, N / 16, now.ep); });
    };
    if (c % 2) run_earlier(), run_now();
    else run_now(), run_earlier();
    t_earlier.push_back(a);
    t_now.push_back(b);
    ratios.push_back(a / b);
  }
  std::sort(ratios.begin(), ratios.end());
  std::sort(t_earlier.begin(), t_earlier.end());
  std::sort(t_now.begin(), t_now.end());
  const bool same =
      std::memcmp(earlier.out.data(), now.out.data(), earlier.out.size() * sizeof(float)) == 0;
  std::printf(
      "fmt %d N %ld K %ld M %ld: best %.3f ms earlier, %.3f ms this tree; earlier / this tree, "
      "median of %d: %.3f (quartiles %.3f-%.3f); outputs %s\n",
      f, N, K, M, t_earlier[0] * 1e3, t_now[0] * 1e3, calls, ratios[calls / 2], ratios[calls / 4],
      ratios[3 * calls / 4], same ? "the same bits" : "DIFFER");
  return 0;
}
