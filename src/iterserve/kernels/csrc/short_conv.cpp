// LFM2's short convolution for the rows of one engine step, inside the fused layer op
// (layer.cpp `run_layer`): model/short_conv.py's arithmetic, which it is tested against.
//
// in_proj's rows are [B | C | x]. B * x (rounded to bf16) is stored first, one row a token in
// the layer's pool (cache [1, blocks, block_size, hidden], bf16 or int8 rows with their scale:
// kv_rows.h), so a prefill chunk's later rows find its earlier ones there; then each row's
// convolution over its predecessors' stored rows (found through the step's block table, zeros
// before a sequence's first token) and its own, oldest first, in fp32 and in that order;
// rounded, and times C, rounded. Rows and channels are independent: a row's result does not
// depend on what else shares the step.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cstring>
#include <vector>

#include "kv_rows.h"
#include "ops.h"

namespace iterserve {
namespace {

using at::BFloat16;
using at::Tensor;

// Every row's predecessors' slots, `history` a row, oldest first; -1 before the sequence's
// start. A row's position is its sequence's length less the rows after it in the step.
std::vector<int64_t> predecessor_slots(const Tensor& step, int64_t rows, int64_t history,
                                       int64_t block_size) {
  const StepTable table(step);
  const Tensor blocks = table.block_tables(), lens = table.seq_lens();
  const Tensor starts = table.query_start_loc();
  const int32_t* start = starts.data_ptr<int32_t>();
  TORCH_CHECK(start[table.num_seqs()] == rows, "short_conv: the step table has ",
              start[table.num_seqs()], " rows, the step ", rows);
  std::vector<int64_t> slots(rows * history);
  for (int64_t s = 0; s < table.num_seqs(); ++s) {
    const int32_t* row_blocks = blocks.data_ptr<int32_t>() + s * blocks.size(1);
    const int64_t len = lens.data_ptr<int32_t>()[s], count = start[s + 1] - start[s];
    for (int64_t i = 0; i < count; ++i) {
      const int64_t p = len - count + i;
      for (int64_t j = 0; j < history; ++j) {
        const int64_t q = p - history + j;
        TORCH_CHECK(q / block_size < blocks.size(1), "short_conv: position ", q,
                    " past its block table");
        slots[(start[s] + i) * history + j] =
            q < 0 ? -1 : row_blocks[q / block_size] * block_size + q % block_size;
      }
    }
  }
  return slots;
}

// A stored row's value at channel c, as the torch path reads it (int8: s * q in fp32,
// rounded to bf16).
inline float stored(const uint8_t* row, int64_t c, int64_t hidden, bool int8) {
  if (!int8) return static_cast<float>(reinterpret_cast<const BFloat16*>(row)[c]);
  float scale;
  std::memcpy(&scale, row + hidden, sizeof(float));
  return static_cast<float>(BFloat16(static_cast<float>(reinterpret_cast<const int8_t*>(row)[c]) * scale));
}

}  // namespace

Tensor short_conv(const Tensor& bcx, const Tensor& kernel, const Tensor& cache,
                  const Tensor& slot_mapping, const Tensor& step) {
  TORCH_CHECK(bcx.dim() == 2 && bcx.scalar_type() == at::kBFloat16 && bcx.is_contiguous() &&
                  bcx.size(1) % 3 == 0,
              "short_conv: in_proj's rows must be contiguous bf16 [tokens, 3 x hidden]");
  const int64_t M = bcx.size(0), H = bcx.size(1) / 3;
  TORCH_CHECK(kernel.dim() == 2 && kernel.size(0) == H && kernel.size(1) >= 1 &&
                  kernel.scalar_type() == at::kBFloat16 && kernel.is_contiguous(),
              "short_conv: the kernel must be contiguous bf16 [hidden, width]");
  const int64_t L = kernel.size(1), history = L - 1;
  const bool int8 = is_int8_cache(cache);
  TORCH_CHECK(cache.dim() == 4 && cache.size(0) == 1 && cache.is_contiguous() &&
                  (cache.scalar_type() == at::kBFloat16 || int8) && cache_head_dim(cache) == H &&
                  (!int8 || H % 16 == 0),
              "short_conv: the layer's pool must be contiguous [1, blocks, block_size, hidden] "
              "bf16 or int8 rows");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == M &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "short_conv: slot_mapping must be int64 [tokens]");
  const int64_t block_size = cache.size(2), num_slots = cache.size(1) * block_size;
  const int64_t row_bytes = cache.size(3) * cache.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(slots[m] >= 0 && slots[m] < num_slots, "short_conv: slot ", slots[m],
                " is outside the pool's ", num_slots);
  const std::vector<int64_t> past = predecessor_slots(step, M, history, block_size);
  for (int64_t slot : past)
    TORCH_CHECK(slot < num_slots, "short_conv: slot ", slot, " is outside the pool");

  const BFloat16* in = bcx.data_ptr<BFloat16>();
  uint8_t* pool = static_cast<uint8_t*>(cache.data_ptr());
  Tensor bx = at::empty({M, H}, bcx.options());
  BFloat16* b_x = bx.data_ptr<BFloat16>();
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const BFloat16* b = in + m * 3 * H;
      const BFloat16* x = b + 2 * H;
      BFloat16* row = b_x + m * H;
      for (int64_t c = 0; c < H; ++c)
        row[c] = BFloat16(static_cast<float>(b[c]) * static_cast<float>(x[c]));
      uint8_t* dst = pool + slots[m] * row_bytes;
      if (int8) quantize_row(row, H, reinterpret_cast<int8_t*>(dst));
      else std::memcpy(dst, row, H * sizeof(BFloat16));
    }
  });

  Tensor out = at::empty({M, H}, bcx.options());
  const BFloat16* w = kernel.data_ptr<BFloat16>();
  at::parallel_for(0, M, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const BFloat16* c_row = in + m * 3 * H + H;
      const BFloat16* own = b_x + m * H;
      BFloat16* o = out.data_ptr<BFloat16>() + m * H;
      for (int64_t c = 0; c < H; ++c) {
        const BFloat16* wc = w + c * L;
        float acc = 0.0f;
        for (int64_t j = 0; j < history; ++j) {
          const int64_t slot = past[m * history + j];
          const float v = slot < 0 ? 0.0f : stored(pool + slot * row_bytes, c, H, int8);
          const float product = v * static_cast<float>(wc[j]);
          acc += product;
        }
        const float product = static_cast<float>(own[c]) * static_cast<float>(wc[history]);
        acc += product;
        o[c] = BFloat16(static_cast<float>(c_row[c]) * static_cast<float>(BFloat16(acc)));
      }
    }
  });
  return out;
}

}  // namespace iterserve
