// LoRA deltas: each row of a step adds its own adapter's low-rank product to a projection's
// output, the rows of many adapters (and rows of none) in one call.
//
//   y[r, column_p + c] += sum_j s[r, p * rank + j] * B_p[slot_r, j, c]
//   s[r, i]             = x[r] . A[slot_r, i]                         (the shrink)
//
// A [slots, parts x rank, K] holds every part's A side by side (a fused q/k/v shrinks x once
// for its three parts); part p has its own B_p [slots, rank, N_p], and its outputs are the
// next N_p columns of y. Slots are bf16 and arithmetic fp32. A row of slot -1 is left alone.
//
// A step's cost here is reading the slots, not arithmetic (a decode row is 2 x rank x (K + N)
// multiply-adds a projection), so rows of one slot are taken kRowsTogether at a time, sharing
// every load of A and B, and a step reads each resident slot about once per projection. Rows
// are grouped by slot here from the per-row slots (a counting pass over a few hundred ints), so
// callers pass only `row_slots`. Without this op the deltas were torch products per adapter:
// ~10 small ops a projection, whose dispatch cost ~3x the arithmetic (benchmarks/lora_step.py).

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace iterserve {
namespace {

using at::BFloat16;
using at::Tensor;

constexpr int kRowsTogether = 4;

// Up to kRowsTogether rows of one slot: their indices in y and x.
struct RowGroup {
  int64_t slot;
  int count;
  int64_t rows[kRowsTogether];
};

std::vector<RowGroup> group_rows(const Tensor& row_slots, int64_t slots) {
  const int32_t* slot_of = row_slots.data_ptr<int32_t>();
  const int64_t M = row_slots.numel();
  std::vector<std::vector<int64_t>> by_slot(slots);
  for (int64_t r = 0; r < M; ++r) {
    const int32_t s = slot_of[r];
    TORCH_CHECK(s >= -1 && s < slots, "lora_add_: row ", r, " has slot ", s, " of ", slots);
    if (s >= 0) by_slot[s].push_back(r);
  }
  std::vector<RowGroup> groups;
  for (int64_t s = 0; s < slots; ++s) {
    const std::vector<int64_t>& rows = by_slot[s];
    for (size_t first = 0; first < rows.size(); first += kRowsTogether) {
      RowGroup g{s, static_cast<int>(std::min<size_t>(kRowsTogether, rows.size() - first)), {}};
      for (int i = 0; i < g.count; ++i) g.rows[i] = rows[first + i];
      groups.push_back(g);
    }
  }
  return groups;
}

// Independent sums kept in flight a loop (rows x ranks, or rows x column tiles): an FMA waits
// ~4 cycles for its accumulator and two can start a cycle, so ~8 chains keep the FMA units
// busy (one chain per row ran a 1-row delta at a quarter of the arithmetic's speed); fewer
// rows take more ranks or tiles at once. AVX2 and NEON hold an F16 in 2 or 4 registers, so
// they keep fewer F16s in flight, not to run out of registers.
template <int N>
constexpr int kChains = std::max(1, 8 / kParts / N);

// s[i][j] = x[row_i] . A[j] for the group's rows, ranks j .. j + J (`shrunk` is [N][ranks]).
template <int N, int J>
ITERSERVE_INLINE void shrink_ranks(const float* xf, int64_t K, const BFloat16* a, int64_t ranks,
                                   int64_t j, float* shrunk) {
  std::array<F16, N * J> acc = zeros<N * J>();
  for (int64_t k = 0; k < K; k += kLanes) {
    ITERSERVE_UNROLL
    for (int r = 0; r < J; ++r) {
      const F16 w = load_bf16x16(a + (j + r) * K + k);
      ITERSERVE_UNROLL
      for (int i = 0; i < N; ++i) acc[i * J + r] = fmadd(F16::load(xf + i * K + k), w, acc[i * J + r]);
    }
  }
  ITERSERVE_UNROLL
  for (int i = 0; i < N; ++i) {
    ITERSERVE_UNROLL
    for (int r = 0; r < J; ++r) shrunk[i * ranks + j + r] = acc[i * J + r].sum();
  }
}

template <int N>
ITERSERVE_INLINE void shrink(const float* xf, int64_t K, const BFloat16* a, int64_t ranks,
                             float* shrunk) {
  constexpr int J = kChains<N>;
  int64_t j = 0;
  for (; j + J <= ranks; j += J) shrink_ranks<N, J>(xf, K, a, ranks, j, shrunk);
  for (; j < ranks; ++j) shrink_ranks<N, 1>(xf, K, a, ranks, j, shrunk);
}

// y[row_i, c .. c + 16 C] += s[i][lo + j] * B[j, c ..] (B [rank, n]).
template <int N, int C>
ITERSERVE_INLINE void expand_tiles(const float* shrunk, int64_t ranks, int64_t lo,
                                   const BFloat16* b, int64_t rank, int64_t n, int64_t c,
                                   BFloat16* const* y_rows) {
  std::array<F16, N * C> acc = zeros<N * C>();
  for (int64_t j = 0; j < rank; ++j) {
    ITERSERVE_UNROLL
    for (int t = 0; t < C; ++t) {
      const F16 w = load_bf16x16(b + j * n + c + t * kLanes);
      ITERSERVE_UNROLL
      for (int i = 0; i < N; ++i)
        acc[i * C + t] = fmadd(F16::splat(shrunk[i * ranks + lo + j]), w, acc[i * C + t]);
    }
  }
  ITERSERVE_UNROLL
  for (int i = 0; i < N; ++i) {
    ITERSERVE_UNROLL
    for (int t = 0; t < C; ++t) {
      BFloat16* out = y_rows[i] + c + t * kLanes;
      store_bf16x16(out, load_bf16x16(out) + acc[i * C + t]);
    }
  }
}

// One part's columns: y[row_i, :n] += s[i][lo .. lo + rank] B.
template <int N>
ITERSERVE_INLINE void expand(const float* shrunk, int64_t ranks, int64_t lo, const BFloat16* b,
                             int64_t rank, int64_t n, BFloat16* const* y_rows) {
  constexpr int C = kChains<N>;
  int64_t c = 0;
  for (; c + C * kLanes <= n; c += C * kLanes)
    expand_tiles<N, C>(shrunk, ranks, lo, b, rank, n, c, y_rows);
  for (; c < n; c += kLanes) expand_tiles<N, 1>(shrunk, ranks, lo, b, rank, n, c, y_rows);
}

template <int N>
void group_delta(const RowGroup& g, const Tensor& y, const Tensor& x, const Tensor& a,
                 at::TensorList b_parts, std::vector<float>& xf, std::vector<float>& shrunk) {
  const int64_t K = x.size(1), ranks = a.size(1);
  xf.resize(N * K);
  shrunk.resize(N * ranks);
  for (int i = 0; i < N; ++i) {
    const BFloat16* row = x.data_ptr<BFloat16>() + g.rows[i] * x.stride(0);
    for (int64_t k = 0; k < K; k += kLanes) load_bf16x16(row + k).store(xf.data() + i * K + k);
  }
  shrink<N>(xf.data(), K, a.data_ptr<BFloat16>() + g.slot * ranks * K, ranks, shrunk.data());
  int64_t column = 0;
  for (size_t p = 0; p < b_parts.size(); ++p) {
    const Tensor& b = b_parts[p];
    const int64_t rank = b.size(1), n = b.size(2);
    BFloat16* y_rows[N];
    for (int i = 0; i < N; ++i) y_rows[i] = y.data_ptr<BFloat16>() + g.rows[i] * y.stride(0) + column;
    expand<N>(shrunk.data(), ranks, static_cast<int64_t>(p) * rank,
              b.data_ptr<BFloat16>() + g.slot * rank * n, rank, n, y_rows);
    column += n;
  }
}

}  // namespace

void lora_add_(const Tensor& y, const Tensor& x, const Tensor& a, at::TensorList b_parts,
               const Tensor& row_slots) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 &&
                  y.stride(1) == 1 && x.scalar_type() == at::kBFloat16 &&
                  y.scalar_type() == at::kBFloat16,
              "lora_add_: x [M, K] and y [M, N] must be bf16 with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(a.dim() == 3 && a.size(2) == K && a.is_contiguous() && a.scalar_type() == at::kBFloat16,
              "lora_add_: A must be [slots, ranks, ", K, "] contiguous bf16");
  TORCH_CHECK(K % kLanes == 0, "lora_add_: K=", K, " is not a multiple of ", kLanes);
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.numel() == M && row_slots.scalar_type() == at::kInt &&
                  row_slots.is_contiguous(),
              "lora_add_: row_slots must be [", M, "] int32");
  const int64_t slots = a.size(0);
  int64_t columns = 0, ranks = 0;
  for (const Tensor& b : b_parts) {
    TORCH_CHECK(b.dim() == 3 && b.size(0) == slots && b.is_contiguous() &&
                    b.scalar_type() == at::kBFloat16 && b.size(2) % kLanes == 0,
                "lora_add_: each B must be [", slots, ", rank, N] contiguous bf16, N a multiple "
                "of ", kLanes);
    columns += b.size(2);
    ranks += b.size(1);
  }
  TORCH_CHECK(ranks == a.size(1), "lora_add_: the B parts' ranks add up to ", ranks,
              ", A has ", a.size(1));
  TORCH_CHECK(columns == y.size(1), "lora_add_: the B parts have ", columns, " columns, y ",
              y.size(1));
  const std::vector<RowGroup> groups = group_rows(row_slots, slots);
  at::parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf, shrunk;
    for (int64_t i = begin; i < end; ++i) {
      const RowGroup& g = groups[i];
      switch (g.count) {
        case 4: group_delta<4>(g, y, x, a, b_parts, xf, shrunk); break;
        case 3: group_delta<3>(g, y, x, a, b_parts, xf, shrunk); break;
        case 2: group_delta<2>(g, y, x, a, b_parts, xf, shrunk); break;
        default: group_delta<1>(g, y, x, a, b_parts, xf, shrunk); break;
      }
    }
  });
}

}  // namespace iterserve
