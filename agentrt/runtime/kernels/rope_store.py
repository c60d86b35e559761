"""Fused rotary position embedding + KV store: one kernel rotates the new tokens' queries and
keys (RoFormer, Su et al. 2021, arXiv 2104.09864; the half-split layout of Llama/GPT-NeoX) and
writes the keys and values into their KV pool slots, instead of four separate torch ops.

Partial rotary (Phi-3 / Phi-4-mini, transformers' `partial_rotary_factor`): the cos/sin tables
have rotary_dim // 2 columns with rotary_dim < head_dim; the first rotary_dim features of each q/k
head are rotated (half-split within them) and the rest pass through unchanged."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt.runtime.kernels.paged import pool_args
from agentrt.runtime.kv_cache import store_kv


@triton.jit
def _rope_store_kernel(
    Q,
    K,
    V,
    QOut,
    Cos,
    Sin,
    Positions,
    SlotMapping,
    KCache,
    VCache,
    KScale,
    VScale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    stride_kss,
    stride_vss,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_V: tl.constexpr,
):
    # HALF = rotary_dim // 2: features [0, HALF) pair with [HALF, 2 * HALF); features
    # [2 * HALF, 2 * HALF + PASS) (partial rotary, PASS = head_dim - rotary_dim) are copied as is.
    # Program (t, hb) rotates q heads [hb * BLOCK_H, (hb + 1) * BLOCK_H) of token t; hb 0 also
    # stores its K (and V, HAS_V) rows.
    t = tl.program_id(0)
    hb = tl.program_id(1)
    pos = tl.load(Positions + t)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    c = tl.load(Cos + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]
    s = tl.load(Sin + pos * stride_cos + offs_d, mask=d_mask, other=0.0)[None, :]

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    qm = (offs_h < NUM_HEADS)[:, None] & d_mask[None, :]
    qp = Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q1 = tl.load(qp, mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(qp + HALF, mask=qm, other=0.0).to(tl.float32)
    op = QOut + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(op, (q1 * c - q2 * s).to(QOut.dtype.element_ty), mask=qm)
    tl.store(op + HALF, (q2 * c + q1 * s).to(QOut.dtype.element_ty), mask=qm)
    if PASS > 0:
        offs_p = tl.arange(0, BLOCK_PASS)
        p_mask = offs_p < PASS
        qpm = (offs_h < NUM_HEADS)[:, None] & p_mask[None, :]
        qpp = Q + t * stride_qt + offs_h[:, None] * stride_qh + 2 * HALF + offs_p[None, :]
        opp = QOut + t * stride_ot + offs_h[:, None] * stride_oh + 2 * HALF + offs_p[None, :]
        tl.store(opp, tl.load(qpp, mask=qpm, other=0.0).to(QOut.dtype.element_ty), mask=qpm)

    slot = tl.load(SlotMapping + t)
    if (slot >= 0) & (hb == 0):
        offs_kh = tl.arange(0, BLOCK_KH)
        h_mask = offs_kh < NUM_KV_HEADS
        km = h_mask[:, None] & d_mask[None, :]
        kp = K + t * stride_kt + offs_kh[:, None] * stride_kh + offs_d[None, :]
        k1 = tl.load(kp, mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(kp + HALF, mask=km, other=0.0).to(tl.float32)
        kc = KCache + slot * stride_kcs + offs_kh[:, None] * stride_kch + offs_d[None, :]
        vp = V + t * stride_vt + offs_kh[:, None] * stride_vh + offs_d[None, :]
        vc = VCache + slot * stride_vcs + offs_kh[:, None] * stride_vch + offs_d[None, :]
        offs_p = tl.arange(0, BLOCK_PASS)
        kpm = h_mask[:, None] & (offs_p < PASS)[None, :]
        kpp = K + t * stride_kt + offs_kh[:, None] * stride_kh + 2 * HALF + offs_p[None, :]
        kcp = KCache + slot * stride_kcs + offs_kh[:, None] * stride_kch + 2 * HALF + offs_p[None, :]
        vpp = V + t * stride_vt + offs_kh[:, None] * stride_vh + 2 * HALF + offs_p[None, :]
        vcp = VCache + slot * stride_vcs + offs_kh[:, None] * stride_vch + 2 * HALF + offs_p[None, :]
        if QUANT:
            # the rotated key in the activations' dtype (what the torch path quantizes), then per head:
            # amax, 127 / amax, round half to even (the 1.5 * 2^23 trick: exact for |x| < 2^22)
            kr1 = (k1 * c - k2 * s).to(K.dtype.element_ty).to(tl.float32)
            kr2 = (k2 * c + k1 * s).to(K.dtype.element_ty).to(tl.float32)
            kx = tl.load(kpp, mask=kpm, other=0.0).to(tl.float32)
            k_amax = tl.maximum(tl.max(tl.abs(kr1), 1), tl.max(tl.abs(kr2), 1))
            if PASS > 0:
                k_amax = tl.maximum(k_amax, tl.max(tl.abs(kx), 1))
            k_inv = _inv_scale(k_amax)
            tl.store(kc, _round_int8(kr1 * k_inv[:, None]), mask=km)
            tl.store(kc + HALF, _round_int8(kr2 * k_inv[:, None]), mask=km)
            if PASS > 0:
                tl.store(kcp, _round_int8(kx * k_inv[:, None]), mask=kpm)
            tl.store(KScale + slot * stride_kss + offs_kh, _scale(k_amax), mask=h_mask)
            if HAS_V:
                v1 = tl.load(vp, mask=km, other=0.0).to(tl.float32)
                v2 = tl.load(vp + HALF, mask=km, other=0.0).to(tl.float32)
                vx = tl.load(vpp, mask=kpm, other=0.0).to(tl.float32)
                v_amax = tl.maximum(tl.max(tl.abs(v1), 1), tl.max(tl.abs(v2), 1))
                if PASS > 0:
                    v_amax = tl.maximum(v_amax, tl.max(tl.abs(vx), 1))
                v_inv = _inv_scale(v_amax)
                tl.store(vc, _round_int8(v1 * v_inv[:, None]), mask=km)
                tl.store(vc + HALF, _round_int8(v2 * v_inv[:, None]), mask=km)
                if PASS > 0:
                    tl.store(vcp, _round_int8(vx * v_inv[:, None]), mask=kpm)
                tl.store(VScale + slot * stride_vss + offs_kh, _scale(v_amax), mask=h_mask)
        else:
            tl.store(kc, (k1 * c - k2 * s).to(KCache.dtype.element_ty), mask=km)
            tl.store(kc + HALF, (k2 * c + k1 * s).to(KCache.dtype.element_ty), mask=km)
            if PASS > 0:
                tl.store(kcp, tl.load(kpp, mask=kpm, other=0.0).to(KCache.dtype.element_ty), mask=kpm)
            if HAS_V:
                tl.store(vc, tl.load(vp, mask=km, other=0.0).to(VCache.dtype.element_ty), mask=km)
                tl.store(
                    vc + HALF, tl.load(vp + HALF, mask=km, other=0.0).to(VCache.dtype.element_ty), mask=km
                )
                if PASS > 0:
                    tl.store(vcp, tl.load(vpp, mask=kpm, other=0.0).to(VCache.dtype.element_ty), mask=kpm)


@triton.jit
def _inv_scale(amax):
    """127 / amax per row (IEEE-rounded division), 0 where amax < QUANT_MIN_AMAX (kv_cache.quantize_kv)."""
    ok = amax >= 1e-30
    return tl.where(ok, tl.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.where(ok, amax, 1.0)), 0.0)


@triton.jit
def _scale(amax):
    """amax / 127 per row, 0 where amax < QUANT_MIN_AMAX."""
    return tl.where(amax >= 1e-30, tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), 0.0)


@triton.jit
def _round_int8(y):
    """fp32 y (|y| <= 127 up to rounding) -> int8 round-half-even, clamped to [-127, 127]."""
    r = (y + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)


def _rotary_half(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> int:
    """rotary_dim // 2 of the cos / sin tables [max_positions, rotary_dim // 2]; ValueError unless
    0 < rotary_dim <= head_dim (rotary_dim = 2 * columns is even by construction)."""
    half = cos.shape[-1]
    if cos.shape != sin.shape:
        raise ValueError(f"rope_and_store: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} tables differ")
    if half < 1 or 2 * half > head_dim:
        raise ValueError(
            f"rope_and_store: rotary_dim {2 * half} (2 x the cos/sin columns) must be even, "
            f"positive and at most head_dim {head_dim}"
        )
    return half


ROPE_STORE_TILE = 16384  # q elements per program at most (heads x padded features), else head blocks


def rope_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache,
    v_cache,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate q and k of T new tokens and store k, v into the pool.

    q: [T, H, D], k / v: [T, Hkv, D] (views of the fused QKV projection are fine: the last dim
    must be contiguous); cos / sin: [max_positions, rotary_dim // 2] fp32 tables, rotary_dim <= D
    (< D: partial rotary, features [rotary_dim, D) of q and k pass through); positions: [T] int64;
    slot_mapping: [T] int64 pool slot per token (-1 = do not store: a padding row);
    k_cache / v_cache: [S, Hkv, D] tensors (written in their dtype), or an int8 pool's
    kv_cache.QuantizedKV pair: each token's K and V head rows quantized as kv_cache.quantize_kv (the
    rotated key rounded to k's dtype first, as the torch path has it), the same bytes for the same
    rows. Math in fp32. v and v_cache None: no V (multi-head latent attention's rows are K's
    alone), only k is stored. Returns the rotated q [T, H, D] (`q_out` if
    given, else a new tensor). Raises ValueError on a rotary_dim of 0 or over D, cos / sin tables
    of different shapes, a non-contiguous last dim, or only one of v and v_cache given.
    A program rotates at most ROPE_STORE_TILE of q's (padded) elements: wide heads (latent
    attention's 128 x 576) are cut into blocks of heads.
    """
    num_tokens, _, head_dim = q.shape
    has_v = v is not None
    if has_v != (v_cache is not None):
        raise ValueError("rope_and_store: v and v_cache go together")
    if q.stride(2) != 1 or k.stride(2) != 1 or (has_v and v.stride(2) != 1):
        raise ValueError("rope_and_store needs contiguous head vectors")
    half = _rotary_half(cos, sin, head_dim)
    if q_out is None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    _launch(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, q_out, half)
    return q_out


def _launch(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, q_out, half: int) -> None:
    """One program per (token, block of q heads), a block of a power of 2 heads holding at most
    ROPE_STORE_TILE padded q elements; v None: no V stored (k and its cache stand in, never read)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    has_v = v is not None
    passthrough = head_dim - 2 * half
    if not has_v:
        v, v_cache = k, k_cache
    k_cache, v_cache, k_scale, v_scale, stride_kss, stride_vss, quant = pool_args(k_cache, v_cache)
    block_half = triton.next_power_of_2(half)
    block_pass = triton.next_power_of_2(max(passthrough, 1))
    fit = max(1, ROPE_STORE_TILE // (2 * block_half + block_pass))  # heads per program, a power of 2
    block_h = min(triton.next_power_of_2(num_heads), 1 << (fit.bit_length() - 1))
    _rope_store_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        q,
        k,
        v,
        q_out,
        cos,
        sin,
        positions,
        slot_mapping,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        stride_kss,
        stride_vss,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=block_half,
        PASS=passthrough,
        BLOCK_PASS=block_pass,
        QUANT=quant,
        HAS_V=has_v,
    )


def rope_and_store_ref(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache) -> torch.Tensor:
    """Torch reference of `rope_and_store` (fp32 math, then the tensors' dtypes; an int8 pool's rows
    quantized by kv_cache.store_kv; v None: no V stored); partial rotary
    (rotary_dim = 2 * cos.shape[-1] < head_dim) leaves features [rotary_dim, head_dim) as they are."""
    half = _rotary_half(cos, sin, q.shape[-1])
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]

    def rot(x):
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
        return torch.cat((out, x[..., 2 * half :]), dim=-1)

    keep = slot_mapping >= 0
    store_kv(k_cache, slot_mapping[keep], rot(k)[keep])
    if v is not None:
        store_kv(v_cache, slot_mapping[keep], v[keep])
    return rot(q)
