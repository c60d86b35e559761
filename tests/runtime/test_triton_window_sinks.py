"""Sliding window and learned attention sinks (gpt-oss) in the Triton attention kernels.

The kernels are compared with their torch references (on CPU under TRITON_INTERPRET=1, set in
conftest), and the references with an attention written out here from positions (full scores, a
mask, a sink column appended; fp64), and with transformers' own GptOss eager attention, so a bug
shared by a kernel and its reference cannot pass. GQA (H=4, Hkv=2), small shapes."""

from __future__ import annotations

import math

import pytest
import torch

from agentrt.runtime.kernels import triton_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_usable(DEVICE), reason="triton is not installed")

H, HKV, D = 4, 2, 32
I32 = {"dtype": torch.int32, "device": DEVICE}


def pool(lens: list[int], page_size: int, gen: torch.Generator, dtype=torch.float32):
    """A KV pool [S, HKV, D] with random contents and a shuffled page table covering `lens`."""
    pages = max(1, max(-(-n // page_size) for n in lens))
    num_pages = len(lens) * pages + 2
    k = torch.randn(num_pages * page_size, HKV, D, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(num_pages * page_size, HKV, D, generator=gen).to(dtype).to(DEVICE)
    table = torch.randperm(num_pages, generator=gen)[: len(lens) * pages].view(len(lens), pages)
    return k, v, table.to(**I32)


def sink_logits(gen: torch.Generator) -> torch.Tensor:
    """Sinks large enough to take a visible share of each head's softmax."""
    return (torch.randn(H, generator=gen) * 2 + 1).to(DEVICE)


def gather(cache, table, b: int, length: int, page_size: int) -> torch.Tensor:
    """Keys or values 0..length-1 of sequence b, read through its page table row."""
    pos = torch.arange(length, device=cache.device)
    return cache[table[b, pos // page_size].long() * page_size + pos % page_size]


def positions_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window) -> torch.Tensor:
    """[T, N] True where the query at q_pos[t] sees the key at k_pos[n]: causal, last `window` keys."""
    seen = k_pos[None, :] <= q_pos[:, None]
    if window:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    return seen


def direct_attention(q, k, v, seen, sinks, scale) -> torch.Tensor:
    """q [T, H, D], k / v [N, HKV, D], seen [T, N] -> [T, H, D] in fp64, the softmax written out:
    masked scores, the sink appended as a last column, exp / sum, the sink's column dropped."""
    heads = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // k.shape[1])
    scores = torch.einsum("thd,nhd->htn", q.double(), k.double()[:, heads]) * scale
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(*scores.shape[:2], 1)], dim=-1)
    e = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    probs = e / e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("htn,nhd->thd", probs, v.double()[:, heads])


def extend_batch(q_lens: list[int], prefixes: list[int], page_size: int, gen, dtype=torch.float32):
    """Inputs of extend_attention for sequences with these new / prefix lengths (row 0 of q unused)."""
    k, v, table = pool([p + n for p, n in zip(prefixes, q_lens)], page_size, gen, dtype)
    starts = [1]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
    q = torch.randn(sum(q_lens) + 1, H, D, generator=gen).to(dtype).to(DEVICE)
    ints = [torch.tensor(x, **I32) for x in (starts, q_lens, prefixes)]
    return (q, k, v, *ints, table)


def random_trees(q_lens: list[int], gen):
    """Random draft trees (node i's parent a random earlier node; its row: its ancestors and itself,
    so its depth, its row's count minus 1, differs from its index) and their flat uint8 layout."""
    masks, parts, offsets, acc = [], [], [], 0
    for n in q_lens:
        m = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            if i:
                m[i] = m[int(torch.randint(0, i, (1,), generator=gen))]
            m[i, i] = True
        masks.append(m.to(DEVICE))
        parts.append(m.flatten().to(torch.uint8))
        offsets.append(acc)
        acc += n * n
    return masks, torch.cat(parts).to(DEVICE), torch.tensor(offsets, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("window", [None, 1, 5, 40])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_references_match_direct_softmax(window, with_sinks):
    """decode_attention_ref and extend_attention_ref (causal and tree) against direct_attention."""
    from agentrt.runtime.kernels.decode_attention import decode_attention_ref
    from agentrt.runtime.kernels.extend_attention import extend_attention_ref

    gen = torch.Generator().manual_seed(3 + (window or 0) + with_sinks)
    sinks = sink_logits(gen) if with_sinks else None
    scale = 1 / math.sqrt(D)
    lens = [3, 57, 90]
    k, v, table = pool(lens, 4, gen)
    q = torch.randn(len(lens), H, D, generator=gen).to(DEVICE)
    ref = decode_attention_ref(
        q, k, v, table, torch.tensor(lens, **I32), page_size=4, window=window, sinks=sinks
    )
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=DEVICE)
        seen = positions_mask(pos[-1:], pos, window)
        want = direct_attention(
            q[b : b + 1], gather(k, table, b, n, 4), gather(v, table, b, n, 4), seen, sinks, scale
        )
        torch.testing.assert_close(ref[b : b + 1].double(), want, atol=1e-5, rtol=1e-5)

    q_lens, prefixes = [9, 20], [0, 45]
    args = extend_batch(q_lens, prefixes, 1, gen)
    q, k, v, table = args[0], args[1], args[2], args[6]
    masks, _, _ = random_trees(q_lens, gen)
    for trees in (None, masks):
        ref = extend_attention_ref(*args, tree_masks=trees, window=window, sinks=sinks)
        for b, (n, p) in enumerate(zip(q_lens, prefixes)):
            pos = torch.arange(p + n, device=DEVICE)
            # a tree node's position: the prefix + its depth (not its index among the new tokens)
            q_pos = pos[p:] if trees is None else p + trees[b].sum(1) - 1
            seen = positions_mask(q_pos, pos, window)
            if trees is not None:  # the tree rule among the new tokens, the window on the prefix
                seen[:, p:] = trees[b]
            s = 1 + sum(q_lens[:b])
            want = direct_attention(
                q[s : s + n], gather(k, table, b, p + n, 1), gather(v, table, b, p + n, 1), seen, sinks, scale
            )
            torch.testing.assert_close(ref[s : s + n].double(), want, atol=1e-5, rtol=1e-5)


def test_references_match_transformers_gpt_oss():
    """The references against transformers' GptOss eager attention (sinks) under its own sliding
    window causal mask function, for a prefill over a prefix and for one decode step."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    masking = pytest.importorskip("transformers.masking_utils")
    from agentrt.runtime.kernels.decode_attention import decode_attention_ref
    from agentrt.runtime.kernels.extend_attention import extend_attention_ref

    gen = torch.Generator().manual_seed(5)
    window, p, n = 7, 13, 6
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks = H // HKV, sink_logits(gen).cpu()
    module.train(False)
    k = torch.randn(p + n, HKV, D, generator=gen)
    v = torch.randn(p + n, HKV, D, generator=gen)
    q = torch.randn(n, H, D, generator=gen)
    table = torch.arange(p + n, dtype=torch.int32)[None]
    mask_fn = masking.sliding_window_causal_mask_function(window)
    q_idx = torch.arange(p, p + n)[:, None]
    seen = mask_fn(0, 0, q_idx, torch.arange(p + n)[None, :])
    additive = torch.zeros(n, p + n).masked_fill(~seen, torch.finfo(torch.float32).min)[None, None]
    hf, _ = gpt_oss.eager_attention_forward(
        module, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], additive, D**-0.5
    )
    i32 = {"dtype": torch.int32}
    ext = extend_attention_ref(
        q,
        k,
        v,
        torch.tensor([0], **i32),
        torch.tensor([n], **i32),
        torch.tensor([p], **i32),
        table,
        window=window,
        sinks=module.sinks,
    )
    torch.testing.assert_close(ext, hf[0], atol=1e-5, rtol=1e-5)
    dec = decode_attention_ref(
        q[-1:], k, v, table, torch.tensor([p + n], **i32), window=window, sinks=module.sinks
    )
    torch.testing.assert_close(dec, hf[0, -1:], atol=1e-5, rtol=1e-5)


DECODE_CASES = [  # (dtype, window, sinks, lens, page_size, split_tokens)
    (torch.float32, 40, False, [3, 40, 41, 150], 1, 1),  # shorter, equal, longer; 1-3 splits of 64
    (torch.float32, 5, True, [1, 4, 70, 200], 4, 1),  # a window smaller than the key block (64)
    (torch.float32, None, True, [0, 33, 130], 1, 1),  # sinks alone; a padding row
    (torch.float32, 150, True, [97, 300], 16, 1),  # the window spans several splits
    (torch.bfloat16, 40, True, [7, 90, 170], 1, 256),  # one split per sequence
    (torch.bfloat16, 5, False, [2, 129], 4, 1),
]


@pytest.mark.parametrize("dtype,window,with_sinks,lens,page_size,split_tokens", DECODE_CASES)
def test_decode_window_sinks_match_reference(dtype, window, with_sinks, lens, page_size, split_tokens):
    """The kernel against decode_attention_ref, through a persistent (shuffled, taller) table,
    on the grid that decode_splits gives with the window and on the one without it."""
    from agentrt.runtime.kernels.decode_attention import decode_attention, decode_attention_ref, decode_splits

    gen = torch.Generator().manual_seed(len(lens) * 10 + (window or 0))
    k, v, table = pool(lens, page_size, gen, dtype)
    q = torch.randn(len(lens), H, D, generator=gen).to(dtype).to(DEVICE)
    sinks = sink_logits(gen) if with_sinks else None
    seq_lens = torch.tensor(lens, **I32)
    rows = torch.randperm(len(lens), generator=gen).to(**I32)
    tall = torch.cat([table[torch.argsort(rows.long())], table[:1]]).contiguous()
    opts = {
        "page_size": page_size,
        "page_rows": rows,
        "split_tokens": split_tokens,
        "window": window,
        "sinks": sinks,
    }
    out = decode_attention(
        q, k, v, tall, seq_lens, num_splits=decode_splits(max(lens), split_tokens, window), **opts
    )
    del opts["split_tokens"]
    ref = decode_attention_ref(q, k, v, tall, seq_lens, **opts)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    if 0 in lens:
        assert torch.equal(out[lens.index(0)].float(), torch.zeros(H, D, device=DEVICE))
    # a grid sized without the window (as for the model's other layers): its extra splits are empty
    wide = decode_attention(
        q,
        k,
        v,
        tall,
        seq_lens,
        num_splits=decode_splits(max(lens), split_tokens),
        split_tokens=split_tokens,
        **opts,
    )
    assert torch.equal(wide, out)


def test_decode_window_keeps_rows_independent_of_the_batch():
    """With a window (and sinks) a row's output is bitwise the same alone, in a batch with
    sequences of other lengths, and on the widest grid; split sizes of one key block."""
    from agentrt.runtime.kernels.decode_attention import MAX_SPLITS, decode_attention, decode_splits

    gen = torch.Generator().manual_seed(17)
    lens, window = [150, 7, 301, 64, 700], 300
    k, v, table = pool(lens, 1, gen)
    q = torch.randn(len(lens), H, D, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, **I32)
    sinks = sink_logits(gen)
    opts = {"split_tokens": 1, "window": window, "sinks": sinks}
    batched = decode_attention(
        q, k, v, table, seq_lens, num_splits=decode_splits(max(lens), 1, window), **opts
    )
    assert torch.equal(decode_attention(q, k, v, table, seq_lens, num_splits=MAX_SPLITS, **opts), batched)
    for i, n in enumerate(lens):
        alone = decode_attention(
            q[i : i + 1],
            k,
            v,
            table[i : i + 1],
            seq_lens[i : i + 1],
            num_splits=decode_splits(n, 1, window),
            **opts,
        )
        assert torch.equal(alone[0], batched[i]), (i, n)


def test_decode_window_and_sinks_change_the_output():
    """The options are not ignored: a window shorter than the context and sinks each change the
    output; a window of 0, or one longer than every context, changes nothing (bitwise)."""
    from agentrt.runtime.kernels.decode_attention import decode_attention

    gen = torch.Generator().manual_seed(23)
    lens = [80, 120]
    k, v, table = pool(lens, 1, gen)
    q = torch.randn(2, H, D, generator=gen).to(DEVICE)
    seq_lens = torch.tensor(lens, **I32)
    plain = decode_attention(q, k, v, table, seq_lens, num_splits=2, split_tokens=1)
    for opts in ({"window": 50}, {"sinks": sink_logits(gen)}):
        changed = decode_attention(q, k, v, table, seq_lens, num_splits=2, split_tokens=1, **opts)
        assert (changed - plain).abs().amax() > 1e-3, opts
    for window in (0, 2**40):
        same = decode_attention(q, k, v, table, seq_lens, num_splits=2, split_tokens=1, window=window)
        assert torch.equal(same, plain), window


EXTEND_CASES = [  # (dtype, window, sinks, q_lens, prefixes, page_size, tree)
    (torch.float32, 40, False, [70, 9, 20], [0, 3, 110], 1, False),  # blocks wholly before the window
    (torch.float32, 5, True, [37, 12], [50, 0], 4, False),  # a window smaller than a key block
    (torch.float32, None, True, [33, 5], [10, 70], 1, False),  # sinks alone
    (torch.float32, 8, True, [11, 6], [40, 9], 1, True),  # tree: the window on the prefix only
    (torch.bfloat16, 16, True, [45, 4], [20, 100], 4, False),
    (torch.bfloat16, 3, False, [7, 30], [64, 2], 1, True),
]


@pytest.mark.parametrize("dtype,window,with_sinks,q_lens,prefixes,page_size,tree", EXTEND_CASES)
def test_extend_window_sinks_match_reference(dtype, window, with_sinks, q_lens, prefixes, page_size, tree):
    """The kernel against extend_attention_ref, through a persistent (shuffled) table; rows of q
    that belong to no sequence stay untouched."""
    from agentrt.runtime.kernels.extend_attention import extend_attention, extend_attention_ref

    gen = torch.Generator().manual_seed(sum(q_lens) + (window or 0))
    q, k, v, starts, lens, prefix, table = extend_batch(q_lens, prefixes, page_size, gen, dtype)
    rows = torch.randperm(len(q_lens), generator=gen).to(**I32)
    table = table[torch.argsort(rows.long())].contiguous()
    args = (q, k, v, starts, lens, prefix, table)
    masks = flat = offsets = None
    if tree:
        masks, flat, offsets = random_trees(q_lens, gen)
    sinks = sink_logits(gen) if with_sinks else None
    out = torch.full_like(q, 7.0)
    opts = {"page_size": page_size, "page_rows": rows, "window": window, "sinks": sinks}
    extend_attention(*args, max(q_lens), tree_mask=flat, tree_offsets=offsets, out=out, **opts)
    ref = extend_attention_ref(*args, tree_masks=masks, **opts)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out[1:].float(), ref[1:].float(), **tol)
    assert (out[0] == 7.0).all()


def test_extend_window_and_sinks_change_the_output():
    """A window shorter than the context and sinks each change the output; a window of 0, or one
    longer than every context, changes nothing (bitwise)."""
    from agentrt.runtime.kernels.extend_attention import extend_attention

    gen = torch.Generator().manual_seed(29)
    args = extend_batch([40], [30], 1, gen)
    plain = extend_attention(*args, 40)
    for opts in ({"window": 10}, {"sinks": sink_logits(gen)}):
        assert (extend_attention(*args, 40, **opts) - plain)[1:].abs().amax() > 1e-3, opts
    for window in (0, 2**40):
        assert torch.equal(extend_attention(*args, 40, window=window)[1:], plain[1:]), window


def test_bad_window_or_sinks_raise_value_error():
    from agentrt.runtime.kernels.decode_attention import decode_attention, decode_attention_ref, decode_splits
    from agentrt.runtime.kernels.extend_attention import extend_attention, extend_attention_ref

    gen = torch.Generator().manual_seed(31)
    k, v, table = pool([5], 1, gen)
    q = torch.randn(1, H, D, generator=gen).to(DEVICE)
    seq_lens = torch.tensor([5], **I32)
    ext = extend_batch([3], [2], 1, gen)
    calls = [
        lambda **kw: decode_attention(q, k, v, table, seq_lens, **kw),
        lambda **kw: decode_attention_ref(q, k, v, table, seq_lens, **kw),
        lambda **kw: extend_attention(*ext, 3, **kw),
        lambda **kw: extend_attention_ref(*ext, **kw),
    ]
    good = torch.zeros(H, device=DEVICE)
    for call in calls:
        for window in (-1, 2.0, True, "4", torch.tensor(4)):
            with pytest.raises(ValueError, match="window must be"):
                call(window=window)
        for sinks in (good.half(), good.double(), torch.zeros(H + 1, device=DEVICE), good[None], [0.0] * H):
            with pytest.raises(ValueError, match="sinks must be"):
                call(sinks=sinks)
        with pytest.raises(ValueError, match="sinks must be"):
            call(sinks=torch.zeros(H, device="meta"))  # another device than q's
    for window in (-3, 1.5, False):
        with pytest.raises(ValueError, match="window must be"):
            decode_splits(100, 1, window)
    assert decode_splits(1000, 64, 100) == 2 and decode_splits(1000, 64, 0) == decode_splits(1000, 64) == 16
