"""The int8 KV cache (issue 38 item 1; runtime/kv_cache.py): one symmetric absmax scale per token and KV
head, written by every store path and read in place by every attention backend.

- the quantization itself (round half to even, zero rows, NaN rows);
- every store path writes the same bytes: the torch reference (`quantize_kv`), the C++ `rope_store`,
  and the Triton `rope_and_store` (under the interpreter on CPU);
- every attention backend reads the same values: the C++ decode and row kernels and the Triton decode
  and extend kernels against attention over the de-quantized pool;
- whole models: the C++ decoder-stack op equals the layer-by-layer ops on an int8 pool; the torch,
  C++ and Triton backends agree; the default model's logits with int8 KV vs float32 KV stay within
  the stated tolerance (greedy agreement printed); the memory plan; bad values named.

Batch, cache and chunk invariance with int8 KV is asserted in test_engine.py (the int4 + int8 KV case
of test_greedy_identical_cache_on_off_cold_warm_any_batch); the tiers with an int8 pool in
test_kv_tiers_fake.py's real-model test below.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrt.runtime.backends.cpu_stack import CpuStackBackend
from agentrt.runtime.backends.torch_attention import KernelRows
from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kernels import cpu_kernels, triton_usable
from agentrt.runtime.kv_cache import (
    KVPool,
    QuantizedKV,
    dequantize_kv,
    gather_kv,
    quantize_kv,
    resolve_kv_dtype,
    uniform_layout,
)
from agentrt.runtime.layers.rotary import apply_rope
from agentrt.runtime.model_runner import ModelRunner
from tests.support.kernels import needs_kernel

needs_triton = pytest.mark.skipif(not triton_usable(torch.device("cpu")), reason="triton is not installed")


def int8_pool(
    slots: int, kv_heads: int, head_dim: int, gen: torch.Generator
) -> tuple[QuantizedKV, QuantizedKV]:
    """K and V int8 pools holding random rows (a few with an outlier channel, one all zero)."""
    out = []
    for _ in range(2):
        x = torch.randn(slots, kv_heads, head_dim, generator=gen)
        x[::7, :, 3] *= 20  # outlier channels, as real keys have
        x[5] = 0
        out.append(QuantizedKV(*quantize_kv(x)))
    return out[0], out[1]


def dense(cache: QuantizedKV) -> torch.Tensor:
    return dequantize_kv(cache.data, cache.scale)


# ---- the quantization ---------------------------------------------------------------------------


def test_quantize_kv_rounds_to_nearest_and_keeps_zero_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.rand(50, 3, 1, generator=gen) * 10
    x[7, 1] = 0.0
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (50, 3)
    assert q.abs().max() <= 127 and (q.abs().amax(-1)[scale > 0] == 127).all()  # absmax maps to 127
    err = (dequantize_kv(q, scale) - x).abs()
    assert (err <= scale[..., None] * 0.5 * (1 + 1e-5) + 1e-12).all()  # at most half a step
    assert scale[7, 1] == 0 and (q[7, 1] == 0).all()
    # round half to even, exactly at .5 steps
    row = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5] + [0.0] * 2])
    q, scale = quantize_kv(row)
    assert scale.item() == 1.0 and q[0, :6].tolist() == [127, 0, 2, 2, 0, -2]
    q, scale = quantize_kv(torch.tensor([[1.0, float("nan")] + [0.0] * 6]))
    assert scale.isnan().all()  # a NaN row stays visible as NaN, not silently zero


def test_resolve_kv_dtype_names_bad_values():
    cpu = torch.device("cpu")
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_dtype("int8", torch.float32, cpu) == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_dtype("q8_0", torch.float32, cpu)
    with pytest.raises(ValueError, match="fp8_e4m3 needs a CUDA device"):
        resolve_kv_dtype("fp8_e4m3", torch.float32, cpu)
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        CacheConfig(kv_cache_dtype="int4")


def test_int8_pool_holds_more_tokens_and_state_tensors_include_the_scales():
    cpu = torch.device("cpu")
    fp32 = KVPool(uniform_layout(4, 2, 64), torch.float32, cpu, 1 << 20)
    int8 = KVPool(uniform_layout(4, 2, 64), torch.int8, cpu, 1 << 20)
    assert int8.bytes_per_token == 2 * 4 * 2 * (64 + 4)  # the float32 scale per token and head
    assert int8.num_slots == (1 << 20) // int8.bytes_per_token
    assert int8.num_slots > 3.7 * fp32.num_slots
    tensors = int8.state_tensors()
    assert [t.dtype for t in tensors] == [torch.int8] * 8 + [torch.float32] * 8
    assert all(t.shape[0] == int8.num_slots for t in tensors)
    assert sum(t[0].numel() * t.element_size() for t in tensors) == int8.bytes_per_token


# ---- store paths: the same bytes ----------------------------------------------------------------


def rope_tables(t: int, half: int, gen):
    angles = torch.rand(t, half, generator=gen) * 6.28
    return angles.cos(), angles.sin()


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (8, 8, 128)])
def test_cpu_rope_store_writes_the_reference_bytes(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    t, slots = 11, 40
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    qkv[2, heads * head_dim + 5] = 80.0  # an outlier in a key
    qkv[4, heads * head_dim : (heads + kv_heads) * head_dim] = 0  # a zero key row
    cos, sin = rope_tables(t, head_dim // 2, gen)
    slot_mapping = torch.randperm(slots, generator=gen)[:t]
    fk, fv = torch.zeros(slots, kv_heads, head_dim), torch.zeros(slots, kv_heads, head_dim)
    q_f, k_f = cpu_kernels.rope_store(qkv.clone(), cos, sin, fk, fv, slot_mapping, heads)
    ik = QuantizedKV(torch.zeros(slots, kv_heads, head_dim, dtype=torch.int8), torch.zeros(slots, kv_heads))
    iv = QuantizedKV(torch.zeros(slots, kv_heads, head_dim, dtype=torch.int8), torch.zeros(slots, kv_heads))
    q_i, k_i = cpu_kernels.rope_store(qkv.clone(), cos, sin, ik, iv, slot_mapping, heads)
    assert torch.equal(q_i, q_f) and torch.equal(k_i, k_f)  # the rotation does not depend on the pool
    for pool, stored in ((ik, fk), (iv, fv)):
        q, scale = quantize_kv(stored[slot_mapping])
        assert torch.equal(pool.data[slot_mapping], q)
        assert torch.equal(pool.scale[slot_mapping], scale)
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert (ik.data[untouched] == 0).all() and (ik.scale[untouched] == 0).all()
    # the torch path (apply_rope, then store_kv) writes the same bytes for the same rows
    k_ref = apply_rope(
        qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim), cos, sin
    )
    assert torch.equal(quantize_kv(k_ref)[0], ik.data[slot_mapping])


@needs_triton
def test_triton_rope_and_store_writes_the_reference_bytes():
    from agentrt.runtime.kernels.rope_store import rope_and_store

    gen = torch.Generator().manual_seed(1)
    t, heads, kv_heads, head_dim, slots = 7, 4, 2, 32, 20
    q = torch.randn(t, heads, head_dim, generator=gen)
    k = torch.randn(t, kv_heads, head_dim, generator=gen) * 4
    v = torch.randn(t, kv_heads, head_dim, generator=gen)
    k[3, 1] = 0
    positions = torch.randint(0, 64, (t,), generator=gen)
    cos, sin = rope_tables(64, head_dim // 2, gen)
    slot_mapping = torch.randperm(slots, generator=gen)[:t]
    slot_mapping[6] = -1  # a padding row stores nothing
    pools = [
        QuantizedKV(torch.zeros(slots, kv_heads, head_dim, dtype=torch.int8), torch.zeros(slots, kv_heads))
        for _ in range(2)
    ]
    q_rot = rope_and_store(q.clone(), k.clone(), v.clone(), cos, sin, positions, slot_mapping, *pools)
    k_rot = apply_rope(k, cos[positions], sin[positions])
    torch.testing.assert_close(q_rot, apply_rope(q, cos[positions], sin[positions]), atol=1e-5, rtol=1e-5)
    live = slot_mapping[:6]
    for pool, x in zip(pools, (k_rot[:6], v[:6])):
        ref_q, ref_scale = quantize_kv(x)
        torch.testing.assert_close(pool.scale[live], ref_scale, atol=0, rtol=1e-6)
        assert (pool.data[live].int() - ref_q.int()).abs().max() <= 1  # the rotation's last ulp may differ
        assert (pool.data[live] == ref_q).float().mean() > 0.99
        assert (pool.scale.sum(-1) != 0).sum() == 6  # the padding row wrote nothing


# ---- attention backends: the same values -------------------------------------------------------


def sdpa_reference(q, k, v, slots, lens):
    """Decode attention over de-quantized float32 rows: gather + SDPA."""
    mask = (torch.arange(slots.shape[1])[None, :] < lens[:, None])[:, None, None, :]
    kd, vd = gather_kv(k, slots).transpose(1, 2), gather_kv(v, slots).transpose(1, 2)
    gqa = q.shape[1] != kd.shape[1]
    return F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=gqa).squeeze(2)


@needs_kernel
@pytest.mark.parametrize("batch,heads,kv_heads,head_dim,max_len", [(1, 9, 3, 64, 37), (5, 8, 2, 16, 300)])
def test_cpu_kernels_read_the_int8_pool_in_place(batch, heads, kv_heads, head_dim, max_len):
    gen = torch.Generator().manual_seed(batch + max_len)
    num_slots = batch * max_len + 7
    k, v = int8_pool(num_slots, kv_heads, head_dim, gen)
    slots = torch.randperm(num_slots, generator=gen)[: batch * max_len].view(batch, max_len).clone()
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[0] = max_len
    q = torch.randn(batch, heads, head_dim, generator=gen) * 3
    ref = sdpa_reference(q, k, v, slots, lens)
    got = cpu_kernels.decode_attention(q, k, v, slots, lens)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    # the same pool de-quantized into float32: the kernel's int8 path gives the float path's values
    torch.testing.assert_close(
        got, cpu_kernels.decode_attention(q, dense(k), dense(v), slots, lens), atol=2e-5, rtol=1e-5
    )
    rows = KernelRows(slots, torch.arange(batch), lens)
    assert torch.equal(cpu_kernels.attention(q, k, v, rows), got)  # the row kernel: same bits
    with pytest.raises(ValueError, match="both be int8"):
        cpu_kernels.decode_attention(q, k, dense(v), slots, lens)


@needs_triton
@needs_kernel
def test_triton_kernels_read_the_int8_pool_like_the_cpu_kernel():
    from agentrt.runtime.kernels.decode_attention import decode_attention, decode_attention_ref
    from agentrt.runtime.kernels.extend_attention import extend_attention, extend_attention_ref

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, lens = 4, 2, 32, [9, 70, 33]
    num_slots = len(lens) * max(lens) + 5
    k, v = int8_pool(num_slots, kv_heads, head_dim, gen)
    table = torch.randperm(num_slots, generator=gen)[: len(lens) * max(lens)].view(len(lens), max(lens))
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = decode_attention(q, k, v, table.to(torch.int32), seq_lens)
    torch.testing.assert_close(
        out, decode_attention_ref(q, k, v, table.to(torch.int32), seq_lens), atol=2e-5, rtol=1e-4
    )
    slots = table.clone()
    for b, n in enumerate(lens):
        slots[b, n:] = 0
    cpu = cpu_kernels.decode_attention(q, k, v, slots, torch.tensor(lens))
    torch.testing.assert_close(out, cpu, atol=2e-5, rtol=1e-4)  # both backends read the same values
    # extend: new tokens over a cached prefix, all read from the int8 pool
    q_lens, prefixes = [5, 12], [4, 20]
    tq = torch.randn(sum(q_lens) + 1, heads, head_dim, generator=gen)
    ints = [torch.tensor(x, dtype=torch.int32) for x in ([1, 6], q_lens, prefixes)]
    args = (tq, k, v, *ints, table[:2].to(torch.int32).contiguous())
    ext = extend_attention(*args, max(q_lens))
    torch.testing.assert_close(ext[1:], extend_attention_ref(*args)[1:], atol=2e-5, rtol=1e-4)


# ---- whole models ---------------------------------------------------------------------------------


def tiny_runner(path, backend: str, kv: str, quantization: str = "none") -> ModelRunner:
    cfg = ModelConfig(
        model=str(path), device="cpu", dtype="float32", attention_backend=backend, quantization=quantization
    )
    return ModelRunner(cfg, CacheConfig(kv_cache_bytes=4 << 20, kv_cache_dtype=kv))


def prefill_then_decode(r: ModelRunner, prompts, steps: int = 3) -> torch.Tensor:
    """Each prompt prefilled in two chunks (the second over the first's cached K/V), then `steps`
    batched decode steps: every step's logits, stacked [steps + 1, B, vocab]."""
    slots = [r.kv.allocate(len(p) + steps) for p in prompts]
    half = [len(p) // 2 for p in prompts]
    r.execute([SeqChunk(p[:h], 0, s[:h], need_logits=False) for p, s, h in zip(prompts, slots, half)])
    out = [r.execute([SeqChunk(p[h:], h, s[: len(p)]) for p, s, h in zip(prompts, slots, half)])]
    for i in range(steps):
        out.append(
            r.execute([SeqChunk([7 + i], len(p) + i, s[: len(p) + i + 1]) for p, s in zip(prompts, slots)])
        )
    for s in slots:
        r.kv.free(s)
    return torch.stack(out)


PROMPTS = [list(range(100, 131)), list(range(300, 309)), list(range(1000, 1050))]


@needs_kernel
def test_backends_agree_on_an_int8_pool(tiny_gqa_llama_dir, monkeypatch):
    """The torch reference, the C++ kernels (layer by layer and the whole-stack op) and, where
    available, Triton give the same logits from an int8 KV cache; the int8 logits stay near float32's."""
    ref = prefill_then_decode(tiny_runner(tiny_gqa_llama_dir, "torch", "int8"), PROMPTS)
    cpu = tiny_runner(tiny_gqa_llama_dir, "cpu", "int8")
    torch.testing.assert_close(prefill_then_decode(cpu, PROMPTS), ref, atol=1e-4, rtol=1e-4)
    # int8 weights: the whole decoder stack in one C++ op vs the same kernels layer by layer
    cpu = tiny_runner(tiny_gqa_llama_dir, "cpu", "int8", quantization="int8")
    assert cpu.kv.quantized and isinstance(cpu.backend, CpuStackBackend)
    with torch.autograd.profiler.profile() as prof:
        stacked = prefill_then_decode(cpu, PROMPTS)
    assert sum(e.name == "agentrt_cpu::decode_layers" for e in prof.function_events) == 3
    monkeypatch.setattr(cpu, "backend", cpu.backend.eager)  # the same C++ kernels layer by layer
    layers = prefill_then_decode(cpu, PROMPTS)
    monkeypatch.undo()
    assert torch.equal(stacked, layers)  # the same kernels in the same order
    if triton_usable(torch.device("cpu")):
        triton = prefill_then_decode(tiny_runner(tiny_gqa_llama_dir, "triton", "int8"), PROMPTS)
        torch.testing.assert_close(triton, ref, atol=1e-4, rtol=1e-4)
    fp32 = prefill_then_decode(tiny_runner(tiny_gqa_llama_dir, "cpu", "float32"), PROMPTS)
    assert 0 < (fp32 - ref).abs().max() < 0.05  # quantized, and close


@pytest.mark.slow  # torch.compile of the decode step (~30 s)
def test_compiled_decode_stores_into_an_int8_pool(tiny_gqa_llama_dir, tmp_path):
    """The compiled decode step (torch.compile pieces around the attention) writes an int8 pool through
    the same store as the eager path: identical logits."""
    eager = prefill_then_decode(tiny_runner(tiny_gqa_llama_dir, "torch", "int8"), PROMPTS)
    cfg = ModelConfig(
        model=str(tiny_gqa_llama_dir), device="cpu", dtype="float32", attention_backend="torch",
        compile_decode=True, cache_dir=tmp_path,
    )  # fmt: skip
    r = ModelRunner(cfg, CacheConfig(kv_cache_bytes=4 << 20, kv_cache_dtype="int8"), max_num_seqs=4)
    compiled = r.backend.compiled
    assert compiled.active, compiled.failure
    got = prefill_then_decode(r, PROMPTS)
    assert compiled.num_runs > 0
    torch.testing.assert_close(got, eager, atol=1e-5, rtol=1e-5)


def test_memory_plan_prints_tokens_per_gib_for_each_kv_dtype(tiny_gqa_llama_dir):
    r = tiny_runner(tiny_gqa_llama_dir, "torch", "int8")
    plan = r.memory_plan
    per_gib = dict(plan.kv_tokens_per_gib)
    a = r.arch
    assert per_gib["int8"] == (1 << 30) // (2 * a.num_layers * a.num_kv_heads * (a.head_dim + 4))
    assert per_gib["float32"] == (1 << 30) // (2 * a.num_layers * a.num_kv_heads * a.head_dim * 4)
    assert per_gib["float32"] * 2 == per_gib["float16"] and per_gib["int8"] > 3 * per_gib["float32"]
    text = plan.describe()
    assert "KV pool int8" in text and f"int8 {per_gib['int8']}" in text


@pytest.mark.parametrize(
    "kv,bound,agreement",
    [pytest.param(*case, marks=pytest.mark.slow) for case in (("int8", 1.0, 0.95), ("float16", 0.05, 0.99))],
)
def test_default_model_small_kv_logits_stay_within_tolerance(
    default_model_dir, tokenizer, kv, bound, agreement
):
    """Teacher-forced over float32-KV greedy continuations (4 chat prompts, 48 positions each, the CPU
    kernels): log-probabilities of every token the float32 run gives p > 1e-3 differ by at most
    `bound`, top-1 agreement at least `agreement` (int8 measured 0.42 and 98.4% on 2026-12-04;
    float16 0.0105 and 100% on 2026-12-05, docs/benchmarks.md)."""
    from tests.support.models import chat_ids

    questions = [
        "Write a short story about a robot who learns to paint.",
        "Explain how a hash map works, step by step.",
        "List five capitals in Europe and one fact about each.",
        "What is the difference between TCP and UDP?",
    ]
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    cfg = ModelConfig(model=str(default_model_dir), device="cpu", dtype="float32", quantization="none")
    runners = {
        name: ModelRunner(cfg, CacheConfig(kv_cache_bytes=32 << 20, kv_cache_dtype=name))
        for name in ("float32", kv)
    }
    n = 48
    worst, agree, total = 0.0, 0, 0
    for p in prompts:
        logprobs = {}
        ids = list(p)
        for name, r in runners.items():
            slots = r.kv.allocate(len(p) + n)
            rows = [r.execute([SeqChunk(p, 0, slots[: len(p)])])[0]]
            for i in range(len(p), len(p) + n - 1):
                if name == "float32":
                    ids.append(int(rows[-1].argmax()))  # the float32 run's greedy tokens, fed to both
                rows.append(r.execute([SeqChunk(ids[i : i + 1], i, slots[: i + 1])])[0])
            r.kv.free(slots)
            logprobs[name] = torch.stack(rows).log_softmax(-1)
        a, b = logprobs["float32"], logprobs[kv]
        worst = max(worst, (a - b).abs()[a.exp() > 1e-3].max().item())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    print(f"{kv} KV vs float32 KV: worst |d logprob| {worst:.4f}, top-1 agreement {agree}/{total}")
    assert 0 < worst < bound
    assert agree >= agreement * total


def test_engine_serves_with_int8_kv_and_refuses_a_bad_combination(default_model_dir, tokenizer):
    from agentrt.runtime.engine import Engine
    from agentrt.runtime.request import SamplingParams

    def engine(kv: str, deterministic: bool = False) -> Engine:
        return Engine(
            EngineConfig(
                model=ModelConfig(
                    model=str(default_model_dir), device="cpu", dtype="float32", deterministic=deterministic
                ),
                cache=CacheConfig(kv_cache_bytes=16 << 20, kv_cache_dtype=kv),
                scheduler=SchedulerConfig(max_num_seqs=4),
            )
        )

    with pytest.raises(ValueError, match="reads float32, float16 or int8 KV, not bfloat16"):
        engine("bfloat16", deterministic=True)
    eng = engine("int8")
    ids = tokenizer.encode("The capital of France is")
    out = eng.generate([(ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), None)])
    assert len(out[0].token_ids) == 6


@pytest.mark.slow  # ~15 s on 2 cores; the tiers' own moves are in test_kv_tiers_fake.py
def test_tiers_move_int8_pages_with_their_scales(default_model_dir, tokenizer, tmp_path):
    """An int8 pool far smaller than the working set, with a host tier and a disk tier: prompts
    evicted from the pool come back from the lower tiers (K/V data and scales) and give the greedy
    tokens of an int8 pool that holds everything."""
    from agentrt.runtime.engine import Engine
    from agentrt.runtime.request import SamplingParams

    system = tokenizer.encode("You are a careful assistant that answers in one line. " * 12)
    prompts = [
        system + tokenizer.encode(f" Agent {i}: history {' '.join(str(i * j) for j in range(60))}")
        for i in range(6)
    ]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def engine(pool_bytes: int, tiers: bool) -> Engine:
        cache = CacheConfig(kv_cache_bytes=pool_bytes, kv_cache_dtype="int8", kv_tier_block_tokens=16)
        if tiers:
            cache = CacheConfig(
                kv_cache_bytes=pool_bytes,
                kv_cache_dtype="int8",
                kv_tier_block_tokens=16,
                kv_host_bytes=2 << 20,
                kv_disk_dir=str(tmp_path / "kv"),
            )
        return Engine(
            EngineConfig(
                model=ModelConfig(model=str(default_model_dir), device="cpu", dtype="float32"),
                cache=cache,
                scheduler=SchedulerConfig(max_num_seqs=2),
            )
        )

    big = engine(64 << 20, tiers=False)
    reference = [o.token_ids for o in big.generate([(p, params, None) for p in prompts])]
    per_token = big.runner.kv.bytes_per_token
    small = engine(int(1.6 * max(len(p) for p in prompts) * per_token), tiers=True)
    assert small.runner.kv.quantized and small.runner.kv.num_slots < sum(len(p) for p in prompts) / 3
    first = [o.token_ids for p in prompts for o in small.generate([(p, params, None)])]
    again = small.generate([(p, params, None) for p in prompts])
    small.close()
    assert first == reference and [o.token_ids for o in again] == reference
    lower = sum(
        o.cached_tokens_by_tier.get("host", 0) + o.cached_tokens_by_tier.get("disk", 0) for o in again
    )
    assert lower >= 4 * 100  # each evicted agent's own history came back from below (measured 877)
