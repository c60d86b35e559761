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

Per-layer options (gpt-oss style, as Hugging Face transformers computes them): a sliding `window`
W restricts the query at position L-1 to the keys L-W .. L-1; the splits then cover those W keys
only (blocks before L-W are never loaded: O(W) per token however long the context), and their
plan is a function of min(L, W). Learned attention `sinks` (one logit per query head) add a
value-less column to the softmax; the merge adds it once, after the splits, so the result does
not depend on how many splits there are.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from agentrt.runtime.kernels import dot_precision, require_contiguous_heads, upcast_dot
from agentrt.runtime.kernels.paged import load_paged_kv, online_softmax_step, pool_args


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
    window,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    KScale,
    VScale,
    stride_kss,
    stride_vss,
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
    QUANT: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    table_row = tl.load(PageRows + b).to(tl.int64) if HAS_ROWS else b
    # keys first_key .. seq_len-1 are attended (a window skips the older ones: never loaded)
    first_key = tl.maximum(seq_len - window, 0) if HAS_WINDOW else 0
    # the split length is a function of the attended length alone (batch-invariant); the grid's
    # last split takes any rest, so a grid smaller than decode_splits() stays correct (only not
    # invariant)
    split_len = tl.maximum(split_tokens, tl.cdiv(tl.cdiv(seq_len - first_key, MAX_SPLITS), BLOCK_N) * BLOCK_N)
    lo = first_key + split * split_len
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
    Sinks,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    stride_sink,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:  # the sink's logit joins the softmax once, here: its value is 0
        sink = tl.load(Sinks + h * stride_sink)
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # empty splits (lse -inf) weigh 0
    parts = tl.load(
        PartOut + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - m)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


MAX_SPLITS = 32  # splits per sequence at most (the merge's fixed width)
SPLIT_TOKENS = 256  # keys per split at least
_INT32_MAX = 2**31 - 1


def check_window_sinks(window, sinks, q: torch.Tensor) -> int:
    """Validate the per-layer attention options of a kernel call with queries q [..., H, D].

    window: None or 0 (no window) or a positive int (keys in (p - window, p] for a query at p);
    sinks: None or a float32 tensor [H] on q's device (one learned logit per query head).
    Returns the window as an int (0 = none; clamped to 2**31 - 1, beyond any int32 length).
    Raises ValueError on a window that is not a non-negative int (bools included) or sinks of
    another dtype, shape or device.
    """
    if window is None:
        window = 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be a positive int, 0 or None, got {window!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32:
            raise ValueError(f"sinks must be a float32 tensor, got {getattr(sinks, 'dtype', type(sinks))}")
        if sinks.shape != (q.shape[-2],) or sinks.device != q.device:
            raise ValueError(
                f"sinks must be [H] = [{q.shape[-2]}] on {q.device}, got {tuple(sinks.shape)} on {sinks.device}"
            )
    return min(window, _INT32_MAX)


def decode_splits(max_seq_len: int, split_tokens: int = SPLIT_TOKENS, window: int | None = None) -> int:
    """The grid's splits per sequence that cover every sequence of up to `max_seq_len` tokens (the
    kernel cuts the A = min(L, window) attended keys of a sequence of L tokens into pieces of
    max(split_tokens, ceil(A / MAX_SPLITS)) keys rounded up to its key block); between 1 and
    MAX_SPLITS. Depends on the longest sequence (and the window) only: callers pass the page
    table's capacity so the grid, too, is the same for every batch. A grid computed without the
    window also serves a windowed layer (its extra splits are empty).
    Raises ValueError on split_tokens < 1 or a window that is not a positive int, 0 or None."""
    if split_tokens < 1:
        raise ValueError(f"split_tokens must be >= 1, got {split_tokens}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be a positive int, 0 or None, got {window!r}")
    if window:
        max_seq_len = min(max_seq_len, window)
    return int(max(1, min(MAX_SPLITS, math.ceil(max_seq_len / split_tokens))))


def decode_attention(
    q: torch.Tensor,
    k_cache,
    v_cache,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    page_size: int = 1,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    page_rows: torch.Tensor | None = None,
    split_tokens: int = SPLIT_TOKENS,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole context in the KV pool.

    q: [B, H, D] (the new tokens' queries, RoPE applied); k_cache / v_cache: [S, Hkv, D] with the
    new tokens' K/V already stored (tensors, or an int8 pool's kv_cache.QuantizedKV: de-quantized
    on load, data x the row's scale); page_table: [B, P] int32 page ids; seq_lens: [B] int32 tokens of
    context per sequence, new token included (0 = a padding row: its output is 0).
    H must be a multiple of Hkv; the last dimension of q and the caches must be contiguous. Returns out [B, H, D] in q's dtype (written into `out` if given).
    `num_splits` sets the grid (static for CUDA graph capture): `decode_splits(longest seq_len,
    split_tokens, window)` covers every row (a smaller grid folds the rest into its last split:
    correct, not batch-invariant); a runtime kernel argument, like `split_tokens` (keys per split at
    least) and `window`, so new values compile nothing. A row's output depends on its own q,
    context, split_tokens, window and sinks only.
    window (optional): a sliding window of W keys, the query (position L-1) attends keys
    L-W .. L-1 only (None or 0: the whole context). sinks (optional): float32 [H] learned logits,
    one per query head, added to each head's softmax as a column with no value (gpt-oss).
    Raises ValueError on mismatched shapes, num_splits / split_tokens < 1, a window that is not a
    positive int (or None / 0) and sinks that are not float32 [H] on q's device.
    """
    pool = pool_args(k_cache, v_cache)
    _check_decode_args(q, pool[0], pool[1], page_table, seq_lens, page_rows, num_splits, split_tokens)
    window = check_window_sinks(window, sinks, q)
    require_contiguous_heads(q=q, k_cache=pool[0], v_cache=pool[1])
    out = _out_like(q, out)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])
    part_out, part_lse = _split_pass(
        q, pool, page_table, page_rows, seq_lens, sm_scale, num_splits, split_tokens, window, page_size
    )
    merge_splits(part_out, part_lse, out, sinks, num_splits)
    return out


def _check_decode_args(
    q, k_cache, v_cache, page_table, seq_lens, page_rows, num_splits, split_tokens
) -> None:
    """Raises ValueError when q [B, H, D], the caches [S, Hkv, D], page_table / seq_lens (one row per
    query) or num_splits / split_tokens (>= 1) do not fit together."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or k_cache.shape[2] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit the KV cache {tuple(k_cache.shape)}")
    if (page_rows is None and page_table.shape[0] != batch) or seq_lens.shape[0] != batch:
        raise ValueError("page_table and seq_lens need one row per query")
    if num_splits < 1 or split_tokens < 1:
        raise ValueError(f"num_splits and split_tokens must be >= 1, got {num_splits} and {split_tokens}")


def _out_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out`, or a new tensor like q. Raises ValueError when `out` is not q's shape, dtype and device
    with a contiguous last dimension."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be like q {tuple(q.shape)} {q.dtype} with a contiguous last dimension")
    return out


def _split_pass(
    q, pool, page_table, page_rows, seq_lens, sm_scale, num_splits, split_tokens, window, page_size
):
    """First pass: each (sequence, KV head, split) program's partial output and log-sum-exp over its
    keys. Returns part_out float32 [B, H, num_splits, D] and part_lse float32 [B, H, num_splits]."""
    k_cache, v_cache, k_scale, v_scale, stride_kss, stride_vss, quant = pool
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
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
        window,
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
        QUANT=quant,
        HAS_ROWS=page_rows is not None,
        PRECISION=dot_precision(q.dtype),
        MAX_SPLITS=MAX_SPLITS,
        HAS_WINDOW=window > 0,
    )
    return part_out, part_lse


def merge_splits(part_out, part_lse, out, sinks, num_splits) -> None:
    """Second pass: merges each head's splits (and its sink, if any) into out [B, H, D] over a fixed
    MAX_SPLITS-wide vector, so the sum order does not depend on the batch. part_out [B, H, splits, D]
    and part_lse [B, H, splits] float32 (lse -inf: an empty split); sinks float32 [H] or None; out
    in any float dtype with a contiguous last dimension (also kernels/mla_attention.py's)."""
    batch, num_heads, _, head_dim = part_out.shape
    block_d = triton.next_power_of_2(head_dim)
    _decode_merge_kernel[(batch, num_heads)](
        part_out,
        part_lse,
        out,
        sinks if sinks is not None else part_lse,
        num_splits,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        sinks.stride(0) if sinks is not None else 0,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=max(MAX_SPLITS, triton.next_power_of_2(num_splits)),  # a fixed width: batch-invariant
        HAS_SINKS=sinks is not None,
    )


def gather_kv_ref(cache, page_table: torch.Tensor, b: int, length: int, page_size: int) -> torch.Tensor:
    """Torch reference of the paged addressing: [length, Hkv, D] K or V of sequence b (an int8
    pool's rows de-quantized to float32: kv_cache.gather_kv)."""
    from agentrt.runtime.kv_cache import gather_kv

    j = torch.arange(length, device=cache.device)
    slots = page_table[b, j // page_size].long() * page_size + j % page_size
    return gather_kv(cache, slots)


def softmax_with_sinks_ref(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of fp32 scores [H, ..., N] (-inf where not attended); with
    sinks (float32 [H]) one more logit per head joins it and its probability is dropped, as in
    transformers' GptOssAttention (eager): cat, subtract the max, softmax, drop the last column."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1)[..., :-1]


def decode_attention_ref(
    q,
    k_cache,
    v_cache,
    page_table,
    seq_lens,
    sm_scale=None,
    page_size: int = 1,
    page_rows=None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
):
    """Torch reference of `decode_attention` (fp32 math, one sequence at a time); same arguments,
    shapes and errors."""
    window = check_window_sinks(window, sinks, q)
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
        first = max(0, n - window) if window else 0
        k = gather_kv_ref(k_cache, page_table, b, n, page_size)[first:]
        v = gather_kv_ref(v_cache, page_table, b, n, page_size)[first:]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hn,nhd->hd", softmax_with_sinks_ref(scores, sinks), v).to(q.dtype)
    return out
