// A Llama decoder stack's decode step in one op call (float32 activations, int8 or 4-bit linear
// layers), for batch-1 decoding on the CPU, where the Python around the ~10 op calls per layer (module
// calls, the dispatcher, argument checks: ~5 ms of a ~21 ms token on the default model) was a quarter
// of the time. The same functions as the layer-by-layer fused path, in the same order (the header
// cpu_kernels.h): the result is bit-identical to it (tests/runtime/test_cpu_layer_ops.py).
//
// decode_layers(x [B, hidden] float32: the embeddings of B sequences' one new token each,
//     weights: 18 tensors per layer, in order: input norm [hidden]; qkv packed, scales, mins, bias;
//     o_proj packed, scales, mins, bias; post-attention norm [hidden]; gate_up packed, scales, mins,
//     bias; down_proj packed, scales, mins, bias (an int8 packed weight runs int8_linear, a uint8 one
//     int4_linear, in the layouts of those kernels; mins only for int4; a tensor with no elements
//     means none),
//     k_caches, v_caches: one [S, Hkv, D] float32 pool per layer (or int8, with k_scales / v_scales:
//     one [S, Hkv] float32 scale tensor per layer, runtime/kv_cache.py, given last; empty lists for
//     float32),
//     cos, sin [B, D/2] float32,
//     slot_mapping [B] int64 (the new token's slot), slots [B, L] int64, lens [B] int64
//     (decode_attention's), final_norm [hidden], out_features [4] (qkv, o, gate_up, down rows),
//     H (query heads), eps, scale (softmax))
//   -> the final norm of the last layer's residual stream [B, hidden] float32 (LlamaForCausalLM.forward).
// K and V of the new tokens are written to the pools. Errors are the called kernels' RuntimeErrors,
// or a RuntimeError naming a miscounted weight list.
#include <torch/library.h>
#include <torch/types.h>

#include "cpu_kernels.h"

namespace {

constexpr int64_t PER_LAYER = 18;

c10::optional<at::Tensor> maybe(const at::Tensor& b) {
  return b.numel() ? c10::optional<at::Tensor>(b) : c10::nullopt;
}

// p: the layer's packed weight, scales, mins, bias
at::Tensor linear(const at::Tensor& x, const at::Tensor* p, int64_t N) {
  if (p[0].scalar_type() == at::kByte) return agentrt_cpu::int4_linear(x, p[0], p[1], p[2], maybe(p[3]), N);
  return agentrt_cpu::int8_linear(x, p[0], p[1], maybe(p[3]), N);
}

at::Tensor decode_layers(const at::Tensor& x0, at::TensorList w, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slot_mapping,
                         const at::Tensor& slots, const at::Tensor& lens, const at::Tensor& final_norm,
                         at::IntArrayRef out_features, int64_t H, double eps, double scale,
                         at::TensorList k_scales, at::TensorList v_scales) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(v_caches.size()) == L &&
                  static_cast<int64_t>(w.size()) == L * PER_LAYER,
              "decode_layers: ", w.size(), " weights for ", L, " layers (", PER_LAYER, " each) and ",
              v_caches.size(), " V pools");
  TORCH_CHECK(out_features.size() == 4, "decode_layers: out_features must hold 4 row counts");
  const bool quant = !k_scales.empty();
  TORCH_CHECK(k_scales.size() == v_scales.size() && (!quant || static_cast<int64_t>(k_scales.size()) == L),
              "decode_layers: ", k_scales.size(), " K and ", v_scales.size(), " V scale tensors for ", L,
              " layers (one each per layer with int8 pools, none with float32 ones)");
  TORCH_CHECK(x0.dim() == 2 && x0.size(0) > 0, "decode_layers: x must be [B, hidden] with B >= 1");
  for (int64_t l = 0; l < L; ++l) {  // before layer 0 writes its K/V: no half-written step
    TORCH_CHECK(k_caches[l].sizes() == k_caches[0].sizes() && v_caches[l].sizes() == k_caches[0].sizes(),
                "decode_layers: layer ", l, "'s K/V pools are not shaped like layer 0's");
  }
  const int64_t B = x0.size(0);
  at::Tensor x = x0, residual, h;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* p = w.data() + l * PER_LAYER;
    if (l == 0) {
      residual = x;
      h = agentrt_cpu::rms_norm(x, p[0], eps);
    } else {
      std::tie(residual, h) = agentrt_cpu::add_rms_norm(residual, x, p[0], eps);
    }
    const at::Tensor qkv = linear(h, p + 1, out_features[0]);
    at::Tensor q, k;
    c10::optional<at::Tensor> ks, vs;
    if (quant) ks = k_scales[l], vs = v_scales[l];
    std::tie(q, k) = agentrt_cpu::rope_store(qkv, cos, sin, k_caches[l], v_caches[l], slot_mapping, H, ks, vs);
    const at::Tensor attn =
        agentrt_cpu::decode_attention(q, k_caches[l], v_caches[l], slots, lens, scale, c10::nullopt, ks, vs);
    const at::Tensor o = linear(attn.view({B, -1}), p + 5, out_features[1]);
    std::tie(residual, h) = agentrt_cpu::add_rms_norm(residual, o, p[9], eps);
    const at::Tensor gate_up = linear(h, p + 10, out_features[2]);
    x = linear(agentrt_cpu::silu_mul(gate_up), p + 14, out_features[3]);
  }
  return std::get<1>(agentrt_cpu::add_rms_norm(residual, x, final_norm, eps));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(agentrt_cpu, m) {
  m.def(
      "decode_layers(Tensor x, Tensor[] weights, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor cos, "
      "Tensor sin, Tensor slot_mapping, Tensor slots, Tensor lens, Tensor final_norm, int[] out_features, int H, "
      "float eps, float scale, Tensor(c!)[] k_scales, Tensor(d!)[] v_scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(agentrt_cpu, CPU, m) { m.impl("decode_layers", &decode_layers); }
