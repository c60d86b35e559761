"""The CPU decode-attention kernel (runtime/kernels/cpu_kernels.py) against the torch path
(gather + SDPA), the backend choice, and the KV pool's slot order the kernel relies on for speed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrt.runtime.backends.torch_attention import KernelRows, gather_slots
from agentrt.runtime.config import CacheConfig, ModelConfig, default_cache_dir
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kernels import cpu_kernels
from agentrt.runtime.kv_cache import KVPool, uniform_layout
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.platform import choose_attention_backend
from tests.support.kernels import KERNEL_FAILURE, needs_kernel, run_fresh
from tests.support.models import make_tiny_model


def reference(q, k_cache, v_cache, slots, lens):
    """The torch path's decode attention (attention.AttentionMetadata._decode without the kernel)."""
    mask = (torch.arange(slots.shape[1])[None, :] < lens[:, None])[:, None, None, :]
    kd = gather_slots(k_cache, slots).transpose(1, 2)
    vd = gather_slots(v_cache, slots).transpose(1, 2)
    gqa = q.shape[1] != k_cache.shape[1]
    return F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=gqa).squeeze(2)


@needs_kernel
@pytest.mark.parametrize(
    "batch,heads,kv_heads,head_dim,max_len",
    [(1, 9, 3, 64, 37), (5, 8, 8, 32, 100), (16, 12, 3, 64, 257), (3, 4, 1, 16, 1), (2, 9, 3, 64, 2049)],
)
def test_kernel_matches_gather_and_sdpa(batch, heads, kv_heads, head_dim, max_len):
    gen = torch.Generator().manual_seed(batch * 1000 + max_len)
    num_slots = batch * max_len + 7
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    # each sequence's slots a random subset in random order (the pool after frees), padded with 0
    perm = torch.randperm(num_slots, generator=gen)
    slots = perm[: batch * max_len].view(batch, max_len).clone()
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[0] = max_len
    for b in range(batch):
        slots[b, lens[b] :] = 0
    q = torch.randn(batch, heads, head_dim, generator=gen) * 3  # peaked softmax rows too
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lens)
    assert got.shape == (batch, heads, head_dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, slots, lens), atol=2e-5, rtol=1e-5)


@needs_kernel
def test_loading_the_kernel_keeps_subnormal_floats():
    """A library linked with -ffast-math sets flush-to-zero for the whole process when it loads
    (crtfastmath.o); the kernel must not (the process has loaded it at import of this module)."""
    tiny = 2.2250738585072014e-308  # the smallest normal double
    assert tiny / 3 > 0
    assert (torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() > 0


@needs_kernel
def test_kernel_refuses_bad_slots_and_lengths():
    k = torch.zeros(10, 1, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        cpu_kernels.decode_attention(q, k, k, torch.tensor([[3, 10]]), torch.tensor([2]))
    with pytest.raises(RuntimeError, match=r"lens must be in \[1, L\]"):
        cpu_kernels.decode_attention(q, k, k, torch.tensor([[3, 4]]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="query heads must be a multiple of KV heads"):
        cpu_kernels.decode_attention(torch.zeros(1, 3, 8), torch.zeros(10, 2, 8), torch.zeros(10, 2, 8),
                                       torch.tensor([[1]]), torch.tensor([1]))  # fmt: skip


def test_backend_choice_names_why(tmp_path):
    cpu = torch.device("cpu")
    assert choose_attention_backend("auto", cpu, torch.bfloat16, tmp_path) == ("torch", "auto")
    assert choose_attention_backend("torch", cpu, torch.float32, tmp_path) == ("torch", "requested")
    with pytest.raises(
        ValueError, match=r"attention_backend 'cpu' needs the CPU at float32 \(here cpu, torch.bfloat16\)"
    ):
        choose_attention_backend("cpu", cpu, torch.bfloat16, tmp_path)
    with pytest.raises(ValueError, match="attention_backend must be auto, torch, cpu or triton"):
        ModelConfig(attention_backend="flash")
    if KERNEL_FAILURE is None:
        assert choose_attention_backend("auto", cpu, torch.float32, default_cache_dir())[0] == "cpu"


@needs_kernel
def test_model_logits_and_tokens_match_the_torch_path(default_model_dir, tmp_path):
    tiny = make_tiny_model(tmp_path / "m", default_model_dir, "llama", hidden_size=128)

    def runner(backend: str) -> ModelRunner:
        cfg = ModelConfig(model=str(tiny), device="cpu", dtype="float32", attention_backend=backend)
        return ModelRunner(cfg, CacheConfig(kv_cache_bytes=4 << 20))

    torch_runner, kernel_runner = runner("torch"), runner("auto")
    assert kernel_runner.attention_backend == "cpu"
    prompts = [list(range(100, 100 + n)) for n in (3, 17, 40)]
    outs = {}
    for name, r in (("torch", torch_runner), ("cpu", kernel_runner)):
        slots = [r.kv.allocate(len(p) + 8) for p in prompts]
        ids = [list(p) for p in prompts]
        logits_seen = []
        for step in range(8):  # prefill, then 7 batched greedy decode steps over 3 lengths
            chunks = [
                SeqChunk(ids[i] if step == 0 else ids[i][-1:], 0 if step == 0 else len(ids[i]) - 1,
                         slots[i][: len(ids[i])])
                for i in range(len(prompts))
            ]  # fmt: skip
            logits = r.execute(chunks)
            logits_seen.append(logits)
            for i, row in enumerate(logits):
                ids[i].append(int(row.argmax()))
        outs[name] = (ids, torch.stack(logits_seen))
    assert outs["torch"][0] == outs["cpu"][0]
    torch.testing.assert_close(outs["cpu"][1], outs["torch"][1], atol=1e-4, rtol=0)


def test_pool_gives_ascending_runs():
    pool = KVPool(uniform_layout(1, 1, 4), torch.float32, torch.device("cpu"), 1 << 12)  # 128 slots
    a = pool.allocate(5)
    assert a == [0, 1, 2, 3, 4]
    assert [pool.allocate(1)[0] for _ in range(3)] == [5, 6, 7]
    pool.free(a)
    assert pool.allocate(5) == a  # a freed run comes back in its order
    pool.free([9, 3, 7])
    assert pool.allocate(3) == [9, 3, 7]


NO_COMPILER = """
import sys, torch
from pathlib import Path
from agentrt.runtime.kernels import cpu_kernels as c
from agentrt.runtime.platform import choose_attention_backend
cache = Path(sys.argv[1])
print("nocompiler", c.load(cache / "none"))
print("auto", choose_attention_backend("auto", torch.device("cpu"), torch.float32, cache / "none"))
try:
    choose_attention_backend("cpu", torch.device("cpu"), torch.float32, cache / "none")
except ValueError as e:
    print("explicit", e)
"""

DAMAGED = """
import sys
from pathlib import Path
from agentrt.runtime.kernels import cpu_kernels as c
target = c.library_path(Path(sys.argv[1]) / "bad")
target.parent.mkdir(parents=True)
target.write_bytes(b"not a shared library")
print("damaged", c.load(Path(sys.argv[1]) / "bad"), target.stat().st_size > 1000)
"""


@needs_kernel
def test_no_compiler_falls_back_to_torch_and_says_why(tmp_path):
    """With no compiler the kernel is unavailable, auto takes torch and says why, an explicit `cpu`
    is refused."""
    out = run_fresh(NO_COMPILER, tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert "nocompiler FileNotFoundError" in out or "nocompiler RuntimeError" in out, out
    assert "auto ('torch', " in out and "auto: the C++ kernels are unavailable: " in out
    assert "explicit attention_backend 'cpu': the C++ kernels are unavailable" in out


@pytest.mark.slow  # a full build of the library (~30 s on 2 cores)
@needs_kernel
def test_a_damaged_cache_entry_is_rebuilt(tmp_path):
    """A cached library that is not one is rebuilt in its place."""
    out = run_fresh(DAMAGED, tmp_path)
    assert "damaged None True" in out, out


GUARDED_SLOTS = """
import ctypes, mmap, sys, torch
from agentrt.runtime.kernels import cpu_kernels
from agentrt.runtime.config import default_cache_dir
assert cpu_kernels.load(default_cache_dir()) is None
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE = mmap.PAGESIZE
keep = []

def guarded(t):
    # a copy of the int64 tensor t whose last element is right before a page that cannot be read
    nb = t.numel() * 8
    pages = (nb + PAGE - 1) // PAGE + 1
    mm = mmap.mmap(-1, pages * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    assert libc.mprotect(base + (pages - 1) * PAGE, PAGE, 0) == 0
    keep.append(mm)
    out = torch.frombuffer(mm, dtype=torch.int64, count=t.numel(), offset=(pages - 1) * PAGE - nb)
    return out.view(t.shape).copy_(t)

torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
ops = torch.ops.agentrt_cpu
for H, Hkv, D in [(9, 3, 64), (8, 1, 128), (4, 4, 32)]:
    S = 2400
    k, v = torch.randn(S, Hkv, D, generator=g), torch.randn(S, Hkv, D, generator=g)
    for n in (1, 9, 16, 17, 300, 1100, 2300):  # 1,100 and 2,300 keys: the split-phase path
        slots = torch.randperm(S, generator=g)[:n].view(1, n)
        q = torch.randn(1, H, D, generator=g)
        for kk, vv in ((k, v), (k.half(), v.half())):
            a = ops.decode_attention(q, kk, vv, guarded(slots), torch.tensor([n]), 0.125)
            assert torch.equal(a, ops.decode_attention(q, kk, vv, slots, torch.tensor([n]), 0.125))
    # a prefill chunk of 40 rows over 60 cached tokens, its slot row exactly 100 long
    slots = torch.randperm(S, generator=g)[:100].view(1, 100)
    q = torch.randn(40, H, D, generator=g)
    lens = torch.arange(61, 101)
    a = ops.attention(q, k, v, guarded(slots), torch.zeros(40, dtype=torch.int64), lens, 0.125)
    assert torch.equal(a, ops.attention(q, k, v, slots, torch.zeros(40, dtype=torch.int64), lens, 0.125))
print("guarded ok")
"""


@needs_kernel
def test_no_slot_past_a_rows_length_is_read(tmp_path):
    """The kernel reads a row's slot table only below its length, prefetching included: slot tables
    that end right before a page with no access (a read past the end is a segfault, caught here as
    the fresh process's exit), decode rows of 1-2,300 keys (both paths, float32 and float16 pools)
    and a prefill chunk; the results equal those on ordinary memory."""
    assert "guarded ok" in run_fresh(GUARDED_SLOTS, tmp_path)


# --- attention sinks (gpt-oss) and an explicit softmax scale -------------------------------------


def sink_reference(q, k_cache, v_cache, slots, seq, lens, scale, sinks):
    """Direct torch, in float64, of transformers' GptOssAttention eager path over the pool: per query
    row t, the scores of its first lens[t] slots (slot row seq[t]) times scale, one sink column
    sinks[h] appended, softmax, the sink column dropped, times V. sinks None: plain softmax."""
    H, Hkv = q.shape[1], k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        idx = slots[seq[t], : lens[t]]
        k = k_cache[idx].double().repeat_interleave(H // Hkv, dim=1)  # [l, H, D]
        v = v_cache[idx].double().repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t].double(), k) * scale
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        probs = torch.softmax(scores, dim=1)[:, : idx.numel()]
        out[t] = torch.einsum("hl,lhd->hd", probs, v)
    return out.float()


def sink_problem(heads, kv_heads, head_dim, length, seed):
    """A pool of 3 * length + 5 slots, 3 sequences' slot rows (random slots: the pool after frees),
    q of 3 decode rows, and sinks [heads] with head 0's sink far above every score."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = 3 * length + 5
    k = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[: 3 * length].view(3, length).clone()
    lens = torch.tensor([length, max(1, length // 2), max(1, length - 3)])
    q = torch.randn(3, heads, head_dim, generator=gen) * 2
    sinks = torch.randn(heads, generator=gen) * 2
    sinks[0] = 200.0  # far above every score: m must be the sink (exp(200 - max score) overflows float32)
    return q, k, v, slots, lens, sinks


SINK_CASES = [(h, hkv, d, n) for h, hkv in ((4, 2), (4, 4)) for d in (64, 256) for n in (1, 7, 300)]


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,length", SINK_CASES)
def test_decode_attention_with_sinks_matches_torch(heads, kv_heads, head_dim, length):
    q, k, v, slots, lens, sinks = sink_problem(
        heads, kv_heads, head_dim, length, seed=head_dim + length + heads
    )
    got = cpu_kernels.decode_attention(q, k, v, slots, lens, sinks=sinks)
    want = sink_reference(q, k, v, slots, torch.arange(3), lens, head_dim**-0.5, sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # the sink changes the result (not silently ignored): head 0's sink takes nearly all the weight
    plain = cpu_kernels.decode_attention(q, k, v, slots, lens)
    assert got[:, 0].abs().max() < 1e-6 < plain[:, 0].abs().max()
    assert not torch.allclose(got[:, 1:], plain[:, 1:], atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,length", SINK_CASES)
def test_attention_prefill_rows_with_sinks_match_torch(heads, kv_heads, head_dim, length):
    """The general op: sequence 0's whole prompt as one prefill chunk (row t attends its first t + 1
    slots), behind sequence 1's decode row, with sinks."""
    _, k, v, slots, lens, sinks = sink_problem(heads, kv_heads, head_dim, length, seed=7 * head_dim + length)
    gen = torch.Generator().manual_seed(length)
    qp = torch.randn(length + 1, heads, head_dim, generator=gen) * 2
    seq = torch.tensor([1] + [0] * length)
    row_lens = torch.tensor([lens[1].item(), *range(1, length + 1)])
    rows = KernelRows(slots[:2].clone(), seq, row_lens)
    got = cpu_kernels.attention(qp, k, v, rows, sinks=sinks)
    want = sink_reference(qp, k, v, slots, seq, row_lens, head_dim**-0.5, sinks)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_explicit_scale_matches_torch(scale):
    q, k, v, slots, lens, sinks = sink_problem(4, 2, 64, 37, seed=3)
    q = q / 4  # scale 1.0 on D = 64: keep the softmax rows from being one-hot
    for s in (None, sinks):
        got = cpu_kernels.decode_attention(q, k, v, slots, lens, scale=scale, sinks=s)
        torch.testing.assert_close(
            got, sink_reference(q, k, v, slots, range(3), lens, scale, s), atol=2e-5, rtol=1e-5
        )
        rows = KernelRows(slots, torch.tensor([], dtype=torch.long), lens)
        assert torch.equal(cpu_kernels.attention(q, k, v, rows, scale=scale, sinks=s), got)
    # scale None is D ** -0.5, and a different scale gives a different result
    default = cpu_kernels.decode_attention(q, k, v, slots, lens)
    assert torch.equal(default, cpu_kernels.decode_attention(q, k, v, slots, lens, scale=64**-0.5))
    assert not torch.allclose(
        default, cpu_kernels.decode_attention(q, k, v, slots, lens, scale=scale), atol=1e-3
    )


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (4, 4, 256), (8, 2, 128)])
def test_rows_with_sinks_are_batch_invariant(heads, kv_heads, head_dim):
    """A row's output with sinks is the same bits alone (a decode step) and inside a batch (a
    prefill chunk at odd boundaries behind another sequence's decode row)."""
    gen = torch.Generator().manual_seed(head_dim + heads)
    num_slots, n = 400, 131
    k = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    seq_a = torch.randperm(num_slots, generator=gen)[:n]
    seq_b = torch.randperm(num_slots, generator=gen)[:n]
    q = torch.randn(n, heads, head_dim, generator=gen) * 2
    qb = torch.randn(1, heads, head_dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 3
    slots = torch.stack([seq_a, seq_b])
    whole = cpu_kernels.attention(q, k, v, KernelRows(slots[:1], torch.zeros(n, dtype=torch.long),
                                                      torch.arange(1, n + 1)), sinks=sinks)  # fmt: skip
    for start, end in ((0, 1), (1, 6), (6, 70), (70, n)):
        batch = torch.cat([qb, q[start:end]])
        seq = torch.tensor([1] + [0] * (end - start))
        lens = torch.tensor([50, *range(start + 1, end + 1)])
        got = cpu_kernels.attention(batch, k, v, KernelRows(slots, seq, lens), sinks=sinks)
        assert torch.equal(got[1:], whole[start:end]), (start, end)
    for t in (0, 5, 64, 65, n - 1):
        alone = cpu_kernels.decode_attention(
            q[t : t + 1], k, v, slots[:1], torch.tensor([t + 1]), sinks=sinks
        )
        assert torch.equal(alone[0], whole[t]), t


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 256, 40])
def test_no_sinks_gives_the_same_bits_as_before(head_dim):
    """sinks=None is the call without sinks (the op's old 6-argument form included); a sink of -inf
    (weight exactly 0 after rounding) takes the sink path and still gives the same bits, so that path
    adds to the arithmetic without reordering it."""
    q, k, v, slots, lens, _ = sink_problem(4, 2, head_dim, 70, seed=head_dim)
    old = torch.ops.agentrt_cpu.decode_attention(q, k, v, slots, lens, head_dim**-0.5)
    assert torch.equal(cpu_kernels.decode_attention(q, k, v, slots, lens), old)
    assert torch.equal(cpu_kernels.decode_attention(q, k, v, slots, lens, sinks=None), old)
    minus_inf = torch.full((4,), float("-inf"))
    assert torch.equal(cpu_kernels.decode_attention(q, k, v, slots, lens, sinks=minus_inf), old)
    rows = KernelRows(slots, torch.tensor([0, 1, 2]), lens)
    assert torch.equal(cpu_kernels.attention(q, k, v, rows, sinks=minus_inf), old)


@needs_kernel
def test_bad_sinks_and_head_dims_are_refused():
    q, k, v, slots, lens, sinks = sink_problem(4, 2, 8, 5, seed=0)
    rows = KernelRows(slots, torch.tensor([], dtype=torch.long), lens)
    bad = [
        (sinks.double(), "sinks must be float32"),
        (sinks[:3], r"sinks must be \[H\] = \[4\]"),
        (torch.zeros(8), r"sinks must be \[H\] = \[4\]"),
        (sinks.view(2, 2), r"sinks must be \[H\] = \[4\]"),
        (torch.zeros(8)[::2], "sinks must be contiguous"),
    ]
    for s, match in bad:
        with pytest.raises(RuntimeError, match=match):
            cpu_kernels.decode_attention(q, k, v, slots, lens, sinks=s)
        with pytest.raises(RuntimeError, match=match):
            cpu_kernels.attention(q, k, v, rows, sinks=s)
    with pytest.raises(RuntimeError, match="at most 256"):
        cpu_kernels.decode_attention(torch.zeros(1, 2, 264), torch.zeros(4, 1, 264), torch.zeros(4, 1, 264),
                                     torch.tensor([[1]]), torch.tensor([1]))  # fmt: skip
    with pytest.raises(RuntimeError, match="head_dim 0 must be a positive multiple of 8"):  # was a segfault
        cpu_kernels.decode_attention(torch.zeros(1, 2, 0), torch.zeros(4, 1, 0), torch.zeros(4, 1, 0),
                                     torch.tensor([[1]]), torch.tensor([1]))  # fmt: skip


@needs_kernel
def test_a_nan_in_q_k_or_a_sink_makes_the_row_nan_as_sdpa_does():
    """exp's lower clamp must not turn a NaN score into a ~0 weight (a NaN key was silently dropped
    and a NaN max gave the mean of V): the row is NaN, as SDPA's; the other rows are untouched."""
    q, k, v, slots, lens, sinks = sink_problem(4, 2, 8, 5, seed=3)
    # (tensor, index, the (row, head) outputs that read it): q of row 0 head 1; a key of row 0's
    # KV head 0, read by its query heads 0 and 1 (the slot rows share no slot)
    cases = [("q", (0, 1, 2), [(0, 1)]), ("k", (int(slots[0, 2]), 0, 5), [(0, 0), (0, 1)])]
    for name, index, hit in cases:
        qq, kk = q.clone(), k.clone()
        (qq if name == "q" else kk)[index] = float("nan")
        nan_rows = torch.isnan(cpu_kernels.decode_attention(qq, kk, v, slots, lens)).all(dim=-1)
        want = torch.zeros_like(nan_rows)
        for r, h in hit:
            want[r, h] = True
        assert torch.equal(nan_rows, want), name
    bad_sink = sinks.clone()
    bad_sink[3] = float("nan")
    out = cpu_kernels.decode_attention(q, k, v, slots, lens, sinks=bad_sink)
    assert torch.isnan(out[:, 3]).all() and not torch.isnan(out[:, :3]).any()


@needs_kernel
def test_a_sink_far_above_every_score_takes_all_the_weight():
    """Scores all 0 (q = 0) and sinks 89.5 .. 1e4 above them: exp(sink - max score) overflows
    float32, so the softmax must subtract m = max(max score, sink) (the reference's max over the
    appended column); every real key's weight then underflows and the output is ~0, where plain
    attention gives the mean of V."""
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(20, 2, 16, generator=gen), torch.randn(20, 2, 16, generator=gen)
    q = torch.zeros(2, 4, 16)
    slots, lens = torch.arange(20).view(2, 10), torch.tensor([10, 3])
    sinks = torch.tensor([89.5, 120.0, 200.0, 1e4])
    got = cpu_kernels.decode_attention(q, k, v, slots, lens, sinks=sinks)
    assert got.isfinite().all() and got.abs().max() < 1e-30
    plain = cpu_kernels.decode_attention(q, k, v, slots, lens)
    torch.testing.assert_close(plain[1, 0], v[10:13, 0].mean(0))  # row 1: slots 10, 11, 12


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim,length", [(64, 300), (128, 40), (40, 77), (64, 2100)])
def test_a_float16_pool_gives_the_bits_of_a_float32_pool_holding_its_values(threads, head_dim, length):
    """`--kv-cache-dtype float16` on the CPU: each value is widened exactly as it is loaded, so every
    row (prefill rows over a slot row, decode rows, the split path of a long decode row at 2 threads)
    equals the float32 pool's with the same values, bit for bit: half the K/V bytes, the same
    invariance."""
    gen = torch.Generator().manual_seed(head_dim + length)
    S, Hkv, H = length + 20, 3, 9
    k16 = (torch.randn(S, Hkv, head_dim, generator=gen)).half()
    v16 = (torch.randn(S, Hkv, head_dim, generator=gen)).half()
    k32, v32 = k16.float(), v16.float()
    perm = torch.randperm(S, generator=gen)[:length]
    slots = torch.stack([perm, perm.roll(3)])
    T = 6
    q = torch.randn(T, H, head_dim, generator=gen)
    seq = torch.tensor([0] * (T - 1) + [1])
    lens = torch.tensor([length - T + 2 + i for i in range(T - 1)] + [length])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ops = torch.ops.agentrt_cpu
        got = ops.attention(q, k16, v16, slots, seq, lens, head_dim**-0.5)
        want = ops.attention(q, k32, v32, slots, seq, lens, head_dim**-0.5)
        assert torch.equal(got, want)
        one = ops.attention(
            q[-1:], k16, v16, slots[1:], torch.empty(0, dtype=torch.int64), lens[-1:], head_dim**-0.5
        )
        assert torch.equal(one, want[-1:])  # the decode row alone (the split path when long)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="must both be float32, both float16 or both int8"):
        ops.attention(q, k16, v32, slots, seq, lens, 0.1)


@needs_kernel
def test_rope_store_rounds_into_a_float16_pool_as_torch_does():
    gen = torch.Generator().manual_seed(3)
    T, H, Hkv, D = 5, 4, 2, 64
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen) * 7
    qkv[0, H * D] = 70000.0  # beyond float16: inf, as torch's cast gives
    cos, sin = torch.rand(T, D // 2, generator=gen), torch.rand(T, D // 2, generator=gen)
    k16 = torch.zeros(10, Hkv, D, dtype=torch.float16)
    v16 = torch.zeros(10, Hkv, D, dtype=torch.float16)
    k32, v32 = torch.zeros(10, Hkv, D), torch.zeros(10, Hkv, D)
    slots = torch.tensor([7, 1, 3, 9, 0])
    q_a, k_a = torch.ops.agentrt_cpu.rope_store(qkv, cos, sin, k16, v16, slots, H)
    q_b, k_b = torch.ops.agentrt_cpu.rope_store(qkv, cos, sin, k32, v32, slots, H)
    assert torch.equal(q_a, q_b) and torch.equal(k_a, k_b)
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())
