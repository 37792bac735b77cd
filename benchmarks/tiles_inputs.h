// What benchmarks/tiles_timing.cpp and tiles_ab.cpp feed the projection loops: a weight of
// random bytes on 2 MiB pages (its scales random too: they do not change the loops' speed),
// then M rows of K normal bf16 activations, from one seeded generator.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <vector>
#include <sys/mman.h>

struct TilesInputs {
  uint8_t* weight;
  std::vector<at::BFloat16> x;

  TilesInputs(size_t weight_bytes, int64_t M, int64_t K) : x(M * K) {
    constexpr size_t kPage = 2 << 20;
    const size_t total = (weight_bytes + kPage - 1) / kPage * kPage;
    weight = static_cast<uint8_t*>(std::aligned_alloc(kPage, total));
    madvise(weight, total, MADV_HUGEPAGE);
    std::mt19937 rng(1);
    for (size_t i = 0; i < total; ++i) weight[i] = rng() & 0xff;
    std::normal_distribution<float> normal;
    for (auto& v : x) v = at::BFloat16(normal(rng));
  }
  ~TilesInputs() { std::free(weight); }
  TilesInputs(const TilesInputs&) = delete;
  TilesInputs& operator=(const TilesInputs&) = delete;
};
