"""Batch invariance of the CPU kernels, bit for bit: a query row's attention output does not depend
on the other rows of the batch, on chunking or on where its keys came from; the integer matmuls give
the same output on every instruction-set path this CPU has, and each equals its integer reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrt.runtime import hardware
from agentrt.runtime.backends.torch_attention import KernelRows, kernel_rows
from agentrt.runtime.config import default_cache_dir
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kernels import cpu_kernels

FAILURE = cpu_kernels.load(default_cache_dir())
pytestmark = pytest.mark.skipif(FAILURE is not None, reason=f"the C++ kernels are unavailable: {FAILURE}")


def rows_for(slots: list[list[int]], seq: list[int], lens: list[int]) -> KernelRows:
    width = max(len(r) for r in slots)
    return KernelRows(
        torch.tensor([r + [0] * (width - len(r)) for r in slots]), torch.tensor(seq), torch.tensor(lens)
    )


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 8)])
def test_attention_rows_are_batch_chunk_and_cache_invariant(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * head_dim)
    num_slots, n = 700, 203
    k = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    seq_a = torch.randperm(num_slots, generator=gen)[:n].tolist()  # a sequence's slots after frees
    seq_b = torch.randperm(num_slots, generator=gen)[:50].tolist()
    q = torch.randn(n, heads, head_dim, generator=gen) * 2
    qb = torch.randn(1, heads, head_dim, generator=gen)
    # the whole prompt as one prefill chunk
    whole = cpu_kernels.attention(q, k, v, rows_for([seq_a], [0] * n, list(range(1, n + 1))))
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k[seq_a].transpose(0, 1)[None],
        v[seq_a].transpose(0, 1)[None],
        is_causal=True,
        enable_gqa=heads != kv_heads,
    )[0].transpose(0, 1)
    torch.testing.assert_close(whole, ref, atol=2e-5, rtol=1e-5)
    # chunked at odd boundaries, behind another sequence's decode row (the prefix "from the cache")
    for start, end in ((0, 1), (1, 5), (5, 70), (70, 131), (131, n)):
        batch = torch.cat([qb, q[start:end]])
        got = cpu_kernels.attention(
            batch, k, v, rows_for([seq_b, seq_a], [0] + [1] * (end - start), [50, *range(start + 1, end + 1)])
        )
        assert torch.equal(got[1:], whole[start:end]), (start, end)
    # each row alone as a decode step (the decode entry point too)
    lens = torch.arange(1, n + 1)
    slots = torch.tensor([seq_a])
    for t in (0, 3, 64, 65, 202):
        alone = cpu_kernels.decode_attention(q[t : t + 1], k, v, slots, lens[t : t + 1])
        assert torch.equal(alone[0], whole[t]), t


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (6, 1, 40)])
def test_long_chunks_on_an_int8_pool_equal_each_row_alone(heads, kv_heads, head_dim):
    """A 300-row prefill chunk (blocks of up to 32 rows, 3 heads per K/V load with AVX-512) on an
    int8 pool, and the same rows in odd chunks behind a decode row, give each row's decode output bit
    for bit (head_dim 40: 5 vectors, the 8-lane weighted sum)."""
    from agentrt.runtime.kv_cache import QuantizedKV, quantize_kv

    gen = torch.Generator().manual_seed(heads + head_dim)
    num_slots, n = 600, 300
    k = QuantizedKV(*quantize_kv(torch.randn(num_slots, kv_heads, head_dim, generator=gen)))
    v = QuantizedKV(*quantize_kv(torch.randn(num_slots, kv_heads, head_dim, generator=gen)))
    seq_a = torch.randperm(num_slots, generator=gen)[:n].tolist()
    q = torch.randn(n, heads, head_dim, generator=gen)
    qb = torch.randn(1, heads, head_dim, generator=gen)
    whole = cpu_kernels.attention(q, k, v, rows_for([seq_a], [0] * n, list(range(1, n + 1))))
    for start, end in ((0, 33), (33, 100), (100, n)):
        batch = torch.cat([qb, q[start:end]])
        got = cpu_kernels.attention(
            batch,
            k,
            v,
            rows_for([seq_a[:9], seq_a], [0] + [1] * (end - start), [9, *range(start + 1, end + 1)]),
        )
        assert torch.equal(got[1:], whole[start:end]), (start, end)
    slots, lens = torch.tensor([seq_a]), torch.arange(1, n + 1)
    for t in (0, 31, 32, 100, 299):
        assert torch.equal(
            cpu_kernels.decode_attention(q[t : t + 1], k, v, slots, lens[t : t + 1])[0], whole[t]
        ), t


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,quant", [(9, 3, 64, False), (4, 1, 256, True), (6, 2, 40, False)]
)
def test_a_long_decode_row_split_across_threads_equals_the_same_row_in_a_chunk(
    heads, kv_heads, head_dim, quant
):
    """One sequence decoding at 1,100+ keys takes the split path (every phase across the threads: the
    scores by keys, the weighted sum by vectors of D); the same row inside a 40-row chunk takes the
    blocked path. Bit for bit the same, with and without sinks, on float32 and int8 pools."""
    from agentrt.runtime.kv_cache import QuantizedKV, quantize_kv

    gen = torch.Generator().manual_seed(head_dim)
    num_slots, n = 1500, 1200
    k = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    if quant:
        k, v = QuantizedKV(*quantize_kv(k)), QuantizedKV(*quantize_kv(v))
    seq = torch.randperm(num_slots, generator=gen)[:n].tolist()
    q = torch.randn(40, heads, head_dim, generator=gen)
    lens = list(range(n - 39, n + 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split path needs more than one thread
    try:
        for sinks in (None, torch.randn(heads, generator=gen)):
            chunk = cpu_kernels.attention(q, k, v, rows_for([seq], [0] * 40, lens), sinks=sinks)
            for t in (0, 21, 39):
                alone = cpu_kernels.decode_attention(
                    q[t : t + 1], k, v, torch.tensor([seq]), torch.tensor([lens[t]]), sinks=sinks
                )
                assert torch.equal(alone[0], chunk[t]), (t, sinks is not None)
    finally:
        torch.set_num_threads(threads)


def test_draft_tree_rows_attend_their_ancestors_like_decoded_tokens():
    """A draft tree's token reads the context and its ancestors (kernel_rows): the same output as if
    the path had been decoded one token at a time."""
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(64, 2, 16, generator=gen), torch.randn(64, 2, 16, generator=gen)
    ctx = [5, 9, 2, 40]
    new = [11, 12, 13, 14]  # tree: 0 -> 1, 0 -> 2 -> 3
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    chunk = SeqChunk(token_ids=[1, 2, 3, 4], context_len=4, slots=ctx + new, tree_mask=mask)
    q = torch.randn(4, 4, 16, generator=gen)
    got = cpu_kernels.attention(q, k, v, kernel_rows([chunk], torch.device("cpu")))
    paths = [[11], [11, 12], [11, 13], [11, 13, 14]]
    for i, path in enumerate(paths):
        slots = torch.tensor([ctx + path])
        alone = cpu_kernels.decode_attention(q[i : i + 1], k, v, slots, torch.tensor([len(ctx) + len(path)]))
        assert torch.equal(got[i], alone[0]), i


def test_attention_refuses_bad_rows_naming_the_problem():
    k = v = torch.randn(10, 1, 8)
    q = torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="lens must be in"):
        cpu_kernels.attention(q, k, v, rows_for([[1, 2]], [0, 0], [1, 3]))
    with pytest.raises(RuntimeError, match="slot row 1 out of"):
        cpu_kernels.attention(q, k, v, rows_for([[1, 2]], [0, 1], [1, 2]))
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        cpu_kernels.attention(q, k, v, rows_for([[1, 20]], [0, 0], [1, 2]))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        cpu_kernels.attention(torch.randn(1, 1, 12), torch.randn(4, 1, 12), torch.randn(4, 1, 12),
                              rows_for([[0]], [0], [1]))  # fmt: skip


def _available_isas() -> list[str]:
    """The integer paths this process can run (the CPU's flags capped by what executes: isa_here)."""
    if FAILURE is not None:
        return []  # the module is skipped
    have = []
    for isa in hardware.ISAS:
        try:
            cpu_kernels.isa_here(forced=isa)
        except ValueError:
            continue
        have.append(isa)
    best = cpu_kernels.isa_here(forced="")
    return [
        i for i in have if i != "scalar" or best == "scalar"
    ]  # the scalar path is built only without AVX2


def _int8_reference(x, q, scales):
    """int8_linear's definition with exact integer block sums (int64) and the kernel's float order."""
    xb = x.view(x.shape[0], -1, 32)
    d = xb.abs().amax(-1) / 127
    xq = torch.round(xb / torch.where(d > 0, d, 1)[..., None]).to(torch.int64)
    sums = torch.einsum("mbk,nbk->mnb", xq, q.view(q.shape[0], -1, 32).to(torch.int64)).float()
    return sums, d


@pytest.mark.parametrize("isa", _available_isas())
def test_integer_kernels_agree_bitwise_on_every_isa_and_match_the_integer_reference(isa):
    ops = torch.ops.agentrt_cpu
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(20, 320, generator=gen)  # 20 rows: the int4 kernel's GEMM path
    q8 = torch.randint(-127, 128, (37, 320), dtype=torch.int8, generator=gen)
    s8 = (torch.rand(37, 10, generator=gen) / 100).half().float()  # int4 keeps float16 scales and mins
    levels = torch.randint(0, 16, (37, 320), dtype=torch.uint8, generator=gen)
    mins = (torch.randn(37, 10, generator=gen) / 10).half().float()
    from agentrt.runtime.models.quant import Int4BlockLinear, group_major

    w8, g8 = ops.pack_int8(q8), group_major(s8)
    lin4 = Int4BlockLinear(320, 37, bias=False, group_size=32)
    lin4.qweight.copy_(levels[:, 0::2] | (levels[:, 1::2] << 4))
    lin4.scales.copy_(s8)
    lin4.mins.copy_(mins)
    dense4 = lin4.dequantized()
    lin4.pack_for_kernel()
    try:
        assert cpu_kernels.select_isa(isa) == isa
        got8 = ops.int8_linear(x, w8, g8, None, 37)
        got4 = lin4(x)
        ops.set_cpu_isa("avx2" if isa != "scalar" else "scalar")
        assert torch.equal(ops.int8_linear(x, w8, g8, None, 37), got8)
        assert torch.equal(lin4(x), got4)
    finally:
        cpu_kernels.select_isa(cpu_kernels.isa_here())
    sums, d = _int8_reference(x, q8, s8)
    want8 = (sums * s8[None] * d[:, None, :]).sum(-1)
    torch.testing.assert_close(got8, want8, atol=1e-4, rtol=1e-5)
    xq_dq = (torch.round(x.view(20, -1, 32) / d[..., None]) * d[..., None]).view(20, 320)
    torch.testing.assert_close(got4, xq_dq @ dense4.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("isa", _available_isas())
def test_integer_kernel_rows_do_not_depend_on_the_batch(isa):
    """A row's int8 / int4 matmul output is the same bit for bit alone or among 1 to 9 rows, or 16 to
    40 (the int4 GEMM path: 16 output rows a work item, 22 here so the second item is
    part padding), first or last (the VNNI paths take batch rows 4 at a time, then the rest, and blocks
    2 at a time, then the rest: 10 blocks here), which the engine's batch invariance with the kernels
    relies on."""
    ops = torch.ops.agentrt_cpu
    gen = torch.Generator().manual_seed(11)
    from agentrt.runtime.models.quant import group_major

    x = torch.randn(40, 320, generator=gen)
    w8 = ops.pack_int8(torch.randint(-127, 128, (22, 320), dtype=torch.int8, generator=gen))
    scales = group_major(torch.rand(22, 10, generator=gen) / 100)
    w4 = torch.randint(0, 256, (24, 160), dtype=torch.uint8, generator=gen)
    mins = group_major(torch.randn(22, 10, generator=gen) / 10)
    try:
        assert cpu_kernels.select_isa(isa) == isa
        full8 = ops.int8_linear(x, w8, scales, None, 22)
        full4 = ops.int4_linear(x, w4, scales.half(), mins.half(), None, 22)
        for rows in [*range(1, 10), 16, 17, 23, 40]:
            for start in (0, 40 - rows):
                part = x[start : start + rows].contiguous()
                assert torch.equal(ops.int8_linear(part, w8, scales, None, 22), full8[start : start + rows])
                assert torch.equal(
                    ops.int4_linear(part, w4, scales.half(), mins.half(), None, 22),
                    full4[start : start + rows],
                )
    finally:
        cpu_kernels.select_isa(cpu_kernels.isa_here())


def test_the_cpu_reports_its_isa_and_a_vnni_cpu_is_tested_on_both_paths():
    info = hardware.cpu_info()
    best = cpu_kernels.isa_here(forced="")
    assert cpu_kernels.active_isa() == cpu_kernels.isa_here()
    if best in ("avxvnni", "avx512vnni"):
        assert "avx2" in _available_isas() and best in _available_isas()
    else:
        pytest.skip(
            f"this process runs no VNNI path (CPU {info.describe()}, executable "
            f"{cpu_kernels.executable_isa()}): only its {best} path is tested here"
        )


def test_dense_float32_linear_rows_do_not_depend_on_the_batch():
    """`--quantization none` at float32 runs the dense layers on oneDNN's packed matmul
    (models/cpu_linear.py): on this CPU a row's output is the same alone or among 2 to 300 rows (the
    default model's shapes; on AVX-512 CPUs oneDNN's single-row GEMV sums in another order for
    in >= 1536, so OneDNNLinear runs one row as two), which the engine's invariance at float32 relies on."""
    from agentrt.runtime.hardware import onednn_usable
    from agentrt.runtime.models.cpu_linear import OneDNNLinear

    if not onednn_usable():
        pytest.skip("this torch build has no oneDNN")
    gen = torch.Generator().manual_seed(3)
    for out_features, in_features in ((1728, 576), (576, 1536), (3072, 576)):
        lin = OneDNNLinear(torch.randn(out_features, in_features, generator=gen) / 24, None)
        x = torch.randn(300, in_features, generator=gen)
        full = lin(x)
        for rows in (*range(1, 18), 33, 96):
            assert torch.equal(lin(x[:rows]), full[:rows]), (out_features, in_features, rows)
        assert torch.equal(lin(x[7:8]), full[7:8])
        assert torch.equal(lin(x[7]), full[7])  # a 1-d input too


def test_onednn_single_row_keeps_shape_checks():
    """A single row of the wrong width is refused as F.linear refuses it, not reshaped."""
    from agentrt.runtime.hardware import onednn_usable
    from agentrt.runtime.models.cpu_linear import OneDNNLinear

    if not onednn_usable():
        pytest.skip("this torch build has no oneDNN")
    lin = OneDNNLinear(torch.randn(4, 6), None)
    with pytest.raises(RuntimeError):
        lin(torch.randn(2, 3))
