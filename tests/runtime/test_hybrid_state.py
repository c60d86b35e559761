"""A hybrid model (Gated DeltaNet + gated attention, a tiny random Qwen3-Next) in the engine: the
recurrent state pool beside the KV pool, radix-tree state snapshots and everything that must
compose with them. Every case is checked against the greedy tokens of transformers' own model (or of
the same engine without the feature), so a state that is not carried, restored or rolled back
exactly shows as different tokens."""

from __future__ import annotations

import pytest
import torch

from agentrt.prefix_cache import RadixCache
from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.recurrent_state import StatePool
from agentrt.runtime.request import SamplingParams
from tests.support.families import save_family

NEW = 24


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, default_model_dir):
    return save_family("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), default_model_dir)


@pytest.fixture(scope="module")
def reference(hybrid_dir):
    """greedy(prompt) -> transformers' NEW greedy tokens for `prompt`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hybrid_dir), dtype=torch.float32).eval()
    memo = {}

    def greedy(ids: list[int]) -> list[int]:
        if tuple(ids) not in memo:
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([ids]),
                    max_new_tokens=NEW,
                    min_new_tokens=NEW,
                    do_sample=False,
                    pad_token_id=0,
                )
            memo[tuple(ids)] = out[0, len(ids) :].tolist()
        return memo[tuple(ids)]

    return greedy


def _engine(path, interval=16, kv_bytes=16 << 20, state_slots=None, **kw) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=str(path), device="cpu", dtype="float32"),
            cache=CacheConfig(
                kv_cache_bytes=kv_bytes, state_snapshot_interval=interval, state_slots=state_slots
            ),
            scheduler=kw.pop("scheduler", SchedulerConfig()),
            speculative=kw.pop("speculative", SpecConfig()),
        )
    )


def _run(engine, prompts):
    no_eos = {t: -100.0 for t in engine.stop_ids}
    params = SamplingParams(temperature=0, max_tokens=NEW, logit_bias=no_eos)
    return engine.generate([(ids, params, None) for ids in prompts])


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_hit_between_two_snapshots_resumes_from_the_lower_one(hybrid_dir, reference):
    """Snapshots every 16 tokens: a prompt sharing 40 tokens with a cached one resumes at 32 (the
    deepest snapshot at or below the match), and reports 32 cached tokens; its tokens are
    transformers' own."""
    engine = _engine(hybrid_dir)
    first = _prompt(1, 50)
    second = first[:40] + _prompt(2, 20)
    (out,) = _run(engine, [first])
    assert out.token_ids == reference(first) and out.num_cached_tokens == 0
    (out,) = _run(engine, [second])
    assert out.num_cached_tokens == 32, "the hit must stop at the deepest snapshot, 32"
    assert out.token_ids == reference(second), "resuming from the snapshot changed the tokens"
    (out,) = _run(engine, [first])  # the same prompt again: the snapshot at its last token but one
    assert out.num_cached_tokens == 49 and out.token_ids == reference(first)


def test_a_conversation_resumes_from_the_end_of_the_previous_turn(hybrid_dir, reference):
    """A finished request leaves the state after everything it computed: the next turn (its prompt +
    output + more) hits all of it."""
    engine = _engine(hybrid_dir, interval=1000)
    turn1 = _prompt(3, 30)
    (out,) = _run(engine, [turn1])
    turn2 = turn1 + out.token_ids + _prompt(4, 10)
    (out2,) = _run(engine, [turn2])
    assert out2.num_cached_tokens == len(turn1) + NEW - 1  # the last output token was never computed
    assert out2.token_ids == reference(turn2)


def test_batched_chunked_and_two_of_one_prompt_match_transformers(hybrid_dir, reference):
    """Prefill in 7-token chunks (the state carried across chunks), three prompts batched with a
    repeat of the first (n = 2: two sequences of one prompt, each its own state)."""
    engine = _engine(hybrid_dir, scheduler=SchedulerConfig(max_num_batched_tokens=7))
    prompts = [_prompt(5, 41), _prompt(6, 23), _prompt(7, 35)]
    outs = _run(engine, [prompts[0], *prompts, prompts[0]])
    assert [o.token_ids for o in outs] == [reference(p) for p in [prompts[0], *prompts, prompts[0]]]


def test_speculation_rolls_the_state_back_to_the_last_accepted_token(hybrid_dir, monkeypatch):
    """Verify chunks with rejections: the n-gram proposer is made to draft the unspeculated run's next
    tokens with a wrong one after them (one, two or none right), so every verify pass keeps some
    tokens and rejects the rest. The state must be rolled back to the last accepted token: the tokens
    equal the unspeculated run's."""
    from agentrt.speculative.ngram import NgramProposer

    prompt = _prompt(8, 45)
    plain = _run(_engine(hybrid_dir), [prompt])[0].token_ids
    wrong = next(t for t in range(100, 200) if t not in plain)

    def propose(self, token_ids, k=None):
        m = len(token_ids) - len(prompt)
        right = m % 3  # 0, 1 or 2 right tokens, then a wrong one
        return (plain[m : m + right] + [wrong] * 3)[:k]

    monkeypatch.setattr(NgramProposer, "propose", propose)
    spec = _engine(hybrid_dir, speculative=SpecConfig(method="ngram", num_speculative_tokens=3))
    assert _run(spec, [prompt])[0].token_ids == plain
    s = spec.stats
    assert s.num_spec_steps > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens


def test_preempted_requests_resume_from_their_state(hybrid_dir, reference):
    """A KV pool too small for all at once: requests are preempted mid-decode (their working state
    becomes a snapshot) and resume from it with the same tokens."""
    prompts = [_prompt(10 + i, 40) for i in range(4)]
    engine = _engine(hybrid_dir, kv_bytes=256 * 150 + 3584 * 40, state_slots=40)
    outs = _run(engine, prompts)
    assert engine.stats.num_preemptions > 0, "the pool was large enough: no preemption was exercised"
    assert [o.token_ids for o in outs] == [reference(p) for p in prompts]


def test_state_slots_are_all_returned(hybrid_dir):
    """After requests finish, the only state slots taken are the tree's snapshots; evicting every
    snapshot returns the pool to full."""
    engine = _engine(hybrid_dir)
    _run(engine, [_prompt(20, 50), _prompt(21, 33)])
    pool: StatePool = engine.runner.kv.states
    cache: RadixCache = engine.scheduler.cache
    assert cache.num_states > 0
    assert pool.num_free + cache.num_states == pool.num_slots
    cache.evict_states(cache.num_states)
    assert pool.num_free == pool.num_slots and cache.num_states == 0


def test_the_memory_plan_names_the_state_pool(hybrid_dir):
    engine = _engine(hybrid_dir, state_slots=64)
    plan = engine.runner.memory_plan.describe()
    assert "recurrent state (2 of 3 layers): 64 slots x 3,584 bytes" in plan, plan
    assert "KV pool" in plan and engine.runner.kv.bytes_per_token == 256  # one attention layer's K/V


@pytest.mark.parametrize(
    "cache,error",
    [
        ({"state_slots": 1}, "state_slots must be an integer >= 2"),
        ({"state_snapshot_interval": 0}, "state_snapshot_interval must be a positive integer"),
    ],
)
def test_bad_state_options_are_refused(cache, error):
    with pytest.raises(ValueError, match=error):
        CacheConfig(**cache)


def test_state_slots_that_do_not_fit_the_budget_are_refused(hybrid_dir):
    with pytest.raises(ValueError, match="cannot hold 100000 recurrent states"):
        _engine(hybrid_dir, kv_bytes=1 << 20, state_slots=100_000)


def test_speculation_that_needs_a_tree_or_draft_layers_is_refused(hybrid_dir):
    with pytest.raises(ValueError, match="self-draft .* not supported with recurrent"):
        _engine(hybrid_dir, speculative=SpecConfig(method="draft", draft_layers=1))


def test_a_dense_draft_model_speculates_for_a_hybrid_target(hybrid_dir, tmp_path, default_model_dir):
    """A draft model's chain is verified like an n-gram draft: the hybrid target's state rolls back to
    the last accepted token, so the tokens are the unspeculated run's; a hybrid draft is refused."""
    draft = save_family("qwen3", tmp_path / "draft", default_model_dir)
    prompt = _prompt(40, 37)
    plain = _run(_engine(hybrid_dir), [prompt])[0].token_ids
    spec = _engine(
        hybrid_dir, speculative=SpecConfig(method="draft", draft_model=str(draft), num_speculative_tokens=3)
    )
    assert _run(spec, [prompt])[0].token_ids == plain
    s = spec.stats
    assert s.num_spec_steps > 0 and s.num_accepted_tokens < s.num_draft_tokens
    with pytest.raises(ValueError, match="draft model with recurrent"):
        _engine(hybrid_dir, speculative=SpecConfig(method="draft", draft_model=str(hybrid_dir)))


def test_the_state_flags_reach_the_cache_config():
    import argparse

    from agentrt.engine_args import add_engine_args, cache_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--state-slots", "96", "--state-snapshot-interval", "64"])
    c = cache_config(args)
    assert (c.state_slots, c.state_snapshot_interval) == (96, 64)
    default = cache_config(p.parse_args([]))
    assert (default.state_slots, default.state_snapshot_interval) == (None, 256)


def test_routers_and_the_shared_expert_gate_stay_dense(hybrid_dir):
    """--quantization int8 takes every projection but the MoE routers and the shared expert's gate
    (one output row: a rounding there scales the whole shared expert)."""
    from agentrt.runtime.models.quant import linear_names
    from agentrt.runtime.models.registry import arch_from_hf_config, build_model, read_hf_config

    model = build_model(arch_from_hf_config(read_hf_config(hybrid_dir)), 64)
    names = linear_names(model, include_lm_head=False)
    assert not any(n.endswith((".mlp.gate", ".shared_expert_gate")) for n in names)
    assert any(n.endswith("linear_attn.in_proj_qkvz") for n in names)
    assert any(n.endswith("shared_expert.gate_up_proj") for n in names)


def test_a_decode_step_gives_the_same_logits_alone_and_batched(hybrid_dir):
    """Sequences decoding one token each run their scan as one batch over gathered states; a
    sequence's logits must be the same bits as when it decodes alone (batch invariance), on the
    C++ CPU kernels (the invariant configuration; the torch path's linear layers are not)."""
    from agentrt.runtime.forward import SeqChunk

    engine = Engine(
        EngineConfig(
            model=ModelConfig(model=str(hybrid_dir), device="cpu", dtype="float32", attention_backend="cpu"),
            cache=CacheConfig(kv_cache_bytes=16 << 20),
        )
    )
    runner, pool = engine.runner, engine.runner.kv.states
    prompts = [_prompt(30 + i, n) for i, n in enumerate((20, 31, 9))]
    states, slots = [], []
    for ids in prompts:
        s, kv = pool.allocate(), runner.kv.allocate(len(ids) + 1)
        runner.execute([SeqChunk(ids, 0, kv[: len(ids)], state_slot=s)])
        states.append(s)
        slots.append(kv)
    saved = {j: {k: t.clone() for k, t in layer.items()} for j, layer in enumerate(pool.tensors)}

    def decode(which):
        chunks = [SeqChunk([7], len(prompts[i]), slots[i], state_slot=states[i]) for i in which]
        return runner.execute(chunks)

    batched = decode([0, 1, 2])
    for i in range(3):
        for j, layer in saved.items():  # back to the state after the prompts
            for k, t in layer.items():
                pool.tensors[j][k].copy_(t)
        alone = decode([i])
        assert torch.equal(alone[0], batched[i]), f"sequence {i}'s logits differ batched"


def test_qwen3_5_with_its_vision_tower_serves_its_text_model(tmp_path, default_model_dir):
    """A Qwen3.5 checkpoint as released (Qwen3_5ForConditionalGeneration: model.language_model.* and
    the vision tower's model.visual.*): the text model loads, the tower is not read, and the logits
    are transformers' own on text."""
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from agentrt.runtime.forward import SeqChunk
    from agentrt.runtime.model_runner import ModelRunner
    from tests.support.families import COMMON, HYBRID

    torch.manual_seed(0)
    cfg = Qwen3_5Config(
        text_config={**COMMON, **HYBRID},
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
        },
    )
    hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    hf.save_pretrained(str(tmp_path))
    AutoTokenizer.from_pretrained(str(default_model_dir)).save_pretrained(str(tmp_path))
    runner = ModelRunner(
        ModelConfig(model=str(tmp_path), device="cpu", dtype="float32"), CacheConfig(kv_cache_bytes=8 << 20)
    )
    ids = _prompt(50, 30)
    slots, state = runner.kv.allocate(30), runner.kv.states.allocate()
    ours = runner.execute([SeqChunk(ids, 0, slots, num_logits=30, state_slot=state)])
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_a_returning_agent_keeps_its_snapshot_on_a_tight_state_pool(hybrid_dir, reference):
    """Three agents taking turns, one running at a time, 5 state slots: making room for a returning
    agent's working slot must not drop the very snapshot it resumes from (the least recently used
    one in round-robin traffic), so every returning turn hits its previous turn's end."""
    engine = _engine(hybrid_dir, interval=1000, state_slots=5, scheduler=SchedulerConfig(max_num_seqs=1))
    history = {a: _prompt(60 + a, 20) for a in range(3)}
    for turn in range(3):
        for a in range(3):
            prompt = history[a]
            (out,) = _run(engine, [prompt])
            if turn:
                assert out.num_cached_tokens >= len(prompt) - 9, f"agent {a} turn {turn}: no resume"
            history[a] = prompt + out.token_ids + _prompt(100 + 10 * turn + a, 8)


def test_a_huge_context_limit_is_capped_without_max_model_len(tmp_path, default_model_dir):
    """A config (or a lying GGUF header) with max_position_embeddings 4,000,000,000: without
    --max-model-len the context is capped at DEFAULT_MAX_CONTEXT, so the RoPE tables stay small."""
    import json
    import shutil

    from agentrt.runtime.model_runner import ModelRunner
    from agentrt.runtime.models.config import DEFAULT_MAX_CONTEXT

    path = tmp_path / "m"
    shutil.copytree(save_family("qwen3", tmp_path / "q", default_model_dir), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 4_000_000_000
    (path / "config.json").write_text(json.dumps(cfg))
    runner = ModelRunner(
        ModelConfig(model=str(path), device="cpu", dtype="float32"), CacheConfig(kv_cache_bytes=8 << 20)
    )
    assert runner.max_model_len == DEFAULT_MAX_CONTEXT
    assert runner.model.rope_cos.shape[0] <= DEFAULT_MAX_CONTEXT + 64
