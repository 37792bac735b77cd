// Views of a tensor made without the dispatcher, for the layer op's glue.
//
// A narrow() or view() passes through the dispatcher, whose code is cold in the layer op: each
// projection sweeps megabytes of weights through the core's caches. The qkv row's narrow +
// view before attention took 6.6 us, the step table's three slices 3.4 us, and a layer made
// ~13 such views (rdtsc in a throwaway build, a 1B Q4_K_M at one row, 2026-12-05, AVX-512
// BF16). Made here, as ATen's CPU as_strided makes them, the qkv view took 0.4 us.
//
// The view shares the base's storage and dispatch keys and tracks nothing for autograd: the
// layer op's views live inside its call, where nothing differentiates.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace iterserve {

// base's storage seen as `sizes` with `strides` (in elements), `offset` elements past base's
// first; it must lie within base's storage.
inline at::Tensor strided_view(const at::Tensor& base, c10::IntArrayRef sizes,
                               c10::IntArrayRef strides, int64_t offset = 0) {
  TORCH_CHECK(sizes.size() == strides.size(), "strided_view: a stride a dimension");
  const int64_t first = base.storage_offset() + offset;
  int64_t last = first;
  for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
  TORCH_CHECK(first >= 0 && (last + 1) * static_cast<int64_t>(base.itemsize()) <=
                                static_cast<int64_t>(base.storage().nbytes()),
              "strided_view: the view runs past its base's storage");
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(base.storage()), base.key_set(), base.dtype());
  impl->set_sizes_and_strides(sizes, strides, first);
  return at::Tensor(std::move(impl));
}

// Columns [first, first + count) of a 2-D tensor's rows (its narrow(1, first, count)).
inline at::Tensor columns(const at::Tensor& rows, int64_t first, int64_t count) {
  return strided_view(rows, {rows.size(0), count}, {rows.stride(0), rows.stride(1)},
                      first * rows.stride(1));
}

// Columns [first, first + heads * head_dim) of a 2-D tensor with contiguous rows, as
// [rows, heads, head_dim].
inline at::Tensor heads_of(const at::Tensor& rows, int64_t first, int64_t heads,
                           int64_t head_dim) {
  TORCH_CHECK(rows.stride(1) == 1, "heads_of: rows must be contiguous");
  return strided_view(rows, {rows.size(0), heads, head_dim}, {rows.stride(0), head_dim, 1},
                      first);
}

}  // namespace iterserve
