"""The latent-attention kernels (kernels/mla_attention.py) against their torch reference (CPU:
TRITON_INTERPRET=1, set in conftest; on a GPU the compiled kernels), and a MultiHeadLatentAttention
layer run through the Triton backend's metadata against the same layer through the torch backend's
(the path test_mla holds to transformers), so that a slip shared by a kernel and its reference cannot
pass.

Shapes: DeepSeek V3's cached row (RoPE key 64 + latent 512) with 16 and 128 heads, the tiny
family's (8 + 32: the RoPE part padded to the 16 a GPU dot needs), a rank and a head count that are
not powers of two; contexts that are not a multiple of the key block, split-K with one and several
splits, a padding row, page sizes 1 and 4, an int8 pool; extend chunks over a prefix and draft trees.
Tolerances: float32 inputs 1e-5 (measured up to 3.2e-6); bfloat16 inputs 2e-2 absolute and relative
(measured: one bf16 ulp of the output at most, 0.0156 where |out| is in [2, 4); the interpreter
upcasts the dots to float32, a GPU's bf16 P x V product adds ~0.4% relative).
"""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.kernels import triton_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_usable(DEVICE), reason="triton is not installed")
F32, BF16 = torch.float32, torch.bfloat16


def latent_pool(lens: list[int], dim: int, page_size: int, gen: torch.Generator, dtype=F32):
    """Rows [S, 1, dim] with random contents and a shuffled page table [B, pages] int32 covering lens."""
    pages = max(1, max((n + page_size - 1) // page_size for n in lens))
    num_pages = len(lens) * pages + 3
    rows = torch.randn(num_pages * page_size, 1, dim, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen)[: len(lens) * pages]
    return rows.to(DEVICE), order.view(len(lens), pages).to(torch.int32).to(DEVICE)


def tolerance(dtype) -> dict:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == F32 else {"atol": 2e-2, "rtol": 2e-2}


def decode_ref(q, rows, table, seq_lens, rank, page_size=1, page_rows=None):
    from agentrt.runtime.kernels.mla_attention import mla_attention_ref

    b = q.shape[0]
    ones = torch.ones(b, dtype=torch.int32, device=DEVICE)
    starts = torch.arange(b, dtype=torch.int32, device=DEVICE)
    return mla_attention_ref(q, rows, starts, ones, seq_lens - 1, table, rank, 0.1, page_size, page_rows)


DECODE_CASES = [  # (batch, heads, rope, rank, page_size, max_len, split_tokens, dtype)
    (3, 16, 64, 512, 1, 97, 32, BF16),  # DeepSeek V3's row; 97 keys: 3 blocks of 32 and one key
    (1, 128, 64, 512, 1, 70, 256, BF16),  # 128 heads: 4 blocks of 32 rows, one split
    (4, 4, 8, 32, 4, 130, 1, F32),  # the tiny family's row, paged; splits of one 64-key block
    (2, 24, 16, 48, 1, 45, 16, F32),  # heads and rank not powers of two
]


@pytest.mark.parametrize("batch,heads,rope,rank,page_size,max_len,split_tokens,dtype", DECODE_CASES)
def test_decode_matches_reference(batch, heads, rope, rank, page_size, max_len, split_tokens, dtype):
    from agentrt.runtime.kernels.decode_attention import decode_splits
    from agentrt.runtime.kernels.mla_attention import mla_decode

    gen = torch.Generator().manual_seed(heads + rank)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[0] = max_len
    rows, table = latent_pool(lens, rope + rank, page_size, gen, dtype)
    q = torch.randn(batch, heads, rope + rank, generator=gen).to(dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    splits = decode_splits(max_len, split_tokens)
    got = mla_decode(
        q, rows, table, seq_lens, rank, 0.1, splits, page_size=page_size, split_tokens=split_tokens
    )
    assert got.shape == (batch, heads, rank) and got.dtype == dtype
    torch.testing.assert_close(got, decode_ref(q, rows, table, seq_lens, rank, page_size), **tolerance(dtype))


def test_decode_padding_rows_page_rows_and_an_int8_pool():
    """seq_len 0 (a CUDA-graph padding row) gives zeros; page_rows pick the table's rows; an int8
    pool (one scale per row) is read de-quantized, as the reference reads it."""
    from agentrt.runtime.kernels.mla_attention import mla_decode
    from agentrt.runtime.kv_cache import QuantizedKV, quantize_kv

    gen = torch.Generator().manual_seed(5)
    lens = [0, 77, 1, 130]
    rows, table = latent_pool(lens, 8 + 32, 1, gen)
    data, scale = quantize_kv(rows)
    pool = QuantizedKV(data, scale)
    q = torch.randn(4, 4, 40, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    page_rows = torch.tensor([3, 1, 2, 0], dtype=torch.int32, device=DEVICE)
    table = table[page_rows.long().argsort()]  # row page_rows[b] holds sequence b's pages
    for cache in (rows, pool):
        got = mla_decode(q, cache, table, seq_lens, 32, 0.1, 3, page_rows=page_rows, split_tokens=32)
        assert torch.equal(got[0], torch.zeros(4, 32, device=DEVICE))
        want = decode_ref(q, cache, table, seq_lens, 32, page_rows=page_rows)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_rows_do_not_depend_on_the_batch():
    """A row's output is bitwise the same alone (its own grid: one split writes the output itself)
    and among sequences of other lengths (their grid, or the widest: the partial outputs merged),
    as decode_attention's: its splits follow its own length only."""
    from agentrt.runtime.kernels.decode_attention import MAX_SPLITS, decode_splits
    from agentrt.runtime.kernels.mla_attention import mla_decode

    gen = torch.Generator().manual_seed(11)
    lens = [150, 7, 301, 700]  # splits of one 64-key block: 3, 1 (written directly), 5 and 11
    rows, table = latent_pool(lens, 8 + 32, 1, gen)
    q = torch.randn(len(lens), 8, 40, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)

    def decode(rows_of, num_splits):
        return mla_decode(
            q[rows_of], rows, table[rows_of], seq_lens[rows_of], 32, 0.1, num_splits, split_tokens=64
        )

    batched = decode(slice(None), decode_splits(max(lens), 64))
    assert torch.equal(batched, decode(slice(None), MAX_SPLITS))
    for i, n in enumerate(lens):
        assert torch.equal(decode(slice(i, i + 1), decode_splits(n, 64))[0], batched[i]), (i, n)
    torch.testing.assert_close(batched, decode_ref(q, rows, table, seq_lens, 32), atol=1e-5, rtol=1e-5)


EXTEND_CASES = [  # (heads, rope, rank, q_lens, prefix_lens, page_size, dtype)
    (16, 16, 64, [5, 1, 17, 9], [0, 30, 12, 3], 1, F32),  # a chunk's rows cross the 32-row blocks
    (4, 8, 32, [40, 3], [0, 61], 4, F32),  # the tiny family: 8 tokens per block of rows; paged
    (128, 64, 512, [3], [20], 1, BF16),  # DeepSeek V3's shape, a short verify-like chunk
]


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("heads,rope,rank,q_lens,prefix_lens,page_size,dtype", EXTEND_CASES)
def test_extend_matches_reference(heads, rope, rank, q_lens, prefix_lens, page_size, dtype, tree):
    from agentrt.runtime.kernels.mla_attention import mla_attention_ref, mla_extend

    gen = torch.Generator().manual_seed(heads + sum(q_lens))
    totals = [n + p for n, p in zip(q_lens, prefix_lens)]
    rows, table = latent_pool(totals, rope + rank, page_size, gen, dtype)
    q = torch.randn(sum(q_lens) + 2, heads, rope + rank, generator=gen).to(dtype).to(DEVICE)  # 2 spare rows
    i32 = {"dtype": torch.int32, "device": DEVICE}
    starts = torch.tensor([sum(q_lens[:b]) for b in range(len(q_lens))], **i32)
    lens, prefixes = torch.tensor(q_lens, **i32), torch.tensor(prefix_lens, **i32)
    masks, flat, offsets = None, None, None
    if tree:  # random lower-triangular trees, each node seeing itself
        masks = [
            (torch.rand(n, n, generator=gen) < 0.5).tril() | torch.eye(n, dtype=torch.bool) for n in q_lens
        ]
        masks = [m.to(DEVICE) for m in masks]
        flat = torch.cat([m.reshape(-1) for m in masks]).to(torch.uint8)
        offsets = torch.tensor([sum(n * n for n in q_lens[:b]) for b in range(len(q_lens))], device=DEVICE)
    out = torch.full((q.shape[0], heads, rank), 7.0, dtype=dtype, device=DEVICE)
    got = mla_extend(
        q, rows, starts, lens, prefixes, table, max(q_lens), rank, 0.1, page_size=page_size,
        tree_mask=flat, tree_offsets=offsets, out=out,
    )  # fmt: skip
    want = mla_attention_ref(q, rows, starts, lens, prefixes, table, rank, 0.1, page_size, tree_masks=masks)
    n = sum(q_lens)
    torch.testing.assert_close(got[:n], want[:n], **tolerance(dtype))
    assert (got[n:] == 7.0).all()  # rows no sequence covers are left as they were


def test_rope_and_store_without_v_in_blocks_of_heads():
    """The latent rows stored without a V (float and int8 pools, bit-equal to the reference's bytes),
    128 query heads of 576 features rotated in blocks of 16 heads."""
    from agentrt.runtime.kernels.rope_store import rope_and_store, rope_and_store_ref
    from agentrt.runtime.kv_cache import QuantizedKV

    gen = torch.Generator().manual_seed(3)
    t, heads, rope, rank = 5, 128, 64, 512
    q = torch.randn(t, heads, rope + rank, generator=gen).to(DEVICE)
    k = torch.randn(t, 1, rope + rank, generator=gen).to(DEVICE)
    freqs = torch.outer(torch.arange(64.0), 1e4 ** (-torch.arange(0, rope, 2) / rope)).to(DEVICE)
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.tensor([3, 9, 10, 11, 40], device=DEVICE)
    slots = torch.tensor([7, 2, -1, 0, 5], device=DEVICE)  # -1: a padding row, not stored

    def pools():
        return [
            torch.zeros(9, 1, rope + rank, device=DEVICE),
            QuantizedKV(
                torch.zeros(9, 1, rope + rank, dtype=torch.int8, device=DEVICE),
                torch.zeros(9, 1, device=DEVICE),
            ),
        ]

    def parts(pool):
        return (pool.data, pool.scale) if isinstance(pool, QuantizedKV) else (pool,)

    for got_pool, want_pool in zip(pools(), pools()):
        got_q = rope_and_store(q, k, None, cos, sin, positions, slots, got_pool, None)
        want_q = rope_and_store_ref(q, k, None, cos, sin, positions, slots, want_pool, None)
        torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
        assert torch.equal(got_q[..., rope:], q[..., rope:])  # the latent part passes through
        for got_t, want_t in zip(parts(got_pool), parts(want_pool)):
            assert torch.equal(got_t, want_t)
    with pytest.raises(ValueError, match="v and v_cache go together"):
        rope_and_store(q, k, None, cos, sin, positions, slots, pools()[0], pools()[0])


def test_the_kernels_refuse_shapes_that_do_not_fit():
    from agentrt.runtime.kernels.mla_attention import mla_decode, mla_extend

    rows = torch.zeros(8, 1, 40, device=DEVICE)
    q = torch.zeros(2, 4, 40, device=DEVICE)
    table = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="value_dim must be in"):
        mla_decode(q, rows, table, lens, 40)
    with pytest.raises(ValueError, match="does not fit the latent cache"):
        mla_decode(q, torch.zeros(8, 2, 40, device=DEVICE), table, lens, 32)
    with pytest.raises(ValueError, match="one row per query"):
        mla_decode(q, rows, table[:1], lens, 32)
    with pytest.raises(ValueError, match="go together"):
        mla_extend(q, rows, lens, lens, lens, table, 1, 32, tree_mask=torch.ones(1, dtype=torch.uint8))


def _layer_steps(kv_dtype, backend: str):
    """A latent-attention layer (q LoRA, interleaved RoPE pairs, the tiny family's widths) over a
    fresh pool through one backend's metadata: a 20-token prefill of sequence a, a 10-token chunk
    on its cache, a decode of a batched with b's 12-token prefill, then 4 decodes of a and b
    together. Returns (outputs per step, the pool's K rows)."""
    from agentrt.runtime.backends.torch_attention import build_torch_metadata
    from agentrt.runtime.backends.triton import SlotTable, build_triton_metadata
    from agentrt.runtime.forward import SeqChunk
    from agentrt.runtime.kv_cache import KVPool
    from agentrt.runtime.layers.mla import MLAConfig, MultiHeadLatentAttention

    cfg = MLAConfig(24, 32, 16, 8, 12, rope_interleave=True)
    torch.manual_seed(0)
    layer = MultiHeadLatentAttention(cfg, 64, 4, 0.2).to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    freqs = torch.outer(torch.arange(128.0), 1e4 ** (-torch.arange(0, 8, 2) / 8)).to(DEVICE)
    tables = (freqs.cos(), freqs.sin())
    pool = KVPool([cfg.cache_spec()], kv_dtype, DEVICE, 1 << 20)
    slot_table = SlotTable(4, 64, DEVICE)
    sa, sb = pool.allocate(34), pool.allocate(16)
    x = {"a": torch.randn(34, 64, device=DEVICE), "b": torch.randn(16, 64, device=DEVICE)}

    def chunk(key, start, end):
        return SeqChunk([0] * (end - start), start, (sa if key == "a" else sb)[:end], seq_key=key)

    steps = [[chunk("a", 0, 20)], [chunk("a", 20, 30)], [chunk("a", 30, 31), chunk("b", 0, 12)]]
    steps += [[chunk("a", 31 + i, 32 + i), chunk("b", 12 + i, 13 + i)] for i in range(3)]
    outs = []
    for chunks in steps:
        if backend == "triton":
            batch = build_triton_metadata(chunks, slot_table, DEVICE)
        else:
            batch = build_torch_metadata(chunks, DEVICE)
        batch.meta.prepare_rope(batch.positions, *tables, torch.float32)
        xs = torch.cat([x[c.seq_key][c.context_len : c.context_len + len(c.token_ids)] for c in chunks])
        with torch.no_grad():
            outs.append(layer(xs, pool.k[0], pool.v[0], batch.meta))
    return outs, pool.k[0]


@pytest.mark.parametrize("kv_dtype", [F32, torch.int8])
def test_a_latent_attention_layer_on_triton_matches_the_torch_backend(kv_dtype):
    """The Triton metadata's rope_and_store(v_dim=0) and attend(value_dim) (extend and split-K
    decode kernels) against the torch backend's, step by step: outputs within 1e-5 of the largest
    (measured ~1e-7), the pool's rows the same (an int8 pool: the same bytes and scales)."""
    got, got_rows = _layer_steps(kv_dtype, "triton")
    want, want_rows = _layer_steps(kv_dtype, "torch")
    scale = max(w.abs().max().item() for w in want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g - w).abs().max().item() < 1e-5 * scale, i
    if kv_dtype == torch.int8:
        assert torch.equal(got_rows.data, want_rows.data) and torch.equal(got_rows.scale, want_rows.scale)
    else:
        torch.testing.assert_close(got_rows, want_rows, atol=1e-6, rtol=1e-6)
