// The CPU kernels' C++ entry points (namespace agentrt_cpu), shared by the sources of the one
// library runtime/kernels/cpu_kernels.py builds, so that decode_layers (cpu_decode_layers.cpp) calls
// them directly instead of through the dispatcher. Shapes, dtypes and errors: each source's header.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace agentrt_cpu {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale);
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

}  // namespace agentrt_cpu
