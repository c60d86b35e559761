// 4-bit weight x int8 activation matmul for decode-sized batches on the CPU (float32 in and out).
//
// int4_linear(x [M, K] float32, packed [N4, K / 2] uint8, scales [N4, K / 32] float16,
//             mins [N4, K / 32] float16, bias [N] or None, N) -> y [M, N] float32,
//   y[m, n] = sum_b sum_{k in block b} (scale[n, b] q[n, k] + min[n, b]) d[m, b] xq[m, k] (+ bias[n]):
//   weights in llama.cpp's Q4_1 format (q in 0..15, a scale and a minimum per block of 32 input
//   columns: w = scale * q + min), activations as in int8_linear (Q8_0 blocks of 32, quantized per row
//   on every call; the min term uses the block's sum of the quantized activations, as Q8_1 does).
//   Packed layout (models/quant.py: Int4BlockLinear.pack_for_kernel): rows padded to N4, a multiple
//   of 4 (zero scales and mins), in groups of 4; per group and block, 64 bytes: two runs of 32 whose
//   byte j holds row 2c's q[j] in its low nibble and row 2c + 1's in its high one (c = 0, 1), so a
//   32-byte load and a mask or a shift give one row's 32 values in order; scales and mins likewise
//   group-major, [N4 / 4, K / 32, 4] (the 4 rows' values of a block side by side).
//
// Why: a batch-1 decode step reads every weight; the default model's weights come from a Q4_1 GGUF,
// so these are its exact values at 0.625 bytes per weight (float16 scale and min, as in the file; each
// widened to float32 exactly where it is used) against int8's 1.125.
// Per block the 4 rows' integer dot products (AVX2 maddubs on the unsigned nibbles: no sign trick)
// are reduced together with horizontal adds and scaled with one 4-wide FMA, the mins' term with
// another: about half the instructions of a row at a time. The VNNI paths unpack a work item's
// nibbles once for up to 4 batch rows and reduce 2 blocks together (1.4-1.6x at batch 4, 1.0-1.2x at
// batch 1 with the prefetch, on Zen 4: bench/gemv.py). From 16 batch rows (a prefill chunk) the AVX-512
// VNNI path is a GEMM with 16 output rows on the lanes (gemm_rows below: no horizontal sums). A row's
// output is the same bit for bit on every path and whatever the batch. K must be a multiple of 32;
// errors are RuntimeErrors naming the problem. Built with the other CPU kernels
// (runtime/kernels/cpu_kernels.py).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "cpu_kernels.h"

namespace {

using agentrt_cpu::detail::half_float;
using agentrt_cpu::detail::QK;
using agentrt_cpu::detail::quantize_row;

constexpr int64_t NR = 4;  // rows per work item

// One work item's inputs: the quantized activations (M rows), its 4 rows' packed nibbles, scales, mins.
struct Item {
  const int8_t* xq;  // [M, K]
  const float* xd;   // [M, K / 32] block scales
  const float* xs;   // [M, K / 32] block scale x sum of the block's int8 values
  const float* xd4;  // [M, K / 32, 4]: xd, each value 4 times (one per row of the group)
  const float* xs4;  // [M, K / 32, 4]: xs likewise
  const uint8_t* w0;  // [K / 32, 2, 32]
  const uint16_t* s0;  // [K / 32, 4] float16
  const uint16_t* m0;  // [K / 32, 4] float16
  int64_t M, K, nb;
  float* out;  // [M, 4]
};

#ifdef __AVX2__
using agentrt_cpu::detail::load4h;
using agentrt_cpu::detail::load8h;
using agentrt_cpu::detail::PREFETCH_AHEAD;
using agentrt_cpu::detail::sum4;
using agentrt_cpu::detail::sum8;

// AVX2: the 4 rows' dot products with one activation block: q0..q3 32 unsigned 4-bit values each, x 32
// int8 -> [4] int32. maddubs gives 16 int16 pair sums per row (|.| <= 2 * 15 * 127); two rounds of
// 16-bit horizontal adds fold the 4 rows into one register (sums of 8 products, |.| <= 15240: no
// overflow) before the one widening madd: 5 multiplies per 4 rows instead of 8, which matters where
// vector integer multiplies have a single port (AMD Zen 1: 256-bit ops are two 128-bit halves).
inline __m128i dot4_avx2(__m256i q0, __m256i q1, __m256i q2, __m256i q3, __m256i x) {
  const __m256i h01 = _mm256_hadd_epi16(_mm256_maddubs_epi16(q0, x), _mm256_maddubs_epi16(q1, x));
  const __m256i h23 = _mm256_hadd_epi16(_mm256_maddubs_epi16(q2, x), _mm256_maddubs_epi16(q3, x));
  // lanes [r0 r0 r1 r1 r2 r2 r3 r3] per 128-bit half; madd with ones adds the neighbours
  const __m256i s = _mm256_madd_epi16(_mm256_hadd_epi16(h01, h23), _mm256_set1_epi16(1));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// Batch row m of the item, per block: acc = fma(float(the 4 rows' int32 sums), s * d, acc),
// low = fma(min, xs, low); the output acc + low. Prefetches the weights ahead.
AGENTRT_INLINE void row_avx2(const Item& a, int64_t m) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const int8_t* xm = a.xq + m * a.K;
  const float* dm = a.xd + m * a.nb;
  const float* sm = a.xs + m * a.nb;
  __m128 acc = _mm_setzero_ps(), low = _mm_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* wb = a.w0 + b * 64;
    _mm_prefetch(reinterpret_cast<const char*>(wb) + PREFETCH_AHEAD, _MM_HINT_T0);
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + b * QK));
    const __m256i w01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb));
    const __m256i w23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32));
    const __m128i s = dot4_avx2(_mm256_and_si256(w01, nibble), _mm256_and_si256(_mm256_srli_epi16(w01, 4), nibble),
                                _mm256_and_si256(w23, nibble), _mm256_and_si256(_mm256_srli_epi16(w23, 4), nibble), xv);
    const __m128 scale = _mm_mul_ps(load4h(a.s0 + b * NR), _mm_set1_ps(dm[b]));
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(s), scale, acc);
    low = _mm_fmadd_ps(load4h(a.m0 + b * NR), _mm_set1_ps(sm[b]), low);
  }
  _mm_storeu_ps(a.out + m * NR, _mm_add_ps(acc, low));
}

// VNNI: vpdpbusd sums 4 byte products (unsigned nibbles x signed activations) straight into int32.
// The nibbles unpacked once for up to 4 batch rows (MB); 2 blocks per step, the 8 rows' partial sums
// reduced together (sum8), then each block's 4 rows take the same two fmas as the AVX2 path, in block
// order (bit for bit its output); a last odd block goes alone (sum4).
#define AGENTRT_INT4_VNNI_ROWS(DPBUSD)                                                                         \
  const __m256i nibble = _mm256_set1_epi8(0x0F);                                                               \
  __m128 acc[MB], low[MB];                                                                                      \
  for (int m = 0; m < MB; ++m) acc[m] = low[m] = _mm_setzero_ps();                                              \
  int64_t b = 0;                                                                                                \
  for (; b + 2 <= a.nb; b += 2) {                                                                               \
    const uint8_t* wb = a.w0 + b * 64;                                                                          \
    _mm_prefetch(reinterpret_cast<const char*>(wb) + PREFETCH_AHEAD, _MM_HINT_T0);                              \
    _mm_prefetch(reinterpret_cast<const char*>(wb) + PREFETCH_AHEAD + 64, _MM_HINT_T0);                         \
    __m256i w[8]; /* w[4j + r]: row r of block b + j */                                                         \
    for (int j = 0; j < 2; ++j) {                                                                               \
      const __m256i w01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j));                    \
      const __m256i w23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j + 32));               \
      w[4 * j] = _mm256_and_si256(w01, nibble);                                                                 \
      w[4 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(w01, 4), nibble);                                       \
      w[4 * j + 2] = _mm256_and_si256(w23, nibble);                                                             \
      w[4 * j + 3] = _mm256_and_si256(_mm256_srli_epi16(w23, 4), nibble);                                       \
    }                                                                                                           \
    const __m256 sc = load8h(a.s0 + b * NR); /* [2 blocks, 4 rows] */                                  \
    for (int m = 0; m < MB; ++m) {                                                                              \
      const int64_t mb = (m0 + m) * a.nb + b;                                                                   \
      const int8_t* xb = a.xq + (m0 + m) * a.K + b * QK;                                                        \
      __m256i p[8];                                                                                             \
      for (int j = 0; j < 2; ++j) {                                                                             \
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + j * QK));                   \
        for (int r = 0; r < 4; ++r) p[4 * j + r] = DPBUSD(_mm256_setzero_si256(), w[4 * j + r], xv);           \
      }                                                                                                         \
      const __m256 f = _mm256_cvtepi32_ps(sum8(p));                                                             \
      const __m256 scale = _mm256_mul_ps(sc, _mm256_loadu_ps(a.xd4 + mb * NR));                                 \
      acc[m] = _mm_fmadd_ps(_mm256_castps256_ps128(f), _mm256_castps256_ps128(scale), acc[m]);                  \
      low[m] = _mm_fmadd_ps(load4h(a.m0 + b * NR), _mm_loadu_ps(a.xs4 + mb * NR), low[m]);                \
      acc[m] = _mm_fmadd_ps(_mm256_extractf128_ps(f, 1), _mm256_extractf128_ps(scale, 1), acc[m]);              \
      low[m] = _mm_fmadd_ps(load4h(a.m0 + b * NR + 4), _mm_loadu_ps(a.xs4 + mb * NR + 4), low[m]);        \
    }                                                                                                           \
  }                                                                                                             \
  if (b < a.nb) {                                                                                               \
    const __m256i w01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w0 + b * 64));                   \
    const __m256i w23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w0 + b * 64 + 32));              \
    const __m256i q0 = _mm256_and_si256(w01, nibble), q1 = _mm256_and_si256(_mm256_srli_epi16(w01, 4), nibble); \
    const __m256i q2 = _mm256_and_si256(w23, nibble), q3 = _mm256_and_si256(_mm256_srli_epi16(w23, 4), nibble); \
    for (int m = 0; m < MB; ++m) {                                                                              \
      const int64_t mb = (m0 + m) * a.nb + b;                                                                   \
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + (m0 + m) * a.K + b * QK));  \
      const __m128i s = sum4(DPBUSD(_mm256_setzero_si256(), q0, xv), DPBUSD(_mm256_setzero_si256(), q1, xv),    \
                             DPBUSD(_mm256_setzero_si256(), q2, xv), DPBUSD(_mm256_setzero_si256(), q3, xv));   \
      const __m128 scale = _mm_mul_ps(load4h(a.s0 + b * NR), _mm_loadu_ps(a.xd4 + mb * NR));              \
      acc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), scale, acc[m]);                                                 \
      low[m] = _mm_fmadd_ps(load4h(a.m0 + b * NR), _mm_loadu_ps(a.xs4 + mb * NR), low[m]);                \
    }                                                                                                           \
  }                                                                                                             \
  for (int m = 0; m < MB; ++m) _mm_storeu_ps(a.out + (m0 + m) * NR, _mm_add_ps(acc[m], low[m]));

// AVX2's stand-in for vpdpbusd on a zero accumulator (AGENTRT_DOT_AVX2: nibble x int8 pair sums
// |.| <= 2 * 15 * 128, no saturation): the same exact int32 sums of 4 products, so the AVX2 path
// shares the VNNI paths' steps (and their bits).
#define AGENTRT_DPBUSD_AVX2(zero, u, s) AGENTRT_DOT_AVX2(u, s)
template <int MB>
AGENTRT_INLINE void rows_avx2(const Item& a, int64_t m0) {
  AGENTRT_INT4_VNNI_ROWS(AGENTRT_DPBUSD_AVX2)
}
// AVX2: 2 to 4 batch rows at a time take the VNNI paths' steps (the nibbles unpacked once for them);
// a single row the 5-multiply dot4_avx2 (faster alone: bench/gemv.py)
void item_avx2(const Item& a) { AGENTRT_ROWS_BY_4(rows_avx2, row_avx2) }

template <int MB>
__attribute__((target("avxvnni"), always_inline)) inline void rows_avxvnni(const Item& a, int64_t m0) {
  AGENTRT_INT4_VNNI_ROWS(_mm256_dpbusd_avx_epi32)
}
template <int MB>
__attribute__((target("avx512vl,avx512vnni"), always_inline)) inline void rows_avx512vnni(const Item& a,
                                                                                      int64_t m0) {
  AGENTRT_INT4_VNNI_ROWS(_mm256_dpbusd_epi32)
}
__attribute__((target("avxvnni"))) void item_avxvnni(const Item& a) { AGENTRT_ROWS_BY_4(rows_avxvnni, rows_avxvnni<1>) }
__attribute__((target("avx512vl,avx512vnni"))) void item_avx512vnni(const Item& a) {
  AGENTRT_ROWS_BY_4(rows_avx512vnni, rows_avx512vnni<1>)
}
#else
void item_scalar(const Item& a) {
  for (int64_t m = 0; m < a.M; ++m) {
    const int8_t* xm = a.xq + m * a.K;
    for (int64_t r = 0; r < NR; ++r) {
      float acc = 0.f, low = 0.f;
      for (int64_t b = 0; b < a.nb; ++b) {
        const uint8_t* wr = a.w0 + b * 64 + (r / 2) * 32;
        const int shift = (r % 2) * 4;
        int32_t s = 0;
        for (int64_t i = 0; i < QK; ++i) s += int32_t((wr[i] >> shift) & 0x0F) * xm[b * QK + i];
        acc = std::fma(static_cast<float>(s), half_float(a.s0[b * NR + r]) * a.xd[m * a.nb + b], acc);
        low = std::fma(half_float(a.m0[b * NR + r]), a.xs[m * a.nb + b], low);
      }
      a.out[m * NR + r] = acc + low;
    }
  }
}
#endif

// Many batch rows (a prefill chunk), AVX-512 VNNI: 16 output rows on the 16 lanes of a register, so
// a block's integer sums need no horizontal reduction. Per work item the 16 rows' nibbles are laid out
// once as [block, 8 column quads, 16 rows, 4 bytes] (vpdpbusd's operand: each lane 4 unsigned weights of
// its row), their scales and mins as [block, 16]; then per batch row and block 8 vpdpbusd with the
// row's 4 activation bytes broadcast give the exact int32 sums, and the float steps are the other
// paths': acc = fma(float(sum), scale * d, acc), low = fma(min, xs, low) in block order, out = acc +
// low: bit for bit the same outputs (the int32 sums are exact in any order).
constexpr int64_t NG = agentrt_cpu::detail::GEMM_ROWS;
constexpr int64_t GEMM_MIN_ROWS = 16;  // batch rows from which int4_linear takes the GEMM path (every ISA)

struct GemmItem {
  const int8_t* xq;  // [M, K]
  const float* xd;   // [M, K / 32]
  const float* xs;   // [M, K / 32]
  const uint8_t* w;  // the item's first group of 4 rows: [groups, K / 32, 2, 32] (kernel layout)
  const uint16_t* s;   // [groups, K / 32, 4] float16
  const uint16_t* mn;  // [groups, K / 32, 4] float16
  int64_t groups;    // 1..4 groups of 4 rows in this item (the rest of the 16 lanes are zero)
  int64_t M, K, nb;
};

#ifdef __AVX2__
// the item's [K / 32, 8, 16, 4] weight bytes and [K / 32, 16] scales and mins
void gemm_layout(const GemmItem& a, uint8_t* wv, float* s16, float* m16) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  alignas(32) uint8_t rows[NG * QK];  // one block's 16 rows of 32 levels
  for (int64_t b = 0; b < a.nb; ++b) {
    for (int64_t n = 0; n < NG; ++n) {
      const int64_t g = n / 4, r = n % 4;
      __m256i q = _mm256_setzero_si256();  // padding lanes: zero levels, scales and mins
      float sc = 0.f, mn = 0.f;
      if (g < a.groups) {
        const __m256i run = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.w + (g * a.nb + b) * 64 + (r / 2) * 32));
        q = _mm256_and_si256(r % 2 ? _mm256_srli_epi16(run, 4) : run, nibble);
        sc = half_float(a.s[(g * a.nb + b) * NR + r]), mn = half_float(a.mn[(g * a.nb + b) * NR + r]);
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(rows + n * QK), q);
      s16[b * NG + n] = sc, m16[b * NG + n] = mn;
    }
    agentrt_cpu::detail::column_quads(rows, wv + b * 8 * NG * 4);
  }
}

// out[m, 16] for the item's rows, MB batch rows at a time from m0
template <int MB>
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline void gemm_rows(const GemmItem& a, const uint8_t* wv,
                                                                                  const float* s16, const float* m16,
                                                                                  int64_t m0, float* out) {
  __m512 acc[MB], low[MB];
  for (int m = 0; m < MB; ++m) acc[m] = low[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* wb = wv + b * 8 * NG * 4;
    __m512i sum[MB];
    for (int m = 0; m < MB; ++m) sum[m] = _mm512_setzero_si512();
    for (int64_t kq = 0; kq < 8; ++kq) {
      const __m512i w = _mm512_loadu_si512(wb + kq * NG * 4);
      for (int m = 0; m < MB; ++m) {
        int32_t x4;
        std::memcpy(&x4, a.xq + (m0 + m) * a.K + b * QK + kq * 4, 4);
        sum[m] = _mm512_dpbusd_epi32(sum[m], w, _mm512_set1_epi32(x4));
      }
    }
    const __m512 sc = _mm512_loadu_ps(s16 + b * NG), mi = _mm512_loadu_ps(m16 + b * NG);
    for (int m = 0; m < MB; ++m) {
      const int64_t mb = (m0 + m) * a.nb + b;
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]), _mm512_mul_ps(sc, _mm512_set1_ps(a.xd[mb])), acc[m]);
      low[m] = _mm512_fmadd_ps(mi, _mm512_set1_ps(a.xs[mb]), low[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + (m0 + m) * NG, _mm512_add_ps(acc[m], low[m]));
}

__attribute__((target("avx512f,avx512vnni"))) void gemm_avx512vnni(const GemmItem& a, const uint8_t* wv,
                                                                    const float* s16, const float* m16, float* out) {
  int64_t m = 0;
  for (; m + 8 <= a.M; m += 8) gemm_rows<8>(a, wv, s16, m16, m, out);
  for (; m + 4 <= a.M; m += 4) gemm_rows<4>(a, wv, s16, m16, m, out);
  for (; m < a.M; ++m) gemm_rows<1>(a, wv, s16, m16, m, out);
}

// The GEMM on AVX2 (and AVX-VNNI): the same layout, each column quad's 16 rows as two registers of 8
// rows on int32 lanes. AVX2: maddubs gives a lane its 4 products as two int16 pair sums; the 8 quads
// of a block add up in int16 (|.| <= 8 * 2 * 15 * 128 = 30720: no overflow) and one madd with ones
// widens them: the exact int32 sums, so the float steps after them give the other paths' bits.
// AVX-VNNI: vpdpbusd into int32 lanes directly.
#define AGENTRT_INT4_GEMM_ROWS(QUAD, WIDEN)                                                                     \
  __m256 acc[MB][2], low[MB][2];                                                                                \
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = low[m][0] = low[m][1] = _mm256_setzero_ps();             \
  for (int64_t b = 0; b < a.nb; ++b) {                                                                          \
    const uint8_t* wb = wv + b * 8 * NG * 4;                                                                    \
    __m256i sum[MB][2];                                                                                         \
    for (int m = 0; m < MB; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_si256();                                \
    for (int64_t kq = 0; kq < 8; ++kq) {                                                                        \
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kq * NG * 4));                \
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + kq * NG * 4 + 32));           \
      for (int m = 0; m < MB; ++m) {                                                                            \
        int32_t x4;                                                                                             \
        std::memcpy(&x4, a.xq + (m0 + m) * a.K + b * QK + kq * 4, 4);                                           \
        const __m256i xb = _mm256_set1_epi32(x4);                                                               \
        sum[m][0] = QUAD(sum[m][0], w0, xb);                                                                    \
        sum[m][1] = QUAD(sum[m][1], w1, xb);                                                                    \
      }                                                                                                         \
    }                                                                                                           \
    for (int h = 0; h < 2; ++h) {                                                                               \
      const __m256 sc = _mm256_loadu_ps(s16 + b * NG + 8 * h), mi = _mm256_loadu_ps(m16 + b * NG + 8 * h);      \
      for (int m = 0; m < MB; ++m) {                                                                            \
        const int64_t mb = (m0 + m) * a.nb + b;                                                                 \
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(WIDEN(sum[m][h])), _mm256_mul_ps(sc, _mm256_set1_ps(a.xd[mb])), \
                                    acc[m][h]);                                                                 \
        low[m][h] = _mm256_fmadd_ps(mi, _mm256_set1_ps(a.xs[mb]), low[m][h]);                                   \
      }                                                                                                         \
    }                                                                                                           \
  }                                                                                                             \
  for (int m = 0; m < MB; ++m) {                                                                                \
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + (m0 + m) * NG + 8 * h, _mm256_add_ps(acc[m][h], low[m][h])); \
  }

#define AGENTRT_QUAD_AVX2(sum, w, x) _mm256_add_epi16(sum, _mm256_maddubs_epi16(w, x))
#define AGENTRT_WIDEN_AVX2(sum) _mm256_madd_epi16(sum, _mm256_set1_epi16(1))
#define AGENTRT_QUAD_AVXVNNI(sum, w, x) _mm256_dpbusd_avx_epi32(sum, w, x)
#define AGENTRT_WIDEN_NONE(sum) (sum)

template <int MB>
AGENTRT_INLINE void gemm_rows_avx2(const GemmItem& a, const uint8_t* wv, const float* s16, const float* m16,
                                   int64_t m0, float* out) {
  AGENTRT_INT4_GEMM_ROWS(AGENTRT_QUAD_AVX2, AGENTRT_WIDEN_AVX2)
}
template <int MB>
__attribute__((target("avxvnni"), always_inline)) inline void gemm_rows_avxvnni(const GemmItem& a, const uint8_t* wv,
                                                                               const float* s16, const float* m16,
                                                                               int64_t m0, float* out) {
  AGENTRT_INT4_GEMM_ROWS(AGENTRT_QUAD_AVXVNNI, AGENTRT_WIDEN_NONE)
}

#define AGENTRT_INT4_GEMM_BY(ROWS)                          \
  int64_t m = 0;                                            \
  for (; m + GEMM_MB_AVX2 <= a.M; m += GEMM_MB_AVX2) ROWS<GEMM_MB_AVX2>(a, wv, s16, m16, m, out); \
  for (; m < a.M; ++m) ROWS<1>(a, wv, s16, m16, m, out);
constexpr int GEMM_MB_AVX2 = 4;  // batch rows per pass (their int16/int32 sums, acc and low in registers)
void gemm_avx2(const GemmItem& a, const uint8_t* wv, const float* s16, const float* m16, float* out) {
  AGENTRT_INT4_GEMM_BY(gemm_rows_avx2)
}
__attribute__((target("avxvnni"))) void gemm_avxvnni(const GemmItem& a, const uint8_t* wv, const float* s16,
                                                     const float* m16, float* out) {
  AGENTRT_INT4_GEMM_BY(gemm_rows_avxvnni)
}
#endif

using ItemFn = void (*)(const Item&);

ItemFn item_fn(int isa) {
#ifdef __AVX2__
  if (isa == agentrt_cpu::ISA_AVX512VNNI) return item_avx512vnni;
  if (isa == agentrt_cpu::ISA_AVXVNNI) return item_avxvnni;
  return item_avx2;
#else
  (void)isa;
  return item_scalar;
#endif
}

}  // namespace

namespace agentrt_cpu {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "int4_linear: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kByte,
              "int4_linear: qweight must be a contiguous uint8 [N4, K / 2] tensor (two 4-bit values a byte)");
  const int64_t M = x.size(0), K = x.size(1), N4 = qweight.size(0);
  TORCH_CHECK(N4 % 4 == 0 && N >= 0 && N <= N4 && N4 < N + 4, "int4_linear: ", N4,
              " packed rows do not hold N = ", N, " rows padded to a multiple of 4");
  TORCH_CHECK(K % QK == 0, "int4_linear: K = ", K, " is not a multiple of ", QK);
  TORCH_CHECK(qweight.size(1) * 2 == K, "int4_linear: x has ", K, " columns, qweight holds ", qweight.size(1) * 2);
  const int64_t nb = K / QK;
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == N4 && t->size(1) == nb && t->is_contiguous() &&
                    t->scalar_type() == at::kHalf,
                "int4_linear: scales and mins must be float16 [N4, K / 32]");
  }
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "int4_linear: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);  // block scales; scale x sum of the block's int8 values
  std::vector<float> xd4(M * nb * NR), xs4(M * nb * NR);  // the same, 4 times each
  std::vector<int32_t> sums(M * nb);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      quantize_row(xp + m * K, xq.data() + m * K, xd.data() + m * nb, sums.data() + m * nb, K);
      for (int64_t k = m * nb; k < (m + 1) * nb; ++k) {
        xs[k] = xd[k] * static_cast<float>(sums[k]);
        for (int64_t r = 0; r < NR; ++r) xd4[k * NR + r] = xd[k], xs4[k * NR + r] = xs[k];
      }
    }
  });
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const int isa = cpu_isa();
#ifdef __AVX2__
  if (M >= GEMM_MIN_ROWS && isa != agentrt_cpu::ISA_SCALAR) {
    at::parallel_for(0, (N4 + NG - 1) / NG, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> wv(nb * 8 * NG * 4);
      std::vector<float> s16(nb * NG), m16(nb * NG), out(M * NG);
      for (int64_t it = begin; it < end; ++it) {
        const int64_t n0 = it * NG, nr = std::min(NG, N - n0);
        const GemmItem g{xq.data(), xd.data(), xs.data(), wp + n0 * (K / 2), sp + n0 * nb, mp + n0 * nb,
                         std::min<int64_t>(4, (N4 - n0) / NR), M, K, nb};
        gemm_layout(g, wv.data(), s16.data(), m16.data());
        if (isa == agentrt_cpu::ISA_AVX512VNNI) {
          gemm_avx512vnni(g, wv.data(), s16.data(), m16.data(), out.data());
        } else if (isa == agentrt_cpu::ISA_AVXVNNI) {
          gemm_avxvnni(g, wv.data(), s16.data(), m16.data(), out.data());
        } else {
          gemm_avx2(g, wv.data(), s16.data(), m16.data(), out.data());
        }
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t r = 0; r < nr; ++r) yp[m * N + n0 + r] = out[m * NG + r] + (bp ? bp[n0 + r] : 0.f);
        }
      }
    });
    return y;
  }
#endif
  // one batch row: row_avx2 on every ISA (at batch 1 it streamed the weights 6-17% faster than the
  // VNNI steps on one row: bench/gemv.py, docs/benchmarks.md, issue 37; the same int32 sums and bits)
  const ItemFn fn = item_fn(M == 1 && isa != agentrt_cpu::ISA_SCALAR ? agentrt_cpu::ISA_AVX2 : isa);
  at::parallel_for(0, N4 / NR, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> out(M * NR);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t n0 = it * NR, nr = std::min(NR, N - n0);
      fn(Item{xq.data(), xd.data(), xs.data(), xd4.data(), xs4.data(), wp + n0 * (K / 2), sp + n0 * nb, mp + n0 * nb,
              M, K, nb, out.data()});
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t r = 0; r < nr; ++r) yp[m * N + n0 + r] = out[m * NR + r] + (bp ? bp[n0 + r] : 0.f);
      }
    }
  });
  return y;
}

}  // namespace agentrt_cpu

TORCH_LIBRARY_FRAGMENT(agentrt_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(agentrt_cpu, CPU, m) { m.impl("int4_linear", &agentrt_cpu::int4_linear); }
