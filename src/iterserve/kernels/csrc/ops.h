// The C++ entry points the kernel files share (each is also a registered op).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace iterserve {

// linear.cpp: x [M, K] bf16 @ W^T (+ bias) (+ residual), W in a tile layout (`format`).
at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& scales,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& residual, int64_t format,
                        const std::optional<at::Tensor>& wide_weight, int64_t max_tile_rows);

// paged_attention.cpp: store the step's K/V into the pool, then attend every query row.
at::Tensor store_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& slot_mapping, const at::Tensor& step,
                            double scale, int64_t sliding_window);

}  // namespace iterserve
