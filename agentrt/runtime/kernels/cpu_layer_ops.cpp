// Fused element-wise parts of a Llama decoder layer on the CPU (float32), so that a layer makes about
// ten op calls instead of about seventy: at batch 1 the default model's step spent more time in the
// per-op overhead of these small ops (RMSNorm as seven ops, rotary embedding as a dozen, two index
// writes) than in its matmuls. Built and loaded with decode_attention (runtime/kernels/cpu_kernels.py).
//
// rms_norm(x [T, D], w [D], eps) -> w * x / sqrt(mean(x^2) + eps)               (Zhang & Sennrich 2019)
// add_rms_norm(x [T, D], delta [T, D], w [D], eps) -> (x + delta, rms_norm(x + delta))  (vLLM's fused
//     residual add: the sum is the next residual, the norm the next layer's input)
// rope_store(qkv [T, (H + 2 Hkv) D], cos [T, D/2], sin [T, D/2], k_cache [S, Hkv, D], v_cache,
//     slot_mapping [T] int64, H, k_scale, v_scale) -> (q [T, H, D], k [T, Hkv, D]), both rotated
//     (RoFormer, half-split layout); k and v are written to the pool rows slot_mapping[t]: float32
//     pools as they are, float16 pools rounded to nearest even, int8 pools (k_cache / v_cache int8 with k_scale / v_scale float32 [S, Hkv])
//     quantized per token and KV head exactly as runtime/kv_cache.py quantize_kv: amax = max |x|,
//     q = nearbyint(x * (127 / amax)) clamped to [-127, 127], scale = amax / 127 (amax < 1e-30: zeros,
//     scale 0; a NaN row: zeros, scale NaN)
// silu_mul(gate_up [T, 2 I]) -> silu(gate) * up [T, I]  (SwiGLU, Shazeer 2020; torch's own silu and
//     mul, called from C++, so the result is bit-identical to the Python path)
// All float32, contiguous; errors are RuntimeErrors naming the problem.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include "cpu_kernels.h"
#include "cpu_vec8.h"

namespace {

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, name,
              ": x must be a contiguous float32 [T, D] tensor");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.scalar_type() == at::kFloat && w.size(0) == x.size(1),
              name, ": weight must be float32 [D] with D = x.size(1)");
}

// The sum of squares in an order written out, not the compiler's: lane i of 8 takes the FMA chain
// over d = i, i + 8, ... (a last partial vector zero-padded), then the lanes add as
// ((0+1)+(2+3))+((4+5)+(6+7)) (vec8::lanes_sum). An `omp simd` reduction left the order to the
// vectorizer, which chose differently for -march=znver2 than for native or x86-64-v3: another
// CPU's build gave other bits.
inline void norm_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  using namespace agentrt_cpu::vec8;
  V8 acc = vzero();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const V8 v = vload(x + d);
    acc = vfma(v, v, acc);
  }
  if (d < D) {
    float tail[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::memcpy(tail, x + d, (D - d) * sizeof(float));
    const V8 v = vload(tail);
    acc = vfma(v, v, acc);
  }
  const float ss = lanes_sum(acc);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] = w[d] * (x[d] * r);
}

}  // namespace

namespace agentrt_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w, "rms_norm");
  auto y = at::empty_like(x);
  const int64_t T = x.size(0), D = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) norm_row(xp + t * D, wp, yp + t * D, D, static_cast<float>(eps));
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps) {
  check_rows(x, w, "add_rms_norm");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.is_contiguous() && delta.scalar_type() == at::kFloat,
              "add_rms_norm: delta must be a contiguous float32 tensor shaped like x");
  auto sum = at::empty_like(x);
  auto y = at::empty_like(x);
  const int64_t T = x.size(0), D = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) sp[t * D + d] = xp[t * D + d] + dp[t * D + d];
      norm_row(sp + t * D, wp, yp + t * D, D, static_cast<float>(eps));
    }
  });
  return {sum, y};
}

}  // namespace agentrt_cpu

namespace {

// One row of D floats -> D int8 and its scale (runtime/kv_cache.py quantize_kv, the same float32
// operations: one division for 127 / amax, one product and a round-half-even per element).
inline void quantize_kv_row(const float* x, int8_t* q, float* scale, int64_t D) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t d = 0; d < D; ++d) {
    const float a = std::fabs(x[d]);
    nan = nan || a != a;
    amax = a > amax ? a : amax;
  }
  if (nan) amax = NAN;
  const bool ok = amax >= 1e-30f;
  const float inv = ok ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < D; ++d) {
    float v = std::nearbyint(x[d] * inv);
    v = std::min(std::max(v, -127.f), 127.f);
    q[d] = static_cast<int8_t>(v == v ? v : 0.f);  // NaN (inf x 0) -> 0; a NaN cast would be undefined
  }
  *scale = (ok || nan) ? amax / 127.f : 0.f;
}

inline void rotate(const float* x, const float* c, const float* s, float* y, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    y[i] = x[i] * c[i] - x[i + half] * s[i];
    y[i + half] = x[i + half] * c[i] + x[i] * s[i];
  }
}

}  // namespace

namespace agentrt_cpu {

std::tuple<at::Tensor, at::Tensor> rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                                              const at::Tensor& slot_mapping, int64_t H,
                                              const c10::optional<at::Tensor>& k_scale,
                                              const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == at::kFloat,
              "rope_store: qkv must be a contiguous float32 [T, (H + 2 Hkv) D] tensor");
  const bool quant = k_cache.scalar_type() == at::kChar, f16 = k_cache.scalar_type() == at::kHalf;
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  (k_cache.scalar_type() == at::kFloat || quant || f16) && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "rope_store: caches must be contiguous float32, float16 or int8 [S, Hkv, D] tensors of one shape "
              "and dtype");
  const int64_t T = qkv.size(0), S = k_cache.size(0), Hkv = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(quant == (k_scale.has_value() && v_scale.has_value()) && k_scale.has_value() == v_scale.has_value(),
              quant ? "rope_store: an int8 pool needs k_scale and v_scale" : "rope_store: scales only with an int8 pool");
  if (quant) {
    for (const at::Tensor* t : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == S && t->size(1) == Hkv &&
                      t->is_contiguous(),
                  "rope_store: scales must be contiguous float32 [S, Hkv] = [", S, ", ", Hkv, "]");
    }
  }
  TORCH_CHECK(D % 2 == 0 && H > 0 && qkv.size(1) == (H + 2 * Hkv) * D, "rope_store: qkv width ", qkv.size(1),
              " is not (H + 2 Hkv) D = ", (H + 2 * Hkv) * D);
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D / 2 &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "rope_store: cos and sin must be contiguous float32 [T, D/2]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && slot_mapping.is_contiguous() &&
                  slot_mapping.scalar_type() == at::kLong,
              "rope_store: slot_mapping must be int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < S, "rope_store: slot out of the pool");
  auto q = at::empty({T, H, D}, qkv.options());
  auto k = at::empty({T, Hkv, D}, qkv.options());
  const int64_t W = qkv.size(1), half = D / 2;
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* row = xp + t * W;
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c, s, qp + (t * H + h) * D, half);
      for (int64_t h = 0; h < Hkv; ++h) rotate(row + (H + h) * D, c, s, kp + (t * Hkv + h) * D, half);
      if (quant) {
        int8_t* kc = k_cache.data_ptr<int8_t>() + slots[t] * Hkv * D;
        int8_t* vc = v_cache.data_ptr<int8_t>() + slots[t] * Hkv * D;
        float* ks = k_scale->data_ptr<float>() + slots[t] * Hkv;
        float* vs = v_scale->data_ptr<float>() + slots[t] * Hkv;
        for (int64_t h = 0; h < Hkv; ++h) {
          quantize_kv_row(kp + (t * Hkv + h) * D, kc + h * D, ks + h, D);
          quantize_kv_row(row + (H + Hkv + h) * D, vc + h * D, vs + h, D);
        }
      } else if (f16) {  // rounded to nearest even, as torch's .to(torch.float16)
        at::Half* kc = k_cache.data_ptr<at::Half>() + slots[t] * Hkv * D;
        at::Half* vc = v_cache.data_ptr<at::Half>() + slots[t] * Hkv * D;
        const float* vrow = row + (H + Hkv) * D;
        for (int64_t i = 0; i < Hkv * D; ++i) kc[i] = at::Half(kp[t * Hkv * D + i]), vc[i] = at::Half(vrow[i]);
      } else {
        std::copy(kp + t * Hkv * D, kp + (t + 1) * Hkv * D, k_cache.data_ptr<float>() + slots[t] * Hkv * D);
        std::copy(row + (H + Hkv) * D, row + (H + 2 * Hkv) * D, v_cache.data_ptr<float>() + slots[t] * Hkv * D);
      }
    }
  });
  return {q, k};
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up must be [T, 2 I]");
  const int64_t inter = gate_up.size(1) / 2;
  return at::silu(gate_up.narrow(1, 0, inter)).mul_(gate_up.narrow(1, inter, inter));
}

}  // namespace agentrt_cpu

TORCH_LIBRARY_FRAGMENT(agentrt_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, int H, "
        "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(agentrt_cpu, CPU, m) {
  m.impl("rms_norm", &agentrt_cpu::rms_norm);
  m.impl("add_rms_norm", &agentrt_cpu::add_rms_norm);
  m.impl("rope_store", &agentrt_cpu::rope_store);
  m.impl("silu_mul", &agentrt_cpu::silu_mul);
}
