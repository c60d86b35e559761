"""Multi-head latent attention over the paged pool (DeepSeek V2 / V3, Kimi K2; layers/mla.py): the
absorbed form, every query head of a sequence against its one cached row per token [k_pe | c]
(rope + R features), the value being the row's last R features (the latent c).

Layout. The (new token i, head h) pairs of a sequence are folded into one row index r = i * H + h,
as FlashMLA folds its query tokens and heads into the rows of a tile; a program takes BLOCK_M of
these rows and loops over the sequence's keys in blocks of BLOCK_N. Each key block is loaded once
for all its rows and serves as K (the RoPE part against q_pe, the latent against the absorbed
q_latent: two dots, so that DeepSeek's 64 + 512 features are not padded to 1,024) and as V (the
same latent tile: SGLang's and vLLM's Triton MLA decode read the latent a second time through a V
view of the same buffer). A decode (one token per sequence) is the case i = 0: the rows are the
heads, H / BLOCK_M programs per sequence and split. The causal rule (or a speculative draft tree's
mask) is applied per row.

Split-K (flash-decoding, as kernels/decode_attention.py): the keys of a decoding sequence are cut
into splits by the same rule as decode_attention's, a function of the sequence's length only (at
least `split_tokens` keys, at most MAX_SPLITS splits), each writing a partial output and its
log-sum-exp that decode_attention.merge_splits merges over a fixed-width vector: a row's result
does not depend on the batch. With one split (extend chunks, short contexts) the program writes the
output itself, the same bits as merging that one split.

int8 pools (kv_cache.QuantizedKV): one scale per cached row, de-quantized on load.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from agentrt.runtime.kernels import dot_precision, require_contiguous_heads, upcast_dot
from agentrt.runtime.kernels.decode_attention import MAX_SPLITS, SPLIT_TOKENS, gather_kv_ref, merge_splits
from agentrt.runtime.kernels.paged import online_softmax_step


@triton.jit
def _mla_kernel(
    Q,
    K,
    KScale,
    Out,
    PartOut,
    PartLse,
    QStarts,
    QLens,
    PrefixLens,
    PageTable,
    PageRows,
    TreeMask,
    TreeOffsets,
    sm_scale,
    num_splits,
    split_tokens,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kss,
    stride_pt,
    stride_ot,
    stride_oh,
    stride_pot,
    stride_poh,
    stride_pos,
    stride_plt,
    stride_plh,
    NUM_HEADS: tl.constexpr,
    ROPE: tl.constexpr,
    RANK: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DECODE: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_TREE: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    QUANT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    mb = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # one new token per sequence, q row b; PrefixLens holds the context incl. that token
        q_start = b
        q_len = 1
        prefix = tl.load(PrefixLens + b) - 1
    else:
        q_start = tl.load(QStarts + b)
        q_len = tl.load(QLens + b)
        prefix = tl.load(PrefixLens + b)
    table_row = tl.load(PageRows + b).to(tl.int64) if HAS_ROWS else b

    # this program's rows: (new token tok, head) pairs, r = tok * NUM_HEADS + head
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len * NUM_HEADS
    tok = offs_m // NUM_HEADS
    head = offs_m % NUM_HEADS
    t_row = (q_start + tok).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_ROPE)
    offs_r = tl.arange(0, BLOCK_R)
    e_mask = offs_e < ROPE
    r_mask = offs_r < RANK
    q_rows = Q + t_row[:, None] * stride_qt + head[:, None] * stride_qh
    q_pe = tl.load(q_rows + offs_e[None, :], mask=m_mask[:, None] & e_mask[None, :], other=0.0)
    q_c = tl.load(q_rows + ROPE + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    if UPCAST:
        q_pe = q_pe.to(tl.float32)
        q_c = q_c.to(tl.float32)

    # keys [lo, hi) of this split (decode_attention's rule), then none past the block's last row
    seq_len = prefix + q_len
    split_len = tl.maximum(split_tokens, tl.cdiv(tl.cdiv(seq_len, MAX_SPLITS), BLOCK_N) * BLOCK_N)
    lo = split * split_len
    hi = tl.where(split == num_splits - 1, seq_len, tl.minimum(lo + split_len, seq_len))
    last_tok = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // NUM_HEADS, q_len - 1)
    hi = tl.minimum(hi, prefix + last_tok + 1)
    hi = tl.where(mb * BLOCK_M < q_len * NUM_HEADS, hi, 0)  # a block past this sequence's rows
    if HAS_TREE:
        tree_off = tl.load(TreeOffsets + b)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        page = tl.load(PageTable + table_row * stride_pt + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        k_rows = K + slot[:, None] * stride_ks
        k_pe = tl.load(k_rows + offs_e[None, :], mask=n_mask[:, None] & e_mask[None, :], other=0)
        c = tl.load(k_rows + ROPE + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0)
        if QUANT:  # one scale per row; de-quantized fp32, the dots' operands in q's dtype
            row_scale = tl.load(KScale + slot * stride_kss, mask=n_mask, other=0.0)[:, None]
            k_pe = (k_pe.to(tl.float32) * row_scale).to(q_c.dtype)
            c = (c.to(tl.float32) * row_scale).to(q_c.dtype)
        elif UPCAST:
            k_pe = k_pe.to(tl.float32)
            c = c.to(tl.float32)
        s = tl.dot(q_c, tl.trans(c), out_dtype=tl.float32, input_precision=PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), out_dtype=tl.float32, input_precision=PRECISION)
        s = s * sm_scale
        new_col = offs_n - prefix  # index among the new tokens (negative: a cached key)
        if HAS_TREE:
            in_new = (new_col[None, :] >= 0) & m_mask[:, None] & n_mask[None, :]
            tree = tl.load(
                TreeMask + tree_off + tok[:, None] * q_len + new_col[None, :], mask=in_new, other=0
            )
            allowed = (new_col[None, :] < 0) | (tree != 0)
        else:
            allowed = new_col[None, :] <= tok[:, None]
        s = tl.where(allowed & n_mask[None, :] & m_mask[:, None], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, c, PRECISION)  # V: the same latent tile

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT:
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        part = PartOut + t_row[:, None] * stride_pot + head[:, None] * stride_poh + split * stride_pos
        tl.store(part + offs_r[None, :], out, mask=o_mask)
        tl.store(PartLse + t_row * stride_plt + head * stride_plh + split, lse, mask=m_mask)
    else:
        o_rows = Out + t_row[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(o_rows + offs_r[None, :], out.to(Out.dtype.element_ty), mask=o_mask)


def mla_decode(
    q: torch.Tensor,
    k_cache,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    value_dim: int,
    sm_scale: float | None = None,
    num_splits: int = 1,
    page_rows: torch.Tensor | None = None,
    page_size: int = 1,
    split_tokens: int = SPLIT_TOKENS,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latent attention of one new token per sequence over its cached rows.

    q: [B, H, D] the absorbed queries [q_pe (RoPE applied) | q_latent], D = rope + value_dim;
    k_cache: [S, 1, D] rows [k_pe | c] with the new tokens' already stored (a tensor, or an int8
    pool's kv_cache.QuantizedKV, one scale per row); value_dim R: the latent's width, each row's
    last R features are its value; page_table [rows, P] int32 page ids (agentrt's pool: slots,
    page_size 1), page_rows [B] int32 its row per sequence (None: row b); seq_lens [B] int32 keys
    per sequence, the new token included (0: a padding row, its output 0). sm_scale: None = D **
    -0.5. num_splits: the grid's splits per sequence (decode_attention.decode_splits(longest) covers
    every row; the plan of a row depends on its own length only). Returns out [B, H, R] in q's dtype
    (written into `out` if given). Raises ValueError on shapes that do not fit, num_splits /
    split_tokens < 1 or a non-contiguous last dimension."""
    batch = q.shape[0]
    if seq_lens.shape[0] != batch or (page_rows is None and page_table.shape[0] != batch):
        raise ValueError("page_table and seq_lens need one row per query")
    if num_splits < 1 or split_tokens < 1:
        raise ValueError(f"num_splits and split_tokens must be >= 1, got {num_splits} and {split_tokens}")
    out = _checked_out(q, k_cache, value_dim, out)
    _launch(
        q, k_cache, out, None, None, seq_lens, page_table, page_rows, None, None, value_dim, sm_scale,
        page_size, 1, num_splits, split_tokens,
    )  # fmt: skip
    return out


def mla_extend(
    q: torch.Tensor,
    k_cache,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_q_len: int,
    value_dim: int,
    sm_scale: float | None = None,
    page_rows: torch.Tensor | None = None,
    page_size: int = 1,
    tree_mask: torch.Tensor | None = None,
    tree_offsets: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latent attention of the new tokens of B sequences laid out in one flat batch (prefill
    chunks, speculative verify chunks), causal among the new tokens.

    q: [T, H, D], k_cache and value_dim as `mla_decode`'s; sequence b's new tokens are rows
    [q_starts[b], q_starts[b] + q_lens[b]) at positions prefix_lens[b] + i (all [B] int32), their
    rows already in the pool; page_table / page_rows as mla_decode's, covering prefix + new tokens;
    max_q_len: at least the longest q_lens (sets the grid). tree_mask / tree_offsets (together or
    not at all): a flat uint8 [q_len, q_len] row-major block per sequence at tree_offsets[b] (int64),
    1 where new token i attends new token j, replacing the causal rule (every new token sees the
    whole prefix); lower triangular, as a draft tree's. Rows of q no sequence covers are left as
    they are in `out`. Returns out [T, H, R] in q's dtype. Raises ValueError as mla_decode, and
    when only one of tree_mask and tree_offsets is given."""
    if (tree_mask is None) != (tree_offsets is None):
        raise ValueError("tree_mask and tree_offsets go together")
    out = _checked_out(q, k_cache, value_dim, out)
    _launch(
        q, k_cache, out, q_starts, q_lens, prefix_lens, page_table, page_rows, tree_mask, tree_offsets,
        value_dim, sm_scale, page_size, max(1, max_q_len), 1, 1,
    )  # fmt: skip
    return out


def _pool(k_cache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data [S, 1, D], scale [S, 1] float32 or None) of a tensor or an int8 pool's QuantizedKV."""
    from agentrt.runtime.kv_cache import QuantizedKV

    if isinstance(k_cache, QuantizedKV):
        return k_cache.data, k_cache.scale
    return k_cache, None


def _checked_out(q: torch.Tensor, k_cache, value_dim: int, out: torch.Tensor | None) -> torch.Tensor:
    """`out` (or a new [T, H, value_dim] tensor in q's dtype) after checking that q [T, H, D] fits
    the cache [S, 1, D] and 0 < value_dim < D. Raises ValueError otherwise."""
    data, _ = _pool(k_cache)
    dim = q.shape[-1]
    if q.dim() != 3 or data.dim() != 3 or data.shape[1] != 1 or data.shape[2] != dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit the latent cache {tuple(data.shape)} ([S, 1, D])")
    if not 0 < value_dim < dim:
        raise ValueError(f"value_dim must be in (0, {dim}): the rows hold a RoPE key, got {value_dim}")
    require_contiguous_heads(q=q, k_cache=data)
    shape = (*q.shape[:2], value_dim)
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if tuple(out.shape) != shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {shape} {q.dtype} on {q.device} with a contiguous last dimension")
    return out


def _launch(
    q, k_cache, out, q_starts, q_lens, lens, page_table, page_rows, tree_mask, tree_offsets, value_dim,
    sm_scale, page_size, max_q_len, num_splits, split_tokens,
) -> None:  # fmt: skip
    """One program per (sequence, BLOCK_M rows of its max_q_len x H folded rows, split); with more
    than one split, the partial outputs [T, H, splits, R] float32 are merged into `out` after.
    q_starts None: a decode batch (`lens` = seq_lens); else an extend batch (`lens` = prefix_lens)."""
    data, scale = _pool(k_cache)
    tokens, num_heads, dim = q.shape
    rope = dim - value_dim
    block_r = max(16, triton.next_power_of_2(value_dim))  # tl.dot needs 16 at least on a GPU
    block_m = 32
    split = num_splits > 1
    part_out = part_lse = out  # placeholders, unread without SPLIT
    if split:
        part_out = torch.empty(tokens, num_heads, num_splits, value_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    decode = q_starts is None
    grid = (lens.shape[0], triton.cdiv(max_q_len * num_heads, block_m), num_splits)
    _mla_kernel[grid](
        q,
        data,
        scale if scale is not None else data,
        out,
        part_out,
        part_lse,
        lens if decode else q_starts,
        lens if decode else q_lens,
        lens,
        page_table,
        page_rows if page_rows is not None else lens,
        tree_mask if tree_mask is not None else lens,
        tree_offsets if tree_offsets is not None else lens,
        sm_scale if sm_scale is not None else 1.0 / math.sqrt(dim),
        num_splits,
        split_tokens,
        q.stride(0),
        q.stride(1),
        data.stride(0),
        scale.stride(0) if scale is not None else 0,
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2) if split else 0,
        part_lse.stride(0),
        part_lse.stride(1),
        NUM_HEADS=num_heads,
        ROPE=rope,
        RANK=value_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=32 if block_r >= 256 else 64,
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope)),
        BLOCK_R=block_r,
        DECODE=decode,
        SPLIT=split,
        HAS_TREE=tree_mask is not None,
        HAS_ROWS=page_rows is not None,
        QUANT=scale is not None,
        UPCAST=upcast_dot(q.dtype),
        PRECISION=dot_precision(q.dtype),
        MAX_SPLITS=MAX_SPLITS,
        num_warps=8 if block_r >= 256 else 4,
    )
    if split:
        merge_splits(part_out, part_lse, out, None, num_splits)


def mla_attention_ref(
    q,
    k_cache,
    q_starts,
    q_lens,
    prefix_lens,
    page_table,
    value_dim: int,
    sm_scale=None,
    page_size: int = 1,
    page_rows=None,
    tree_masks: list | None = None,
):
    """Torch reference of `mla_extend` (and of `mla_decode`: q_starts = arange(B), q_lens = 1,
    prefix_lens = seq_lens - 1), fp32 math one sequence at a time: the rows [k_pe | c] gathered
    (an int8 pool's de-quantized), scores q . row, values the rows' last value_dim features.
    tree_masks: per sequence a [n, n] bool tensor or None (causal). Returns [T, H, value_dim] in q's
    dtype, zeros for rows no sequence covers."""
    if page_rows is not None:
        page_table = page_table[page_rows.long()]
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros(*q.shape[:2], value_dim, dtype=q.dtype, device=q.device)
    for b in range(q_lens.shape[0]):
        s, n, p = int(q_starts[b]), int(q_lens[b]), int(prefix_lens[b])
        if n == 0 or p + n == 0:
            continue
        rows = gather_kv_ref(k_cache, page_table, b, p + n, page_size)[:, 0].float()  # [p + n, D]
        allowed = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
        tree = tree_masks[b] if tree_masks is not None else None
        allowed[:, p:] = (
            tree if tree is not None else torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        )
        scores = torch.einsum("thd,nd->htn", q[s : s + n].float(), rows) * sm_scale
        probs = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
        out[s : s + n] = torch.einsum("htn,nr->thr", probs, rows[:, -value_dim:]).to(q.dtype)
    return out
