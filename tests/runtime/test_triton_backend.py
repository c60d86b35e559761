"""The Triton attention path end to end (CPU: the Triton interpreter; GPU: compiled kernels):
engine outputs identical to the torch reference path, the CUDA-graph decode path's padding, the
device slot table, and the memory plan."""

from __future__ import annotations

import json

import pytest
import torch

from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.backends import run_chunks
from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kernels import triton_usable
from agentrt.runtime.model_runner import plan_kv_budget
from agentrt.runtime.request import SamplingParams

pytestmark = pytest.mark.skipif(
    not triton_usable(torch.device("cpu")) and not torch.cuda.is_available(),
    reason="needs triton (TRITON_INTERPRET=1 on CPU)",
)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def tiny_engine(path, backend: str, max_num_seqs: int = 4, graph_sizes=(1, 2, 4)) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(
                model=str(path),
                device="cpu",
                dtype="float32",
                attention_backend=backend,
                cuda_graph_batch_sizes=graph_sizes,
            ),
            cache=CacheConfig(kv_cache_bytes=8 << 20),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=48),
        )
    )


def workload(tokenizer):
    shared = tokenizer.encode(
        "A shared system prompt that several requests start with, long enough to be cached. " * 2
    )
    prompts = [shared + tokenizer.encode(f"Question {i}: what is {i} plus {i}?") for i in range(3)]
    prompts.append(tokenizer.encode("An unrelated short prompt."))
    # few decode steps: each costs ~1 s under the Triton interpreter; the request lengths differ
    # (5 and 7) so batches shrink below the captured sizes at the end
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    reqs = [(p, greedy, None) for p in prompts]
    reqs.append(
        (
            prompts[0],
            SamplingParams(max_tokens=7, temperature=0.0),
            ConstraintSpec(kind="json_schema", value=json.dumps(SCHEMA)),
        )
    )
    return reqs


def test_triton_engine_matches_torch_engine(tiny_gqa_llama_dir, tokenizer):
    """Prefill in chunks (48-token budget), a prefix-cache hit (extend over a cached prefix), batched
    decode through the static-buffer graph path with padding (3 -> 4), a constrained request: token
    for token the same as the torch path, in a cold and a warm round."""
    reqs = workload(tokenizer)
    outs = {}
    for backend in ("torch", "triton"):
        eng = tiny_engine(tiny_gqa_llama_dir, backend)
        outs[backend] = [[o.token_ids for o in eng.generate(reqs)] for _ in range(2)]  # cold, then warm
        if backend == "triton":
            assert eng.runner.attention_backend == "triton"
            assert (
                eng.runner.backend.graphs.num_runs > 0
            )  # decode steps went through the padded static buffers
            assert eng.stats.num_cached_prompt_tokens > 0
        eng.grammar.shutdown()
    assert outs["triton"] == outs["torch"]
    assert outs["torch"][0] == outs["torch"][1]


def test_graph_path_logits_match_reference_with_padding(tiny_gqa_llama_dir):
    """Logits of a 3-sequence decode via the static buffers (padded to 4) and via the eager Triton
    path match the torch reference; padding rows write no KV."""
    eng = tiny_engine(tiny_gqa_llama_dir, "triton")
    runner = eng.runner
    gen = torch.Generator().manual_seed(0)
    lens = [5, 17, 33]
    chunks_prefill, chunks_decode = [], []
    for n in lens:
        slots = runner.kv.allocate(n + 1)
        ids = torch.randint(0, 1000, (n + 1,), generator=gen).tolist()
        chunks_prefill.append(SeqChunk(ids[:n], 0, slots[:n]))
        chunks_decode.append(SeqChunk(ids[n:], n, slots, seq_key=("seq", n)))
    ref_prefill = run_chunks(runner.model, runner.kv.k, runner.kv.v, chunks_prefill, runner.device)
    k_before = [k.clone() for k in runner.kv.k]
    ref = run_chunks(runner.model, runner.kv.k, runner.kv.v, chunks_decode, runner.device)
    assert runner.backend.graphs.accepts(chunks_decode) and runner.backend.graphs.padded_size(3) == 4
    via_graph = runner.execute(chunks_decode)
    eager = runner.backend.eager.run(chunks_decode)
    torch.testing.assert_close(via_graph, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(eager, ref, atol=1e-4, rtol=1e-4)
    used = {s for c in chunks_decode for s in c.slots}
    untouched = [s for s in range(runner.kv.num_slots) if s not in used]
    for k_now, k_old in zip(runner.kv.k, k_before):
        assert torch.equal(k_now[untouched], k_old[untouched])  # the padding row stored nothing
    assert ref_prefill.shape[0] == 3
    # a batch larger than the largest captured size runs the eager Triton path, same logits
    extra = runner.kv.allocate(2 * 8)
    more = chunks_decode + [
        SeqChunk([7], 7, extra[:8], seq_key="x"),
        SeqChunk([8], 7, extra[8:], seq_key="y"),
    ]
    run_chunks(
        runner.model,
        runner.kv.k,
        runner.kv.v,
        [SeqChunk([1] * 7, 0, extra[:7]), SeqChunk([2] * 7, 0, extra[8:15])],
        runner.device,
    )
    assert not runner.backend.graphs.accepts(more)
    runs = runner.backend.graphs.num_runs
    torch.testing.assert_close(
        runner.execute(more),
        run_chunks(runner.model, runner.kv.k, runner.kv.v, more, runner.device),
        atol=1e-4,
        rtol=1e-4,
    )
    assert runner.backend.graphs.num_runs == runs
    eng.grammar.shutdown()


def test_slot_table_uploads_changes_and_recycles_rows():
    from agentrt.runtime.backends.triton import SlotTable

    table = SlotTable(num_rows=3, max_len=16, device=torch.device("cpu"))
    rows = table.sync([("a", [4, 5, 6]), ("b", [9])])
    assert table.table[rows[0], :3].tolist() == [4, 5, 6] and table.table[rows[1], 0] == 9
    rows2 = table.sync([("a", [4, 5, 6, 7])])  # one new token: same row, tail written
    assert rows2 == rows[:1] and table.table[rows[0], :4].tolist() == [4, 5, 6, 7]
    table.sync([("a", [4, 5, 11, 12])])  # a rewritten tail (a speculative path kept other slots)
    assert table.table[rows[0], :4].tolist() == [4, 5, 11, 12]
    table.sync([("c", [1]), ("d", [2])])  # 4 keys, 3 rows: "b" (least recently used) gives its row
    assert table.sync([("a", [4, 5, 11, 12])]) == rows[:1]
    with pytest.raises(ValueError, match="twice"):
        table.sync([("a", [1]), ("a", [1])])
    with pytest.raises(ValueError, match="exceeds"):
        table.sync([("e", list(range(17)))])
    with pytest.raises(ValueError, match="more sequences"):
        table.sync([("w", [1]), ("x", [1]), ("y", [1]), ("z", [1])])


def test_memory_plan(monkeypatch):
    cpu = torch.device("cpu")
    assert plan_kv_budget(CacheConfig(), cpu, 1000, 100, 8, 1000, 64)[0] == 1 << 30
    assert plan_kv_budget(CacheConfig(kv_cache_bytes=12345), cpu, 1000, 100, 8, 1000, 64)[0] == 12345
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    budget, reserve, total = plan_kv_budget(
        CacheConfig(), torch.device("cuda"), 131072, 8192, 16, 128256, 4096
    )
    assert total == 80 * gib and reserve >= gib
    assert budget == int(0.9 * 80 * gib) - 20 * gib - reserve
    with pytest.raises(ValueError, match="not enough device memory"):
        plan_kv_budget(
            CacheConfig(gpu_memory_utilization=0.26), torch.device("cuda"), 131072, 8192, 16, 128256, 4096
        )
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(attention_backend="flash")


def test_verify_chunks_with_draft_trees_match_reference(tiny_gqa_llama_dir):
    """Speculative verify chunks (explicit positions, a tree mask; a chain; a plain decode in the
    same batch) give the same logits on the Triton path as on the torch path."""
    from agentrt.speculative.tree import DraftTree

    eng = tiny_engine(tiny_gqa_llama_dir, "triton")
    runner = eng.runner
    gen = torch.Generator().manual_seed(1)
    tree = DraftTree(torch.randint(0, 1000, (6,), generator=gen).tolist(), [-1, -1, 0, 0, 1, 2])
    chunks = []
    for i, ctx in enumerate((9, 20, 31)):
        slots = runner.kv.allocate(ctx + 1 + len(tree))
        ids = torch.randint(0, 1000, (ctx,), generator=gen).tolist()
        run_chunks(runner.model, runner.kv.k, runner.kv.v, [SeqChunk(ids, 0, slots[:ctx])], runner.device)
        if i == 0:  # a tree
            chunks.append(
                SeqChunk(
                    [ids[-1], *tree.token_ids],
                    ctx,
                    slots,
                    True,
                    1 + len(tree),
                    [ctx, *(ctx + d for d in tree.depths)],
                    tree.attention_mask(),
                    seq_key=i,
                )
            )
        elif i == 1:  # a chain: consecutive positions, causal
            chunks.append(
                SeqChunk(
                    [ids[-1], 5, 6, 7],
                    ctx,
                    slots[: ctx + 4],
                    True,
                    4,
                    list(range(ctx, ctx + 4)),
                    None,
                    seq_key=i,
                )
            )
        else:
            chunks.append(SeqChunk([ids[-1]], ctx, slots[: ctx + 1], seq_key=i))
    ref = run_chunks(runner.model, runner.kv.k, runner.kv.v, chunks, runner.device)
    got = runner.backend.eager.run(chunks)
    assert ref.shape[0] == 1 + len(tree) + 4 + 1
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    eng.grammar.shutdown()


def test_triton_backend_needs_a_usable_device(tiny_gqa_llama_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device"):
        tiny_engine(tiny_gqa_llama_dir, "triton")


def test_adversarial_inputs_are_refused_cleanly(monkeypatch):
    """Found by the adversarial pass: strided head vectors, a refused slot-table batch leaving
    stale bookkeeping, NaN rows in the sampler, zero-sized scheduler limits, bogus devices."""
    from agentrt.runtime.backends.triton import SlotTable
    from agentrt.runtime.config import SchedulerConfig
    from agentrt.runtime.kernels import interpreting
    from agentrt.runtime.kernels.decode_attention import decode_attention
    from agentrt.runtime.models.loader import resolve_device_dtype
    from agentrt.runtime.request import Request
    from agentrt.runtime.sampler import sample

    q = torch.zeros(1, 4, 128)[:, :, ::2]  # head vectors with stride 2
    with pytest.raises(ValueError, match="q needs a contiguous last dimension"):
        decode_attention(
            q,
            torch.zeros(4, 4, 64),
            torch.zeros(4, 4, 64),
            torch.zeros(1, 4, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
        )
    table = SlotTable(num_rows=2, max_len=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="more sequences"):
        table.sync([("a", [7, 8]), ("b", [9]), ("c", [1])])
    rows = table.sync([("a", [7, 8]), ("b", [9])])  # the refused batch changed nothing
    assert table.table[rows[0], :2].tolist() == [7, 8] and table.table[rows[1], 0] == 9
    r = Request("r", [0], SamplingParams(temperature=1.0))
    r.generator = torch.Generator().manual_seed(0)
    assert sample(torch.full((1, 8), float("nan")), [r]) == [-1]
    for kw in ({"max_num_seqs": 0}, {"max_num_batched_tokens": -3}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SchedulerConfig(**kw)
    for device in ("bogus", "cuda:abc", "meta"):
        with pytest.raises(ValueError, match="is not one of auto, cpu, cuda"):
            resolve_device_dtype(device, "auto")
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    assert interpreting()


def test_kv_budget_shared_with_a_self_draft_and_allocation_failure_is_clear(tiny_gqa_llama_dir):
    from agentrt.runtime.config import SpecConfig
    from agentrt.runtime.kv_cache import KVPool, uniform_layout

    eng = Engine(
        EngineConfig(
            model=ModelConfig(model=str(tiny_gqa_llama_dir), device="cpu"),
            speculative=SpecConfig(method="draft", draft_layers=1),
        )
    )
    target, draft = eng.runner.kv, eng.speculator.draft.kv
    total = target.num_slots * target.bytes_per_token + draft.num_slots * draft.bytes_per_token
    assert abs(target.num_slots * target.bytes_per_token - (1 << 30) * 2 / 3) < target.bytes_per_token
    assert total <= 1 << 30  # the automatic budget now covers the draft pool too
    eng.grammar.shutdown()
    with pytest.raises(ValueError, match="cannot allocate a KV pool"):
        KVPool(uniform_layout(1, 1, 1), torch.float32, torch.device("cpu"), 1 << 52)
