"""Paged decode attention: one query token per sequence over its KV in the pool, split-K.

Flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context inference"): the context of
each sequence is cut into splits that run as separate programs (so a batch of one long sequence
still fills the GPU); each writes a partial output and its log-sum-exp, and a second kernel merges
them. The splits of a sequence depend on its own length only (at least `split_tokens` keys each,
at most MAX_SPLITS of them, aligned to the key block), and the merge reduces a fixed MAX_SPLITS-wide
vector: a row's sum order is the same whatever the batch (batch-invariant decoding, as SGLang's
deterministic mode fixes the split size). Grouped-query attention (Ainslie et al. 2023) is handled per KV head:
one program loads each K/V block once for the whole group of query heads that share it (the
group is padded to 16 rows so the block products run on tensor cores, as SGLang's grouped
decode kernel does).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from agentrt.runtime.kernels import dot_precision, require_contiguous_heads, upcast_dot
from agentrt.runtime.kernels.paged import load_paged_kv, online_softmax_step


@triton.jit
def _decode_split_kernel(
    Q,
    K,
    V,
    PageTable,
    PageRows,
    SeqLens,
    PartOut,
    PartLse,
    sm_scale,
    num_splits,
    split_tokens,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    table_row = tl.load(PageRows + b).to(tl.int64) if HAS_ROWS else b
    # the split length is a function of seq_len alone (batch-invariant); the grid's last split takes
    # any rest, so a grid smaller than decode_splits() stays correct (only not invariant)
    split_len = tl.maximum(split_tokens, tl.cdiv(tl.cdiv(seq_len, MAX_SPLITS), BLOCK_N) * BLOCK_N)
    lo = split * split_len
    hi = tl.where(split == num_splits - 1, seq_len, tl.minimum(lo + split_len, seq_len))

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
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
            PAGE_SIZE,
            UPCAST,
        )
        s = tl.dot(q, tl.trans(k), out_dtype=tl.float32, input_precision=PRECISION) * sm_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, PRECISION)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(
        PartOut + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
        out,
        mask=g_mask[:, None] & d_mask[None, :],
    )
    tl.store(PartLse + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    PartOut,
    PartLse,
    Out,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # empty splits (lse -inf) weigh 0
    parts = tl.load(
        PartOut + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


MAX_SPLITS = 32  # splits per sequence at most (the merge's fixed width)
SPLIT_TOKENS = 256  # keys per split at least


def decode_splits(max_seq_len: int, split_tokens: int = SPLIT_TOKENS) -> int:
    """The grid's splits per sequence that cover every sequence of up to `max_seq_len` tokens (the
    kernel cuts a sequence of L tokens into pieces of max(split_tokens, ceil(L / MAX_SPLITS)) keys
    rounded up to its key block); between 1 and MAX_SPLITS. Depends on the longest sequence only:
    callers pass the page table's capacity so the grid, too, is the same for every batch."""
    if split_tokens < 1:
        raise ValueError(f"split_tokens must be >= 1, got {split_tokens}")
    return int(max(1, min(MAX_SPLITS, math.ceil(max_seq_len / split_tokens))))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    page_size: int = 1,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    page_rows: torch.Tensor | None = None,
    split_tokens: int = SPLIT_TOKENS,
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole context in the KV pool.

    q: [B, H, D] (the new tokens' queries, RoPE applied); k_cache / v_cache: [S, Hkv, D] with the
    new tokens' K/V already stored; page_table: [B, P] int32 page ids; seq_lens: [B] int32 tokens of
    context per sequence, new token included (0 = a padding row: its output is 0).
    H must be a multiple of Hkv; the last dimension of q and the caches must be contiguous. Returns out [B, H, D] in q's dtype (written into `out` if given).
    `num_splits` sets the grid (static for CUDA graph capture): `decode_splits(longest seq_len,
    split_tokens)` covers every row (a smaller grid folds the rest into its last split: correct, not
    batch-invariant); a runtime kernel argument, like `split_tokens` (keys per split at least), so
    new values compile nothing. A row's output depends on its own q, context and split_tokens only.
    Raises ValueError on mismatched shapes or num_splits / split_tokens < 1.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or k_cache.shape[2] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit the KV cache {tuple(k_cache.shape)}")
    if (page_rows is None and page_table.shape[0] != batch) or seq_lens.shape[0] != batch:
        raise ValueError("page_table and seq_lens need one row per query")
    if num_splits < 1 or split_tokens < 1:
        raise ValueError(f"num_splits and split_tokens must be >= 1, got {num_splits} and {split_tokens}")
    require_contiguous_heads(q=q, k_cache=k_cache, v_cache=v_cache)
    group = num_heads // num_kv_heads
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    block_d = triton.next_power_of_2(head_dim)
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be like q {tuple(q.shape)} {q.dtype} with a contiguous last dimension")
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        page_rows if page_rows is not None else seq_lens,
        seq_lens,
        part_out,
        part_lse,
        sm_scale,
        num_splits,
        split_tokens,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        page_table.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64 if block_d <= 64 else 32,
        BLOCK_D=block_d,
        UPCAST=upcast_dot(q.dtype),
        HAS_ROWS=page_rows is not None,
        PRECISION=dot_precision(q.dtype),
        MAX_SPLITS=MAX_SPLITS,
    )
    _decode_merge_kernel[(batch, num_heads)](
        part_out,
        part_lse,
        out,
        num_splits,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(num_splits)),  # a fixed width: batch-invariant
    )
    return out


def gather_kv_ref(
    cache: torch.Tensor, page_table: torch.Tensor, b: int, length: int, page_size: int
) -> torch.Tensor:
    """Torch reference of the paged addressing: [length, Hkv, D] K or V of sequence b."""
    j = torch.arange(length, device=cache.device)
    slots = page_table[b, j // page_size].long() * page_size + j % page_size
    return cache[slots]


def decode_attention_ref(
    q, k_cache, v_cache, page_table, seq_lens, sm_scale=None, page_size: int = 1, page_rows=None
):
    """Torch reference of `decode_attention` (fp32 math, one sequence at a time)."""
    if page_rows is not None:
        page_table = page_table[page_rows.long()]
    batch, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros_like(q)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        k = gather_kv_ref(k_cache, page_table, b, n, page_size).float().repeat_interleave(group, dim=1)
        v = gather_kv_ref(v_cache, page_table, b, n, page_size).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out
