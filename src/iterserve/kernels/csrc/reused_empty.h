// Uninitialised tensors for a decode step's intermediates, reused from call to call.
//
// A one-row step of a 1B makes ~8 tensors a layer (norms' outputs, projections', attention's,
// the gated product), and at::empty took 1-3 us each there, through the dispatcher and
// malloc (decoder_stack timed by parts, a 1B Q4_K_M at one row, AVX-512 BF16, 2026-12-05):
// ~1% of the step. The steps of a decode run make the same shapes over and over, so each
// thread keeps a few small tensors and hands one out again once nothing else holds it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace iterserve {

// Tensors up to this size are reused (a batch-16 decode step's of an 8B: its gate_up rows
// are 0.9 MB); larger ones, a prompt's, are allocated, their cost small beside their work.
constexpr int64_t kReusedBytes = int64_t{1} << 20;
// Tensors a thread keeps.
constexpr size_t kReusedTensors = 32;

// This thread's kept tensors.
inline std::vector<at::Tensor>& reused_tensors() {
  thread_local std::vector<at::Tensor> kept;
  return kept;
}

// As at::empty(sizes, options): a tensor of this thread's that no one else holds (neither it
// nor a view of its storage), of these sizes, dtype and inference mode, or a new one.
inline at::Tensor empty_reused(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  const at::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
  int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
  for (const int64_t size : sizes) bytes *= size;
  if (bytes > kReusedBytes || options.device().type() != c10::DeviceType::CPU)
    return at::empty(sizes, options);
  std::vector<at::Tensor>& kept = reused_tensors();
  const bool inference = c10::InferenceMode::is_enabled();
  auto free = [](const at::Tensor& t) {
    return t.use_count() == 1 && t.storage().use_count() == 1;
  };
  for (const at::Tensor& t : kept)
    if (t.scalar_type() == dtype && t.sizes() == sizes && t.is_inference() == inference &&
        free(t))
      return t;
  at::Tensor made = at::empty(sizes, options);
  if (kept.size() < kReusedTensors) {
    kept.push_back(made);
  } else {
    for (at::Tensor& t : kept)
      if (free(t)) {
        t = made;
        break;
      }
  }
  return made;
}

// An op's result as it goes back to Python: out of the kept tensors. Python's wrapper of a
// tensor keeps a reference to it for as long as C++ holds one too, so a kept tensor that
// Python has seen is never free again: the logits and last hidden rows of a decode run's first
// steps filled the 32 places, and 95% of the calls went to at::empty (a 1B Q4_K_M at one row,
// counted in a throwaway build, 2026-12-05, AVX-512 BF16). library.cpp hands out every op's.
inline at::Tensor handed_out(at::Tensor result) {
  std::vector<at::Tensor>& kept = reused_tensors();
  const c10::StorageImpl* storage = result.storage().unsafeGetStorageImpl();
  kept.erase(std::remove_if(kept.begin(), kept.end(),
                            [&](const at::Tensor& t) {
                              return t.storage().unsafeGetStorageImpl() == storage;
                            }),
             kept.end());
  return result;
}

}  // namespace iterserve
