// The CPU kernels' C++ entry points (namespace agentrt_cpu), shared by the sources of the one
// library runtime/kernels/cpu_kernels.py builds, so that decode_layers (cpu_decode_layers.cpp) calls
// them directly instead of through the dispatcher. Shapes, dtypes and errors: each source's header.
#pragma once

#include "cpu_isa.h"

#include <ATen/ATen.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#ifdef __AVX2__
#include <immintrin.h>
#endif


namespace agentrt_cpu {

// sinks: [H] float32 attention-sink logits (gpt-oss), or none; k_scale / v_scale: [S, Hkv] float32
// scales of an int8 pool, or none for a float32 one (cpu_decode_attention.cpp)
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale,
                            const c10::optional<at::Tensor>& sinks = c10::nullopt,
                            const c10::optional<at::Tensor>& k_scale = c10::nullopt,
                            const c10::optional<at::Tensor>& v_scale = c10::nullopt);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w,
                                                double eps);
// k_scale / v_scale: an int8 pool's [S, Hkv] float32 scales (the rows are quantized), or none (cpu_layer_ops.cpp)
std::tuple<at::Tensor, at::Tensor> rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                              const at::Tensor& k_cache, const at::Tensor& v_cache,
                                              const at::Tensor& slot_mapping, int64_t H,
                                              const c10::optional<at::Tensor>& k_scale = c10::nullopt,
                                              const c10::optional<at::Tensor>& v_scale = c10::nullopt);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor pack_int8(const at::Tensor& q);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t N);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias, int64_t N);

// Helpers of the quantized matmuls (cpu_int8_linear.cpp, cpu_int4_linear.cpp).
namespace detail {

constexpr int64_t QK = 32;  // activation block

// a float16 value (its bits) as float32, exactly
inline float half_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
// Bytes ahead of the packed weights the quantized matmuls prefetch (_mm_prefetch): a decode-sized
// matmul streams its weights from memory once, and the hardware prefetcher alone stops at each 4 KiB
// page (measured on Zen 4, one thread: 14 -> 17 GB/s at 4 KiB pages, 17 -> 20 GB/s at 2 MiB pages,
// against a plain read's 20 and 27; 4-12 KiB ahead were alike). A prefetch past the end is harmless.
constexpr int64_t PREFETCH_AHEAD = 6144;

// One row of K floats -> K int8, K / QK scales d and K / QK block sums of the int8 values (llama.cpp's
// Q8_0: d = max|x| / 127, q = round(x / d)). A block with a NaN gets d = NaN and zeros (its outputs
// NaN); an all-zero or subnormal block (|x| < 4e-37: its scale's inverse would overflow) zeros.
inline void quantize_row_scalar(const float* x, int8_t* q, float* d, int32_t* sums, int64_t K) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    float amax = 0.f;
    for (int64_t i = 0; i < QK; ++i) {
      const float a = std::fabs(xb[i]);
      amax = (a > amax || std::isnan(a)) ? a : amax;  // a NaN scale keeps a NaN input visible
      if (std::isnan(amax)) break;
    }
    const float scale = amax / 127.f;
    const float inv = scale >= FLT_MIN ? 1.f / scale : 0.f;
    d[b] = scale;
    int32_t sum = 0;
    for (int64_t i = 0; i < QK; ++i) {
      const float v = std::nearbyint(xb[i] * inv);  // in [-127, 127], or NaN with a NaN block
      q[b * QK + i] = static_cast<int8_t>(v == v ? v : 0.f);  // a NaN cast would be undefined
      sum += q[b * QK + i];
    }
    sums[b] = sum;
  }
}

#ifdef __AVX2__
// The same with 8 floats at a time (the same float operations, so the same bits: max is exact,
// x * inv one rounding, round-to-nearest-even as nearbyint's default mode); ~10x fewer instructions
// than the scalar loop's compares and branches per element, which cost ~3 us a call at K = 1536.
inline void quantize_row(const float* x, int8_t* q, float* d, int32_t* sums, int64_t K) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' per-lane interleave
  for (int64_t b = 0; b < K / QK; ++b) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float a = _mm256_movemask_ps(nan) ? NAN : _mm_cvtss_f32(m4);
    const float scale = a / 127.f;
    const __m256 inv = _mm256_set1_ps(scale >= FLT_MIN ? 1.f / scale : 0.f);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      qi[i] = _mm256_cvtps_epi32(_mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q)));  // NaN -> 0
    }
    const __m256i q16 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), _mm256_permutevar8x32_epi32(q16, order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    d[b] = scale;
    sums[b] = _mm_cvtsi128_si32(s4);
  }
}
#else
inline void quantize_row(const float* x, int8_t* q, float* d, int32_t* sums, int64_t K) {
  quantize_row_scalar(x, q, d, sums, K);
}
#endif

#ifdef __AVX2__
AGENTRT_INLINE float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// float16 scales (the int4 kernel's): 4 or 8 of them widened to float32, exactly (F16C's vcvtph2ps,
// which AVX2 CPUs have; a value at a time where a VM hides F16C)
AGENTRT_INLINE __m128 load4h(const uint16_t* p) {
#ifdef __F16C__
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  return _mm_setr_ps(half_float(p[0]), half_float(p[1]), half_float(p[2]), half_float(p[3]));
#endif
}
AGENTRT_INLINE __m256 load8h(const uint16_t* p) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return _mm256_set_m128(load4h(p + 4), load4h(p));
#endif
}

// AVX2's vpdpbusd on a zero accumulator: unsigned x signed bytes, 4 products summed into each int32
// lane (maddubs' int16 pair sums, then madd with ones); exact where a pair sum fits int16, which every
// caller's operands guarantee (int8: |x| x sign(w, x), int4: nibbles x int8).
#define AGENTRT_DOT_AVX2(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))

// 4 rows' sums of 8 int32 partials each -> [4] int32 (horizontal adds: one reduction for 4 rows)
AGENTRT_INLINE __m128i sum4(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// 8 sums of 8 int32 partials each (p[0..7]) -> [8] int32, lane i the sum of p[i]: a transposing tree
// of unpacks and adds (21 instructions for 8 sums; two sum4's horizontal adds decode to more here).
AGENTRT_INLINE __m256i sum8(const __m256i* p) {
  __m256i q[4];
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
  }
  // per 128-bit half: [p0 p1 p2 p3] and [p4 p5 p6 p7], partial
  const __m256i r0 = _mm256_add_epi32(_mm256_unpacklo_epi64(q[0], q[1]), _mm256_unpackhi_epi64(q[0], q[1]));
  const __m256i r1 = _mm256_add_epi32(_mm256_unpacklo_epi64(q[2], q[3]), _mm256_unpackhi_epi64(q[2], q[3]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(r0, r1, 0x20), _mm256_permute2x128_si256(r0, r1, 0x31));
}

// A work item's batch rows (a.M) 4 at a time, ROWS<4>(a, m), then the 1 to 3 left: ROWS<MB>(a, m)
// takes MB rows from m (the weights loaded once for them), ROW1(a, m) a last single row (each row's
// arithmetic the same whichever takes it).
#define AGENTRT_ROWS_BY_4(ROWS, ROW1)           \
  int64_t m = 0;                                \
  for (; m + 4 <= a.M; m += 4) ROWS<4>(a, m);   \
  switch (a.M - m) {                            \
    case 3: ROWS<3>(a, m); break;               \
    case 2: ROWS<2>(a, m); break;               \
    case 1: ROW1(a, m); break;                  \
    default: break;                             \
  }
#endif

// The GEMM paths of int8_linear / int4_linear (16+ batch rows on AVX-512 VNNI): a work item's 16
// output rows of one block of 32 columns, [16 rows, 32 bytes] -> vpdpbusd's operand layout [8 column
// quads, 16 rows, 4 bytes] (each lane of a 512-bit register: 4 bytes of its row).
constexpr int64_t GEMM_ROWS = 16;  // output rows per GEMM work item
inline void column_quads(const uint8_t* rows, uint8_t* out) {
  for (int64_t kq = 0; kq < QK / 4; ++kq) {
    for (int64_t n = 0; n < GEMM_ROWS; ++n) std::memcpy(out + (kq * GEMM_ROWS + n) * 4, rows + n * QK + kq * 4, 4);
  }
}

}  // namespace detail

}  // namespace agentrt_cpu
