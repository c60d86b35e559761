// Int8 weight x int8 activation matmul for decode-sized batches on the CPU (float32 in and out).
//
// int8_linear(x [M, K] float32, packed [N4, K] int8, scales [N4, K / 32] float32 (group-major: see
//             below), bias [N] or None, N)
//   -> y [M, N] float32, y[m, n] = sum_b scales[n, b] d[m, b] sum_{k in block b} xq[m, k] w[n, k]
//   (+ bias[n]): weights and activations both in llama.cpp's Q8_0 format, int8 in blocks of 32 input
//   columns with one float scale per block (symmetric: d = max|v| / 127, q = round(v / d)); the
//   activations are quantized here, per row, on every call (models/quant.py quantizes the weights).
//   The weights come packed by pack_int8 below: rows padded to N4 = a multiple of 4 (zeros), and
//   each group of 4 rows stored block-interleaved, [N4 / 4, K / 32, 4, 32], so one work item reads
//   one contiguous stream (row by row, 4 streams, read 8.6 GB/s here; packed 12.6-14.2 GB/s); the
//   scales group-major likewise, [N4 / 4, K / 32, 4] (models/quant.py: group_major), so the 4 rows'
//   sums of a block, reduced together with horizontal adds, take one 4-wide FMA.
// pack_int8(q [N, K] int8) -> [N4, K] int8 in that layout; the padded rows' scales are the caller's
//   (zeros).
//
// Why: at batch 1 a decode step is a read of every weight; int8 weights read 4x fewer bytes than
// float32, and integer dot products (AVX2 maddubs/madd: 32 multiply-adds in ~6 instructions, as
// llama.cpp's ggml_vec_dot_q8_0_q8_0) keep the arithmetic below the read. Converting int8 weights to
// float32 for an FMA (torch._weight_int8pack_mm at float32) costs ~4x the instructions and was
// compute-bound here (2 cores, AVX2). The VNNI paths take up to 4 batch rows per pass over a work
// item's weights (batch 4: 1.4-1.6x the per-row passes on Zen 4, bench/gemv.py); every path
// prefetches the weights ahead (cpu_kernels.h: PREFETCH_AHEAD). From 16 batch rows (a prefill chunk)
// the AVX-512 VNNI path is a GEMM with 16 output rows on the lanes (gemm_rows). A row's output is the
// same bit for bit on every path and whatever the batch (tests/runtime/test_batch_invariance.py). K
// must be a multiple of 32 (the caller checks); errors are RuntimeErrors naming the problem. Built
// with the other CPU kernels (runtime/kernels/cpu_kernels.py).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "cpu_isa.h"
#include "cpu_kernels.h"

namespace {

using agentrt_cpu::detail::QK;
using agentrt_cpu::detail::quantize_row;

constexpr int64_t NR = 4;  // output rows per work item: each activation block loaded once for 4

// One work item's inputs: the quantized activations (M rows), its 4 rows' packed weights and scales.
struct Item {
  const int8_t* xq;   // [M, K]
  const float* xd;    // [M, K / 32]
  const float* xd4;   // [M, K / 32, 4]: xd, each value 4 times (one per row of the group)
  const int32_t* xc4;  // [M, K / 32, 4]: 128 x the block's sum of xq, 4 times (VNNI: see there)
  const int8_t* w0;   // [K / 32, 4, 32]
  const float* s0;    // [K / 32, 4]
  int64_t M, K, nb;
  float* out;  // [M, 4]
};

#ifdef __AVX2__
using agentrt_cpu::detail::PREFETCH_AHEAD;
using agentrt_cpu::detail::sum4;
using agentrt_cpu::detail::sum8;

// Batch row m of the item, block by block: DOT(ax, sx) -> 8 int32 sums of 4 products |x| * sign(w, x)
// per row (the int8 pairs' signs moved onto w), the 4 rows reduced together (sum4), then
// acc[r] = fma(float(the block's int32 sum of row r), s[r] * d, acc[r]); PF: prefetch the weights.
#define AGENTRT_INT8_ROW(DOT, PF)                                                                    \
  const int8_t* xm = a.xq + m * a.K;                                                                \
  const float* dm = a.xd + m * a.nb;                                                                \
  __m128 acc = _mm_setzero_ps();                                                                    \
  for (int64_t b = 0; b < a.nb; ++b) {                                                              \
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + b * QK));          \
    const __m256i ax = _mm256_sign_epi8(xv, xv);                                                    \
    const int8_t* wb = a.w0 + b * NR * QK;                                                          \
    if (PF) {                                                                                       \
      _mm_prefetch(reinterpret_cast<const char*>(wb) + PREFETCH_AHEAD, _MM_HINT_T0);               \
      _mm_prefetch(reinterpret_cast<const char*>(wb) + PREFETCH_AHEAD + 64, _MM_HINT_T0);          \
    }                                                                                               \
    __m256i p[NR];                                                                                  \
    for (int64_t r = 0; r < NR; ++r) {                                                              \
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + r * QK));         \
      p[r] = DOT(ax, _mm256_sign_epi8(wv, xv));                                                     \
    }                                                                                               \
    const __m128 scale = _mm_mul_ps(_mm_loadu_ps(a.s0 + b * NR), _mm_set1_ps(dm[b]));               \
    acc = _mm_fmadd_ps(_mm_cvtepi32_ps(sum4(p[0], p[1], p[2], p[3])), scale, acc);                  \
  }                                                                                                 \
  _mm_storeu_ps(a.out + m * NR, acc);

#define AGENTRT_DOT_AVXVNNI(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s)
#define AGENTRT_DOT_AVX512VNNI(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)

// AVX2: the item's M x 4 outputs a batch row at a time (the weights prefetched on the first)
void item_avx2(const Item& a) {
  for (int64_t m = 0; m < a.M; ++m) {
    AGENTRT_INT8_ROW(AGENTRT_DOT_AVX2, m == 0)
  }
}

// VNNI (vpdpbusd: unsigned x signed bytes, 4 products summed into each int32): the weights are made
// unsigned by flipping their sign bit (w + 128), once for up to 4 batch rows (MB), so a row's sum
// over a block is the wanted one plus 128 x the sum of the block's activations, taken off again
// (xc4): the same int32 as the AVX2 path's, without its sign instructions per batch row. 2 blocks
// per step: the 8 rows' partial sums reduced together (sum8), then each block's 4 rows take the same
// fma as AVX2, in block order (bit for bit its output); a last odd block goes alone (sum4). 256-bit
// registers: the same steps on 512-bit ones streamed their weights from memory 20-30% slower here
// (Zen 4), though faster from the cache.
#define AGENTRT_INT8_VNNI_ROWS(DPBUSD)                                                                         \
  const __m256i flip = _mm256_set1_epi32(static_cast<int>(0x80808080u));                                        \
  __m128 acc[MB];                                                                                               \
  for (int m = 0; m < MB; ++m) acc[m] = _mm_setzero_ps();                                                       \
  int64_t b = 0;                                                                                                \
  for (; b + 2 <= a.nb; b += 2) {                                                                               \
    const int8_t* wb = a.w0 + b * NR * QK;                                                                      \
    for (int i = 0; i < 4; ++i) _mm_prefetch(reinterpret_cast<const char*>(wb) + PREFETCH_AHEAD + 64 * i, _MM_HINT_T0); \
    __m256i w[8]; /* w[4j + r]: row r of block b + j */                                                         \
    for (int i = 0; i < 8; ++i) {                                                                               \
      w[i] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + QK * i)), flip);         \
    }                                                                                                           \
    const __m256 sc = _mm256_loadu_ps(a.s0 + b * NR); /* [2 blocks, 4 rows] */                                  \
    for (int m = 0; m < MB; ++m) {                                                                              \
      const int64_t mb = (m0 + m) * a.nb + b;                                                                   \
      const int8_t* xb = a.xq + (m0 + m) * a.K + b * QK;                                                        \
      __m256i p[8];                                                                                             \
      for (int j = 0; j < 2; ++j) {                                                                             \
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + j * QK));                   \
        for (int r = 0; r < 4; ++r) p[4 * j + r] = DPBUSD(_mm256_setzero_si256(), w[4 * j + r], xv);           \
      }                                                                                                         \
      const __m256i s =                                                                                         \
          _mm256_sub_epi32(sum8(p), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xc4 + mb * NR)));     \
      const __m256 f = _mm256_cvtepi32_ps(s);                                                                   \
      const __m256 scale = _mm256_mul_ps(sc, _mm256_loadu_ps(a.xd4 + mb * NR));                                 \
      acc[m] = _mm_fmadd_ps(_mm256_castps256_ps128(f), _mm256_castps256_ps128(scale), acc[m]);                  \
      acc[m] = _mm_fmadd_ps(_mm256_extractf128_ps(f, 1), _mm256_extractf128_ps(scale, 1), acc[m]);              \
    }                                                                                                           \
  }                                                                                                             \
  if (b < a.nb) {                                                                                               \
    const int8_t* wb = a.w0 + b * NR * QK;                                                                      \
    __m256i w[4];                                                                                               \
    for (int i = 0; i < 4; ++i) {                                                                               \
      w[i] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + QK * i)), flip);         \
    }                                                                                                           \
    for (int m = 0; m < MB; ++m) {                                                                              \
      const int64_t mb = (m0 + m) * a.nb + b;                                                                   \
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + (m0 + m) * a.K + b * QK));  \
      const __m128i s = sum4(DPBUSD(_mm256_setzero_si256(), w[0], xv), DPBUSD(_mm256_setzero_si256(), w[1], xv), \
                             DPBUSD(_mm256_setzero_si256(), w[2], xv), DPBUSD(_mm256_setzero_si256(), w[3], xv)); \
      const __m128 scale = _mm_mul_ps(_mm_loadu_ps(a.s0 + b * NR), _mm_loadu_ps(a.xd4 + mb * NR));              \
      acc[m] = _mm_fmadd_ps(                                                                                    \
          _mm_cvtepi32_ps(_mm_sub_epi32(s, _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.xc4 + mb * NR)))), \
          scale, acc[m]);                                                                                       \
    }                                                                                                           \
  }                                                                                                             \
  for (int m = 0; m < MB; ++m) _mm_storeu_ps(a.out + (m0 + m) * NR, acc[m]);

template <int MB>
__attribute__((target("avxvnni"), always_inline)) inline void rows_avxvnni(const Item& a, int64_t m0) {
  AGENTRT_INT8_VNNI_ROWS(_mm256_dpbusd_avx_epi32)
}
template <int MB>
__attribute__((target("avx512vl,avx512vnni"), always_inline)) inline void rows_avx512vnni(const Item& a,
                                                                                      int64_t m0) {
  AGENTRT_INT8_VNNI_ROWS(_mm256_dpbusd_epi32)
}
// one batch row alone: the AVX2 path's per-block steps with vpdpbusd (these streamed the weights of
// a batch-1 call from memory 5-10% faster here than the 2-block steps above, though slower from cache)
__attribute__((target("avxvnni"), always_inline)) inline void row_avxvnni(const Item& a, int64_t m) {
  AGENTRT_INT8_ROW(AGENTRT_DOT_AVXVNNI, true)
}
__attribute__((target("avx512vl,avx512vnni"), always_inline)) inline void row_avx512vnni(const Item& a, int64_t m) {
  AGENTRT_INT8_ROW(AGENTRT_DOT_AVX512VNNI, true)
}
__attribute__((target("avxvnni"))) void item_avxvnni(const Item& a) { AGENTRT_ROWS_BY_4(rows_avxvnni, row_avxvnni) }
__attribute__((target("avx512vl,avx512vnni"))) void item_avx512vnni(const Item& a) {
  AGENTRT_ROWS_BY_4(rows_avx512vnni, row_avx512vnni)
}
#else
void item_scalar(const Item& a) {
  for (int64_t m = 0; m < a.M; ++m) {
    const int8_t* xm = a.xq + m * a.K;
    const float* dm = a.xd + m * a.nb;
    for (int64_t r = 0; r < NR; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < a.nb; ++b) {
        const int8_t* wr = a.w0 + (b * NR + r) * QK;
        int32_t s = 0;
        for (int64_t i = 0; i < QK; ++i) s += int32_t(xm[b * QK + i]) * int32_t(wr[i]);
        acc = std::fma(static_cast<float>(s), a.s0[b * NR + r] * dm[b], acc);
      }
      a.out[m * NR + r] = acc;
    }
  }
}
#endif


// Many batch rows (a prefill chunk) on AVX-512 VNNI: 16 output rows on the 16 lanes of a register (no
// horizontal sums). Per work item the 16 rows' weights are laid out once as [block, 8 column quads, 16
// rows, 4 bytes], made unsigned (w + 128) for vpdpbusd, and the scales as [block, 16]; per batch row
// and block 8 vpdpbusd with the row's 4 activation bytes broadcast, minus 128 x the block's activation
// sum, give the exact int32 sums, then acc = fma(float(sum), scale * d, acc) in block order as on the
// other paths: bit for bit the same outputs.
constexpr int64_t NG = agentrt_cpu::detail::GEMM_ROWS;
constexpr int64_t GEMM_MIN_ROWS = 16;  // batch rows from which int8_linear takes the GEMM path

#ifdef __AVX2__
// the item's [K / 32, 8, 16, 4] unsigned weight bytes and [K / 32, 16] scales; w: the item's first
// group of 4 rows ([groups, K / 32, 4, 32]), s: its scales ([groups, K / 32, 4]), groups in 1..4
void gemm_layout(const int8_t* w, const float* s, int64_t groups, int64_t nb, uint8_t* wv, float* s16) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // w + 128: the sign bit flipped
  alignas(32) uint8_t rows[NG * QK];  // one block's 16 rows of 32 unsigned weights
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t n = 0; n < NG; ++n) {
      const int64_t g = n / 4, r = n % 4;
      __m256i q = flip;  // padding lanes: zero weights (128 unsigned) and zero scales
      float sc = 0.f;
      if (g < groups) {
        q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * nb + b) * NR * QK + r * QK)), flip);
        sc = s[(g * nb + b) * NR + r];
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(rows + n * QK), q);
      s16[b * NG + n] = sc;
    }
    agentrt_cpu::detail::column_quads(rows, wv + b * 8 * NG * 4);
  }
}

// out[m, 16] for batch rows [m0, m0 + MB); xc: [M, K / 32] 128 x each block's activation sum
template <int MB>
__attribute__((target("avx512f,avx512vnni"), always_inline)) inline void gemm_rows(
    const int8_t* xq, const float* xd, const int32_t* xc, int64_t K, int64_t nb, const uint8_t* wv, const float* s16,
    int64_t m0, float* out) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = wv + b * 8 * NG * 4;
    __m512i sum[MB];
    for (int m = 0; m < MB; ++m) sum[m] = _mm512_set1_epi32(-xc[(m0 + m) * nb + b]);
    for (int64_t kq = 0; kq < 8; ++kq) {
      const __m512i w = _mm512_loadu_si512(wb + kq * NG * 4);
      for (int m = 0; m < MB; ++m) {
        int32_t x4;
        std::memcpy(&x4, xq + (m0 + m) * K + b * QK + kq * 4, 4);
        sum[m] = _mm512_dpbusd_epi32(sum[m], w, _mm512_set1_epi32(x4));
      }
    }
    const __m512 sc = _mm512_loadu_ps(s16 + b * NG);
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]), _mm512_mul_ps(sc, _mm512_set1_ps(xd[(m0 + m) * nb + b])),
                               acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + (m0 + m) * NG, acc[m]);
}

__attribute__((target("avx512f,avx512vnni"))) void gemm_avx512vnni(const int8_t* xq, const float* xd,
                                                                    const int32_t* xc, int64_t M, int64_t K,
                                                                    int64_t nb, const uint8_t* wv, const float* s16,
                                                                    float* out) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) gemm_rows<8>(xq, xd, xc, K, nb, wv, s16, m, out);
  for (; m + 4 <= M; m += 4) gemm_rows<4>(xq, xd, xc, K, nb, wv, s16, m, out);
  for (; m < M; ++m) gemm_rows<1>(xq, xd, xc, K, nb, wv, s16, m, out);
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

int best_isa() {
#ifdef __AVX2__
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl")) return agentrt_cpu::ISA_AVX512VNNI;
  if (__builtin_cpu_supports("avxvnni")) return agentrt_cpu::ISA_AVXVNNI;
  return agentrt_cpu::ISA_AVX2;
#else
  return agentrt_cpu::ISA_SCALAR;
#endif
}

std::atomic<int>& isa_state() {
  static std::atomic<int> isa{best_isa()};
  return isa;
}

const char* const ISA_NAMES[] = {"scalar", "avx2", "avxvnni", "avx512vnni"};

}  // namespace

namespace agentrt_cpu {

int cpu_isa() { return isa_state().load(std::memory_order_relaxed); }

// The instructions this library was compiled to use (-march) that the CPU, as this process sees it,
// lacks: "" when it has them all. A library built on a host's -march and loaded under an emulator that
// shows fewer (qemu-user) would otherwise die of an illegal instruction at its first call.
std::string missing_instructions() {
  std::string missing;
  auto need = [&](bool has, const char* name) {
    if (!has) missing += missing.empty() ? name : std::string(", ") + name;
  };
#ifdef __AVX2__
  need(__builtin_cpu_supports("avx2"), "avx2");
#endif
#ifdef __FMA__
  need(__builtin_cpu_supports("fma"), "fma");
#endif
#ifdef __F16C__
  need(__builtin_cpu_supports("f16c"), "f16c");
#endif
#ifdef __AVX512F__
  need(__builtin_cpu_supports("avx512f"), "avx512f");
#endif
#ifdef __AVX512BW__
  need(__builtin_cpu_supports("avx512bw"), "avx512bw");
#endif
#ifdef __AVX512VL__
  need(__builtin_cpu_supports("avx512vl"), "avx512vl");
#endif
#ifdef __AVX512DQ__
  need(__builtin_cpu_supports("avx512dq"), "avx512dq");
#endif
  return missing;
}

void check_build_runs_here() {
  const std::string missing = missing_instructions();
  TORCH_CHECK(missing.empty(), "this library was built for instructions this CPU does not show this process (",
              missing, "): rebuild it for this CPU ($AGENTRT_CPU_MARCH)");
}

std::string best_cpu_isa() {
  check_build_runs_here();
  return ISA_NAMES[best_isa()];
}

std::string set_cpu_isa(const std::string& name) {
  check_build_runs_here();
  int want = -1;
  for (int i = 0; i < 4; ++i) {
    if (name == ISA_NAMES[i]) want = i;
  }
  TORCH_CHECK(want >= 0 || name.empty(), "set_cpu_isa: unknown ISA '", name, "' (scalar, avx2, avxvnni, avx512vnni)");
  const int best = best_isa();
  if (name.empty()) want = best;
  // the scalar path exists only in a build without AVX2; the others only in a build with it
  const bool ok = want == best || (want == ISA_AVX2 && best > ISA_AVX2) ||
                  (want == ISA_AVXVNNI && best >= ISA_AVX2 && __builtin_cpu_supports("avxvnni"));
  TORCH_CHECK(ok, "set_cpu_isa: this CPU (or this build) cannot run '", name, "'; its best is ", ISA_NAMES[best]);
  isa_state().store(want);
  return ISA_NAMES[want];
}

std::string get_cpu_isa() { return ISA_NAMES[cpu_isa()]; }

at::Tensor pack_int8(const at::Tensor& q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(1) % QK == 0,
              "pack_int8: q must be an int8 [N, K] tensor with K a multiple of 32");
  // the kernel moves x's sign onto w (_mm256_sign_epi8), which overflows for -128
  TORCH_CHECK(q.numel() == 0 || q.min().item<int8_t>() >= -127, "pack_int8: weights must be in [-127, 127]");
  const int64_t N = q.size(0), K = q.size(1), N4 = (N + 3) / 4 * 4;
  auto padded = at::zeros({N4, K}, q.options());
  padded.narrow(0, 0, N).copy_(q);
  return padded.view({N4 / 4, 4, K / QK, QK}).permute({0, 2, 1, 3}).contiguous().view({N4, K});
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat,
              "int8_linear: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == at::kChar,
              "int8_linear: qweight must be a contiguous int8 [N4, K] tensor (pack_int8)");
  const int64_t M = x.size(0), K = x.size(1), N4 = qweight.size(0);
  TORCH_CHECK(N4 % 4 == 0 && N >= 0 && N <= N4 && N4 < N + 4, "int8_linear: ", N4,
              " packed rows do not hold N = ", N, " rows padded to a multiple of 4");
  TORCH_CHECK(qweight.size(1) == K, "int8_linear: x has ", K, " columns, qweight ", qweight.size(1));
  TORCH_CHECK(K % QK == 0, "int8_linear: K = ", K, " is not a multiple of ", QK);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N4 && scales.size(1) == K / QK && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat,
              "int8_linear: scales must be float32 [N4, K / 32]");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "int8_linear: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int64_t nb = K / QK;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xd4(M * nb * NR);
  std::vector<int32_t> sums(M * nb), xc4(M * nb * NR);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      quantize_row(xp + m * K, xq.data() + m * K, xd.data() + m * nb, sums.data() + m * nb, K);
      for (int64_t k = m * nb; k < (m + 1) * nb; ++k) {
        for (int64_t r = 0; r < NR; ++r) xd4[k * NR + r] = xd[k], xc4[k * NR + r] = 128 * sums[k];
      }
    }
  });
  const int8_t* wp = qweight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef __AVX2__
  if (M >= GEMM_MIN_ROWS && cpu_isa() == agentrt_cpu::ISA_AVX512VNNI) {
    std::vector<int32_t> xc(M * nb);
    for (int64_t k = 0; k < M * nb; ++k) xc[k] = 128 * sums[k];
    at::parallel_for(0, (N4 + NG - 1) / NG, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> wv(nb * 8 * NG * 4);
      std::vector<float> s16(nb * NG), out(M * NG);
      for (int64_t it = begin; it < end; ++it) {
        const int64_t n0 = it * NG, nr = std::min(NG, N - n0);
        gemm_layout(wp + n0 * K, sp + n0 * nb, std::min<int64_t>(4, (N4 - n0) / NR), nb, wv.data(), s16.data());
        gemm_avx512vnni(xq.data(), xd.data(), xc.data(), M, K, nb, wv.data(), s16.data(), out.data());
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t r = 0; r < nr; ++r) yp[m * N + n0 + r] = out[m * NG + r] + (bp ? bp[n0 + r] : 0.f);
        }
      }
    });
    return y;
  }
#endif
  const int64_t items = N4 / NR;
  const ItemFn fn = item_fn(cpu_isa());
  at::parallel_for(0, items, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> out(M * NR);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t n0 = it * NR, nr = std::min(NR, N - n0);
      fn(Item{xq.data(), xd.data(), xd4.data(), xc4.data(), wp + n0 * K, sp + n0 * nb, M, K, nb, out.data()});
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t r = 0; r < nr; ++r) yp[m * N + n0 + r] = out[m * NR + r] + (bp ? bp[n0 + r] : 0.f);
      }
    }
  });
  return y;
}

}  // namespace agentrt_cpu

TORCH_LIBRARY_FRAGMENT(agentrt_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int N) -> Tensor");
  m.def("pack_int8(Tensor q) -> Tensor");
  m.def("set_cpu_isa(str isa) -> str");
  m.def("get_cpu_isa() -> str");
  m.def("best_cpu_isa() -> str");
}

TORCH_LIBRARY_IMPL(agentrt_cpu, CPU, m) {
  m.impl("int8_linear", &agentrt_cpu::int8_linear);
  m.impl("pack_int8", &agentrt_cpu::pack_int8);
}

TORCH_LIBRARY_IMPL(agentrt_cpu, CatchAll, m) {
  m.impl("set_cpu_isa", &agentrt_cpu::set_cpu_isa);
  m.impl("get_cpu_isa", &agentrt_cpu::get_cpu_isa);
  m.impl("best_cpu_isa", &agentrt_cpu::best_cpu_isa);
}
