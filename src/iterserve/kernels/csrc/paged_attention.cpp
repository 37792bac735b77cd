// Paged attention for the query rows of one engine step, reading K/V where they lie in the
// block pool (no gather copy).
//
// Layout. Caches are [num_kv_heads, num_blocks, block_size, head_dim] (model/attention.py), so
// one kv head's keys in one block are block_size contiguous rows of head_dim; K and V share
// that layout, so a key's element offset, found once through the block table, serves both.
// An int8 cache (--kv-cache-dtype int8, ops.h) has rows of head_dim int8 values and their
// fp32 scale: a key's dot products are scaled once summed, a V row's scale is folded into
// its probabilities, and the rest is as for bf16.
// q is [T, num_heads, head_dim] with contiguous head_dim rows but any row stride (a slice of
// the fused qkv projection); out is [T, num_heads, head_dim] contiguous.
//
// Work. A *group* is one (sequence, kv head, chunk of the sequence's query rows): its
// M = rows x (num_heads / num_kv_heads) queries all read the same K/V rows, so each row is
// loaded once for all of them. A group's key range (the union of its rows' causal / sliding
// windows) is cut into partitions of at most `part_keys` keys (flash-decoding): enough work
// items to keep every thread busy at batch 1, and bounded scratch. Threads take items from an
// atomic counter (contexts differ in length, so static splits would idle). An item is:
//   1. scores  S[m][k] = q_m . k_k for 16 keys at a time,
//   2. softmax exp(scale*S - max) per query over its own keys (0 elsewhere), max and sum,
//   3. P.V     accumulated in fp32,
//   4. out = acc / sum, rounded once to q's dtype; or, if the group has several partitions,
//      (acc, max, sum) saved, and whoever finishes the group's last partition merges them
//      with log-sum-exp rescaling.
// Everything from scores on is fp32 (bf16 inputs are exact in fp32). Only keys inside a
// group's key range are ever read: padding entries of the block table and the unused tail of
// a sequence's last block (which may hold NaN) are never touched, and a key that lies in the
// range but outside one query's window is read (it is a written, finite row) with weight 0.
//
// The loops an item runs are in attention_loops.h.

#include <ATen/Parallel.h>

#include "attention_plan.h"
#include "kv_rows.h"
#include "ops.h"
#include "reused_empty.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

namespace iterserve {
namespace {

using at::BFloat16;
using at::Tensor;
using namespace attention;

Tensor attend_rows(const Tensor& q, const Tensor& key_cache, const Tensor& value_cache,
                   const Tensor& block_tables, const Tensor& seq_lens,
                   const Tensor& query_start_loc, double scale, int64_t sliding_window,
                   double softcap, const std::optional<Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3, "paged_attention: q must be [tokens, num_heads, head_dim], got ",
              q.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "paged_attention: key_cache and value_cache must both be [num_kv_heads, "
              "num_blocks, block_size, head_dim], got ", key_cache.sizes(), " and ",
              value_cache.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
              "paged_attention: q must be bfloat16 or float32, got ", dtype);
  const bool int8_cache = is_int8_cache(key_cache);
  TORCH_CHECK((key_cache.scalar_type() == dtype || int8_cache) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_attention: q, key_cache and value_cache must share a dtype (or the caches "
              "be int8)");
  for (const Tensor* t : {&q, &key_cache, &value_cache, &block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: CPU tensors only");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = key_cache.size(0), NB = key_cache.size(1), BS = key_cache.size(2);
  TORCH_CHECK(cache_head_dim(key_cache) == D, "paged_attention: cache head_dim ",
              cache_head_dim(key_cache), " != q head_dim ", D);
  TORCH_CHECK(head_dim_built(D), "paged_attention: head_dim must be one of ",
              c10::IntArrayRef(built_head_dims()), ", got ", D);
  TORCH_CHECK(KVH >= 1 && H % KVH == 0, "paged_attention: num_heads ", H,
              " is not a multiple of num_kv_heads ", KVH);
  TORCH_CHECK(BS >= 1, "paged_attention: block_size must be >= 1");
  TORCH_CHECK(q.stride(2) == 1, "paged_attention: q's head_dim must be contiguous (stride 1)");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_attention: key_cache and value_cache must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1,
              "paged_attention: block_tables must be [num_seqs, max_blocks] int32 with "
              "contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kInt,
              "paged_attention: seq_lens and query_start_loc must be 1-D int32");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == S && query_start_loc.size(0) == S + 1,
              "paged_attention: block_tables has ", block_tables.size(0), " rows and ",
              "query_start_loc ", query_start_loc.size(0), " entries for ", S, " sequences");
  TORCH_CHECK(sliding_window >= 0, "paged_attention: sliding_window must be >= 0 (0: off)");
  TORCH_CHECK(softcap >= 0, "paged_attention: softcap must be >= 0 (0: off)");
  TORCH_CHECK(!sinks || (sinks->dim() == 1 && sinks->size(0) == H &&
                         sinks->scalar_type() == at::kFloat && sinks->is_contiguous()),
              "paged_attention: sinks must be float32 [num_heads]");

  Tensor out = empty_reused({T, H, D}, q.options());
  const Tensor lens = seq_lens.contiguous(), starts = query_start_loc.contiguous();
  const int32_t* len = lens.data_ptr<int32_t>();
  const int32_t* start = starts.data_ptr<int32_t>();
  TORCH_CHECK(S > 0 ? start[0] == 0 && start[S] == T : T == 0,
              "paged_attention: query_start_loc must run from 0 to the ", T, " rows of q");

  Plan plan;
  plan.q = q.data_ptr();
  plan.q_row_stride = q.stride(0);
  plan.q_head_stride = q.stride(1);
  plan.key_cache = key_cache.data_ptr();
  plan.value_cache = value_cache.data_ptr();
  plan.row_stride = key_cache.size(3);
  plan.out = out.data_ptr();
  plan.tables = block_tables.data_ptr<int32_t>();
  plan.table_stride = block_tables.stride(0);
  plan.num_heads = H;
  plan.group_size = H / KVH;
  plan.head_dim = D;
  plan.num_blocks = NB;
  plan.block_size = BS;
  plan.window = sliding_window;
  plan.scale = static_cast<float>(scale);
  plan.softcap = static_cast<float>(softcap);
  plan.sinks = sinks ? sinks->data_ptr<float>() : nullptr;

  const int64_t G = plan.group_size;
  const int64_t rows_per_group = std::max<int64_t>(1, kMaxQueriesPerGroup / G);
  int64_t work = 0;  // sum over groups of keys x queries
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = start[s + 1] - start[s], ctx = len[s];
    TORCH_CHECK(q_len >= 1, "paged_attention: sequence ", s, " has no query rows");
    TORCH_CHECK(ctx >= q_len, "paged_attention: sequence ", s, " has seq_len ", ctx,
                " < its ", q_len, " query rows");
    // Validate exactly the blocks that will be read.
    const int64_t first_key = key_window(ctx - q_len, sliding_window).first;
    const int64_t last_block = (ctx - 1) / BS;
    TORCH_CHECK(last_block < block_tables.size(1), "paged_attention: sequence ", s, " needs ",
                last_block + 1, " blocks, block_tables has ", block_tables.size(1));
    const int32_t* table = plan.tables + s * plan.table_stride;
    for (int64_t b = first_key / BS; b <= last_block; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < NB, "paged_attention: sequence ", s, " block ", b,
                  " is ", table[b], ", outside the pool's ", NB, " blocks");
    for (int64_t r = 0; r < q_len; r += rows_per_group) {
      const int64_t rows = std::min(rows_per_group, q_len - r);
      const int64_t first_pos = ctx - q_len + r;
      const int64_t key_lo = key_window(first_pos, sliding_window).first;
      const int64_t key_hi = first_pos + rows;
      for (int64_t h = 0; h < KVH; ++h)
        plan.groups.push_back({s, h, start[s] + r, rows, first_pos, key_lo, key_hi, 1, 0});
      work += KVH * (key_hi - key_lo) * rows * G;
    }
  }
  if (plan.groups.empty()) return out;

  // Below this much work a parallel region costs more than it saves. Otherwise partitions
  // are sized for enough items to keep every thread busy (flash-decoding), within limits.
  const int64_t threads = at::get_num_threads();
  const bool parallel = threads > 1 && work >= kMinParallelWork;
  plan.part_keys = kPartKeys;

  const int64_t wave_slots = kWavePartialBytes / ((D + 2) * static_cast<int64_t>(sizeof(float)));
  int64_t slots = 0, in_wave = 0;  // the slots of the largest wave, and of this one
  for (int64_t gi = 0; gi < static_cast<int64_t>(plan.groups.size()); ++gi) {
    Group& g = plan.groups[gi];
    g.parts = (g.key_hi - g.key_lo + plan.part_keys - 1) / plan.part_keys;
    if (g.parts > 1) {
      const int64_t needs = g.parts * g.rows * G;
      if (in_wave > 0 && in_wave + needs > wave_slots) {
        plan.wave_ends.push_back(static_cast<int64_t>(plan.items.size()));
        in_wave = 0;
      }
      g.slot = in_wave;
      in_wave += needs;
      slots = std::max(slots, in_wave);
    }
    for (int64_t p = 0; p < g.parts; ++p) plan.items.push_back({gi, p});
  }
  plan.wave_ends.push_back(static_cast<int64_t>(plan.items.size()));
  Tensor partials;
  if (slots > 0) {
    partials = empty_reused({slots * (D + 2)}, q.options().dtype(at::kFloat));
    plan.partial_acc = partials.data_ptr<float>();
    plan.partial_max = plan.partial_acc + slots * D;
    plan.partial_sum = plan.partial_max + slots;
    plan.done.reset(new std::atomic<int64_t>[plan.groups.size()]);
    for (size_t i = 0; i < plan.groups.size(); ++i) plan.done[i].store(0);
  }
  if (dtype == at::kBFloat16) run_items<BFloat16>(plan, int8_cache, parallel);
  else run_items<float>(plan, int8_cache, parallel);
  return out;
}

// The step's new K/V rows into their slots: [T, kv_heads, head_dim] (any row and head
// stride, head_dim contiguous) -> cache[h, slot / block_size, slot % block_size, :].
template <typename T>
void store_rows(const Tensor& src, const Tensor& cache, const int64_t* slots) {
  const int64_t tokens = src.size(0), heads = src.size(1), D = src.size(2);
  const int64_t slots_per_head = cache.size(1) * cache.size(2);
  const T* in = src.data_ptr<T>();
  T* out = cache.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(out + (h * slots_per_head + slots[t]) * D,
                  in + t * src.stride(0) + h * src.stride(1), D * sizeof(T));
}

template <typename T>
void store_quantized_rows(const Tensor& src, const Tensor& cache, const int64_t* slots) {
  const int64_t tokens = src.size(0), heads = src.size(1), D = src.size(2);
  const int64_t slots_per_head = cache.size(1) * cache.size(2), stride = cache.size(3);
  const T* in = src.data_ptr<T>();
  int8_t* out = cache.data_ptr<int8_t>();
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h)
      quantize_row(in + t * src.stride(0) + h * src.stride(1), D,
                   out + (h * slots_per_head + slots[t]) * stride);
}

template <typename T>
void store_kv_as(const Tensor& k, const Tensor& v, const Tensor& key_cache,
                 const Tensor& value_cache, const int64_t* slots) {
  if (is_int8_cache(key_cache)) {
    store_quantized_rows<T>(k, key_cache, slots);
    store_quantized_rows<T>(v, value_cache, slots);
  } else {
    store_rows<T>(k, key_cache, slots);
    store_rows<T>(v, value_cache, slots);
  }
}

void store_kv(const Tensor& k, const Tensor& v, const Tensor& key_cache,
              const Tensor& value_cache, const Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "store_kv: k and v must be [tokens, kv_heads, head_dim] with contiguous rows");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.size(0) == k.size(1) &&
                  cache_head_dim(key_cache) == k.size(2) &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous(),
              "store_kv: caches must be contiguous [kv_heads, blocks, block_size, head_dim] "
              "matching k");
  TORCH_CHECK((k.scalar_type() == key_cache.scalar_type() || is_int8_cache(key_cache)) &&
                  v.scalar_type() == k.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "store_kv: k, v and the caches must share a dtype (or the caches be int8)");
  TORCH_CHECK(!is_int8_cache(key_cache) || k.size(2) % 16 == 0,
              "store_kv: an int8 cache needs head_dim a multiple of 16");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "store_kv: slot_mapping must be int64 [tokens]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = key_cache.size(1) * key_cache.size(2);
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "store_kv: slot ", slots[t],
                " is outside the pool of ", num_slots);
  if (k.scalar_type() == at::kBFloat16) {
    store_kv_as<BFloat16>(k, v, key_cache, value_cache, slots);
  } else {
    TORCH_CHECK(k.scalar_type() == at::kFloat, "store_kv: bfloat16 or float32 only");
    store_kv_as<float>(k, v, key_cache, value_cache, slots);
  }
}

}  // namespace

Tensor paged_attention(const Tensor& q, const Tensor& key_cache, const Tensor& value_cache,
                       const Tensor& block_tables, const Tensor& seq_lens,
                       const Tensor& query_start_loc, double scale, int64_t sliding_window,
                       double softcap, const std::optional<Tensor>& sinks) {
  return attend_rows(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     sliding_window, softcap, sinks);
}

// One layer's attention for a whole step in one call: the new K/V into the pool, then every
// query row over its sequence's context. What the engine runs per layer when these kernels
// are on (model/llama.py, csrc/layer.cpp). The step's sequences come packed in one int32
// tensor built once per step and shared by every layer (see StepTable in ops.h).
Tensor store_and_attend(const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& key_cache, const Tensor& value_cache,
                        const Tensor& slot_mapping, const Tensor& step, double scale,
                        int64_t sliding_window, double softcap,
                        const std::optional<Tensor>& sinks) {
  store_kv(k, v, key_cache, value_cache, slot_mapping);
  return attend_step(q, key_cache, value_cache, step, scale, sliding_window, softcap, sinks);
}

Tensor attend_step(const Tensor& q, const Tensor& key_cache, const Tensor& value_cache,
                   const Tensor& step, double scale, int64_t sliding_window, double softcap,
                   const std::optional<Tensor>& sinks) {
  const StepTable table(step);
  return attend_rows(q, key_cache, value_cache, table.block_tables(), table.seq_lens(),
                     table.query_start_loc(), scale, sliding_window, softcap, sinks);
}

std::vector<int64_t> attention_head_dims() { return built_head_dims(); }

}  // namespace iterserve
