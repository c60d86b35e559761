"""Triton building blocks shared by the attention kernels: a block of K/V through the page table
(de-quantized on load from an int8 pool), and one online-softmax step (FlashAttention, Dao et al. 2022, arXiv 2205.14135)."""

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
    KScale,
    VScale,
    stride_kss,
    stride_vss,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
):
    """K and V [BLOCK_N, BLOCK_D] of KV head `kvh` for token indices offs_n of the sequence whose
    pages are row `table_row` of PageTable (masked entries are 0; fp32 when UPCAST). QUANT: an int8
    pool (runtime/kv_cache.py) whose rows are de-quantized here, on load: fp32 data x its row's scale
    from KScale / VScale [S, Hkv] (slot stride stride_kss / stride_vss, heads contiguous)."""
    page = tl.load(PageTable + table_row * stride_pt + offs_n // PAGE_SIZE, mask=n_mask, other=0)
    slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0)
    v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0)
    if QUANT:
        ks = tl.load(KScale + slot * stride_kss + kvh, mask=n_mask, other=0.0)
        vs = tl.load(VScale + slot * stride_vss + kvh, mask=n_mask, other=0.0)
        k = k.to(tl.float32) * ks[:, None]
        v = v.to(tl.float32) * vs[:, None]
    elif UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


def pool_args(k_cache, v_cache) -> tuple:
    """(K data, V data, K scales, V scales, K scale slot stride, V scale slot stride, quantized) of one
    layer's caches for the kernels: plain tensors (the scale arguments then point at the data and are
    unused) or an int8 pool's kv_cache.QuantizedKV pair. Raises ValueError when one is quantized and
    the other not, or a scale tensor's heads are not contiguous."""
    from agentrt.runtime.kv_cache import QuantizedKV

    kq, vq = isinstance(k_cache, QuantizedKV), isinstance(v_cache, QuantizedKV)
    if kq != vq:
        raise ValueError("the K and V caches must both be int8 (QuantizedKV) or both plain tensors")
    if not kq:
        return k_cache, v_cache, k_cache, v_cache, 0, 0, False
    for s in (k_cache.scale, v_cache.scale):
        if s.dim() != 2 or s.stride(1) != 1:
            raise ValueError(
                f"KV scales must be [S, Hkv] with contiguous heads, got strides {tuple(s.stride())}"
            )
    return (
        k_cache.data, v_cache.data, k_cache.scale, v_cache.scale,
        k_cache.scale.stride(0), v_cache.scale.stride(0), True,
    )  # fmt: skip


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
