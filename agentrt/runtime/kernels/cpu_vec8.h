// 8-lane float vectors for the CPU attention kernel (cpu_decode_attention.cpp): AVX2 intrinsics, or
// the same arithmetic lane by lane where AVX2 is not built. vexp: exp for x <= 0 (Cephes expf: range
// reduction by ln 2, a degree-5 polynomial), the same operations on every lane; reduce8x8 and
// lanes_sum add 8 lanes as ((0+1)+(2+3))+((4+5)+(6+7)).
#pragma once

#include "cpu_isa.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#ifdef __AVX2__
#include <immintrin.h>
#endif


namespace agentrt_cpu {
namespace vec8 {

#ifdef __AVX2__
using V8 = __m256;
AGENTRT_INLINE V8 vzero() { return _mm256_setzero_ps(); }
AGENTRT_INLINE V8 vload(const float* p) { return _mm256_loadu_ps(p); }
// 8 int8 values as floats (exact)
AGENTRT_INLINE V8 vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 8 float16 values (their bits) as floats (exact: F16C, or a value at a time where a VM hides it)
AGENTRT_INLINE V8 vload(const uint16_t* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = c10::detail::fp16_ieee_to_fp32_value(p[i]);
  return _mm256_load_ps(f);
#endif
}
AGENTRT_INLINE void vstore(float* p, V8 v) { _mm256_storeu_ps(p, v); }
AGENTRT_INLINE V8 vset1(float x) { return _mm256_set1_ps(x); }
AGENTRT_INLINE V8 vfma(V8 a, V8 b, V8 c) { return _mm256_fmadd_ps(a, b, c); }
AGENTRT_INLINE V8 vmul(V8 a, V8 b) { return _mm256_mul_ps(a, b); }
AGENTRT_INLINE V8 vadd(V8 a, V8 b) { return _mm256_add_ps(a, b); }
AGENTRT_INLINE V8 vmax(V8 a, V8 b) { return _mm256_max_ps(a, b); }
// lanes i < n kept, the others zero
AGENTRT_INLINE V8 vkeep(V8 v, int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), idx)));
}
// 8 accumulators -> [8] their lane sums, each as ((0+1)+(2+3))+((4+5)+(6+7))
AGENTRT_INLINE V8 reduce8x8(const V8* a) {
  const V8 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const V8 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
// exp on 8 lanes for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial)
AGENTRT_INLINE V8 vexp(V8 x) {
  x = _mm256_max_ps(vset1(-87.3f), x);  // a NaN x stays NaN (maxps returns its second operand then)
  V8 fx = _mm256_floor_ps(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
  x = vfma(fx, vset1(-0.693359375f), x);
  x = vfma(fx, vset1(2.12194440e-4f), x);
  V8 y = vset1(1.9875691500e-4f);
  y = vfma(y, x, vset1(1.3981999507e-3f));
  y = vfma(y, x, vset1(8.3334519073e-3f));
  y = vfma(y, x, vset1(4.1665795894e-2f));
  y = vfma(y, x, vset1(1.6666665459e-1f));
  y = vfma(y, x, vset1(5.0000001201e-1f));
  y = vfma(y, vmul(x, x), vadd(x, vset1(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return vmul(y, _mm256_castsi256_ps(e));
}
AGENTRT_INLINE float lanes_sum(V8 v) {
  alignas(32) float a[8];
  vstore(a, v);
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}
AGENTRT_INLINE float lanes_max(V8 v) {
  alignas(32) float a[8];
  vstore(a, v);
  return std::max(std::max(std::max(a[0], a[1]), std::max(a[2], a[3])),
                  std::max(std::max(a[4], a[5]), std::max(a[6], a[7])));
}
#else
// The same arithmetic, lane by lane, where AVX2 is not built.
struct V8 {
  float v[8];
};
inline V8 vzero() { return V8{}; }
inline V8 vload(const float* p) {
  V8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = p[i];
  return r;
}
inline V8 vload(const int8_t* p) {
  V8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline V8 vload(const uint16_t* p) {
  V8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = c10::detail::fp16_ieee_to_fp32_value(p[i]);
  return r;
}
inline void vstore(float* p, V8 a) {
  for (int i = 0; i < 8; ++i) p[i] = a.v[i];
}
inline V8 vset1(float x) {
  V8 r;
  for (int i = 0; i < 8; ++i) r.v[i] = x;
  return r;
}
inline V8 vfma(V8 a, V8 b, V8 c) {
  for (int i = 0; i < 8; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline V8 vmul(V8 a, V8 b) {
  for (int i = 0; i < 8; ++i) a.v[i] *= b.v[i];
  return a;
}
inline V8 vadd(V8 a, V8 b) {
  for (int i = 0; i < 8; ++i) a.v[i] += b.v[i];
  return a;
}
inline V8 vmax(V8 a, V8 b) {
  for (int i = 0; i < 8; ++i) a.v[i] = std::max(a.v[i], b.v[i]);
  return a;
}
inline V8 vkeep(V8 a, int64_t n) {
  for (int i = 0; i < 8; ++i) a.v[i] = i < n ? a.v[i] : 0.f;
  return a;
}
inline float tree(const float* a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }
inline V8 reduce8x8(const V8* a) {
  V8 r;
  for (int j = 0; j < 8; ++j) r.v[j] = tree(a[j].v);
  return r;
}
inline V8 vexp(V8 x) {
  for (int i = 0; i < 8; ++i) {
    float xi = std::max(x.v[i], -87.3f);
    const float fx = std::floor(std::fma(xi, 1.44269504088896341f, 0.5f));
    xi = std::fma(fx, -0.693359375f, xi);
    xi = std::fma(fx, 2.12194440e-4f, xi);
    float y = 1.9875691500e-4f;
    y = std::fma(y, xi, 1.3981999507e-3f);
    y = std::fma(y, xi, 8.3334519073e-3f);
    y = std::fma(y, xi, 4.1665795894e-2f);
    y = std::fma(y, xi, 1.6666665459e-1f);
    y = std::fma(y, xi, 5.0000001201e-1f);
    y = std::fma(y, xi * xi, xi + 1.f);
    x.v[i] = y * std::ldexp(1.f, static_cast<int>(fx));
  }
  return x;
}
inline float lanes_sum(V8 a) { return tree(a.v); }
inline float lanes_max(V8 a) {
  return std::max(std::max(std::max(a.v[0], a.v[1]), std::max(a.v[2], a.v[3])),
                  std::max(std::max(a.v[4], a.v[5]), std::max(a.v[6], a.v[7])));
}
#endif

}  // namespace vec8
}  // namespace agentrt_cpu
