// How fast a core reads a paged KV pool as decode attention walks it, by how many pages it
// reads at once: a Llama 3.2 3B's K and V (28 layers, 8 kv heads, 128 dims in bf16, blocks
// of 16 keys: one kv head's block is one 4 KiB page), one sequence of `keys` keys on blocks
// handed out in a shuffled order (as after hours of churn), each layer its own memory. Each
// thread takes every other kv head and reads its K rows, then its V rows, walking the keys in
// `lanes` stretches side by side (one key of each stretch in turn, each row asked for into L2
// 32 keys ahead in its stretch; kernels/csrc/attention_loops.h asks 64 keys ahead), with
// `work` dependent multiply-adds a key (~4 cycles each) to stand for attention's arithmetic. The lane
// counts run in turns, `rounds` times, and each prints its median GB/s: compare within one
// run (the machine is shared).
//
// What it showed (Intel Xeon family 6 model 207, avx512bf16, 4096 keys, 2026-12-01): two
// threads, one lane 18.8-23.7 GB/s, four lanes 22.2-30.4 (1.2-1.3x), also with arithmetic
// in the loop (work 8: 16.5 against 21.0); one thread 10.1 and 12.1. The attention op read
// the same pool at 15.5-15.7 GB/s beside it, and its loops taken through four lanes were no
// faster (docs/benchmarks.md, "where a long context's attention waits").
//
//   g++ -O2 -std=c++17 -march=native -pthread -o /tmp/kv_pool_read benchmarks/kv_pool_read.cpp
//   /tmp/kv_pool_read [keys=4096] [threads=2] [work=0] [rounds=3] [lanes=1,2,4,8]
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kKvHeads = 8, kBlock = 16, kLayers = 28, kRowBytes = 128 * 2, kLine = 64;
constexpr int kAhead = 32;  // keys ahead in a lane

// One cache line as the machine's widest vector takes it (-march=native).
typedef uint64_t Line __attribute__((vector_size(kLine)));

struct Pool {
  int keys, blocks;
  std::vector<char*> k, v;  // per layer [kv head][block][16 rows]
  std::vector<int> table;   // the sequence's blocks, shuffled
};

const char* row(const Pool& p, const char* base, int head, int key) {
  return base + ((int64_t{head} * p.blocks + p.table[key / kBlock]) * kBlock + key % kBlock) * kRowBytes;
}

// One kv head's rows of one cache, `lanes` stretches side by side; returns a check value.
uint64_t read_head(const Pool& p, const char* base, int head, int lanes, int work, double& chain) {
  const int per_lane = p.keys / lanes;
  Line seen = {};
  for (int i = 0; i < per_lane; ++i) {
    for (int l = 0; l < lanes; ++l) {
      const int key = l * per_lane + i;
      if (i + kAhead < per_lane) {
        const char* ahead = row(p, base, head, key + kAhead);
        for (int b = 0; b < kRowBytes; b += kLine) __builtin_prefetch(ahead + b, 0, 2);
      }
      const char* r = row(p, base, head, key);
      for (int b = 0; b < kRowBytes; b += kLine) {
        Line line;
        std::memcpy(&line, r + b, kLine);
        seen |= line;
      }
      for (int w = 0; w < work; ++w) chain = chain * 0.999 + 1e-3;
    }
  }
  uint64_t any = 0;
  for (int i = 0; i < kLine / 8; ++i) any |= seen[i];
  return any;
}

// A step's time includes starting its threads, per layer (~1 ms: 64 keys take 1.2 ms; the same
// for every lane count, so the ratios stand and the GB/s of a 20-40 ms step read a little low).
double step_seconds(const Pool& p, int threads, int lanes, int work, uint64_t& check) {
  const auto start = std::chrono::steady_clock::now();
  for (int layer = 0; layer < kLayers; ++layer) {
    std::vector<uint64_t> seen(threads);
    std::vector<std::thread> pool;
    auto run = [&](int t) {
      double chain = 1.0;
      for (int h = t; h < kKvHeads; h += threads) {
        seen[t] |= read_head(p, p.k[layer], h, lanes, work, chain);
        seen[t] |= read_head(p, p.v[layer], h, lanes, work, chain);
      }
      seen[t] |= chain > 1e300;  // keep the chain
    };
    for (int t = 1; t < threads; ++t) pool.emplace_back(run, t);
    run(0);
    for (auto& th : pool) th.join();
    for (uint64_t s : seen) check |= s;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int keys = argc > 1 ? std::atoi(argv[1]) : 4096;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const int work = argc > 3 ? std::atoi(argv[3]) : 0;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 3;
  std::vector<int> lane_counts;
  std::stringstream list(argc > 5 ? argv[5] : "1,2,4,8");
  for (std::string item; std::getline(list, item, ',');) lane_counts.push_back(std::stoi(item));
  for (int lanes : lane_counts)
    if (lanes < 1 || keys % (lanes * kBlock) != 0) {
      std::fprintf(stderr, "keys must be whole blocks in every lane (%d keys, %d lanes)\n", keys, lanes);
      return 1;
    }

  Pool p{keys, keys / kBlock + 16, {}, {}, {}};
  const size_t bytes = size_t{kKvHeads} * p.blocks * kBlock * kRowBytes;
  for (int layer = 0; layer < kLayers; ++layer)
    for (auto* cache : {&p.k, &p.v}) {
      char* mem = static_cast<char*>(std::aligned_alloc(4096, bytes));
      std::memset(mem, layer + 1, bytes);
      cache->push_back(mem);
    }
  p.table.resize(p.blocks);
  for (int i = 0; i < p.blocks; ++i) p.table[i] = i;
  std::shuffle(p.table.begin(), p.table.end(), std::mt19937(1));

  const double read = 2.0 * kLayers * kKvHeads * keys * kRowBytes;
  std::vector<std::vector<double>> times(lane_counts.size());
  uint64_t check = 0;
  for (int r = 0; r < rounds; ++r)
    for (size_t c = 0; c < lane_counts.size(); ++c)
      for (int rep = 0; rep < 5; ++rep)
        times[c].push_back(step_seconds(p, threads, lane_counts[c], work, check));
  std::printf("K and V of a 3B, %d keys, %d threads, work %d, %d rounds of 5 steps in turns\n",
              keys, threads, work, rounds);
  for (size_t c = 0; c < lane_counts.size(); ++c) {
    std::sort(times[c].begin(), times[c].end());
    const double median = times[c][times[c].size() / 2];
    std::printf("lanes %d: %.2f ms a step, %.1f GB/s\n", lane_counts[c], median * 1e3, read / median / 1e9);
  }
  std::printf("(check %llx)\n", static_cast<unsigned long long>(check & 0xff));
  for (auto* cache : {&p.k, &p.v})
    for (char* mem : *cache) std::free(mem);
}
