// Uninitialised tensors for a step's intermediates, reused from call to call.
//
// A one-row step of a 1B makes ~8 tensors a layer (norms' outputs, projections', attention's,
// the gated product), and at::empty took 1-3 us each there, through the dispatcher and
// malloc (decoder_stack timed by parts, a 1B Q4_K_M at one row, AVX-512 BF16, 2026-12-05):
// ~1% of the step. The steps of a decode run make the same shapes over and over, so each
// thread keeps a few small tensors and hands one out again once nothing else holds it.
//
// A prompt step's largest tensors are kept only while one call's layers run (`LayersScope`):
// past ~1,000 rows a layer's gate_up output is over glibc's largest mmap threshold (32 MiB),
// so each one was mapped, faulted in page by page and unmapped, layer after layer: ~5% of a
// 2048-row step of a 1B Q6_K (perf: the kernel's page faults 7.3% of the samples, 2.0% at 512
// rows; 2026-12-06, AVX-512 BF16). Every layer makes the same shapes, so from the second layer
// on each takes the first's, and the call lets them go when it ends. Smaller ones come from
// malloc's heap, which reuses its freed chunks already: keeping them too would only hold more
// at once.
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
// Tensors from this size on are kept while a LayersScope is open: glibc's largest mmap
// threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64 bits), past which malloc always maps afresh.
constexpr int64_t kMappedBytes = int64_t{32} << 20;
// Tensors a thread keeps, of each kind.
constexpr size_t kReusedTensors = 32;

// This thread's kept tensors: small ones, or (`mapped`) those of kMappedBytes and more, kept
// while a LayersScope is open.
inline std::vector<at::Tensor>& reused_tensors(bool mapped = false) {
  thread_local std::vector<at::Tensor> small_kept, mapped_kept;
  return mapped ? mapped_kept : small_kept;
}

// Layers' calls open on this thread.
inline int& open_layers_scopes() {
  thread_local int open = 0;
  return open;
}

// While one is open, this thread keeps tensors of kMappedBytes and more too; the last to
// close lets them go.
class LayersScope {
 public:
  LayersScope() { ++open_layers_scopes(); }
  ~LayersScope() {
    if (--open_layers_scopes() == 0) reused_tensors(true).clear();
  }
  LayersScope(const LayersScope&) = delete;
  LayersScope& operator=(const LayersScope&) = delete;
};

// As at::empty(sizes, options): a tensor of this thread's that no one else holds (neither it
// nor a view of its storage), of these sizes, dtype and inference mode, or a new one.
inline at::Tensor empty_reused(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  const at::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
  int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
  for (const int64_t size : sizes) bytes *= size;
  const bool mapped = bytes >= kMappedBytes;
  const bool keeps = bytes <= kReusedBytes || (mapped && open_layers_scopes() > 0);
  if (!keeps || options.device().type() != c10::DeviceType::CPU) return at::empty(sizes, options);
  std::vector<at::Tensor>& kept = reused_tensors(mapped);
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
