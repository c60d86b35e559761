"""Triton kernels vs their torch references (CPU: TRITON_INTERPRET=1, set in conftest; on a GPU
the same tests run the compiled kernels). Random shapes with odd lengths, GQA ratios 1/4/8,
page sizes that put sequence ends on and off page boundaries, and split-K."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.kernels import triton_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_usable(DEVICE), reason="triton is not installed")


def paged_pool(
    lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    gen: torch.Generator,
    dtype=torch.float32,
):
    """A KV pool with random contents (no zeros) and a shuffled page table covering `lens`."""
    pages = max(1, max((n + page_size - 1) // page_size for n in lens))
    num_pages = len(lens) * pages + 3
    k = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_pages * page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    table = (
        torch.randperm(num_pages, generator=gen)[: len(lens) * pages].view(len(lens), pages).to(torch.int32)
    )
    return k.to(DEVICE), v.to(DEVICE), table.to(DEVICE)


DECODE_CASES = [  # (batch, kv_heads, group, head_dim, page_size, num_splits, max_len, split_tokens)
    (1, 4, 1, 64, 1, 1, 37, 256),
    (3, 2, 4, 64, 1, 3, 130, 1),  # splits of one key block (64): 3 for the longest
    (5, 1, 8, 32, 16, 2, 97, 1),
    (4, 2, 8, 40, 4, 4, 65, 1),  # head_dim not a power of two; a grid wider than needed
    (2, 8, 1, 128, 16, 5, 33, 1),  # more splits than some sequences have blocks
    (3, 2, 4, 64, 1, 1, 130, 1),  # a grid narrower than needed: the last split takes the rest
]


@pytest.mark.parametrize(
    "batch,kv_heads,group,head_dim,page_size,num_splits,max_len,split_tokens", DECODE_CASES
)
def test_decode_attention_matches_reference(
    batch, kv_heads, group, head_dim, page_size, num_splits, max_len, split_tokens
):
    from agentrt.runtime.kernels.decode_attention import decode_attention, decode_attention_ref

    gen = torch.Generator().manual_seed(batch * 100 + group)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[0] = max_len  # one sequence at the maximum
    if page_size > 1 and batch > 1:
        lens[1] = page_size * 2  # ends exactly on a page boundary
    k, v, table = paged_pool(lens, kv_heads, head_dim, page_size, gen)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    rows = None
    if batch % 2:  # a persistent table: sequences sit in shuffled rows of a taller table
        rows = torch.randperm(batch, generator=gen).to(torch.int32).to(DEVICE)
        table = table[torch.argsort(rows.long())].contiguous()
        table = torch.cat([table, table[:1]])  # one row more than the batch
    out = decode_attention(
        q,
        k,
        v,
        table,
        seq_lens,
        page_size=page_size,
        num_splits=num_splits,
        page_rows=rows,
        split_tokens=split_tokens,
    )
    ref = decode_attention_ref(q, k, v, table, seq_lens, page_size=page_size, page_rows=rows)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_decode_attention_padding_rows_and_bf16():
    """seq_len 0 (a CUDA-graph padding row) gives zeros, not NaN; bf16 within bf16 tolerance."""
    from agentrt.runtime.kernels.decode_attention import decode_attention, decode_attention_ref

    gen = torch.Generator().manual_seed(7)
    lens = [0, 45, 1]
    k, v, table = paged_pool(lens, 2, 64, 1, gen, dtype=torch.bfloat16)
    q = torch.randn(3, 8, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k, v, table, seq_lens, num_splits=3)
    assert torch.equal(out[0].float(), torch.zeros(8, 64, device=DEVICE))
    ref = decode_attention_ref(q, k, v, table, seq_lens)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_decode_attention_rows_do_not_depend_on_the_batch():
    """A row's output is bitwise the same alone (its own grid) and among other sequences of other
    lengths (their grid, or the widest one): its splits follow its own length only, the merge has
    a fixed width. Split sizes of one key block so the rows take several splits."""
    from agentrt.runtime.kernels.decode_attention import MAX_SPLITS, decode_attention, decode_splits

    gen = torch.Generator().manual_seed(11)
    lens = [150, 7, 301, 64, 2100]  # 2100 tokens: more than MAX_SPLITS blocks of 64, longer splits
    k, v, table = paged_pool(lens, 2, 64, 1, gen)
    q = torch.randn(len(lens), 8, 64, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    batched = decode_attention(
        q, k, v, table, seq_lens, num_splits=decode_splits(max(lens), 1), split_tokens=1
    )
    wide = decode_attention(q, k, v, table, seq_lens, num_splits=MAX_SPLITS, split_tokens=1)
    assert torch.equal(batched, wide)
    for i, n in enumerate(lens):
        alone = decode_attention(
            q[i : i + 1],
            k,
            v,
            table[i : i + 1],
            seq_lens[i : i + 1],
            num_splits=decode_splits(n, 1),
            split_tokens=1,
        )
        assert torch.equal(alone[0], batched[i]), (i, n)


EXTEND_CASES = [  # (batch, kv_heads, group, head_dim, page_size, max_new, max_prefix)
    (1, 4, 1, 64, 1, 33, 0),  # plain prefill, one block and a bit
    (3, 2, 4, 64, 1, 19, 41),
    (2, 1, 8, 32, 16, 40, 50),
    (4, 2, 8, 40, 4, 7, 17),
]


@pytest.mark.parametrize("batch,kv_heads,group,head_dim,page_size,max_new,max_prefix", EXTEND_CASES)
@pytest.mark.parametrize("tree", [False, True])
def test_extend_attention_matches_reference(
    batch, kv_heads, group, head_dim, page_size, max_new, max_prefix, tree
):
    from agentrt.runtime.kernels.extend_attention import extend_attention, extend_attention_ref

    gen = torch.Generator().manual_seed(batch * 10 + group + tree)
    q_lens = torch.randint(1, max_new + 1, (batch,), generator=gen)
    q_lens[0] = max_new
    prefix = torch.randint(0, max_prefix + 1, (batch,), generator=gen)
    if page_size > 1:
        prefix[0] = page_size  # new tokens start exactly on a page boundary
    lens = (q_lens + prefix).tolist()
    k, v, table = paged_pool(lens, kv_heads, head_dim, page_size, gen)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)[:-1]]) + 1  # row 0 unused
    num_rows = int(q_lens.sum()) + 2
    q = torch.randn(num_rows, kv_heads * group, head_dim, generator=gen).to(DEVICE)
    masks = flat = offsets = None
    if tree:  # random draft trees: each node sees itself and a random subset of earlier nodes
        masks, parts, offs, acc = [], [], [], 0
        for n in q_lens.tolist():
            m = (torch.rand(n, n, generator=gen) < 0.5).tril()
            m.fill_diagonal_(True)
            masks.append(m.to(DEVICE))
            parts.append(m.flatten().to(torch.uint8))
            offs.append(acc)
            acc += n * n
        flat = torch.cat(parts).to(DEVICE)
        offsets = torch.tensor(offs, dtype=torch.int64, device=DEVICE)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    rows = None
    if batch % 2:  # a persistent table with shuffled rows
        rows = torch.randperm(batch, generator=gen).to(**i32)
        table = table[torch.argsort(rows.long())].contiguous()
    args = (q, k, v, starts.to(**i32), q_lens.to(**i32), prefix.to(**i32), table)
    out = torch.full_like(q, 7.0)
    extend_attention(
        *args,
        int(q_lens.max()),
        page_size=page_size,
        tree_mask=flat,
        tree_offsets=offsets,
        out=out,
        page_rows=rows,
    )
    ref = extend_attention_ref(*args, page_size=page_size, tree_masks=masks, page_rows=rows)
    torch.testing.assert_close(out[1:-1], ref[1:-1], atol=2e-5, rtol=1e-4)
    assert (out[0] == 7.0).all() and (out[-1] == 7.0).all()  # rows of no sequence stay untouched


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (8, 2, 40), (16, 2, 32)])
def test_rope_and_store_matches_reference(num_heads, num_kv_heads, head_dim):
    from agentrt.runtime.kernels.rope_store import rope_and_store, rope_and_store_ref

    gen = torch.Generator().manual_seed(num_heads)
    t = 11
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (
        q.view(t, num_heads, head_dim),
        k.view(t, num_kv_heads, head_dim),
        v.view(t, num_kv_heads, head_dim),
    )
    freqs = torch.outer(torch.arange(64.0), torch.rand(head_dim // 2, generator=gen)).to(DEVICE)
    positions = torch.randint(0, 64, (t,), generator=gen).to(DEVICE)
    slots = torch.randperm(30, generator=gen)[:t].to(DEVICE)
    slots[3] = -1  # a padding row: nothing stored
    caches = [torch.randn(30, num_kv_heads, head_dim, generator=gen).to(DEVICE) for _ in range(2)]
    caches += [c.clone() for c in caches]
    out = rope_and_store(q, k, v, freqs.cos(), freqs.sin(), positions, slots, caches[0], caches[1])
    ref = rope_and_store_ref(q, k, v, freqs.cos(), freqs.sin(), positions, slots, caches[2], caches[3])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[0], caches[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1], caches[3])


PARTIAL_ROPE_CASES = [  # (num_heads, num_kv_heads, head_dim, rotary_dim)
    (8, 2, 64, 32),  # Phi-3 style: half the head rotated, GQA 4
    (6, 2, 128, 96),  # Phi-4-mini: rotary_dim // 2 = 48 and 32 pass-through features
    (4, 1, 40, 10),  # odd rotary half (5), 30 pass-through features, GQA 4
    (4, 4, 64, 64),  # full rotary through the same test
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,rotary_dim", PARTIAL_ROPE_CASES)
def test_rope_and_store_partial_rotary(num_heads, num_kv_heads, head_dim, rotary_dim, dtype):
    """Partial rotary (cos/sin tables [max_positions, rotary_dim // 2]): the first rotary_dim features of
    q and k rotated as the reference and attention.apply_rope (transformers' Phi-3) rotate them, the
    rest of q, k and all of v copied bit for bit; padding rows store nothing."""
    from agentrt.runtime.kernels.rope_store import rope_and_store, rope_and_store_ref
    from agentrt.runtime.layers.rotary import apply_rope

    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    t = 9
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(t, sum(sizes), generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split(sizes, dim=-1)  # views of a fused projection: strided rows
    q, k, v = (
        q.view(t, num_heads, head_dim),
        k.view(t, num_kv_heads, head_dim),
        v.view(t, num_kv_heads, head_dim),
    )
    freqs = torch.outer(torch.arange(80.0), torch.rand(rotary_dim // 2, generator=gen)).to(DEVICE)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.randint(0, 80, (t,), generator=gen).to(DEVICE)
    slots = torch.randperm(20, generator=gen)[:t].to(DEVICE)
    slots[4] = -1
    caches = [torch.randn(20, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]
    caches += [c.clone() for c in caches]
    before = caches[0].clone()
    out = rope_and_store(q, k, v, cos, sin, positions, slots, caches[0], caches[1])
    ref = rope_and_store_ref(q, k, v, cos, sin, positions, slots, caches[2], caches[3])
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(caches[0].float(), caches[2].float(), **tol)
    assert torch.equal(caches[1], caches[3])

    keep = slots >= 0
    stored = slots[keep]
    assert torch.equal(out[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(caches[0][stored][..., rotary_dim:], k[keep][..., rotary_dim:])
    assert torch.equal(caches[1][stored], v[keep])
    untouched = torch.ones(20, dtype=torch.bool, device=DEVICE)
    untouched[stored] = False
    assert torch.equal(caches[0][untouched], before[untouched])

    c, s = cos[positions], sin[positions]
    torch.testing.assert_close(out.float(), apply_rope(q.float(), c, s), **tol)
    torch.testing.assert_close(caches[0][stored].float(), apply_rope(k.float(), c, s)[keep], **tol)
    if dtype == torch.float32 and DEVICE.type == "cpu":
        # the interpreter rounds each op as torch does: the kernel is the reference bit for bit
        assert torch.equal(out, ref) and torch.equal(caches[0], caches[2])


def test_rope_and_store_rejects_bad_rotary_dims():
    from agentrt.runtime.kernels.rope_store import rope_and_store, rope_and_store_ref

    q, k, v = torch.zeros(2, 4, 32), torch.zeros(2, 2, 32), torch.zeros(2, 2, 32)
    caches = (torch.zeros(4, 2, 32), torch.zeros(4, 2, 32))
    pos = slots = torch.zeros(2, dtype=torch.int64)
    bad = [
        (torch.zeros(8, 17), torch.zeros(8, 17)),  # rotary_dim 34 > head_dim 32
        (torch.zeros(8, 0), torch.zeros(8, 0)),  # rotary_dim 0
        (torch.zeros(8, 8), torch.zeros(8, 4)),  # cos and sin disagree
    ]
    for cos, sin in bad:
        for fn in (rope_and_store, rope_and_store_ref):
            args = [x.to(DEVICE) for x in (q, k, v, cos, sin, pos, slots, *caches)]
            with pytest.raises(ValueError, match="rope_and_store"):
                fn(*args)


@pytest.mark.parametrize("vocab", [1000, 49152, 4097])
def test_apply_token_bitmask_matches_reference_and_xgrammar(vocab):
    from agentrt.runtime.kernels.bitmask import apply_token_bitmask, apply_token_bitmask_ref

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    rows = torch.tensor([0, 3, 4], dtype=torch.int32)
    ours, ref = logits.clone().to(DEVICE), logits.clone()
    apply_token_bitmask(ours, bitmask.to(DEVICE), rows.to(DEVICE))
    apply_token_bitmask_ref(ref, bitmask, rows)
    assert torch.equal(ours.cpu(), ref)
    assert torch.isneginf(ref[0]).any() and not torch.isneginf(ref[1]).any()
    try:  # the layout is xgrammar's: its own apply agrees (xgrammar is absent on bare GPU images)
        import xgrammar as xgr
    except ImportError:
        return
    lib = logits.clone()
    xgr.apply_token_bitmask_inplace(lib, bitmask, indices=rows.tolist())
    assert torch.equal(ref, lib)


def test_kernels_reject_mismatched_shapes():
    from agentrt.runtime.kernels.bitmask import apply_token_bitmask
    from agentrt.runtime.kernels.decode_attention import decode_attention

    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(
            torch.zeros(1, 6, 64),
            torch.zeros(4, 4, 64),
            torch.zeros(4, 4, 64),
            torch.zeros(1, 4, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="does not cover"):
        apply_token_bitmask(torch.zeros(2, 100), torch.zeros(2, 3, dtype=torch.int32))


def test_extend_attention_bf16_and_fused_rope_bf16():
    """bf16 pool and activations (the CUDA dtype) within bf16 tolerance of the fp32 references."""
    from agentrt.runtime.kernels.extend_attention import extend_attention, extend_attention_ref
    from agentrt.runtime.kernels.rope_store import rope_and_store, rope_and_store_ref

    gen = torch.Generator().manual_seed(11)
    lens = [23 + 9, 40 + 1]
    k, v, table = paged_pool(lens, 2, 64, 1, gen, dtype=torch.bfloat16)
    q = torch.randn(49, 8, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    args = (
        q,
        k,
        v,
        torch.tensor([0, 9], **i32),
        torch.tensor([9, 40], **i32),
        torch.tensor([23, 1], **i32),
        table,
    )
    out = extend_attention(*args, 40)
    ref = extend_attention_ref(*(a.float() if a.dtype == torch.bfloat16 else a for a in args))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)

    t = 5
    x = torch.randn(t, 12, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    freqs = torch.outer(torch.arange(16.0), torch.rand(32, generator=gen)).to(DEVICE)
    pos = torch.tensor([0, 3, 7, 8, 15], device=DEVICE)
    slots = torch.tensor([4, 0, 2, 9, 6], device=DEVICE)
    caches = [torch.zeros(10, 2, 64, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    qo = rope_and_store(
        x[:, :8], x[:, 8:10], x[:, 10:], freqs.cos(), freqs.sin(), pos, slots, caches[0], caches[1]
    )
    qr = rope_and_store_ref(
        x[:, :8], x[:, 8:10], x[:, 10:], freqs.cos(), freqs.sin(), pos, slots, caches[2], caches[3]
    )
    torch.testing.assert_close(qo.float(), qr.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(caches[0].float(), caches[2].float(), atol=1e-2, rtol=1e-2)


def interpreter_dot_is_row_invariant(block_m: int, block_k: int, block_n: int) -> bool:
    """Whether a row's product is the same bits at every row of a tile in the Triton interpreter,
    whose tl.dot is numpy's matmul (the BLAS numpy was built with): OpenBLAS's AVX2 sgemm kernel
    (Haswell, Zen) sums a row in another order by its position in the micro-tile, its AVX-512
    kernel does not. On a GPU the kernels run compiled: True."""
    if DEVICE.type == "cuda":
        return True
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((block_m, block_k)).astype(np.float32)
    b = rng.standard_normal((block_k, block_n)).astype(np.float32)
    full, alone = np.matmul(a, b), np.zeros_like(a)
    for r in range(block_m):
        alone[0] = a[r]
        if not np.array_equal(np.matmul(alone, b)[0], full[r]):
            return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_matmul_and_rms_norm(dtype):
    """The batch-invariant matmul (odd M, N, K; with and without bias) and RMSNorm (rows longer than
    one step) match their references, and a row's output is bitwise the same alone and among 4,
    70 or 130 rows (a tile holds 64). The matmul's bits are the kernel's promise where tl.dot is
    row-invariant (a GPU; the interpreter over an AVX-512 BLAS); over an AVX2 BLAS the interpreter's
    tl.dot itself rounds a row by its place in the tile, so there rows agree to 1e-6 (the same
    arithmetic, summed in another order), and RMSNorm, which has no tl.dot, stays bitwise."""
    from agentrt.runtime.kernels import batch_invariant as bi

    same = torch.equal
    if not interpreter_dot_is_row_invariant(bi.BLOCK_M, bi.BLOCK_K, bi.BLOCK_N):

        def same(a, b):
            torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=1e-6)
            return True

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(130, 100, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(75, 100, generator=gen) / 10).to(dtype).to(DEVICE)
    bias = torch.randn(75, generator=gen).to(dtype).to(DEVICE)
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    for b in (None, bias):
        full = bi.matmul(x, w, b)
        torch.testing.assert_close(full.float(), bi.matmul_ref(x, w, b).float(), **tol)
        for rows in (1, 4, 70):
            assert same(bi.matmul(x[:rows], w, b), full[:rows]), rows
        assert same(bi.matmul(x[99:100], w, b), full[99:100])
    h = torch.randn(130, 1500, generator=gen).to(dtype).to(DEVICE)
    g = (1 + torch.randn(1500, generator=gen) / 10).to(dtype).to(DEVICE)
    normed = bi.rms_norm(h, g, 1e-6)
    torch.testing.assert_close(normed.float(), bi.rms_norm_ref(h, g, 1e-6).float(), **tol)
    for rows in (1, 4, 70):
        assert torch.equal(bi.rms_norm(h[:rows], g, 1e-6), normed[:rows]), rows
    assert torch.equal(bi.rms_norm(h.view(2, 65, 1500), g, 1e-6).view(130, 1500), normed)
    with pytest.raises(ValueError, match="does not fit"):
        bi.matmul(x, w[:, :99])
    with pytest.raises(ValueError, match="does not fit"):
        bi.rms_norm(h, g[:10], 1e-6)


def test_batch_invariant_kernels_take_strided_operands_and_refuse_bad_ones():
    """A strided bias or norm weight is read as what it is (not as contiguous memory); mixed or
    integer dtypes, a 0-d or empty row and a decode `out` unlike q are ValueErrors."""
    from agentrt.runtime.kernels import batch_invariant as bi
    from agentrt.runtime.kernels.decode_attention import decode_attention, decode_splits

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 8, generator=gen).to(DEVICE)
    w = torch.randn(4, 8, generator=gen).to(DEVICE)
    bias = torch.arange(8.0, device=DEVICE)[::2]  # stride 2
    torch.testing.assert_close(bi.matmul(x, w, bias), bi.matmul_ref(x, w, bias))
    g = torch.arange(1.0, 17.0, device=DEVICE)[::2]
    h = torch.randn(5, 8, generator=gen).to(DEVICE)
    torch.testing.assert_close(bi.rms_norm(h, g, 1e-6), bi.rms_norm_ref(h, g, 1e-6))
    mixed = bi.rms_norm(h.to(torch.bfloat16), g, 1e-6)  # as RMSNorm: the promoted dtype
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, bi.rms_norm_ref(h.to(torch.bfloat16), g, 1e-6), atol=3e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="one floating dtype"):
        bi.matmul(x, w, bias.double())
    with pytest.raises(ValueError, match="one floating dtype"):
        bi.matmul(x.int(), w.int())
    for bad in (torch.tensor(1.0), torch.zeros(3, 0)):
        with pytest.raises(ValueError, match="no rows"):
            bi.rms_norm(bad.to(DEVICE), torch.ones(0, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="split_tokens must be >= 1"):
        decode_splits(700, 0)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    k, v, table = paged_pool([5, 9], 2, 16, 1, gen)
    with pytest.raises(ValueError, match="out must be like q"):
        decode_attention(q, k, v, table, torch.tensor([5, 9], dtype=torch.int32, device=DEVICE), out=q[:1])
