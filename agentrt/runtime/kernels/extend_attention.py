"""Extend attention: the new tokens of each sequence (a prefill chunk, or a speculative verify
chunk) attend to the sequence's cached prefix and causally to each other.

A FlashAttention-style kernel (Dao et al. 2022, arXiv 2205.14135: online softmax over K/V blocks)
over the paged KV pool: the new tokens' K/V are stored in the pool first (rope_store.py), so one
loop over the page table covers prefix and new tokens alike. A speculative draft tree replaces
the causal rule among the new tokens with its own mask (SpecInfer, Miao et al. 2023; Medusa,
Cai et al. 2024): `tree_mask` rows say which new tokens each new token sees.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from agentrt.runtime.kernels import dot_precision, require_contiguous_heads, upcast_dot
from agentrt.runtime.kernels.paged import load_paged_kv, online_softmax_step


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
    sm_scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
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
    HAS_ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
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

    # keys needed by this block: the prefix plus new tokens up to its last row (none past q_len)
    hi = prefix + tl.minimum(q_len, (mb + 1) * BLOCK_M)
    hi = tl.where(mb * BLOCK_M < q_len, hi, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, hi, BLOCK_N):
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
            PAGE_SIZE,
            UPCAST,
        )
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision=PRECISION) * sm_scale
        new_col = offs_n - prefix  # index among the new tokens (negative: a prefix key)
        if HAS_TREE:
            in_new = (new_col[None, :] >= 0) & m_mask[:, None] & n_mask[None, :]
            tree = tl.load(
                TreeMask + tree_off + offs_m[:, None] * q_len + new_col[None, :], mask=in_new, other=0
            )
            allowed = (new_col[None, :] < 0) | (tree != 0)
        else:
            allowed = new_col[None, :] <= offs_m[:, None]
        allowed = allowed & n_mask[None, :] & m_mask[:, None]
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
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
) -> torch.Tensor:
    """Attention of the new tokens of B sequences laid out in one flat batch.

    q: [T, H, D] queries (RoPE applied); sequence b's new tokens are rows
    [q_starts[b], q_starts[b] + q_lens[b]) at positions prefix_lens[b] + i. k_cache / v_cache:
    [S, Hkv, D] holding the prefix and the new tokens' K/V; page_table: [B, P] int32 page ids
    covering prefix_lens[b] + q_lens[b] tokens; q_starts / q_lens / prefix_lens: [B] int32;
    max_q_len: at least the max of q_lens (sets the grid; rows past it are not computed).
    tree_mask (optional): flat uint8 with, for sequence b, a [q_lens[b], q_lens[b]] row-major block
    at tree_offsets[b] (int64): 1 where new token i attends to new token j (replaces the causal
    rule; every new token sees the whole prefix). It must be lower triangular, as a draft tree's
    is (parents come before children): keys after a row's own block are not visited.
    The last dimension of q and the caches must be contiguous.
    Rows of q not covered by any sequence are left untouched in `out`. page_rows (optional): [B]
    int32 row of page_table per sequence (a persistent per-request table); None = row b.
    Returns out [T, H, D] in q's dtype. Raises ValueError on mismatched shapes.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or k_cache.shape[2] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit the KV cache {tuple(k_cache.shape)}")
    batch = q_lens.shape[0]
    if (tree_mask is None) != (tree_offsets is None):
        raise ValueError("tree_mask and tree_offsets go together")
    require_contiguous_heads(q=q, k_cache=k_cache, v_cache=v_cache)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q)
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
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
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
        HAS_ROWS=page_rows is not None,
        PRECISION=dot_precision(q.dtype),
    )
    return out


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
):
    """Torch reference of `extend_attention` (fp32 math); tree_masks: per sequence a [n, n] bool
    tensor or None (causal)."""
    if page_rows is not None:
        page_table = page_table[page_rows.long()]
    from agentrt.runtime.kernels.decode_attention import gather_kv_ref

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
        scores = torch.einsum("thd,nhd->htn", q[s : s + n].float(), k) * sm_scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[s : s + n] = torch.einsum("htn,nhd->thd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out
