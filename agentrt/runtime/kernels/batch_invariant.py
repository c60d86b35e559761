"""Batch-invariant matmul and RMSNorm for the CUDA path (Triton), each with a torch reference.

Every output row's arithmetic is fixed by that row alone: the matmul runs one tile shape
(BLOCK_M x BLOCK_N, a K loop of BLOCK_K steps in one order, no split-K) whatever M is, and RMSNorm
reduces each row in fixed BLOCK-wide steps in one program. cuBLAS and torch's reductions choose
their kernel (tile, split-K, threads per row) by the shapes, M included, so the same row can be
summed in another order in another batch: a request's tokens then depend on what it is batched
with. Source: H. He and Thinking Machines Lab, "Defeating Nondeterminism in LLM Inference" (2025),
and SGLang's deterministic inference, which fix the reduction order per row the same way.

- `matmul(x [M, K], weight [N, K], bias [N] or None) -> [M, N]` in x's dtype (fp32 accumulation);
- `rms_norm(x [..., H], weight [H], eps) -> [..., H]` in x's dtype, as models.llama.RMSNorm:
  weight * (x / sqrt(mean(x^2) + eps)) rounded to x's dtype before the weight.
Both raise ValueError on mismatched shapes. Tested on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt.runtime.forward import LayerOps
from agentrt.runtime.kernels import dot_precision, upcast_dot

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32  # the one tile shape (any M)
NORM_BLOCK = 1024  # RMSNorm's step along a row


@triton.jit
def _matmul_kernel(
    X,
    W,
    Bias,
    Y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(
            X + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            W + offs_n[None, :].to(tl.int64) * stride_wn + (k0 + offs_k)[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
        acc.to(Y.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight^T + bias, batch-invariant (see the module docstring).

    x: [M, K]; weight: [N, K]; bias: [N] or None; all of one floating dtype (any strides).
    Returns y [M, N] in x's dtype. Raises ValueError on mismatched shapes or dtypes."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"matmul: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)} ([M, K] x [N, K])"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"matmul: bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
    if not x.is_floating_point() or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(
            f"matmul: x, weight and bias must share one floating dtype, got {x.dtype}, {weight.dtype}"
            f"{'' if bias is None else f', {bias.dtype}'}"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        UPCAST=upcast_dot(x.dtype),
        PRECISION=dot_precision(x.dtype),
    )
    return y


@triton.jit
def _rms_norm_kernel(X, W, Y, H, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        x = tl.load(X + row * stride_x + h0 + offs, mask=h0 + offs < H, other=0.0).to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, 0) / H + eps)
    for h0 in range(0, H, BLOCK):
        mask = h0 + offs < H
        x = tl.load(X + row * stride_x + h0 + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + h0 + offs, mask=mask, other=0.0).to(tl.float32)
        normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * stride_y + h0 + offs, (w * normed).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x ([..., H], H >= 1, any float dtype) with weight [H]; returns x's
    shape in the promoted dtype of x and weight (as RMSNorm: the normalized row is rounded to x's
    dtype, then multiplied by the weight). Raises ValueError for a 0-d x, H = 0 or a weight that
    does not have H elements."""
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} has no rows of at least one element")
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not fit rows of {h}")
    weight = weight.contiguous()
    flat = x.reshape(-1, h)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    y = torch.empty(flat.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if flat.shape[0]:
        _rms_norm_kernel[(flat.shape[0],)](
            flat,
            weight,
            y,
            h,
            flat.stride(0),
            y.stride(0),
            eps,
            BLOCK=min(NORM_BLOCK, triton.next_power_of_2(h)),
        )
    return y.view(x.shape)


def matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of `matmul` (fp32 math, rounded to x's dtype)."""
    y = x.float() @ weight.float().T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of `rms_norm` (models.llama.RMSNorm's arithmetic)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _add_rms_norm(x, residual, weight, eps, cast_last=False):
    residual = x if residual is None else residual + x
    return residual, rms_norm(residual, weight, eps)


def invariant_ops(silu_mul) -> LayerOps:
    """LayerOps whose norms run the batch-invariant `rms_norm` (cast_last: the kernel multiplies in
    the promoted dtype), SiLU-and-multiply `silu_mul`."""
    return LayerOps(
        "batch-invariant Triton norms",
        lambda x, w, eps, cast_last=False: rms_norm(x, w, eps),
        _add_rms_norm,
        silu_mul,
    )
