"""Chunked gated delta rule for prefill (Yang, Kautz & Hatamizadeh 2024, arXiv 2412.06464): the tokens of
many sequences at once, each sequence's recurrent state read from a state pool slot and written back in
place, with the state also written to snapshot slots at chosen token boundaries.

The layout is flash-linear-attention's `chunk_gated_delta_rule` (vLLM and SGLang call it for Qwen3-Next
prefill) cut down to two kernels of our own, chunks of 64 tokens:

1. `_wu_kernel`, one program per (chunk, value head), all chunks in parallel: the chunk-local cumulative
   log decay, the strictly lower matrix A = beta_i (k_i . k_j) exp(g_i - g_j), its unit-lower inverse
   (I + A)^-1 (FLA's `solve_tril`: the 16 x 16 diagonal blocks by forward substitution, all four at
   once, then the blocks below them; `_unit_lower_inverse`), and the UT-transformed keys w = (I + A)^-1 (beta k exp(g)) and values u = (I + A)^-1 (beta v) (FLA's
   `recompute_w_u`): what each token writes given the chunk's start state S is u - w S.
2. `_scan_kernel`, one program per (sequence, value head, block of value channels), the chunks of that
   sequence in order (FLA's `chunk_gated_delta_rule_fwd_h` with its output kernel `chunk_fwd_o` fused
   in, so no per-chunk state is stored): v_new = u - w S, o = (q exp(g)) S + causal(q k^T exp(g_i - g_j))
   v_new, S <- exp(g_last) S + (k exp(g_last - g))^T v_new. A sequence is cut into segments at its
   snapshot points, each chunked from its own start, and the state after each segment is stored to
   that segment's slot (the last segment's slot is the working slot).

q and k are L2-normalised in the kernels (FLA's `use_qk_l2norm_in_kernel`) and read per key head (a
value head h reads key head h // (Hv / Hk): no repeated copies). Every product is float32 ("ieee"
`tl.dot`), as the torch form (layers.gated_delta.gated_delta_chunked) computes it; the cumulative
decay is float32 here (the torch form takes it in float64), exact enough within a 64-token chunk
(measured on keys nearly parallel, beta ~1, decay ~1 over 128 tokens: 2.1e-7 from a float64
recurrence, the torch form 3.0e-7).

`gated_delta_chunk_ref` is the torch reference (`gated_delta_chunked` segment by segment);
tests/runtime/test_triton_gated_delta.py compares the two under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from agentrt.runtime.kernels import require_contiguous_heads

if TYPE_CHECKING:
    from agentrt.runtime.recurrent_state import SeqState

CHUNK = 64


@triton.jit
def _load_heads(Ptr, rows, mask_t, head, stride_t, stride_h, offs, mask_d, L2NORM: tl.constexpr, eps):
    """[BT, BD] float32 rows of one head (zero outside the masks), L2-normalised per row with L2NORM."""
    x = tl.load(
        Ptr + rows[:, None] * stride_t + head * stride_h + offs[None, :],
        mask=mask_t[:, None] & mask_d[None, :],
        other=0.0,
    ).to(tl.float32)
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=1) + eps)[:, None]
    return x


@triton.jit
def _unit_lower_inverse(a, BT: tl.constexpr):
    """(I + A)^-1 of a strictly lower [BT, BT] float32 tile A (BT a multiple of 16): FLA's `solve_tril`
    in two steps. First the diagonal blocks of 16 all at once, row i of every block per step by
    forward substitution: N_i = -A_i - A_i N (N: the strictly lower part of the inverse, rows of N done
    so far, -A in the rows to do, zero outside the diagonal blocks). Then, with D^-1 that block
    diagonal inverse and E the blocks below it (I + A = D + E), (I + A)^-1 = (I + M)^-1 D^-1 for
    M = D^-1 E, which is nilpotent (zero after BT / 16 - 1 powers): a short alternating series."""
    o = tl.arange(0, BT)
    same_block = (o[:, None] // 16) == (o[None, :] // 16)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)
    n = tl.where(same_block, -a, 0.0)
    for i in range(2, 16):
        rows = tl.where((o % 16 == i)[:, None], n, 0.0)
        n = tl.where((o % 16 == i)[:, None], rows + tl.dot(rows, n, input_precision="ieee"), n)
    d_inv = n + eye
    m = tl.dot(d_inv, tl.where(same_block, 0.0, a), input_precision="ieee")
    inverse = d_inv
    for _ in range(BT // 16 - 1):  # Horner: D^-1 - M (D^-1 - M (D^-1 - ...))
        inverse = d_inv - tl.dot(m, inverse, input_precision="ieee")
    return inverse


@triton.jit
def _wu_kernel(
    K,
    V,
    G,
    Beta,
    W,
    U,
    Gcum,
    ChunkStart,
    ChunkEnd,
    eps,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_wt,
    stride_wh,
    stride_ut,
    stride_uh,
    stride_ct,
    HEADS_PER_K: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
):
    c = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(ChunkStart + c)
    end = tl.load(ChunkEnd + c)
    o_t = tl.arange(0, BT)
    rows = start + o_t
    mt = rows < end
    offs_k = tl.arange(0, BK)
    mk = offs_k < DK
    k = _load_heads(K, rows, mt, h // HEADS_PER_K, stride_kt, stride_kh, offs_k, mk, L2NORM, eps)
    # padding rows: g = 0 (so the cumulative decay stays flat past the end), beta = 0 (they write nothing)
    g = tl.load(G + rows * stride_gt + h, mask=mt, other=0.0).to(tl.float32)
    beta = tl.load(Beta + rows * stride_bt + h, mask=mt, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, axis=0)
    tl.store(Gcum + rows * stride_ct + h, gc, mask=mt)

    lower = o_t[:, None] > o_t[None, :]
    kk = tl.dot(k, tl.trans(k), input_precision="ieee")
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0))
    a = tl.where(lower, beta[:, None] * kk * decay, 0.0)
    inverse = _unit_lower_inverse(a, BT)

    w = tl.dot(inverse, k * (beta * tl.exp(gc))[:, None], input_precision="ieee")
    tl.store(
        W + rows[:, None] * stride_wt + h * stride_wh + offs_k[None, :],
        w,
        mask=mt[:, None] & mk[None, :],
    )
    for v0 in range(0, DV, BV):
        offs_v = v0 + tl.arange(0, BV)
        mv = offs_v < DV
        v = _load_heads(V, rows, mt, h, stride_vt, stride_vh, offs_v, mv, False, eps)
        u = tl.dot(inverse, v * beta[:, None], input_precision="ieee")
        tl.store(
            U + rows[:, None] * stride_ut + h * stride_uh + offs_v[None, :],
            u,
            mask=mt[:, None] & mv[None, :],
        )


@triton.jit
def _scan_kernel(
    Q,
    K,
    W,
    U,
    Gcum,
    State,
    Out,
    SeqStart,
    SeqSlot,
    SeqFresh,
    SegPtr,
    SegEnd,
    SegSlot,
    scale,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_wt,
    stride_wh,
    stride_ut,
    stride_uh,
    stride_ct,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_ot,
    stride_oh,
    HEADS_PER_K: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // HEADS_PER_K
    offs_k = tl.arange(0, BK)
    mk = offs_k < DK
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mv = offs_v < DV
    s_mask = mk[:, None] & mv[None, :]
    s_offs = h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :]
    slot = tl.load(SeqSlot + n).to(tl.int64)
    s = tl.load(State + slot * stride_ss + s_offs, mask=s_mask, other=0.0)
    # a fresh sequence starts at zero (its slot is not read: it may hold NaN)
    s = tl.where(tl.load(SeqFresh + n) != 0, 0.0, s)

    o_t = tl.arange(0, BT)
    causal = o_t[:, None] >= o_t[None, :]
    pos = tl.load(SeqStart + n)
    for seg in range(tl.load(SegPtr + n), tl.load(SegPtr + n + 1)):
        end = tl.load(SegEnd + seg)
        for c0 in range(pos, end, BT):
            rows = c0 + o_t
            mt = rows < end
            q = _load_heads(Q, rows, mt, hk, stride_qt, stride_qh, offs_k, mk, L2NORM, eps) * scale
            k = _load_heads(K, rows, mt, hk, stride_kt, stride_kh, offs_k, mk, L2NORM, eps)
            w = _load_heads(W, rows, mt, h, stride_wt, stride_wh, offs_k, mk, False, eps)
            u = _load_heads(U, rows, mt, h, stride_ut, stride_uh, offs_v, mv, False, eps)
            gc = tl.load(Gcum + rows * stride_ct + h, mask=mt, other=0.0)
            g_last = tl.sum(tl.where(o_t == tl.minimum(end - c0, BT) - 1, gc, 0.0), axis=0)

            v_new = u - tl.dot(w, s, input_precision="ieee")  # [BT, BV]: what each token writes
            keep = causal & mt[:, None]  # (a padding row's gc is 0, not its chunk's last: exp would overflow)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            scores = tl.where(keep, scores * tl.exp(tl.where(keep, gc[:, None] - gc[None, :], 0.0)), 0.0)
            o = tl.dot(q * tl.exp(gc)[:, None], s, input_precision="ieee")
            o += tl.dot(scores, v_new, input_precision="ieee")
            tl.store(
                Out + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :],
                o,
                mask=mt[:, None] & mv[None, :],
            )
            k_to_end = k * tl.exp(g_last - gc)[:, None]
            s = s * tl.exp(g_last) + tl.dot(tl.trans(k_to_end), v_new, input_precision="ieee")
        pos = end
        out_slot = tl.load(SegSlot + seg).to(tl.int64)
        tl.store(State + out_slot * stride_ss + s_offs, s, mask=s_mask)


def segments_of(seqs: Sequence[SeqState]) -> tuple[list[int], list[tuple[int, int]]]:
    """(segment pointer [N + 1], segments [(end row, slot)]) of sequences cut at their snapshot points:
    sequence i's segments are segments[ptr[i]:ptr[i + 1]], the first starting at its `start`, each
    ending at a snapshot point with the snapshot's slot, the last ending at `end` with the working
    slot (an empty segment where a snapshot falls at the end, or at 0 tokens)."""
    ptr, segs = [0], []
    for s in seqs:
        segs.extend((s.start + n, slot) for n, slot in s.snapshots)
        segs.append((s.end, s.slot))
        ptr.append(len(segs))
    return ptr, segs


class ChunkPlan(NamedTuple):
    """The kernels' view of a batch of sequences, on the device (int32): per sequence its first row,
    working slot and fresh flag ([3, N]); the segment pointer [N + 1]; per segment its end row and
    the slot its final state goes to ([2, S]); per chunk its first and end row ([2, C]; every
    segment cut into chunks of 64 rows from its own start, the last one shorter)."""

    seqs: torch.Tensor
    seg_ptr: torch.Tensor
    segs: torch.Tensor
    chunks: torch.Tensor


def plan_chunks(seqs: Sequence[SeqState], device: torch.device) -> ChunkPlan:
    """The ChunkPlan of `seqs` (recurrent_state.SeqState: rows [start, end), working `slot`, `fresh`,
    `snapshots`), built once and shared by every layer of a forward."""
    ptr, segs = segments_of(seqs)
    chunks = []
    for i, s in enumerate(seqs):
        pos = s.start
        for end, _ in segs[ptr[i] : ptr[i + 1]]:
            chunks.extend((c, min(c + CHUNK, end)) for c in range(pos, end, CHUNK))
            pos = end
    i32 = {"dtype": torch.int32, "device": device}
    per_seq = [[s.start for s in seqs], [s.slot for s in seqs], [int(s.fresh) for s in seqs]]
    return ChunkPlan(
        torch.tensor(per_seq, **i32).reshape(3, len(seqs)),
        torch.tensor(ptr, **i32),
        torch.tensor(segs, **i32).reshape(-1, 2).t().contiguous(),
        torch.tensor(chunks, **i32).reshape(-1, 2).t().contiguous(),
    )


def _check(q, k, v, g, beta, state, out) -> None:
    """Raise ValueError unless the arguments of `gated_delta_chunk` fit each other."""
    t, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    if (
        q.shape != k.shape
        or v.shape[0] != t
        or num_v_heads % num_k_heads
        or g.shape != (t, num_v_heads)
        or beta.shape != (t, num_v_heads)
        or state.shape[1:] != (num_v_heads, dk, dv)
        or (out is not None and (out.shape != v.shape or out.dtype != torch.float32))
    ):
        raise ValueError(
            f"gated_delta_chunk: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)}, state {tuple(state.shape)} do not fit"
        )
    if state.dtype != torch.float32 or state.stride(3) != 1:
        raise ValueError(
            f"state must be float32 with a contiguous last dim, got {state.dtype} {state.stride()}"
        )
    if len({x.device for x in (q, k, v, g, beta, state)}) != 1:
        raise ValueError("gated_delta_chunk: all tensors must be on one device")
    require_contiguous_heads(q=q, k=k, v=v)


def gated_delta_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    seqs: Sequence[SeqState] | ChunkPlan,
    scale: float | None = None,
    l2norm: bool = True,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The chunked gated delta rule over the rows of a flat batch of sequences. q, k [T, Hk, Dk] (raw
    when `l2norm`: normalised here as x / sqrt(sum x^2 + eps), then q times `scale`, default Dk^-0.5),
    v [T, Hv, Dv], g (log decay, <= 0) and beta [T, Hv]; state pool [S, Hv, Dk, Dv] float32 with a
    contiguous last dim. seqs: recurrent_state.SeqState of each sequence (rows [start, end), working
    `slot` read unless `fresh` and written with the final state, `snapshots` (n, slot): the state
    after the first n rows written to slot; slots distinct), or their `plan_chunks`. -> o [T, Hv, Dv]
    float32 (`out` when given), rows outside every sequence left as they were (zeros in a new one).
    Raises ValueError on mismatched shapes, a non-float32 or strided state, tensors on different
    devices."""
    _check(q, k, v, g, beta, state, out)
    t, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1], v.shape[2]
    dev = v.device
    if out is None:
        out = torch.zeros(t, num_v_heads, dv, dtype=torch.float32, device=dev)
    plan = seqs if isinstance(seqs, ChunkPlan) else plan_chunks(seqs, dev)
    if plan.seqs.shape[1] == 0:
        return out
    w = torch.empty(t, num_v_heads, dk, dtype=torch.float32, device=dev)
    u = torch.empty(t, num_v_heads, dv, dtype=torch.float32, device=dev)
    gcum = torch.empty(t, num_v_heads, dtype=torch.float32, device=dev)
    block_k = max(16, triton.next_power_of_2(dk))
    block_v = max(16, min(triton.next_power_of_2(dv), 64))
    common = {"HEADS_PER_K": num_v_heads // num_k_heads, "DK": dk, "DV": dv, "BT": CHUNK, "BK": block_k}
    if plan.chunks.shape[1]:
        _wu_kernel[(plan.chunks.shape[1], num_v_heads)](
            k, v, g, beta, w, u, gcum, plan.chunks[0], plan.chunks[1], eps,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
            w.stride(0), w.stride(1), u.stride(0), u.stride(1), gcum.stride(0),
            BV=block_v, L2NORM=l2norm, **common,
        )  # fmt: skip
    _scan_kernel[(plan.seqs.shape[1], num_v_heads, triton.cdiv(dv, block_v))](
        q, k, w, u, gcum, state, out, plan.seqs[0], plan.seqs[1], plan.seqs[2],
        plan.seg_ptr, plan.segs[0], plan.segs[1], dk**-0.5 if scale is None else scale, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        gcum.stride(0), state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        BV=block_v, L2NORM=l2norm, **common,
    )  # fmt: skip
    return out


def gated_delta_chunk_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    seqs: Sequence[SeqState],
    scale: float | None = None,
    l2norm: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The torch reference of `gated_delta_chunk` (same arguments and in-place updates): the layer's
    chunked form (layers.gated_delta.gated_delta_chunked) segment by segment."""
    from agentrt.runtime.layers.gated_delta import gated_delta_chunked

    rep = v.shape[1] // k.shape[1]
    q, k = q.float(), k.float()
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    q = (q * (k.shape[-1] ** -0.5 if scale is None else scale)).repeat_interleave(rep, dim=1)
    k = k.repeat_interleave(rep, dim=1)
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    ptr, segs = segments_of(seqs)
    for i, s in enumerate(seqs):
        current = torch.zeros_like(state[s.slot]) if s.fresh else state[s.slot].clone()
        pos = s.start
        for end, slot in segs[ptr[i] : ptr[i + 1]]:
            if end > pos:
                part = slice(pos, end)
                out[part] = gated_delta_chunked(q[part], k[part], v[part], g[part], beta[part], current)
            state[slot] = current
            pos = end
    return out
