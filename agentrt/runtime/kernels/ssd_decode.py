"""Mamba-2 (SSD) decode step (Dao & Gu 2024, arXiv 2405.21060): one token of each of B sequences, each
sequence's recurrent state read from and written back to a state pool slot in place (mamba_ssm's
`selective_state_update` with `state_batch_indices`, as vLLM and SGLang call it), the D skip fused.

One program per (sequence, head, block of head channels): the [BLOCK_P, N] tile of the state is
loaded once, decayed by exp(dt A), written with dt x B^T, read by C, stored; heads of one group share
B and C (read per group, not repeated). The sum order per channel is fixed, so a row's result does not
depend on the batch. The torch reference is `ssd_decode_ref` (layers.mamba2.ssd_step on the gathered
states); tests/runtime/test_triton_recurrent_decode.py compares the two under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt.runtime.kernels import require_contiguous_heads


@triton.jit
def _ssd_decode_kernel(
    X,
    Dt,
    A,
    B,
    C,
    D,
    State,
    Slots,
    Out,
    stride_xb,
    stride_xh,
    stride_db,
    stride_bb,
    stride_bg,
    stride_cb,
    stride_cg,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_ob,
    stride_oh,
    HEADS_PER_GROUP: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // HEADS_PER_GROUP
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    slot = tl.load(Slots + b).to(tl.int64)
    x = tl.load(X + b * stride_xb + h * stride_xh + offs_p, mask=mp, other=0.0).to(tl.float32)
    dt = tl.load(Dt + b * stride_db + h).to(tl.float32)
    bv = tl.load(B + b * stride_bb + grp * stride_bg + offs_n, mask=mn, other=0.0).to(tl.float32)
    cv = tl.load(C + b * stride_cb + grp * stride_cg + offs_n, mask=mn, other=0.0).to(tl.float32)
    s_ptr = State + slot * stride_ss + h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :]
    mask = mp[:, None] & mn[None, :]
    s = tl.load(s_ptr, mask=mask, other=0.0) * tl.exp(dt * tl.load(A + h))
    s = s + (x * dt)[:, None] * bv[None, :]
    tl.store(s_ptr, s, mask=mask)
    y = tl.sum(s * cv[None, :], axis=1) + tl.load(D + h).to(tl.float32) * x
    tl.store(Out + b * stride_ob + h * stride_oh + offs_p, y, mask=mp)


def ssd_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One SSD token per sequence: x [B, H, P], dt [B, H] (after softplus and limits), a [H] (A,
    negative), b, c [B, G, N] (G groups of H / G heads), d [H] (the skip), state pool [S, H, P, N]
    float32 with a contiguous last dim, slots [B] int32/int64 distinct (row b's state is
    state[slots[b]], updated in place) -> y [B, H, P] float32, the D skip included. Raises ValueError
    on mismatched shapes, a non-float32 or strided state, or tensors on different devices."""
    batch, heads, p = x.shape
    groups, n = b.shape[1], b.shape[2]
    if (
        dt.shape != (batch, heads)
        or a.shape != (heads,)
        or d.shape != (heads,)
        or b.shape != c.shape
        or b.shape[0] != batch
        or heads % groups
        or state.shape[1:] != (heads, p, n)
        or slots.shape != (batch,)
    ):
        raise ValueError(
            f"ssd_decode: x {tuple(x.shape)}, dt {tuple(dt.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)}, "
            f"state {tuple(state.shape)}, slots {tuple(slots.shape)} do not fit"
        )
    if state.dtype != torch.float32 or state.stride(3) != 1:
        raise ValueError(
            f"state must be float32 with a contiguous last dim, got {state.dtype} {state.stride()}"
        )
    if len({t.device for t in (x, dt, a, b, c, d, state, slots)}) != 1:
        raise ValueError("ssd_decode: all tensors must be on one device")
    require_contiguous_heads(x=x, b=b, c=c)
    out = torch.empty(batch, heads, p, dtype=torch.float32, device=x.device)
    if batch == 0:
        return out
    block_n = triton.next_power_of_2(n)
    block_p = min(triton.next_power_of_2(p), max(16, 8192 // block_n))
    a, d = a.float().contiguous(), d.float().contiguous()
    _ssd_decode_kernel[(batch, heads, triton.cdiv(p, block_p))](
        x, dt, a, b, c, d, state, slots, out,
        x.stride(0), x.stride(1), dt.stride(0), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        HEADS_PER_GROUP=heads // groups, P=p, N=n, BLOCK_P=block_p, BLOCK_N=block_n,
    )  # fmt: skip
    return out


def ssd_decode_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The torch reference of `ssd_decode` (same arguments, same in-place update of state[slots]):
    layers.mamba2.ssd_step on the gathered states, plus the D skip."""
    from agentrt.runtime.layers.mamba2 import ssd_step

    idx = slots.long()
    rows = state[idx]
    y = ssd_step(x, dt, a.float(), b, c, rows)
    state[idx] = rows
    return y + x.float() * d.float()[:, None]
