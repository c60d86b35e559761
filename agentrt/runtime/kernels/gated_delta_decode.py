"""Gated delta rule decode step (Yang et al. 2024, arXiv 2412.06464): one token of each of B sequences,
their recurrent states read from and written back to a state pool in place, with q/k L2 normalisation
fused in (as flash-linear-attention's `fused_recurrent_gated_delta_rule(use_qk_l2norm_in_kernel=True)`
and vLLM / SGLang's decode path do).

One program per (sequence, value head, block of value channels): the state's value columns are
independent under the delta rule (each column j of S [Dk, Dv] is updated from v[j] and the shared
k, beta, g), so a [Dk, BLOCK_V] tile is loaded once, decayed, corrected, read by q and stored, with no
reduction across programs. A value head reads key head h // (Hv / Hk) (grouped heads: q and k are not
repeated in memory). The sum order per column is fixed, so a row's result does not depend on the batch.

The torch reference is `gated_delta_decode_ref` (the same math as `layers.gated_delta.gated_delta_step`
after `l2norm`); tests/runtime/test_triton_gated_delta.py compares the two under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt.runtime.kernels import require_contiguous_heads


@triton.jit
def _gated_delta_decode_kernel(
    Q,
    K,
    V,
    G,
    Beta,
    State,
    Slots,
    Out,
    scale,
    eps,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_gb,
    stride_bb,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_ob,
    stride_oh,
    HEADS_PER_K: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // HEADS_PER_K
    slot = tl.load(Slots + b).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < DK
    mv = offs_v < DV
    q = tl.load(Q + b * stride_qb + hk * stride_qh + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_k, mask=mk, other=0.0).to(tl.float32)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    q = q * scale
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_v, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(G + b * stride_gb + h).to(tl.float32)
    beta = tl.load(Beta + b * stride_bb + h).to(tl.float32)
    s_ptr = State + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    mask = mk[:, None] & mv[None, :]
    s = tl.load(s_ptr, mask=mask, other=0.0) * tl.exp(g)
    predicted = tl.sum(s * k[:, None], axis=0)  # [BLOCK_V]: S^T k
    delta = (v - predicted) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(s_ptr, s, mask=mask)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_v, o.to(Out.dtype.element_ty), mask=mv)


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    l2norm: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One gated-delta-rule token per sequence. q, k [B, Hk, Dk] (raw when `l2norm`: normalised here as
    x / sqrt(sum x^2 + eps)), v [B, Hv, Dv], g (log decay, <= 0) and beta [B, Hv], state pool
    [S, Hv, Dk, Dv] float32 with a contiguous last dim, slots [B] int32/int64 (row b's state is
    state[slots[b]], updated in place; slots must be distinct) -> o [B, Hv, Dv] in v's dtype; q is
    multiplied by `scale` (default Dk^-0.5) after the normalisation. Raises ValueError on mismatched
    shapes, a non-float32 or strided state, or tensors on different devices."""
    batch, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    if (
        q.shape != k.shape
        or v.shape[0] != batch
        or num_v_heads % num_k_heads
        or g.shape != (batch, num_v_heads)
        or beta.shape != (batch, num_v_heads)
        or state.shape[1:] != (num_v_heads, dk, dv)
        or slots.shape != (batch,)
    ):
        raise ValueError(
            f"gated_delta_decode: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}, state {tuple(state.shape)}, slots {tuple(slots.shape)} do not fit"
        )
    if state.dtype != torch.float32 or state.stride(3) != 1:
        raise ValueError(
            f"state must be float32 with a contiguous last dim, got {state.dtype} {state.stride()}"
        )
    if len({t.device for t in (q, k, v, g, beta, state, slots)}) != 1:
        raise ValueError("gated_delta_decode: all tensors must be on one device")
    require_contiguous_heads(q=q, k=k, v=v, g=g, beta=beta)
    out = torch.empty(batch, num_v_heads, dv, dtype=v.dtype, device=v.device)
    if batch == 0:
        return out
    block_k = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), max(16, 8192 // block_k))
    grid = (batch, num_v_heads, triton.cdiv(dv, block_v))
    _gated_delta_decode_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        slots,
        out,
        dk**-0.5 if scale is None else scale,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        out.stride(0),
        out.stride(1),
        HEADS_PER_K=num_v_heads // num_k_heads,
        DK=dk,
        DV=dv,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        L2NORM=l2norm,
    )
    return out


def gated_delta_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    l2norm: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The torch reference of `gated_delta_decode` (same arguments, same in-place update of
    state[slots])."""
    dk = k.shape[-1]
    rep = v.shape[1] // k.shape[1]
    q, k = q.float(), k.float()
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    q = (q * (dk**-0.5 if scale is None else scale)).repeat_interleave(rep, dim=1)
    k = k.repeat_interleave(rep, dim=1)
    idx = slots.long()
    s = state[idx] * g.float().exp()[..., None, None]
    delta = (v.float() - (k.unsqueeze(-2) @ s).squeeze(-2)) * beta.float()[..., None]
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    state[idx] = s
    return (q.unsqueeze(-2) @ s).squeeze(-2).to(v.dtype)
