"""One decode token of a causal depthwise short convolution (the input conv of Gated DeltaNet and
Mamba-2) for B sequences, each sequence's conv state read from and written back to a state pool slot
in place (the `causal-conv1d` package's `causal_conv1d_update` with `conv_state_indices`, as vLLM and
SGLang call it), with the bias and SiLU fused.

One program per (sequence, block of channels): the K-1 stored inputs and the new one are multiplied by
the K taps in float32, and the state shifts by one (oldest dropped, the new input last). The torch
reference is `conv_step_ref` (layers.causal_conv.causal_conv_step on the gathered rows);
tests/runtime/test_triton_recurrent_decode.py compares the two under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(
    X,
    State,
    Slots,
    Weight,
    Bias,
    Out,
    channels,
    stride_xb,
    stride_ss,
    stride_sc,
    stride_wc,
    stride_ob,
    WIDTH: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = offs < channels
    slot = tl.load(Slots + b).to(tl.int64)
    x = tl.load(X + b * stride_xb + offs, mask=mc, other=0.0).to(tl.float32)
    state = State + slot * stride_ss + offs * stride_sc
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH - 1):  # tap j reads the j-th oldest stored input
        s = tl.load(state + j, mask=mc, other=0.0)
        acc += s * tl.load(Weight + offs * stride_wc + j, mask=mc, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(state + j - 1, s, mask=mc)
    acc += x * tl.load(Weight + offs * stride_wc + WIDTH - 1, mask=mc, other=0.0).to(tl.float32)
    if WIDTH > 1:
        tl.store(state + WIDTH - 2, x.to(State.dtype.element_ty), mask=mc)
    if HAS_BIAS:
        acc += tl.load(Bias + offs, mask=mc, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(Out + b * stride_ob + offs, acc.to(Out.dtype.element_ty), mask=mc)


def conv_step(
    x: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> torch.Tensor:
    """x [B, C] (one new input per sequence), state pool [S, C, K-1] (the K-1 inputs before x, oldest
    first; rows state[slots[b]] updated in place to end with x[b]), slots [B] int32/int64 distinct,
    weight [C, K] (tap K-1 multiplies x), bias [C] or None -> [B, C] in weight's dtype, through SiLU
    when `silu`. Raises ValueError on mismatched shapes, a state whose last dim is strided, or
    tensors on different devices."""
    batch, channels = x.shape
    width = weight.shape[1]
    if (
        weight.shape[0] != channels
        or state.shape[1:] != (channels, width - 1)
        or slots.shape != (batch,)
        or (bias is not None and bias.shape != (channels,))
    ):
        raise ValueError(
            f"conv_step: x {tuple(x.shape)}, state {tuple(state.shape)}, slots {tuple(slots.shape)}, "
            f"weight {tuple(weight.shape)} do not fit"
        )
    if width > 1 and state.stride(2) != 1 or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("conv_step: x, weight and the state need a contiguous last dim")
    if len({t.device for t in (x, state, slots, weight)}) != 1:
        raise ValueError("conv_step: all tensors must be on one device")
    out = torch.empty(batch, channels, dtype=weight.dtype, device=x.device)
    if batch == 0:
        return out
    block = min(triton.next_power_of_2(channels), 256)
    _conv_step_kernel[(batch, triton.cdiv(channels, block))](
        x, state, slots, weight, bias if bias is not None else weight, out, channels,
        x.stride(0), state.stride(0), state.stride(1), weight.stride(0), out.stride(0),
        WIDTH=width, BLOCK_C=block, HAS_BIAS=bias is not None, SILU=silu,
    )  # fmt: skip
    return out


def conv_step_ref(
    x: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> torch.Tensor:
    """The torch reference of `conv_step` (same arguments, same in-place update of state[slots])."""
    from agentrt.runtime.layers.causal_conv import causal_conv_step

    idx = slots.long()
    rows = state[idx]
    out = causal_conv_step(x, rows, weight, bias)
    state[idx] = rows
    return F.silu(out) if silu else out
