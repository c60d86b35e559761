// Decode attention straight from the token-slot KV pool on the CPU (one new query token per
// sequence, grouped-query attention), without gathering K/V into a padded copy first.
//
// q [B, H, D] float32, k_cache / v_cache [S, Hkv, D] float32 (contiguous), slots [B, L] int64
// (padded), lens [B] int64 (keys attended per sequence, <= L), scale: softmax scale.
// out [B, H, D] float32. Per sequence (and KV head run, see below), every query head of it
// together, so each K and V row is read once: scores s[h, l] = q_h . k_l * scale, softmax over l
// (max-subtracted), out_h = sum_l p[h, l] v_l. at::parallel_for over the items (torch's own
// thread pool). Built and loaded by runtime/kernels/cpu_attention.py.
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_kernels.h"

namespace agentrt_cpu {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [B,H,D], caches [S,Hkv,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 slots and lens");
  TORCH_CHECK(slots.dim() == 2 && lens.dim() == 1, "slots [B, L] and lens [B]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  slots.is_contiguous() && lens.is_contiguous(), "contiguous inputs");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = k_cache.size(0), Hkv = k_cache.size(1), L = slots.size(1);
  TORCH_CHECK(k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes(), "cache shapes");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(slots.size(0) == B && lens.size(0) == B, "one slot row and one length per sequence");
  const int64_t G = H / Hkv;
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= L, "lens must be in [1, L]");
    for (int64_t l = 0; l < lp[b]; ++l) {
      TORCH_CHECK(sp[b * L + l] >= 0 && sp[b * L + l] < S, "slot out of the pool");
    }
  }
  // work item: a sequence and a run of `per` KV heads (all of them unless there are fewer
  // sequences than threads), so a whole K/V row (Hkv * D floats) is read at once
  const int64_t per = B >= at::get_num_threads() ? Hkv : 1;
  const int64_t groups = Hkv / per;
  at::parallel_for(0, B * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(per * G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / groups, h0 = (item % groups) * per, n = lp[b];
      const int64_t rows = per * G;  // query heads of this item
      scores.resize(rows * n);
      const float* qb = qp + (b * H + h0 * G) * D;
      for (int64_t l = 0; l < n; ++l) {
        const float* kr = kp + (sp[b * L + l] * Hkv + h0) * D;
        for (int64_t r = 0; r < rows; ++r) {
          const float* qr = qb + r * D;
          const float* kh = kr + (r / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qr[d] * kh[d];
          scores[r * n + l] = s * fscale;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = scores.data() + r * n;
        float m = sr[0];
        for (int64_t l = 1; l < n; ++l) m = std::max(m, sr[l]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < n; ++l) {
          sr[l] = std::exp(sr[l] - m);
          sum += sr[l];
        }
        const float inv = 1.f / sum;
        for (int64_t l = 0; l < n; ++l) sr[l] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < n; ++l) {
        const float* vr = vp + (sp[b * L + l] * Hkv + h0) * D;
        for (int64_t r = 0; r < rows; ++r) {
          const float p = scores[r * n + l];
          const float* vh = vr + (r / G) * D;
          float* ar = acc.data() + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] += p * vh[d];
        }
      }
      std::copy(acc.begin(), acc.end(), op + (b * H + h0 * G) * D);
    }
  });
  return out;
}

}  // namespace agentrt_cpu

TORCH_LIBRARY(agentrt_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(agentrt_cpu, CPU, m) { m.impl("decode_attention", &agentrt_cpu::decode_attention); }
