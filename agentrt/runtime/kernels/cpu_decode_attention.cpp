// Attention straight from the token-slot KV pool on the CPU, one kernel for decode, chunked prefill,
// prefill over a cached prefix and speculative verification (grouped-query attention), without a
// gathered copy of K/V. Batch-invariant by construction: every query row is computed by the same
// instruction sequence, which depends only on its own q, its keys and their number, never on the
// other rows of the batch, on how they were blocked, or on whether a key came from the prefix cache.
//
// attention(q [T, H, D] float32, k_cache / v_cache [S, Hkv, D] float32 (contiguous),
//           slots [R, L] int64 (rows of pool slots, padded), seq [T] int64 (the slot row of each
//           query row; empty: row t reads slot row t), lens [T] int64 (keys row t attends: the first
//           lens[t] slots of its slot row, in [1, L]), scale, sinks [H] float32 contiguous or None)
//           -> out [T, H, D] float32:
//   out[t, h] = sum_l softmax_l(q[t, h] . k_l * scale) v_l, query head h reading KV head h / (H / Hkv).
//   With sinks (learned attention sinks, gpt-oss: transformers' GptOssAttention eager path), head h's
//   softmax gets one more logit sinks[h] that has no value row:
//   out[t, h] = sum_l exp(s_l - m) v_l / (sum_l exp(s_l - m) + exp(sinks[h] - m)),
//   m = max(max_l s_l, sinks[h]).
// decode_attention(q [B, H, D], k_cache, v_cache, slots [B, L], lens [B], scale, sinks, k_scale,
//   v_scale): the same, row b reading slot row b (a decode step: one new token per sequence).
// An int8 pool (runtime/kv_cache.py KVPool): k_cache / v_cache int8 [S, Hkv, D] with k_scale /
//   v_scale float32 [S, Hkv] (contiguous), row (s, h) standing for data[s, h, :] * scale[s, h]; read
//   in place, the scales applied on load: s_l = (q . k_l as below, on the int8 values as floats) times
//   k_scale[l] then times `scale`; out = sum_l (e_l * v_scale[l]) v_l. A float32 pool takes no scales,
//   nor does a float16 one (k_cache / v_cache float16: each value widened to float32 exactly as it is
//   loaded, so the result is bit for bit that of a float32 pool holding the same values).
// D up to 256 (Gemma 3's 256 included). Raises RuntimeError on bad shapes or dtypes, D not a multiple
// of 8 or above 256, a slot outside the pool, a length outside [1, L], sinks that are not a
// contiguous float32 [H] CPU tensor, an int8 pool without both scales or scales that are not
// contiguous float32 [S, Hkv], or scales with a float32 pool.
//
// Order of the arithmetic, per query row and head (the invariant the tests check bitwise):
// - scores: keys in groups of 8 from key 0; s_l = sum over d of q[d] k_l[d] as 8 lanes (lane i:
//   d = i, i + 8, ... by FMA), the lanes then added in a fixed tree ((0+1)+(2+3))+((4+5)+(6+7)), times
//   `scale`;
// - softmax: m = max_l s_l; e_l = exp(s_l - m) (a Cephes-style polynomial, the same on every lane);
//   sum_l e_l in 8 lanes (lane i: l = i mod 8), then the same tree;
//   with sinks: m = max(max_l s_l, sinks[h]) instead, and after the tree sum += exp(sinks[h] - m) (the
//   same polynomial), one scalar add; without sinks none of this runs (the same bits as before sinks);
// - out = (sum_l e_l v_l, FMA in key order) * (1 / sum).
// Rows that share a slot row and are adjacent in the batch (a prefill chunk) are worked on together,
// up to 32 at a time (4 without AVX-512), so each K and V row is read once for all of them, and up to 3 (row, head) pairs
// of one length share each K and V load where AVX-512 gives 32 registers (V on 16 lanes, across d);
// that changes which row is computed when, not how. at::parallel_for over (row block, KV head) items;
// with fewer than 2 items a thread and rows of 1,024+ keys (a decode step deep in a long context)
// each phase is split across the threads instead: the scores by keys, the softmax by (row, head), the
// weighted sum by vectors of D, every KV head of a tile of keys together (their rows are adjacent).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_vec8.h"

namespace {

constexpr int64_t KB = 64;  // keys per tile (K and V tiles of one KV head stay in L1)


using namespace agentrt_cpu::vec8;  // the 8-lane vector ops (cpu_vec8.h)

struct Problem {
  const float* q;
  const void *k, *v;          // [S, Hkv, D] float32, or int8 with scales
  const float *ks, *vs;       // [S, Hkv] scales of an int8 pool, else nullptr
  const int64_t* slots;
  const int64_t* lens;
  float* out;
  int64_t H, Hkv, G, D, L;
  float scale;
  const float* sinks;  // [H] attention-sink logits, or nullptr
};

// Pairs of (row, head) taken together by attend_block: 3 where AVX-512 gives 32 vector registers (3
// pairs x 8 keys of accumulators stay in registers), else 2 (their 16 accumulators spill some of the
// 16 registers, and still beat 1 pair: docs/benchmarks.md, issue 37).
#if defined(__AVX512F__)
#define PB_MAX 3
#else
#define PB_MAX 2
#endif
constexpr int64_t PB = PB_MAX;
// query rows per block, at most (K and V read once for all of them; docs/benchmarks.md, issue 37)
constexpr int64_t RB = 32;
// fewer items than 2 per thread and rows of at least WIDE_MIN_KEYS keys: the phases split across the
// threads, the scores in chunks of WIDE_KEYS keys (multiples of KB)
constexpr int64_t WIDE_MIN_KEYS = 1024;
constexpr int64_t WIDE_KEYS = 512;
constexpr int64_t WIDE_VECTORS = 4;  // 8-float vectors of D per weighted-sum task, at most (128 bytes)

// Rows of keys this many keys ahead are prefetched (_mm_prefetch) while the current ones are worked
// on: a row of one head is D values out of every Hkv x D, a pattern the hardware prefetcher follows
// poorly.
constexpr int64_t PF_KEYS = 16;

// prefetch a row of n bytes (its cache lines)
template <typename T>
AGENTRT_INLINE void prefetch_row(const T* row, int64_t n) {
#ifdef __AVX2__
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < n; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
#else
  (void)row, (void)n;
#endif
}

// key l + PF_KEYS's V row of head hk, its vectors [c0, c0 + nc) of 8 values, when that key is below n
template <typename T>
AGENTRT_INLINE void prefetch_v(const Problem& P, const T* V, const int64_t* srow_slots, int64_t hk, int64_t l,
                               int64_t n, int64_t c0, int64_t nc) {
  if (l + PF_KEYS < n) prefetch_row(V + (srow_slots[l + PF_KEYS] * P.Hkv + hk) * P.D + c0 * 8, nc * 8 * sizeof(T));
}

// dots[i] = the 8 keys' scores (before any scale) of query row qp[i], i < NP: per pair and key the
// lanes by FMA over d in order, then reduce8x8 (the order in the header); K rows loaded once for all.
template <int NP, int64_t ND, typename KT>
inline void qk_dots(const float* const* qp, const KT* const* kr, int64_t nd, V8* dots) {
  V8 acc[NP][8];
  for (int j = 0; j < 8; ++j) {
    const V8 kv = vload(kr[j]);
    for (int i = 0; i < NP; ++i) acc[i][j] = vmul(vload(qp[i]), kv);
  }
  for (int64_t c = 1; c < (ND ? ND : nd); ++c) {
    V8 qv[NP];
    for (int i = 0; i < NP; ++i) qv[i] = vload(qp[i] + c * 8);
    for (int j = 0; j < 8; ++j) {
      const V8 kv = vload(kr[j] + c * 8);
      for (int i = 0; i < NP; ++i) acc[i][j] = vfma(qv[i], kv, acc[i][j]);
    }
  }
  for (int i = 0; i < NP; ++i) dots[i] = reduce8x8(acc[i]);
}

// acc[(p + i) * D + 8 (c0 + c)] += sum over l in [l0, end) of e_l v_l[8 (c0 + c) ...], c < nc <= 8,
// FMA in key order (e_l = the pair's score, times the key's V scale for an int8 pool), i < NP; rows
// below n are prefetched ahead (n = 0: none).
template <int NP, typename KT>
inline void pv_acc(const Problem& P, int64_t hk, const int64_t* srow_slots, const float* scores, int64_t npad,
                   int64_t p, int64_t l0, int64_t end, int64_t n, int64_t c0, int64_t nc, float* acc, const KT* V) {
  constexpr bool QUANT = std::is_same<KT, int8_t>::value;
  const int64_t D = P.D;
  V8 a[NP][8];
  for (int i = 0; i < NP; ++i)
    for (int64_t c = 0; c < nc; ++c) a[i][c] = vload(acc + (p + i) * D + (c0 + c) * 8);
  for (int64_t l = l0; l < end; ++l) {
    const int64_t row = srow_slots[l] * P.Hkv + hk;
    const KT* vr = V + row * D + c0 * 8;
    prefetch_v(P, V, srow_slots, hk, l, n, c0, nc);
    V8 e[NP];
    for (int i = 0; i < NP; ++i) {
      const float s = scores[(p + i) * npad + l];
      e[i] = vset1(QUANT ? s * P.vs[row] : s);
    }
    if (nc == 8) {
      for (int64_t c = 0; c < 8; ++c) {
        const V8 vv = vload(vr + c * 8);
        for (int i = 0; i < NP; ++i) a[i][c] = vfma(e[i], vv, a[i][c]);
      }
    } else {
      for (int64_t c = 0; c < nc; ++c) {
        const V8 vv = vload(vr + c * 8);
        for (int i = 0; i < NP; ++i) a[i][c] = vfma(e[i], vv, a[i][c]);
      }
    }
  }
  for (int i = 0; i < NP; ++i)
    for (int64_t c = 0; c < nc; ++c) vstore(acc + (p + i) * D + (c0 + c) * 8, a[i][c]);
}

#if defined(__AVX512F__)
// pv_acc for a float32 pool on 16-lane registers, c0 and nc even: each output element takes the same
// FMAs in the same key order as on 8 lanes (lanes run across d, never across keys), so the result is
// bit for bit pv_acc's.
AGENTRT_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AGENTRT_INLINE __m512 load16(const uint16_t* p) {  // 16 float16 values as floats (exact)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int NP, typename VT>
inline void pv_acc16(const Problem& P, int64_t hk, const int64_t* srow_slots, const float* scores, int64_t npad,
                     int64_t p, int64_t l0, int64_t end, int64_t n, int64_t c0, int64_t nc, float* acc, const VT* V) {
  const int64_t D = P.D, nz = nc / 2;
  __m512 a[NP][4];
  for (int i = 0; i < NP; ++i)
    for (int64_t c = 0; c < nz; ++c) a[i][c] = _mm512_loadu_ps(acc + (p + i) * D + c0 * 8 + c * 16);
  for (int64_t l = l0; l < end; ++l) {
    const VT* vr = V + (srow_slots[l] * P.Hkv + hk) * D + c0 * 8;
    prefetch_v(P, V, srow_slots, hk, l, n, c0, nc);
    __m512 e[NP];
    for (int i = 0; i < NP; ++i) e[i] = _mm512_set1_ps(scores[(p + i) * npad + l]);
    if (nz == 4) {
      for (int64_t c = 0; c < 4; ++c) {
        const __m512 vv = load16(vr + c * 16);
        for (int i = 0; i < NP; ++i) a[i][c] = _mm512_fmadd_ps(e[i], vv, a[i][c]);
      }
    } else {
      for (int64_t c = 0; c < nz; ++c) {
        const __m512 vv = load16(vr + c * 16);
        for (int i = 0; i < NP; ++i) a[i][c] = _mm512_fmadd_ps(e[i], vv, a[i][c]);
      }
    }
  }
  for (int i = 0; i < NP; ++i)
    for (int64_t c = 0; c < nz; ++c) _mm512_storeu_ps(acc + (p + i) * D + c0 * 8 + c * 16, a[i][c]);
}
#endif

// One item: rows [t0, t0 + nr) reading slot row `srow`, KV head `hk` and its G query heads, as np =
// nr * G (row, head) pairs; n[p] the keys pair p attends. Its buffers: scores [np, npad] (npad = max n
// rounded up to 8), inv [np], acc [np, D] (zeros at the start). The phases below each cover a part of
// the item (keys or vectors of D), so one item can be split across threads; a pair's arithmetic is
// the same however it is split.
struct Span {
  int64_t t0, srow, hk, np, nmax, npad;
  const int64_t* n;
  float* scores;
  float* inv;
  float* acc;
};

// pairs [p, p + pb) of equal length (at most PB), from p
inline int64_t group_at(const Span& s, int64_t p) {
  int64_t pb = 1;
  while (pb < PB && p + pb < s.np && s.n[p + pb] == s.n[p]) ++pb;
  return pb;
}

// scores of keys [k0, k1) (k0 a multiple of 8), 8 keys at a time, PB pairs of equal length together
// (each K row loaded once for all of them; the same operations per pair as one at a time), in tiles of
// KB keys (a tile's K rows stay in L1 across the pairs). KT: the pool's element type (float, or int8_t
// with P.ks: each key's score times its K scale, then the softmax scale); ND = D / 8 when known at
// compile time (the accumulators then stay in registers), else 0.
template <int64_t ND, typename KT>
void span_scores(const Problem& P, const Span& s, int64_t k0, int64_t k1) {
  constexpr bool QUANT = std::is_same<KT, int8_t>::value;
  const KT* K = static_cast<const KT*>(P.k);
  const int64_t G = P.G, D = P.D, nd = ND ? ND : D / 8, hk = s.hk;
  const int64_t* srow_slots = P.slots + s.srow * P.L;
  auto kslot = [&](int64_t l) { return srow_slots[std::min(l, s.nmax - 1)]; };
  for (int64_t l0 = k0; l0 < k1; l0 += KB) {
    const int64_t l1 = std::min(l0 + KB, k1);
    for (int64_t p = 0; p < s.np;) {
      const int64_t pb = group_at(s, p);
      const float* qp[PB];
      for (int64_t i = 0; i < pb; ++i) qp[i] = P.q + ((s.t0 + (p + i) / G) * P.H + hk * G + (p + i) % G) * D;
      for (int64_t g = l0; g < std::min(l1, s.n[p]); g += 8) {
        const KT* kr[8];
        for (int j = 0; j < 8; ++j) {
          kr[j] = K + (kslot(g + j) * P.Hkv + hk) * D;
          // the first pairs prefetch (a prefill block's other pairs find the tile in L1)
          if (p == 0) prefetch_row(K + (kslot(g + j + PF_KEYS) * P.Hkv + hk) * D, D * static_cast<int64_t>(sizeof(KT)));
        }
        V8 dots[PB];
        switch (pb) {
          case 1: qk_dots<1, ND>(qp, kr, nd, dots); break;
#if PB_MAX >= 2
          case 2: qk_dots<2, ND>(qp, kr, nd, dots); break;
          default: qk_dots<PB, ND>(qp, kr, nd, dots); break;
#endif
        }
        alignas(32) float ks[8];
        if (QUANT) {
          for (int j = 0; j < 8; ++j) ks[j] = P.ks[kslot(g + j) * P.Hkv + hk];
        }
        for (int64_t i = 0; i < pb; ++i) {
          V8 d = dots[i];
          if (QUANT) d = vmul(d, vload(ks));
          vstore(s.scores + (p + i) * s.npad + g, vmul(d, vset1(P.scale)));
        }
      }
      p += pb;
    }
  }
}

// pair p's softmax numerators in place and inv[p] = 1 / their sum (the order in the header)
void span_softmax(const Problem& P, const Span& s, int64_t p) {
  const int64_t n = s.n[p];
  float* sp = s.scores + p * s.npad;
  const int64_t np8 = (n + 7) / 8 * 8;
  for (int64_t l = n; l < np8; ++l) sp[l] = -std::numeric_limits<float>::infinity();
  V8 mv = vload(sp);
  for (int64_t l = 8; l < np8; l += 8) mv = vmax(mv, vload(sp + l));
  float mx = lanes_max(mv);
  const float sink = P.sinks ? P.sinks[s.hk * P.G + p % P.G] : 0.f;  // query head hk * G + p % G
  if (P.sinks) mx = std::max(mx, sink);
  const V8 m = vset1(mx);
  V8 sum = vzero();
  for (int64_t l = 0; l < np8; l += 8) {
    const V8 e = vkeep(vexp(vadd(vload(sp + l), vmul(m, vset1(-1.f)))), n - l);
    vstore(sp + l, e);
    sum = vadd(sum, e);
  }
  float total = lanes_sum(sum);
  if (P.sinks) {  // the sink's exp(sinks[h] - m): a numerator with no value row
    alignas(32) float es[8];
    vstore(es, vexp(vset1(sink - mx)));
    total += es[0];
  }
  s.inv[p] = 1.f / total;
}

// acc += sum_l e_l v_l over keys [k0, k1) for the vectors [c0, c1) of D (8 floats each), key by key,
// in tiles of KB keys, PB pairs of equal length together (each V row loaded once for all), up to 8
// vectors at a time; then, with `last`, those vectors of the output: acc * inv.
template <typename KT>
void span_pv(const Problem& P, const Span& s, int64_t k0, int64_t k1, int64_t c0, int64_t c1, bool last) {
  constexpr bool QUANT = std::is_same<KT, int8_t>::value;
  const KT* V = static_cast<const KT*>(P.v);
  const int64_t* srow_slots = P.slots + s.srow * P.L;
  const int64_t hk = s.hk;
  for (int64_t l0 = k0; l0 < k1; l0 += KB) {
    const int64_t l1 = std::min(l0 + KB, k1);
    for (int64_t p = 0; p < s.np;) {
      const int64_t pb = group_at(s, p);
      const int64_t end = std::min(l1, s.n[p]);
      const int64_t pf = p == 0 ? s.n[p] : 0;  // the first pairs prefetch; the rest find the rows cached
      if (end > l0) {
        for (int64_t cc = c0; cc < c1; cc += 8) {
          const int64_t nc = std::min<int64_t>(8, c1 - cc);
#if defined(__AVX512F__)
          if (!QUANT && nc % 2 == 0) {
            using VT = std::conditional_t<QUANT, float, KT>;  // (not taken for int8)
            const VT* Vf = reinterpret_cast<const VT*>(V);
            switch (pb) {
              case 1: pv_acc16<1>(P, hk, srow_slots, s.scores, s.npad, p, l0, end, pf, cc, nc, s.acc, Vf); break;
              case 2: pv_acc16<2>(P, hk, srow_slots, s.scores, s.npad, p, l0, end, pf, cc, nc, s.acc, Vf); break;
              default: pv_acc16<PB>(P, hk, srow_slots, s.scores, s.npad, p, l0, end, pf, cc, nc, s.acc, Vf); break;
            }
            continue;
          }
#endif
          switch (pb) {
            case 1: pv_acc<1, KT>(P, hk, srow_slots, s.scores, s.npad, p, l0, end, pf, cc, nc, s.acc, V); break;
#if PB_MAX >= 2
            case 2: pv_acc<2, KT>(P, hk, srow_slots, s.scores, s.npad, p, l0, end, pf, cc, nc, s.acc, V); break;
            default: pv_acc<PB, KT>(P, hk, srow_slots, s.scores, s.npad, p, l0, end, pf, cc, nc, s.acc, V); break;
#endif
          }
        }
      }
      p += pb;
    }
  }
  if (!last) return;
  const int64_t G = P.G, D = P.D;
  for (int64_t p = 0; p < s.np; ++p) {
    float* o = P.out + ((s.t0 + p / G) * P.H + hk * G + p % G) * D;
    const V8 iv = vset1(s.inv[p]);
    for (int64_t c = c0; c < c1; ++c) vstore(o + c * 8, vmul(vload(s.acc + p * D + c * 8), iv));
  }
}

// An item's buffers, sized for its pairs and keys.
struct SpanBuffers {
  std::vector<int64_t> n;
  std::vector<float> scores, inv, acc;

  Span make(const Problem& P, int64_t t0, int64_t nr, int64_t srow, int64_t hk) {
    const int64_t np = nr * P.G;
    n.resize(np);
    int64_t nmax = 0;
    for (int64_t p = 0; p < np; ++p) nmax = std::max(nmax, n[p] = P.lens[t0 + p / P.G]);
    const int64_t npad = (nmax + 7) / 8 * 8;
    scores.resize(np * npad);
    inv.resize(np);
    acc.assign(np * P.D, 0.f);
    return Span{t0, srow, hk, np, nmax, npad, n.data(), scores.data(), inv.data(), acc.data()};
  }
};

// One item on one thread: every phase over all of it.
template <int64_t ND, typename KT>
void attend_block(const Problem& P, int64_t t0, int64_t nr, int64_t srow, int64_t hk, SpanBuffers& buf) {
  const Span s = buf.make(P, t0, nr, srow, hk);
  span_scores<ND, KT>(P, s, 0, s.nmax);
  for (int64_t p = 0; p < s.np; ++p) span_softmax(P, s, p);
  span_pv<KT>(P, s, 0, s.nmax, 0, P.D / 8, true);
}

// The pool's element type: float32, int8 (with scales) or float16 (its bits as uint16_t).
enum Pool { POOL_F32, POOL_I8, POOL_F16 };

// f(nd, kt) with nd a std::integral_constant: D / 8 for the usual head sizes (64, 128: their own
// unrolled copies, the same arithmetic), else 0 (D at run time); kt a null KT* (float, int8_t or
// uint16_t, by the pool).
template <typename F>
void with_types(int64_t D, Pool pool_type, F&& f) {
  auto pool = [&](auto nd) {
    switch (pool_type) {
      case POOL_I8: f(nd, static_cast<int8_t*>(nullptr)); break;
      case POOL_F16: f(nd, static_cast<uint16_t*>(nullptr)); break;
      default: f(nd, static_cast<float*>(nullptr));
    }
  };
  switch (D) {
    case 64: pool(std::integral_constant<int64_t, 8>{}); break;
    case 128: pool(std::integral_constant<int64_t, 16>{}); break;
    default: pool(std::integral_constant<int64_t, 0>{});
  }
}

}  // namespace

namespace agentrt_cpu {

at::Tensor attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slots, const at::Tensor& seq, const at::Tensor& lens, double scale,
                     const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "attention: q [T,H,D], caches [S,Hkv,D]");
  const bool quant = k_cache.scalar_type() == at::kChar;
  const Pool pool = quant ? POOL_I8 : k_cache.scalar_type() == at::kHalf ? POOL_F16 : POOL_F32;
  TORCH_CHECK(q.scalar_type() == at::kFloat, "attention: q must be float32");
  TORCH_CHECK((k_cache.scalar_type() == at::kFloat || quant || pool == POOL_F16) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "attention: the K and V pools must both be float32, both float16 or both int8, got ",
              k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(quant == (k_scale.has_value() && v_scale.has_value()) && k_scale.has_value() == v_scale.has_value(),
              quant ? "attention: an int8 pool needs k_scale and v_scale" : "attention: scales only with an int8 pool");
  if (quant) {
    for (const at::Tensor* t : {&*k_scale, &*v_scale}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == k_cache.size(0) &&
                      t->size(1) == k_cache.size(1) && t->is_contiguous(),
                  "attention: scales must be contiguous float32 [S, Hkv] = [", k_cache.size(0), ", ",
                  k_cache.size(1), "], got ", t->scalar_type(), " ", t->sizes());
    }
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && seq.scalar_type() == at::kLong,
              "attention: int64 slots, seq and lens");
  TORCH_CHECK(slots.dim() == 2 && lens.dim() == 1 && seq.dim() == 1, "attention: slots [R, L], seq [T], lens [T]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous() &&
                  lens.is_contiguous() && seq.is_contiguous(), "attention: contiguous inputs");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1), R = slots.size(0), L = slots.size(1);
  TORCH_CHECK(k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes(), "attention: cache shapes");
  TORCH_CHECK(D > 0 && D % 8 == 0 && D <= 256, "attention: head_dim ", D, " must be a positive multiple of 8, at most 256");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && H / Hkv <= 64, "attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(lens.size(0) == T, "attention: one length per query row");
  TORCH_CHECK(seq.numel() == 0 ? R == T : seq.size(0) == T, "attention: one slot row per query row");
  const float* sinks_p = nullptr;
  if (sinks.has_value()) {
    const at::Tensor& s = *sinks;
    TORCH_CHECK(s.scalar_type() == at::kFloat, "attention: sinks must be float32, got ", s.scalar_type());
    TORCH_CHECK(s.device().is_cpu(), "attention: sinks must be on the CPU");
    TORCH_CHECK(s.dim() == 1 && s.size(0) == H, "attention: sinks must be [H] = [", H, "], got ", s.sizes());
    TORCH_CHECK(s.is_contiguous(), "attention: sinks must be contiguous");
    sinks_p = s.data_ptr<float>();
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* qs = seq.numel() ? seq.data_ptr<int64_t>() : nullptr;
  std::vector<int64_t> checked(R, 0);  // slots of each row checked so far
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = qs ? qs[t] : t;
    TORCH_CHECK(r >= 0 && r < R, "attention: slot row ", r, " out of [0, ", R, ")");
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= L, "attention: lens must be in [1, L]");
    for (int64_t l = checked[r]; l < lp[t]; ++l) {
      TORCH_CHECK(sp[r * L + l] >= 0 && sp[r * L + l] < S, "attention: slot out of the pool");
    }
    checked[r] = std::max(checked[r], lp[t]);
  }
  auto out = at::empty_like(q);
  if (T == 0) return out;
  // blocks: runs of up to rb adjacent rows reading the same slot row; rb the largest of RB, RB / 2, ...,
  // 4 that still gives each thread 4 items (a block's K/V are read once for all its rows: fewer reads
  // for long prompts, enough items for short ones)
  auto blocks = [&](int64_t rb) {
    std::vector<int64_t> starts;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = qs ? qs[t] : t;
      if (starts.empty() || t - starts.back() >= rb || (qs ? qs[t - 1] : t - 1) != r) starts.push_back(t);
    }
    return starts;
  };
  std::vector<int64_t> starts = blocks(RB);
  for (int64_t rb = RB / 2; rb >= 4 && static_cast<int64_t>(starts.size()) * Hkv < 4 * at::get_num_threads(); rb /= 2) {
    starts = blocks(rb);
  }
  const int64_t nblocks = static_cast<int64_t>(starts.size());
  starts.push_back(T);
  const Problem P{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
                  quant ? k_scale->data_ptr<float>() : nullptr, quant ? v_scale->data_ptr<float>() : nullptr,
                  sp, lp, out.data_ptr<float>(), H, Hkv, H / Hkv, D, L, static_cast<float>(scale), sinks_p};
  const int64_t items = nblocks * Hkv, threads = at::get_num_threads();
  auto item_rows = [&](int64_t item, int64_t& t0, int64_t& nr, int64_t& srow) {
    const int64_t b = item / Hkv;
    t0 = starts[b], nr = starts[b + 1] - t0, srow = qs ? qs[t0] : t0;
  };
  int64_t nmax = 0;
  for (int64_t t = 0; t < T; ++t) nmax = std::max(nmax, lp[t]);
  if (threads > 1 && items < 2 * threads && nmax >= WIDE_MIN_KEYS) {
    // few items, long rows (a decode step of one or two sequences deep in a long context): each phase
    // split across the threads, the scores by keys, the softmax by pair, the weighted sum by vectors
    // of D, so no thread waits on another's item (the same arithmetic per pair)
    std::vector<SpanBuffers> bufs(items);
    std::vector<Span> spans(items);
    for (int64_t item = 0; item < items; ++item) {
      int64_t t0, nr, srow;
      item_rows(item, t0, nr, srow);
      spans[item] = bufs[item].make(P, t0, nr, srow, item % Hkv);
    }
    const int64_t kchunks = (nmax + WIDE_KEYS - 1) / WIDE_KEYS;
    at::parallel_for(0, kchunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t chunk = begin; chunk < end; ++chunk) {
        for (int64_t l0 = chunk * WIDE_KEYS; l0 < std::min((chunk + 1) * WIDE_KEYS, nmax); l0 += KB) {
          for (const Span& sp_ : spans) {  // every KV head of a tile of keys: its K rows side by side
            if (l0 >= sp_.nmax) continue;
            const int64_t l1 = std::min(l0 + KB, sp_.nmax);
            with_types(D, pool, [&](auto nd, auto* kt) {
              span_scores<decltype(nd)::value, std::remove_pointer_t<decltype(kt)>>(P, sp_, l0, l1);
            });
          }
        }
      }
    });
    std::vector<std::pair<int64_t, int64_t>> pairs;  // (item, pair)
    for (int64_t item = 0; item < items; ++item) {
      for (int64_t p = 0; p < spans[item].np; ++p) pairs.emplace_back(item, p);
    }
    at::parallel_for(0, static_cast<int64_t>(pairs.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) span_softmax(P, spans[pairs[i].first], pairs[i].second);
    });
    const int64_t nd = D / 8, cw = std::max<int64_t>(1, std::min(WIDE_VECTORS, nd / threads));
    const int64_t cchunks = (nd + cw - 1) / cw;
    at::parallel_for(0, cchunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t c0 = task * cw, c1 = std::min(c0 + cw, nd);
        for (int64_t l0 = 0; l0 < nmax; l0 += KB) {  // a tile of keys for every KV head, in key order
          for (const Span& sp_ : spans) {
            if (l0 >= sp_.nmax) continue;
            const int64_t l1 = std::min(l0 + KB, sp_.nmax);
            const bool last = l1 == sp_.nmax;
            with_types(0, pool, [&](auto, auto* kt) {
              span_pv<std::remove_pointer_t<decltype(kt)>>(P, sp_, l0, l1, c0, c1, last);
            });
          }
        }
      }
    });
    return out;
  }
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    SpanBuffers buf;
    for (int64_t item = begin; item < end; ++item) {
      int64_t t0, nr, srow;
      item_rows(item, t0, nr, srow);
      const int64_t hk = item % Hkv;
      with_types(D, pool, [&](auto nd, auto* kt) {
        attend_block<decltype(nd)::value, std::remove_pointer_t<decltype(kt)>>(P, t0, nr, srow, hk, buf);
      });
    }
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale,
                            const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& k_scale,
                            const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(slots.dim() == 2 && q.dim() == 3 && slots.size(0) == q.size(0),
              "decode_attention: one slot row per sequence");
  return attention(q, k_cache, v_cache, slots, at::empty({0}, slots.options()), lens, scale, sinks, k_scale,
                   v_scale);
}

}  // namespace agentrt_cpu

TORCH_LIBRARY(agentrt_cpu, m) {
  m.def("attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor seq, Tensor lens, float scale, "
        "Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lens, float scale, "
        "Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(agentrt_cpu, CPU, m) {
  m.impl("attention", &agentrt_cpu::attention);
  m.impl("decode_attention", &agentrt_cpu::decode_attention);
}
