// How a step's attention is cut into work (paged_attention.cpp builds the plan) and the
// loops that run it (attention_loops.h, built in two files: attention_bf16.cpp and
// attention_f32.cpp, one for each type of queries, so that a build compiles their
// instantiations on two cores at once).
#pragma once

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace iterserve::attention {

constexpr int64_t kMaxQueriesPerGroup = 64;  // rows are chunked so that M stays near this
// Keys a partition: one size for every step, so that a query's partitions start at the same
// keys whatever shares its step (a lone decode row, or one of a verify step's rows; a step's
// total keys no longer size them): its output is then the same bits either way, and greedy
// answers do not change under n-gram speculation (benchmarks/greedy_agreement.py). 256 keys
// give a batch-1 decode 4 items a kv head by 1K of context and keep the score scratch small.
constexpr int64_t kPartKeys = 256;
constexpr int64_t kMinParallelWork = 3000;  // keys x queries: ~10 us on one thread
// Bytes of partitions' partial sums a wave of groups holds at most (a group more, when one
// group alone needs more). Held for a whole step at once, they grew with its query rows times
// their context: 584 MB a layer for a 1B's 8192-row step of 4096-token prompts, 69 MB at 512
// rows (~1.1 GB for an 8B's 512 rows at a 32K context). A wave's fit in L3 besides, between
// a partition's writes and the merge's reads.
constexpr int64_t kWavePartialBytes = int64_t{8} << 20;

struct Group {
  int64_t seq, kv_head;
  int64_t row0, rows;       // query rows row0 .. row0+rows-1 of q
  int64_t first_pos;        // position of row0 in its sequence
  int64_t key_lo, key_hi;   // the union of the rows' key windows
  int64_t parts;            // partitions of [key_lo, key_hi)
  int64_t slot;             // first partial slot (in queries) when parts > 1, in its wave's
};

struct Item {
  int64_t group, part;
};

struct Plan {
  const void* q;
  int64_t q_row_stride, q_head_stride;
  const void* key_cache;
  const void* value_cache;
  int64_t row_stride;  // cache elements from one key's row to the next (head_dim, + scale)
  void* out;
  const int32_t* tables;
  int64_t table_stride;
  int64_t num_heads, group_size, head_dim, num_blocks, block_size;
  int64_t window;
  float scale;
  float softcap = 0.0f;  // Gemma 2's attention logit soft-cap (0: none)
  // gpt-oss's attention sinks [num_heads]: one more logit in each query's softmax, with no
  // value (nullptr: none).
  const float* sinks = nullptr;
  int64_t part_keys;
  std::vector<Group> groups;
  std::vector<Item> items;
  // Where each wave's items end: waves of groups run one after the other, each on the same
  // partial slots (kWavePartialBytes).
  std::vector<int64_t> wave_ends;
  // Partitions' un-normalized outputs [slots, head_dim], maxima and sums [slots].
  float* partial_acc = nullptr;
  float* partial_max = nullptr;
  float* partial_sum = nullptr;
  std::unique_ptr<std::atomic<int64_t>[]> done;  // partitions finished, per group
};


// A query's softmax denominator: its keys' sum (of exp(score - top)), plus its head's sink.
inline float with_sink(const Plan& plan, int64_t head, float sum, float top) {
  return plan.sinks == nullptr ? sum : sum + std::exp(plan.sinks[head] - top);
}

inline std::pair<int64_t, int64_t> key_window(int64_t pos, int64_t window) {
  return {window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0, pos + 1};
}


// The head sizes the loops are built for, the one list of them (kernels.ATTENTION_HEAD_DIMS
// repeats it to Python, checked by tests/kernels/test_attention_kernel.py): those of the
// models people run (64: Llama 3.2 1B, SmolLM; 96: Phi-3; 128: most; 256: Gemma; 512: Gemma
// 4's full layers, in spans: kSpan) and 32 for tiny test models. Each costs 4 instantiations
// of every loop in attention_loops.h: 160, 192 and 224, which no common model has, took 37% of
// those loops' compile time (255 -> 160 s at -O3, AVX2), and a cold build of every variant is
// paid by each new machine and CI run. Other multiples of 32 attend in torch
// (model/builder.py).
using BuiltHeadDims = std::integer_sequence<int64_t, 32, 64, 96, 128, 256, 512>;

template <int64_t... D>
constexpr bool built(int64_t head_dim, std::integer_sequence<int64_t, D...>) {
  return ((head_dim == D) || ...);
}

inline bool head_dim_built(int64_t head_dim) { return built(head_dim, BuiltHeadDims{}); }

template <int64_t... D>
std::vector<int64_t> listed(std::integer_sequence<int64_t, D...>) {
  return {D...};
}

inline std::vector<int64_t> built_head_dims() { return listed(BuiltHeadDims{}); }

// Runs every item of the plan for queries (and output) of type T, over a cache of T or, with
// int8_cache, of int8 rows: the instantiations of attention_bf16.cpp (T = at::BFloat16) and
// attention_f32.cpp (T = float).
template <typename T>
void run_items(const Plan& plan, bool int8_cache, bool parallel);

}  // namespace iterserve::attention
