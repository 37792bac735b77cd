// The ops' schemas and their registration in one file: the torch library's headers are the
// heaviest part of a kernel file's compile, and here they are compiled once a variant (ops.h).
// A schema's argument names and defaults are what Python calls the op with
// (`kernels.ops().tiled_linear(x, weights, formats, bias, residual)`); each op's file says
// what it computes.

#include <torch/library.h>

#include "ops.h"
#include "reused_empty.h"

namespace iterserve {
namespace {

// An op returning a tensor, registered so that its result leaves the kept tensors as it goes
// back to Python (reused_empty.h `handed_out`); the kernels call each other directly.
template <auto Op>
struct HandsOut;
template <typename... Args, at::Tensor (*Op)(Args...)>
struct HandsOut<Op> {
  static at::Tensor call(Args... args) { return handed_out(Op(args...)); }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(ITERSERVE_OPS, m) {
  m.def("isa() -> str");
  m.def("attention_head_dims() -> int[]");
  m.def("format_sizes(int format) -> (int, int, int)");

  m.def(
      "tiled_linear(Tensor x, Tensor[] weights, int[] formats, Tensor? bias, Tensor? residual, "
      "bool fp32_out=False) -> Tensor");
  m.def("quantize_rows(Tensor x, int unit=32) -> (Tensor, Tensor)");
  m.def(
      "repack_gguf(Tensor raw, int format, int K, Tensor? rows, Tensor(a!) out, "
      "int first_tile) -> ()");
  m.def("dequantize_rows(Tensor tiles, int format, int K, Tensor rows, bool bf16_out) -> Tensor");

  m.def(
      "paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window, "
      "float softcap=0.0, Tensor? sinks=None) -> Tensor");
  m.def(
      "store_and_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping, Tensor step, float scale, "
      "int sliding_window, float softcap=0.0, Tensor? sinks=None) -> Tensor");

  m.def(
      "decoder_layer(Tensor hidden, Tensor input_norm, Tensor post_norm, float eps, "
      "Tensor[] weights, int[] formats, int[] segments, Tensor?[] biases, Tensor? qk_norm, "
      "Tensor? attn_out_norm, Tensor? mlp_out_norm, bool gelu, float softcap, "
      "Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, Tensor step, "
      "Tensor rope_cos, Tensor rope_sin, int num_heads, int num_kv_heads, float scale, "
      "int sliding_window, Tensor[] lora, int[] lora_parts, Tensor? lora_rows, "
      "Tensor[] experts, int[] expert_formats, int top_k, "
      "Tensor? sinks=None, Tensor? query_scales=None, bool value_norm=False, "
      "bool shares_kv=False, Tensor? per_layer_input=None, Tensor? per_layer_norm=None, "
      "Tensor? layer_scalar=None, bool keys_as_values=False) -> Tensor");
  m.def(
      "decoder_stack(Tensor hidden, Tensor slot_mapping, Tensor step, Tensor rope_cos, "
      "Tensor rope_sin, Tensor? second_rope_cos, Tensor? second_rope_sin, Tensor[] input_norms, "
      "Tensor[] post_norms, float eps, Tensor[] weights, int[] formats, int[] segments, "
      "Tensor?[] biases, Tensor?[] qk_norms, Tensor?[] attn_out_norms, "
      "Tensor?[] mlp_out_norms, bool gelu, float softcap, Tensor(a!)[] key_caches, "
      "Tensor(b!)[] value_caches, int num_heads, int num_kv_heads, float scale, "
      "int[] sliding_windows, int[] second_rope, Tensor?[] routers, Tensor[] experts, "
      "int[] expert_formats, int top_k, bool renormalize, Tensor?[] sinks, "
      "Tensor?[] expert_biases, float swiglu_alpha, float swiglu_limit, "
      "Tensor?[] shared_gates, bool sigmoid_scores, Tensor?[] selection_biases, "
      "float routed_scaling, Tensor?[] conv_kernels, Tensor? query_scales=None) -> Tensor");
  m.def("norm_rows(Tensor x, Tensor rows, Tensor weight, float eps) -> Tensor");
  m.def(
      "experts_mlp(Tensor x, Tensor? residual, Tensor router, int top_k, bool renormalize, "
      "Tensor gate, Tensor up, Tensor down, int[] formats, Tensor? router_bias=None, "
      "Tensor? gate_up_bias=None, Tensor? down_bias=None, float swiglu_alpha=0.0, "
      "float swiglu_limit=0.0, bool sigmoid_scores=False, Tensor? selection_bias=None, "
      "float routed_scaling=1.0, Tensor? router_input=None, Tensor? expert_scales=None, "
      "bool gelu=False) -> Tensor");
  m.def(
      "short_conv(Tensor bcx, Tensor kernel, Tensor(a!) cache, Tensor slot_mapping, "
      "Tensor step) -> Tensor");
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor a, Tensor[] b_parts, Tensor row_slots) -> ()");

  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("read_probe(Tensor buffer, int threads) -> int");
}

// Ops without tensor arguments have no device to dispatch on.
TORCH_LIBRARY_IMPL(ITERSERVE_OPS, CatchAll, m) {
  m.impl("isa", &isa);
  m.impl("attention_head_dims", &attention_head_dims);
  m.impl("format_sizes", &format_sizes);
}

TORCH_LIBRARY_IMPL(ITERSERVE_OPS, CPU, m) {
  m.impl("tiled_linear", &HandsOut<&tiled_linear>::call);
  m.impl("quantize_rows", &quantize_rows);
  m.impl("repack_gguf", &repack_gguf);
  m.impl("dequantize_rows", &dequantize_rows);
  m.impl("paged_attention", &HandsOut<&paged_attention>::call);
  m.impl("store_and_attend", &HandsOut<&store_and_attend>::call);
  m.impl("decoder_layer", &HandsOut<&decoder_layer>::call);
  m.impl("decoder_stack", &HandsOut<&decoder_stack>::call);
  m.impl("norm_rows", &HandsOut<&norm_rows>::call);
  m.impl("experts_mlp", &HandsOut<&experts_mlp>::call);
  m.impl("short_conv", &HandsOut<&short_conv>::call);
  m.impl("lora_add_", &lora_add_);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("read_probe", &read_probe);
}

}  // namespace iterserve
