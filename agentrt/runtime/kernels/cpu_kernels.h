// The CPU kernels' C++ entry points (namespace agentrt_cpu), shared by the sources of the one
// library runtime/kernels/cpu_kernels.py builds, so that decode_layers (cpu_decode_layers.cpp) calls
// them directly instead of through the dispatcher. Shapes, dtypes and errors: each source's header.
#pragma once

#include <ATen/ATen.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <tuple>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace agentrt_cpu {

// sinks: [H] float32 attention-sink logits (gpt-oss), or none (cpu_decode_attention.cpp)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale,
                            const c10::optional<at::Tensor>& sinks = c10::nullopt);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps);
std::tuple<at::Tensor, at::Tensor> rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                                              const at::Tensor& slot_mapping, int64_t H);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor pack_int8(const at::Tensor& q);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias, int64_t N);

// Helpers of the quantized matmuls (cpu_int8_linear.cpp, cpu_int4_linear.cpp).
namespace detail {

constexpr int64_t QK = 32;  // activation block

// One row of K floats -> K int8 and K / QK scales (llama.cpp's Q8_0: d = max|x| / 127, q = round(x / d)).
inline void quantize_row(const float* x, int8_t* q, float* d, int64_t K) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int64_t i = 0; i < QK; ++i) {
      const float a = std::fabs(xb[i]);
      amax = (a > amax || std::isnan(a)) ? a : amax;  // a NaN scale keeps a NaN input visible
      if (std::isnan(amax)) break;
    }
    const float scale = amax / 127.f;
    // a subnormal scale's inverse overflows: such a block (|x| < 4e-37) quantizes to zeros
    const float inv = scale >= FLT_MIN ? 1.f / scale : 0.f;
    d[b] = scale;
    for (int64_t i = 0; i < QK; ++i) {
      const float v = std::nearbyint(xb[i] * inv);  // in [-127, 127], or NaN with a NaN block
      q[b * QK + i] = static_cast<int8_t>(v == v ? v : 0.f);  // a NaN cast would be undefined
    }
  }
}

#ifdef __AVX2__
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// 4 rows' sums of 8 int32 partials each -> [4] int32 (horizontal adds: one reduction for 4 rows)
inline __m128i sum4(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
#endif

}  // namespace detail

}  // namespace agentrt_cpu
