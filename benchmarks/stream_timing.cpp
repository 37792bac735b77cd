// A few rows' projections as a decode step streams them (kernels/csrc/tiles.h), on two
// threads, against a plain read of the same bytes timed in the same run: the share of the
// memory's speed the loops reach, with no torch runtime and no Python between the calls.
// The weights are a Llama 3.2 1B's projections (qkv 3072 x 2048, o 2048 x 2048, gate_up
// 16384 x 2048, down 2048 x 8192; with SHAPES=3b a Llama 3.2 3B's, 5120 x 3072, 3072 x 3072,
// 16384 x 3072, 3072 x 8192; with SHAPES=8b a Llama 3.1 8B's, 6144 x 4096, 4096 x 4096,
// 28672 x 4096, 4096 x 14336; with SHAPES=gemma4 a Gemma 4 E2B's narrow layers, 2560 x 1536,
// 1536 x 2048, 12288 x 1536, 1536 x 6144) over `layers` layers, each its own random blocks on 2 MiB
// pages, each split in two equal halves of tiles as the engine splits a few rows' step. On a
// shared machine the memory's speed moves with the other tenants, so run builds in turns
// (several rounds each) and compare runs whose plain reads agree.
//
//   g++ -O3 -std=c++17 -fopenmp -DCPU_CAPABILITY=AVX512 -DCPU_CAPABILITY_AVX512 -mavx512f \
//       -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mfma -mf16c -fno-ipa-pure-const \
//       -fno-ipa-modref -Isrc/iterserve/kernels/csrc -I$TORCH/include \
//       -I$TORCH/include/torch/csrc/api/include -o /tmp/stream_timing benchmarks/stream_timing.cpp
//   (AVX2: -DCPU_CAPABILITY=AVX2 -DCPU_CAPABILITY_AVX2 -mavx2 -mfma -mf16c; TORCH is
//   .venv/lib/python3.11/site-packages/torch)
//   /tmp/stream_timing <format code> [layers=16] [reps=5] [rows=1]
//   IN_CACHE=1 /tmp/stream_timing ...   # one 1024 x 2048 weight over and over: the loops' own rate
//   SHAPES=8b /tmp/stream_timing 22 4     # an 8B's layers (218 MB each in Q4_K)
//   SHAPES=gemma4 /tmp/stream_timing 22 24  # a hidden size of 1536 (Gemma 4 E2B, Qwen 1.5B)
//   SHARES=1 /tmp/stream_timing 22          # each weight split as the engine splits it
//                                           # (thread_shares.h `Shares`), not in two halves
//
// Format codes: blocks.h `Format` (Q4_0 10, Q8_0 14, Q4_K 22, Q6_K 24, ...).
#include "gguf_repack.h"
#include "thread_shares.h"
#include "tiles.h"
#include <omp.h>
#include <sys/mman.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>
using namespace iterserve;

namespace {

struct Weight {
  int64_t N, K, tile_bytes;
  const uint8_t* data;
  int64_t bytes() const { return N / kTile * tile_bytes; }
};

uint8_t* random_pages(size_t bytes, std::mt19937& rng) {
  const size_t huge = 2 << 20, total = (bytes + huge - 1) / huge * huge;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(huge, total));
  madvise(p, total, MADV_HUGEPAGE);
  // Values and scales alike random; fp16 fields kept finite (their exponent bits < 0x3f).
  for (size_t i = 0; i < total; i += 4) *reinterpret_cast<uint32_t*>(p + i) = rng() & 0x3f3f3f3f;
  return p;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Every weight's bytes summed as 32-bit integers, each half by its own thread.
int64_t plain_read(const std::vector<Weight>& weights) {
  int64_t total = 0;
  for (const Weight& w : weights) {
    const int64_t n = w.bytes() / 64 * 64;
#pragma omp parallel num_threads(2) reduction(+ : total)
    {
      const int t = omp_get_thread_num();
      const auto* p = reinterpret_cast<const int32_t*>(w.data + n * t / 2 / 64 * 64);
      const auto* end = reinterpret_cast<const int32_t*>(w.data + n * (t + 1) / 2 / 64 * 64);
      I16 s0 = I16::splat(0), s1 = s0;
      for (; p + 32 <= end; p += 32) s0 = s0 + I16::load(p), s1 = s1 + I16::load(p + 16);
      alignas(64) int32_t lanes[16];
      (s0 + s1).store(lanes);
      for (int32_t v : lanes) total += v;
    }
  }
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  const auto format = static_cast<Format>(atoi(argv[1]));
  const int layers = argc > 2 ? atoi(argv[2]) : 16;
  const int reps = argc > 3 ? atoi(argv[3]) : 5;
  const int64_t M = argc > 4 ? atol(argv[4]) : 1;
  const bool in_cache = getenv("IN_CACHE") != nullptr;
  const bool engine_shares = getenv("SHARES") != nullptr;
  using Shapes = std::vector<std::pair<int64_t, int64_t>>;  // (N, K) of qkv, o, gate_up, down
  const std::map<std::string, Shapes> bodies = {
      {"1b", {{3072, 2048}, {2048, 2048}, {16384, 2048}, {2048, 8192}}},
      {"3b", {{5120, 3072}, {3072, 3072}, {16384, 3072}, {3072, 8192}}},
      {"8b", {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}}},
      {"gemma4", {{2560, 1536}, {1536, 2048}, {12288, 1536}, {1536, 6144}}},
  };
  const char* body = getenv("SHAPES");
  if (body && !bodies.count(body)) {
    fprintf(stderr, "SHAPES=%s: not one of 1b, 3b, 8b, gemma4\n", body);
    return 2;
  }
  Shapes shapes = bodies.at(body ? body : "1b");
  if (in_cache) shapes = {{1024, 2048}};
  std::mt19937 rng(1);
  std::vector<Weight> weights;
  for (int l = 0; l < layers; ++l)
    for (auto [N, K] : shapes) {
      const int64_t tile = tile_bytes(format, K);
      if (in_cache && !weights.empty()) weights.push_back(weights.front());
      else weights.push_back({N, K, tile, random_pages(N / kTile * tile, rng)});
    }
  int64_t total = 0;
  for (const Weight& w : weights) total += w.bytes();

  // Activations of both widths, quantized as the step quantizes them.
  std::normal_distribution<float> normal;
  std::vector<QuantizedBuffers> quantized;
  std::vector<int64_t> widths;  // the shapes' K, each once
  for (auto [N, K] : shapes)
    if (std::find(widths.begin(), widths.end(), K) == widths.end()) widths.push_back(K);
  quantized.reserve(widths.size());  // rows point into them
  std::vector<Rows> rows;
  for (int64_t K : widths) {
    std::vector<at::BFloat16> x(M * K);
    for (auto& v : x) v = at::BFloat16(normal(rng));
    QuantizedBuffers& q = quantized.emplace_back(M, K, unit_inputs(format));
    for (int64_t m = 0; m < M; ++m) q.row(x.data() + m * K, K, m);
    Rows& r = rows.emplace_back(Rows{K, nullptr, 0, nullptr, 0, {}, {}});
    (q.view.unit == 256 ? r.per256 : r.per32) = q.view;
  }
  int64_t widest = 0;
  for (auto [N, K] : shapes) widest = std::max(widest, N);
  std::vector<float> out(M * widest);
  const Epilogue ep{nullptr, out.data(), widest, nullptr, nullptr, 0};

  double kernels = 1e9, read = 1e9;
  int64_t check = 0;
  for (int r = 0; r < reps; ++r) {
    auto start = std::chrono::steady_clock::now();
    for (const Weight& w : weights) {
      const Segment seg{format, w.data, w.tile_bytes, w.N / kTile, 0};
      const Rows& x = rows[std::find(widths.begin(), widths.end(), w.K) - widths.begin()];
      if (engine_shares) {
        const std::vector<Segment> segs{seg};
        Shares shares(segs, 2, M);
#pragma omp parallel num_threads(2)
        shares.run(omp_get_thread_num(),
                   [&](const LaneStep& step) { lane_step(seg, x, M, step, ep); });
        continue;
      }
#pragma omp parallel num_threads(2)
      {
        const int t = omp_get_thread_num();
        segment_range(seg, x, M, seg.tiles * t / 2, seg.tiles * (t + 1) / 2, ep);
      }
    }
    kernels = std::min(kernels, seconds_since(start));
    start = std::chrono::steady_clock::now();
    check += plain_read(weights);
    read = std::min(read, seconds_since(start));
  }
  printf("format %d, %ld rows, %.0f MB: kernels %.2f ms = %.1f GB/s, plain read %.2f ms = %.1f GB/s,"
         " share %.2f (out %g, %ld)\n",
         static_cast<int>(format), M, total / 1e6, kernels * 1e3, total / kernels / 1e9, read * 1e3,
         total / read / 1e9, read / kernels, out[5], check & 0xff);
}
