"""Triton building blocks shared by the attention kernels: a block of K/V through the page table,
and one online-softmax step (FlashAttention, Dao et al. 2022, arXiv 2205.14135)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_paged_kv(
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
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """K and V [BLOCK_N, BLOCK_D] of KV head `kvh` for token indices offs_n of the sequence whose
    pages are row `table_row` of PageTable (masked entries are 0; fp32 when UPCAST)."""
    page = tl.load(PageTable + table_row * stride_pt + offs_n // PAGE_SIZE, mask=n_mask, other=0)
    slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v, PRECISION: tl.constexpr):
    """Fold scores s [M, N] (-inf where not attended) and values v [N, D] into the running max
    m_i [M], denominator l_i [M] and numerator acc [M, D] (fp32); a row with nothing attended yet
    stays at m = -inf, l = 0, acc = 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc
