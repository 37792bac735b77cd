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
// on each takes one of the first's storages, and the call lets them go when it ends. A tensor
// takes the smallest free storage that holds it, whatever its shape and type, so that a
// step's int8 activations (linear.cpp `quantized`) and chunks of other lengths share them too:
// a 1B's 8192-row steps of 4096-token prompts took 0.36-0.41 M page faults against 0.72-0.76 M
// when kept by shape (benchmarks/prompt_budget.py, 2026-12-06, AVX-512 BF16). Smaller ones
// come from malloc's heap, which reuses its freed chunks already: keeping them too would only
// hold more at once.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/strides.h>

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

// This thread's kept small tensors.
inline std::vector<at::Tensor>& reused_tensors() {
  thread_local std::vector<at::Tensor> kept;
  return kept;
}

// This thread's storages for tensors of kMappedBytes and more, kept while a LayersScope is open.
inline std::vector<c10::Storage>& mapped_storages() {
  thread_local std::vector<c10::Storage> kept;
  return kept;
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
    if (--open_layers_scopes() == 0) mapped_storages().clear();
  }
  LayersScope(const LayersScope&) = delete;
  LayersScope& operator=(const LayersScope&) = delete;
};

// As at::empty(sizes, options), on the smallest of this thread's mapped storages that no tensor
// holds and that is large enough, or on a new one (kept, while there is room).
inline at::Tensor on_mapped_storage(c10::IntArrayRef sizes, const at::TensorOptions& options,
                                    int64_t bytes) {
  std::vector<c10::Storage>& kept = mapped_storages();
  const c10::Storage* fit = nullptr;
  for (const c10::Storage& s : kept)
    if (s.use_count() == 1 && static_cast<int64_t>(s.nbytes()) >= bytes &&
        (!fit || s.nbytes() < fit->nbytes()))
      fit = &s;
  if (fit) return at::empty({0}, options).set_(*fit, 0, sizes, c10::contiguous_strides(sizes));
  at::Tensor made = at::empty(sizes, options);
  if (kept.size() < kReusedTensors) kept.push_back(made.storage());
  return made;
}

// As at::empty(sizes, options): a tensor of this thread's that no one else holds (neither it
// nor a view of its storage), of these sizes, dtype and inference mode, or a new one.
inline at::Tensor empty_reused(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  const at::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
  int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
  for (const int64_t size : sizes) bytes *= size;
  const bool cpu = options.device().type() == c10::DeviceType::CPU;
  if (cpu && bytes >= kMappedBytes && open_layers_scopes() > 0)
    return on_mapped_storage(sizes, options, bytes);
  if (!cpu || bytes > kReusedBytes) return at::empty(sizes, options);
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
