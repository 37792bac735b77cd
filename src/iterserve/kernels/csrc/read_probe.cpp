// The machine's read bandwidth as the decode loops can reach it: a buffer read once, each
// thread's equal share cut into 4 lanes walked side by side, each lane one stream asked for a
// few lines ahead (software prefetch), as the few-row loops read a weight (tiles.h
// `LaneRun`, `prefetch_units`). The lines are or-ed together so that nothing is elided.
//
// Why beside torch's float32 sum (iterserve.bench.bandwidth): on an Intel Xeon VM (family 6,
// model 207, 2 cores, 2026-12-01, avx512bf16) one plain stream a thread read 21-27 GB/s
// while a 1B's and a 3B's batch-1 decode read 31 GB/s and more (big_models.py printed shares
// of 117-143%): a server core's misses in flight bound one stream, and several streams
// fetched ahead take more of the memory. A share of a figure the decode itself beats says
// nothing.

#include <ATen/Parallel.h>

#include "ops.h"
#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace iterserve {
namespace {

using at::Tensor;

constexpr int kStreams = 4;
constexpr int64_t kLine = 64;
// Bytes a lane asks for ahead of its reads: about one unit of a Q4_K tile (2.3 KB), as the
// loops ask. On the Xeon above (2 threads, rounds in turns): 16 lines ahead read 27 GB/s where
// the sum read 21-23, 40 lines 37-38 (29 in a slow spell) where it read 24-28, 96 no better.
// One thread: 18-20 GB/s.
constexpr int64_t kAhead = 40 * kLine;

// Bytes [begin, end) (whole lines) or-ed together, in kStreams lanes side by side.
int64_t read_lanes(const uint8_t* begin, const uint8_t* end) {
  const int64_t lines = (end - begin) / kLine, per_lane = lines / kStreams;
  I16 seen[kStreams];
  for (auto& s : seen) s = I16::zero();
  for (int64_t i = 0; i < per_lane; ++i) {
    ITERSERVE_UNROLL for (int l = 0; l < kStreams; ++l) {
      const uint8_t* p = begin + (l * per_lane + i) * kLine;
      __builtin_prefetch(p + kAhead, 0, 3);
      seen[l] = seen[l] | I16::load(p);
    }
  }
  for (int64_t i = kStreams * per_lane; i < lines; ++i)
    seen[0] = seen[0] | I16::load(begin + i * kLine);
  alignas(64) int32_t lanes[kLanes];
  I16 all = seen[0];
  for (int l = 1; l < kStreams; ++l) all = all | seen[l];
  all.store(lanes);
  int64_t any = 0;
  for (int32_t v : lanes) any |= static_cast<uint32_t>(v);
  return any;
}

}  // namespace

// A uint8 buffer's whole 64-byte lines or-ed together (a check value: what matters is how
// long it takes), read by `threads` threads in equal shares.
int64_t read_probe(const Tensor& buffer, int64_t threads) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.is_contiguous(),
              "read_probe: a contiguous uint8 buffer");
  const auto* data = buffer.data_ptr<uint8_t>();
  const int64_t lines = buffer.numel() / kLine;
  threads = std::max<int64_t>(1, std::min(threads, lines));
  std::vector<int64_t> seen(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      seen[t] = read_lanes(data + lines * t / threads * kLine,
                           data + lines * (t + 1) / threads * kLine);
  });
  int64_t any = 0;
  for (int64_t s : seen) any |= s;
  return any;
}

}  // namespace iterserve
