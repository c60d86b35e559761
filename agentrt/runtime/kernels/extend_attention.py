"""Extend attention: the new tokens of each sequence (a prefill chunk, or a speculative verify
chunk) attend to the sequence's cached prefix and causally to each other.

A FlashAttention-style kernel (Dao et al. 2022, arXiv 2205.14135: online softmax over K/V blocks)
over the paged KV pool: the new tokens' K/V are stored in the pool first (rope_store.py), so one
loop over the page table covers prefix and new tokens alike. A speculative draft tree replaces
the causal rule among the new tokens with its own mask (SpecInfer, Miao et al. 2023; Medusa,
Cai et al. 2024): `tree_mask` rows say which new tokens each new token sees.

Per-layer options (gpt-oss style, as Hugging Face transformers computes them): a sliding `window`
W (a query at position p sees the keys in (p - W, p]; key blocks wholly before a query block's
window are not visited) and learned attention `sinks` (one logit per query head, a softmax column
with no value: folded into the running max and denominator after the key loop).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from agentrt.runtime.kernels import dot_precision, require_contiguous_heads, upcast_dot
from agentrt.runtime.kernels.decode_attention import check_window_sinks, gather_kv_ref, softmax_with_sinks_ref
from agentrt.runtime.kernels.paged import load_paged_kv, online_softmax_step, pool_args


@triton.jit
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    QStarts,
    QLens,
    PrefixLens,
    PageTable,
    PageRows,
    TreeMask,
    TreeOffsets,
    Sinks,
    sm_scale,
    window,
    stride_sink,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    KScale,
    VScale,
    stride_kss,
    stride_vss,
    stride_ot,
    stride_oh,
    stride_pt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_TREE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_start = tl.load(QStarts + b)
    q_len = tl.load(QLens + b)
    prefix = tl.load(PrefixLens + b)
    table_row = tl.load(PageRows + b).to(tl.int64) if HAS_ROWS else b
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    if HAS_TREE:
        tree_off = tl.load(TreeOffsets + b)
        if HAS_WINDOW:  # a node's position: prefix + its depth (its ancestors in its row, minus 1)
            depth = tl.zeros([BLOCK_M], dtype=tl.int32)
            for c in range(0, q_len, BLOCK_N):
                cols = c + tl.arange(0, BLOCK_N)
                row = tl.load(
                    TreeMask + tree_off + offs_m[:, None] * q_len + cols[None, :],
                    mask=m_mask[:, None] & (cols[None, :] < q_len),
                    other=0,
                )
                depth += tl.sum(row.to(tl.int32), axis=1)
            q_pos = prefix + depth - 1

    # keys needed by this block: the prefix plus new tokens up to its last row (none past q_len)
    hi = prefix + tl.minimum(q_len, (mb + 1) * BLOCK_M)
    hi = tl.where(mb * BLOCK_M < q_len, hi, 0)
    lo = 0
    if HAS_WINDOW:
        # the block's first row (position prefix + mb * BLOCK_M) sees no key before `lo`; under a
        # tree the new tokens are seen by the tree rule, whatever their distance
        lo = tl.maximum(prefix + mb * BLOCK_M - window + 1, 0)
        if HAS_TREE:  # a node of any depth (>= 0) may be in the block
            lo = tl.maximum(prefix - window + 1, 0)
        lo = lo // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        k, v = load_paged_kv(
            K,
            V,
            PageTable,
            table_row,
            stride_pt,
            offs_n,
            n_mask,
            offs_d,
            d_mask,
            kvh,
            stride_ks,
            stride_kh,
            stride_vs,
            stride_vh,
            KScale,
            VScale,
            stride_kss,
            stride_vss,
            PAGE_SIZE,
            UPCAST,
            QUANT,
        )
        if QUANT:  # de-quantized fp32: the dot's operands in q's dtype
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision=PRECISION) * sm_scale
        new_col = offs_n - prefix  # index among the new tokens (negative: a prefix key)
        if HAS_TREE:
            in_new = (new_col[None, :] >= 0) & m_mask[:, None] & n_mask[None, :]
            tree = tl.load(
                TreeMask + tree_off + offs_m[:, None] * q_len + new_col[None, :], mask=in_new, other=0
            )
            old = new_col[None, :] < 0
            if HAS_WINDOW:  # the window applies to the prefix keys by the node's position
                old = old & (offs_n[None, :] > q_pos[:, None] - window)
            allowed = old | (tree != 0)
        else:
            allowed = new_col[None, :] <= offs_m[:, None]
            if HAS_WINDOW:
                allowed = allowed & (offs_n[None, :] > prefix + offs_m[:, None] - window)
        allowed = allowed & n_mask[None, :] & m_mask[:, None]
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)

    if HAS_SINKS:  # one more logit per head, with no value: it only scales the denominator
        sink = tl.load(Sinks + h * stride_sink)
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp(sink - m_safe)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache,
    v_cache,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_q_len: int,
    sm_scale: float | None = None,
    page_size: int = 1,
    tree_mask: torch.Tensor | None = None,
    tree_offsets: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    page_rows: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the new tokens of B sequences laid out in one flat batch.

    q: [T, H, D] queries (RoPE applied); sequence b's new tokens are rows
    [q_starts[b], q_starts[b] + q_lens[b]) at positions prefix_lens[b] + i. k_cache / v_cache:
    [S, Hkv, D] holding the prefix and the new tokens' K/V (tensors, or an int8 pool's
    kv_cache.QuantizedKV: de-quantized on load); page_table: [B, P] int32 page ids
    covering prefix_lens[b] + q_lens[b] tokens; q_starts / q_lens / prefix_lens: [B] int32;
    max_q_len: at least the max of q_lens (sets the grid; rows past it are not computed).
    tree_mask (optional): flat uint8 with, for sequence b, a [q_lens[b], q_lens[b]] row-major block
    at tree_offsets[b] (int64): 1 where new token i attends to new token j (replaces the causal
    rule; every new token sees the whole prefix). It must be lower triangular, as a draft tree's
    is (parents come before children): keys after a row's own block are not visited.
    The last dimension of q and the caches must be contiguous.
    Rows of q not covered by any sequence are left untouched in `out`. page_rows (optional): [B]
    int32 row of page_table per sequence (a persistent per-request table); None = row b.
    window (optional): a sliding window of W keys: new token i of sequence b (position
    p = prefix_lens[b] + i) attends keys at positions in (p - W, p] only, within the causal rule
    (None or 0: no window; a runtime argument, new values compile nothing). With a tree_mask the
    tree rule alone decides among the new tokens (a draft is far shorter than a window) and the
    window applies to the prefix keys by the node's position, p = prefix_lens[b] + its depth (the
    ones in its tree row, minus 1): prefix key j is attended iff j > p - W.
    sinks (optional): float32 [H] learned logits, one per query head, added to each head's softmax
    as a column with no value (gpt-oss).
    Returns out [T, H, D] in q's dtype. Raises ValueError on mismatched shapes, a window that is
    not a positive int (or None / 0) and sinks that are not float32 [H] on q's device.
    """
    pool = pool_args(k_cache, v_cache)
    _check_extend_args(q, pool[0], pool[1], tree_mask, tree_offsets)
    window = check_window_sinks(window, sinks, q)
    require_contiguous_heads(q=q, k_cache=pool[0], v_cache=pool[1])
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])
    if out is None:
        out = torch.empty_like(q)
    _launch_extend(
        q, pool, out, q_starts, q_lens, prefix_lens, page_table, page_rows, tree_mask, tree_offsets, sinks,
        sm_scale, window, page_size, max_q_len,
    )  # fmt: skip
    return out


def _check_extend_args(q, k_cache, v_cache, tree_mask, tree_offsets) -> None:
    """Raises ValueError when q [T, H, D] does not fit the caches [S, Hkv, D] or only one of
    tree_mask and tree_offsets is given."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or k_cache.shape[2] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit the KV cache {tuple(k_cache.shape)}")
    if (tree_mask is None) != (tree_offsets is None):
        raise ValueError("tree_mask and tree_offsets go together")


def _launch_extend(
    q, pool, out, q_starts, q_lens, prefix_lens, page_table, page_rows, tree_mask, tree_offsets, sinks,
    sm_scale, window, page_size, max_q_len,
) -> None:  # fmt: skip
    """Picks the block sizes for head_dim and launches one program per (sequence, query head, block
    of max_q_len new tokens), writing out [T, H, D]; absent options pass a placeholder tensor."""
    k_cache, v_cache, k_scale, v_scale, stride_kss, stride_vss, quant = pool
    batch = q_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    block_d = triton.next_power_of_2(head_dim)
    block_m = 32 if block_d <= 64 else 16
    has_tree = tree_mask is not None
    grid = (batch, num_heads, triton.cdiv(max(1, max_q_len), block_m))
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        q_starts,
        q_lens,
        prefix_lens,
        page_table,
        page_rows if page_rows is not None else q_lens,
        tree_mask if has_tree else q_lens,
        tree_offsets if has_tree else q_lens,
        sinks if sinks is not None else q_lens,
        sm_scale,
        window,
        sinks.stride(0) if sinks is not None else 0,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        k_scale,
        v_scale,
        stride_kss,
        stride_vss,
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        HAS_TREE=has_tree,
        BLOCK_M=block_m,
        BLOCK_N=32,
        BLOCK_D=block_d,
        UPCAST=upcast_dot(q.dtype),
        QUANT=quant,
        HAS_ROWS=page_rows is not None,
        PRECISION=dot_precision(q.dtype),
        HAS_WINDOW=window > 0,
        HAS_SINKS=sinks is not None,
    )


def extend_attention_ref(
    q,
    k_cache,
    v_cache,
    q_starts,
    q_lens,
    prefix_lens,
    page_table,
    sm_scale=None,
    page_size: int = 1,
    tree_masks: list | None = None,
    page_rows=None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
):
    """Torch reference of `extend_attention` (fp32 math); tree_masks: per sequence a [n, n] bool
    tensor or None (causal); window and sinks as there (same errors)."""
    window = check_window_sinks(window, sinks, q)
    if page_rows is not None:
        page_table = page_table[page_rows.long()]
    head_dim = q.shape[2]
    group = q.shape[1] // k_cache.shape[1]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros_like(q)
    for b in range(q_lens.shape[0]):
        s, n, p = int(q_starts[b]), int(q_lens[b]), int(prefix_lens[b])
        if n == 0:
            continue
        k = gather_kv_ref(k_cache, page_table, b, p + n, page_size).float().repeat_interleave(group, dim=1)
        v = gather_kv_ref(v_cache, page_table, b, p + n, page_size).float().repeat_interleave(group, dim=1)
        allowed = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
        tree = tree_masks[b] if tree_masks is not None else None
        allowed[:, p:] = (
            tree if tree is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        )
        if window:  # key j seen by new token i (position p + i) iff j > p + i - window
            pos = torch.arange(p + n, device=q.device)
            q_pos = p + (pos[:n] if tree is None else tree.sum(1) - 1)  # a tree node: p + its depth
            in_window = pos[None, :] > q_pos[:, None] - window
            if tree is not None:
                in_window[:, p:] = True  # the tree rule alone among the new tokens
            allowed &= in_window
        scores = torch.einsum("thd,nhd->htn", q[s : s + n].float(), k) * sm_scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[s : s + n] = torch.einsum("htn,nhd->thd", softmax_with_sinks_ref(scores, sinks), v).to(q.dtype)
    return out
