// Ops that let torch.compile (Inductor) trace a decoder layer whose heavy parts are
// pdserve's own kernels, with one graph shared by every layer (parameters and the
// layer index are graph inputs, not constants):
//
//   linear_prepacked(x, packed, bias, out_features) -> y
//       the oneDNN GEMM over a weight prepacked by mkldnn._reorder_linear_weight, as
//       an opaque op. Inductor's own lowering of mkldnn._linear_pointwise needs the
//       weight to be a frozen constant, which would make every layer its own graph.
//   attention_layer(q, k, v, slot_mapping, block_table, cu_seqlens_q, context_lens,
//                   scale, cache_id, layer) -> out
//       write the new tokens' K/V into layer `layer` of the KV cache registered as
//       `cache_id`, then paged attention over it (paged_attention.cpp): vLLM's
//       "unified attention" op, which finds its layer's cache outside the graph. The
//       cache is not an argument, so the compiled graph has no mutated (and aliased)
//       cache views among its inputs; the write is ordered by data dependence (the
//       op's q/k/v come from this layer, its output feeds the next).
//   register_kv_cache(kv) -> cache_id; unregister_kv_cache(cache_id)
//       kv: [num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]; the
//       registry holds a reference until unregistered.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace {

std::mutex registry_mu;
std::unordered_map<int64_t, at::Tensor> registry;
int64_t next_cache_id = 1;

int64_t register_kv_cache(at::Tensor kv) {
  TORCH_CHECK(kv.dim() == 6 && kv.size(1) == 2 && kv.is_contiguous(),
              "register_kv_cache: kv must be a contiguous [num_layers, 2, num_blocks, "
              "num_kv_heads, block_size, head_dim] tensor");
  std::lock_guard<std::mutex> lock(registry_mu);
  registry[next_cache_id] = kv;
  return next_cache_id++;
}

void unregister_kv_cache(int64_t cache_id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  registry.erase(cache_id);
}

at::Tensor kv_cache_of(int64_t cache_id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = registry.find(cache_id);
  TORCH_CHECK(it != registry.end(), "attention_layer: no KV cache registered as ", cache_id);
  return it->second;
}

at::Tensor linear_prepacked(at::Tensor x, at::Tensor packed, std::optional<at::Tensor> bias,
                            int64_t out_features) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(std::move(x));
  stack.emplace_back(std::move(packed));
  stack.emplace_back(std::move(bias));
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::optional<std::string>(std::string("")));
  op.callBoxed(&stack);
  at::Tensor y = stack[0].toTensor();
  TORCH_CHECK(y.size(-1) == out_features, "linear_prepacked: the packed weight has ",
              y.size(-1), " outputs, not ", out_features);
  return y;
}

at::Tensor attention_layer(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slot_mapping,
                           at::Tensor block_table, at::Tensor cu_seqlens_q,
                           at::Tensor context_lens, double scale, int64_t cache_id,
                           int64_t layer) {
  at::Tensor kv = kv_cache_of(cache_id);
  TORCH_CHECK(layer >= 0 && layer < kv.size(0), "attention_layer: layer ", layer,
              " outside the cache's ", kv.size(0), " layers");
  at::Tensor k_cache = kv.select(0, layer).select(0, 0);
  at::Tensor v_cache = kv.select(0, layer).select(0, 1);
  static const auto write = c10::Dispatcher::singleton()
      .findSchemaOrThrow("pdserve_cpu::reshape_and_cache", "")
      .typed<void(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor)>();
  static const auto attend = c10::Dispatcher::singleton()
      .findSchemaOrThrow("pdserve_cpu::paged_attention", "")
      .typed<at::Tensor(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                        at::Tensor, double)>();   // the kernels' own signatures
  write.call(k, v, k_cache, v_cache, slot_mapping);
  return attend.call(q, k_cache, v_cache, block_table, cu_seqlens_q, context_lens, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("linear_prepacked(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("attention_layer(Tensor q, Tensor k, Tensor v, Tensor slot_mapping, "
        "Tensor block_table, Tensor cu_seqlens_q, Tensor context_lens, float scale, "
        "int cache_id, SymInt layer) -> Tensor");   // SymInt: one graph for every layer
  m.def("register_kv_cache(Tensor kv) -> int");
  m.def("unregister_kv_cache(int cache_id) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("linear_prepacked", &linear_prepacked);
  m.impl("attention_layer", &attention_layer);
  m.impl("register_kv_cache", &register_kv_cache);
}

// oneDNN prepacks fp32 weights into an opaque MkldnnCPU tensor, which dispatches there
TORCH_LIBRARY_IMPL(pdserve_cpu, MkldnnCPU, m) {
  m.impl("linear_prepacked", &linear_prepacked);
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CompositeExplicitAutograd, m) {
  m.impl("unregister_kv_cache", &unregister_kv_cache);
}
