"""The sliding-window KV pool (runtime/kv_window.py): windowed layers hold rows only for the tokens a
request can still attend, and the engine's tokens are the same as with every layer kept per token.

The pool's bookkeeping is checked alone; then tiny random-weight Gemma 3 (1 full : 2 windowed
layers), gpt-oss (sinks) and Mistral (every layer windowed) models run a workload of shared
prefixes, repeats, 16-token prefill chunks and preemptions on pools so small that window rows are
reclaimed hundreds of times: every greedy token equals the plain pool's, which equals each prompt
run alone (the engine is batch- and cache-invariant, so equal means bit-identical logits).
"""

from __future__ import annotations

import random

import pytest
import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.kv_cache import KVPool
from agentrt.runtime.kv_window import SlidingWindowKVPool, plan_window_pool
from agentrt.runtime.request import SamplingParams
from tests.support.families import WINDOW, save_family

# ---- the pool alone -------------------------------------------------------------------------------


def _pool(slots=12, rows=6, windows=(None, 3, 3)) -> SlidingWindowKVPool:
    return SlidingWindowKVPool(windows, 1, 4, torch.float32, torch.device("cpu"), slots, rows)


def test_pool_shapes_and_bytes():
    pool = _pool()
    assert [k.shape[0] for k in pool.k] == [12, 7, 7]  # window rows + the null row 0
    assert pool.window == 3
    assert pool.bytes_per_token == 2 * 4 * 4  # the one full layer
    assert pool.window_bytes_per_token == 2 * 2 * 4 * 4
    assert pool.pool_bytes == 12 * 32 + 6 * 64


def test_allocate_maps_rows_and_free_returns_them():
    pool = _pool()
    slots = pool.allocate(4)
    rows = pool.swa_map[slots].tolist()
    assert len(set(rows)) == 4 and 0 not in rows
    assert pool.num_free_window == 2
    assert pool.allocate(3) is None  # 8 slots free but 2 rows: nothing taken
    assert pool.num_free == 8 and pool.num_free_window == 2
    pool.free(slots[:2])
    assert pool.swa_map[slots[:2]].tolist() == [0, 0] and pool.num_free_window == 4


def test_reclaim_drops_least_recent_rows_outside_live_windows():
    pool = _pool()
    a = pool.allocate(3)
    b = pool.allocate(3)
    pool.touch(a[:1])  # a[0] is now the most recent
    assert pool.reclaim(2, live=set(b)) == 2
    assert [pool.has_window_row(s) for s in a] == [True, False, False]
    assert all(pool.has_window_row(s) for s in b)
    assert pool.num_reclaimed == 2 and pool.num_free == 6  # the slots themselves stay allocated
    assert pool.reclaim(6, live=set(a + b)) == 0


def test_demoted_rows_are_reclaimed_first():
    pool = _pool()
    a = pool.allocate(3)
    b = pool.allocate(3)
    pool.demote(b[:2])  # a request moved past them
    assert pool.reclaim(2, live=set()) == 2
    assert [pool.has_window_row(s) for s in a + b] == [True, True, True, False, False, True]


def test_usable_prefix_needs_the_last_window():
    pool = _pool(slots=12, rows=10)
    s = pool.allocate(8)
    assert pool.usable_prefix(s) == 8
    assert pool.reclaim(5, live=set(s[3:])) == 3  # positions 0..2 lose their rows (2 were free)
    assert pool.usable_prefix(s) == 8
    assert pool.usable_prefix(s[:6]) == 6  # 3..5 hold
    assert pool.usable_prefix(s[:5]) == 0  # 2 lost its row, and so did everything before it
    assert pool.reclaim(6, live=set(s) - {s[4]}) == 1
    assert pool.usable_prefix(s) == 8  # 5..7 hold
    assert pool.usable_prefix(s[:7]) == 0  # 4 lost its row, 2 too


def test_adopt_moves_a_row_to_the_tree_slot():
    pool = _pool()
    tree = pool.allocate(2)
    pool.reclaim(6, live=set())  # the tree's slots lose their rows
    mine = pool.allocate(2)
    row = pool.swa_map[mine[0]].item()
    pool.adopt(mine, tree)
    assert pool.swa_map[tree[0]].item() == row and pool.has_window_row(tree[1])
    assert pool.num_free == 10 and pool.num_free_window == 4


def test_plan_window_pool():
    layer = 256
    assert plan_window_pool((None, None), layer, 1 << 20, 16, 512, 4096) == "no sliding-window layers"
    assert "not shorter" in plan_window_pool((None, 512), layer, 1 << 20, 16, 512, 512)
    slots, rows = plan_window_pool((None, 512, 512), layer, 1 << 30, 16, 512, 8192)
    assert rows == 2 * (16 * 512 + 512)
    assert slots * layer + rows * 2 * layer <= 1 << 30
    assert slots > 2.5 * (1 << 30) // (3 * layer)  # the plain pool's tokens: every layer per token
    slots, rows = plan_window_pool((None, 512, 512), layer, 8 << 20, 16, 512, 8192)
    assert rows == (8 << 20) // 2 // (2 * layer) and slots == (8 << 20) // 2 // layer  # rows: half at most
    assert isinstance(plan_window_pool((None, 512, 512), layer, 1 << 19, 16, 512, 8192), str)  # too small
    slots, rows = plan_window_pool((64, 64), layer, 1 << 20, 4, 64, 4096)  # every layer windowed
    assert rows == (1 << 20) // (2 * layer) and slots == 4 * rows
    slots, rows = plan_window_pool((None, 24), layer, 1 << 20, 4, 16, 512, 0.5)
    assert rows == int(0.5 * slots) and slots * layer + rows * layer <= 1 << 20
    with pytest.raises(ValueError, match="fewer than one request needs"):
        plan_window_pool((None, 512), layer, 1 << 20, 4, 512, 4096, 0.01)


def test_a_ratio_with_the_window_pool_off_is_refused():
    from agentrt.runtime.config import CacheConfig

    with pytest.raises(ValueError, match="disable_hybrid_swa_memory turns off"):
        CacheConfig(swa_full_tokens_ratio=0.5, disable_hybrid_swa_memory=True)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        CacheConfig(swa_full_tokens_ratio=1.5)
    assert CacheConfig(disable_hybrid_swa_memory=True).swa_full_tokens_ratio is None


# ---- the engine -------------------------------------------------------------------------------------

FAMILIES = ["gemma3", "gpt_oss", "mistral_window"]


@pytest.fixture(scope="module")
def window_dirs(tmp_path_factory, default_model_dir):
    return {name: save_family(name, tmp_path_factory.mktemp(name), default_model_dir) for name in FAMILIES}


def _engine(path, cache: dict, scheduler: dict | None = None, **kw) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=str(path), device="cpu", dtype="float32", **kw.pop("model", {})),
            cache=CacheConfig(**cache),
            scheduler=SchedulerConfig(**(scheduler or {})),
            speculative=kw.pop("speculative", SpecConfig()),
        )
    )


def _workload() -> list[list[int]]:
    """Prompts of 5-130 tokens, most sharing 20-70 tokens of one prefix, the first three again."""
    rng = random.Random(0)
    base = [rng.randrange(49152) for _ in range(70)]
    prompts = [
        base[: rng.choice([0, 20, 50, 70])] + [rng.randrange(49152) for _ in range(rng.randrange(5, 60))]
        for _ in range(10)
    ]
    return prompts + prompts[:3]


def _run(engine: Engine, prompts, new: int = 30) -> list[list[int]]:
    no_eos = {t: -100.0 for t in engine.stop_ids}
    params = SamplingParams(temperature=0, max_tokens=new, logit_bias=no_eos)
    return [o.token_ids for o in engine.generate([(ids, params, None) for ids in prompts])]


@pytest.mark.parametrize("family", FAMILIES)
def test_small_window_pool_gives_the_plain_pools_tokens(window_dirs, family):
    path = window_dirs[family]
    prompts = _workload()
    plain = _engine(path, {"kv_cache_bytes": 16 << 20, "disable_hybrid_swa_memory": True})
    assert type(plain.runner.kv) is KVPool
    alone = [_run(plain, [p])[0] for p in prompts]
    tight = {"max_num_seqs": 4, "max_num_batched_tokens": 16}
    for ratio, budget in [(0.25, 128 << 10), (0.5, 96 << 10)]:
        engine = _engine(path, {"kv_cache_bytes": budget, "swa_full_tokens_ratio": ratio}, tight)
        kv = engine.runner.kv
        assert isinstance(kv, SlidingWindowKVPool) and kv.window == WINDOW
        assert _run(engine, prompts) == alone, f"{family}: ratio {ratio}, in order"
        assert _run(engine, prompts[::-1])[::-1] == alone, f"{family}: ratio {ratio}, reversed (cache hits)"
        assert kv.num_reclaimed > 100, "the workload did not press the window rows"
        assert engine.stats.num_cached_prompt_tokens > 0


def test_window_pool_with_int8_kv_and_ngram_speculation(window_dirs):
    path = window_dirs["gemma3"]
    prompts = [p + p[-12:] * 2 for p in _workload()[:6]]  # repeats for n-gram drafts to find
    ref = _engine(
        path, {"kv_cache_bytes": 16 << 20, "kv_cache_dtype": "int8", "disable_hybrid_swa_memory": True}
    )
    alone = [_run(ref, [p])[0] for p in prompts]
    engine = _engine(
        path,
        {"kv_cache_bytes": 96 << 10, "kv_cache_dtype": "int8", "swa_full_tokens_ratio": 0.5},
        {"max_num_seqs": 4, "max_num_batched_tokens": 32},
        speculative=SpecConfig(method="ngram"),
    )
    assert isinstance(engine.runner.kv, SlidingWindowKVPool)
    assert _run(engine, prompts) == alone
    assert engine.runner.kv.num_reclaimed > 0


def test_window_pool_saves_memory_and_says_so(window_dirs):
    path = window_dirs["gemma3"]
    plain = _engine(path, {"kv_cache_bytes": 16 << 20, "disable_hybrid_swa_memory": True}).runner
    hybrid = _engine(path, {"kv_cache_bytes": 16 << 20}).runner
    assert hybrid.kv.pool_bytes <= 16 << 20
    assert hybrid.kv.num_slots > 2.5 * plain.kv.num_slots  # 1 of 3 layers per token, windows apart
    text = hybrid.memory_plan.describe()
    assert "sliding-window pool (the model has 2 sliding-window layers, window 24)" in text
    assert (
        f"{hybrid.kv.num_slots} tokens" in text
        and f"{hybrid.kv.num_window_slots} rows x 512 bytes/row" in text
    )
    assert "plain pool: the windowed layers keep every token too (disable_hybrid_swa_memory)" in (
        plain.memory_plan.describe()
    )
    from agentrt.commands.check import check_model

    report = check_model(str(path), kv_cache_bytes=16 << 20, device="cpu", dtype="float32")
    kv = hybrid.kv  # `agentrt check` counts the pool the engine builds
    assert report.capacity.pool_sequences == min(kv.num_slots // 512, kv.num_window_slots // 24) > 0
    tiers = _engine(path, {"kv_cache_bytes": 16 << 20, "kv_host_bytes": 1 << 20}).runner
    assert type(tiers.kv) is KVPool and "host/disk tiers" in tiers.memory_plan.describe()
    torch_path = _engine(path, {"kv_cache_bytes": 16 << 20}, model={"attention_backend": "torch"}).runner
    assert isinstance(torch_path.kv, SlidingWindowKVPool)  # the torch reference path reads it too


# gpt-oss's run (sinks too) is slow under the interpreter (~28 s): with the slow tests
# slow under the interpreter (gemma3 27-36 s, gpt-oss's sinks ~28 s): with the slow tests; the Triton
# window kernels themselves are in test_triton_window_sinks.py
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) for f in ("gemma3", "gpt_oss")])
def test_triton_path_reads_the_window_rows(window_dirs, family):
    """The Triton kernels (the interpreter on a CPU) store to and read the windowed layers' rows
    through the page table mapped by `swa_map`: the same tokens as the plain pool's, under pressure."""
    from agentrt.runtime.kernels import triton_usable

    if not triton_usable(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("needs triton (TRITON_INTERPRET=1 on CPU)")
    path = window_dirs[family]
    prompts = [p[:40] for p in _workload()[:5]]
    triton = {"model": {"attention_backend": "triton"}}
    plain = _engine(path, {"kv_cache_bytes": 16 << 20, "disable_hybrid_swa_memory": True}, **triton)
    alone = [_run(plain, [p], new=12)[0] for p in prompts]
    engine = _engine(
        path,
        {"kv_cache_bytes": 64 << 10, "swa_full_tokens_ratio": 0.5},
        {"max_num_seqs": 3, "max_num_batched_tokens": 16},
        **triton,
    )
    assert engine.runner.attention_backend == "triton" and isinstance(engine.runner.kv, SlidingWindowKVPool)
    assert _run(engine, prompts, new=12) == alone
    assert engine.runner.kv.num_reclaimed > 0


def test_a_shared_system_prompt_keeps_its_window_under_row_pressure(window_dirs):
    """Every request moves past the shared prefix's end; its rows must not be the first reclaimed
    (the window before a request's cache hit is kept out of the demotion), or each pair's first
    request would recompute the prefix."""
    rng = random.Random(0)
    system = [rng.randrange(100, 49000) for _ in range(100)]
    prompts = [system + [rng.randrange(100, 49000) for _ in range(20)] for _ in range(16)]
    engine = _engine(
        window_dirs["gemma3"], {"kv_cache_bytes": 4 << 20}, {"max_num_seqs": 4, "max_num_batched_tokens": 16}
    )
    params = SamplingParams(temperature=0, max_tokens=20, logit_bias={t: -100.0 for t in engine.stop_ids})
    hits = []
    for i in range(0, len(prompts), 2):
        requests = [engine.make_request(p, params) for p in prompts[i : i + 2]]
        for r in requests:
            engine.enqueue(r)
        while engine.has_work():
            engine.step()
        hits += [r.cache.num_cached_tokens for r in requests]
    assert engine.runner.kv.num_reclaimed > 0
    assert hits == [0] + [100] * (len(prompts) - 1)


def test_train_medusa_reclaims_the_caches_rows(window_dirs, tmp_path):
    """`agentrt train-medusa` computes hidden states of whole sequences after the engine generated
    them: the prefix cache then holds the window rows, which it takes back."""
    import json
    import subprocess
    import sys

    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(60))}) + "\n" for _ in range(24)
        )
    )
    cmd = [sys.executable, "-m", "agentrt.cli", "train-medusa", str(window_dirs["gemma3"]), "--device", "cpu"]
    cmd += ["--prompts", str(prompts), "--output", str(tmp_path / "heads"), "--max-tokens", "48"]
    cmd += ["--epochs", "1", "--num-heads", "2", "--kv-cache-bytes", str(1200 << 10)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow  # ~19 s under the Triton interpreter
def test_triton_medusa_tree_with_windows_matches_plain_decoding(window_dirs, tmp_path):
    """A branching Medusa tree verified by the Triton extend kernel: a node's window is counted from
    its position (the prefix + its depth), not its index in the tree; with the sliding-window pool
    under pressure the tokens equal plain decoding's."""
    from agentrt.runtime.kernels import triton_usable
    from agentrt.speculative.medusa import MedusaHeads

    if not triton_usable(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("needs triton (TRITON_INTERPRET=1 on CPU)")
    torch.manual_seed(1)
    heads = MedusaHeads(64, 49152, 3, 1, True)
    with torch.no_grad():
        for p in heads.parameters():
            p.mul_(0.01)
    heads.save(str(tmp_path / "medusa"), dtype=torch.float32)
    rng = random.Random(3)
    base = [rng.randrange(100, 49000) for _ in range(60)]
    prompts = [
        base[:n] + [rng.randrange(100, 49000) for _ in range(k)] for n, k in [(0, 30), (24, 10), (48, 5)]
    ]
    path, triton = window_dirs["gemma3"], {"model": {"attention_backend": "triton"}}
    plain = _engine(path, {"kv_cache_bytes": 16 << 20, "disable_hybrid_swa_memory": True}, **triton)
    alone = [_run(plain, [p], new=12)[0] for p in prompts]
    tree = ((0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0))
    spec = SpecConfig(method="medusa", medusa_heads=str(tmp_path / "medusa"), medusa_tree=tree)
    engine = _engine(
        path,
        {"kv_cache_bytes": 64 << 10, "swa_full_tokens_ratio": 0.25},
        {"max_num_seqs": 3, "max_num_batched_tokens": 16},
        speculative=spec,
        **triton,
    )
    assert _run(engine, prompts, new=12) == alone
