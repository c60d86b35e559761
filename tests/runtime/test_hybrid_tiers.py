"""A hybrid model's prefixes in the KV tiers (issue 53 item 2): the recurrent-state snapshots go down
to the host and disk tiers with the KV blocks and come back with them, so a prefix evicted from the
device pool, or written by an engine that has since stopped, resumes from the tier's snapshot. The
model is a tiny random Qwen3-Next (Gated DeltaNet + gated attention); every case checks the greedy
tokens against transformers' own model and `cached_tokens` against the snapshot depth."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import SamplingParams
from tests.support.families import save_family

NEW = 24
BLOCK = 16  # kv_tier_block_tokens (and the snapshot interval)
STATE_SLOTS = 40
STATE_BYTES = 3584  # one sequence's state of the tiny model (2 Gated DeltaNet layers)
KV_BYTES = 256  # per token (one attention layer)


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


def _engine(path, pool_tokens: int, interval: int = BLOCK, **tiers) -> Engine:
    """An engine whose KV pool holds `pool_tokens` tokens beside STATE_SLOTS states, with the tiers."""
    return Engine(
        EngineConfig(
            model=ModelConfig(model=str(path), device="cpu", dtype="float32"),
            cache=CacheConfig(
                kv_cache_bytes=STATE_SLOTS * STATE_BYTES + pool_tokens * KV_BYTES,
                state_slots=STATE_SLOTS,
                state_snapshot_interval=interval,
                kv_tier_block_tokens=BLOCK,
                **tiers,
            ),
            scheduler=SchedulerConfig(max_num_seqs=2),
        )
    )


def _run(engine, prompt):
    no_eos = {t: -100.0 for t in engine.stop_ids}
    params = SamplingParams(temperature=0, max_tokens=NEW, logit_bias=no_eos)
    (out,) = engine.generate([(prompt, params, None)])
    return out


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _evicted_to_host(hybrid_dir, reference):
    """(an engine with a host tier and a 100-token pool whose first prompt was served and pushed
    down to the host tier by two others, a prompt sharing that prompt's first 40 tokens)."""
    engine = _engine(hybrid_dir, 100, kv_host_bytes=4 << 20)
    first = _prompt(1, 50)
    assert _run(engine, first).token_ids == reference(first)
    for seed in (2, 3):
        _run(engine, _prompt(seed, 50))
    second = first[:40] + _prompt(4, 20)
    assert engine.scheduler.cache.match_prefix(second, "").slots == [], "the prefix was not evicted"
    return engine, second


def test_a_prefix_evicted_to_the_host_tier_resumes_from_its_snapshot(hybrid_dir, reference):
    """A pool of 100 tokens: two other prompts push the first one's prefix out of it, down to the
    host tier. A prompt sharing its first 40 tokens loads the blocks back and resumes from the
    snapshot at 32 (the deepest block boundary with a snapshot at or below the match): 32 cached
    tokens, all from the host tier, and transformers' tokens."""
    engine, second = _evicted_to_host(hybrid_dir, reference)
    out = _run(engine, second)
    engine.close()
    assert out.num_cached_tokens == 32, "the prefix must resume from the host tier's snapshot at 32"
    assert out.cached_tokens_by_tier == {"host": 32}
    assert out.token_ids == reference(second), "resuming from the loaded snapshot changed the tokens"


def test_a_loaded_snapshot_dropped_before_admission_is_not_counted(hybrid_dir, reference, monkeypatch):
    """A loaded snapshot can be dropped (state slots short) before its request is admitted: the
    request then computes its prompt, and reports no cached tokens from the tier."""
    from agentrt.runtime.scheduler import Scheduler

    engine, second = _evicted_to_host(hybrid_dir, reference)
    promote = Scheduler._promote_state

    def promote_then_drop(self, r, load, loaded):
        promote(self, r, load, loaded)
        self.cache.evict_states(self.cache.num_states)

    monkeypatch.setattr(Scheduler, "_promote_state", promote_then_drop)
    out = _run(engine, second)
    engine.close()
    assert (out.num_cached_tokens, out.cached_tokens_by_tier) == (0, {})
    assert out.token_ids == reference(second)


def test_a_restart_with_the_disk_tier_resumes_from_the_snapshot(hybrid_dir, reference, tmp_path):
    """A first engine serves a prompt and stops; a second engine on the same disk directory serves
    the next turn of that conversation (prompt + output + more) and a prompt sharing 40 tokens with
    it: the first resumes from the snapshot at the first request's end (its prompt + output but the
    last token), the second from the one at 32; both give transformers' tokens."""
    disk = str(tmp_path / "kv")
    first = _prompt(5, 50)
    engine = _engine(hybrid_dir, 400, kv_disk_dir=disk)
    out = _run(engine, first)
    engine.close()
    assert out.token_ids == reference(first)

    turn2 = first + out.token_ids + _prompt(6, 10)
    other = first[:40] + _prompt(7, 20)
    engine = _engine(hybrid_dir, 400, kv_disk_dir=disk)
    out2 = _run(engine, turn2)
    out3 = _run(engine, other)
    engine.close()
    assert out2.num_cached_tokens == len(first) + NEW - 1, "the next turn must resume from the disk snapshot"
    assert out2.cached_tokens_by_tier == {"disk": len(first) + NEW - 1}
    assert out2.token_ids == reference(turn2)
    assert out3.num_cached_tokens == 32 and out3.cached_tokens_by_tier == {"disk": 32}
    assert out3.token_ids == reference(other)


def test_with_tiers_snapshots_fall_on_block_ends(hybrid_dir, tmp_path):
    """A snapshot goes down beside the block ending at its depth: with the tiers on, the snapshot
    interval is rounded up to a multiple of their block (20 -> 32 with 16-token blocks), and the
    memory plan says so; without them it is kept."""
    engine = _engine(hybrid_dir, 100, interval=20, kv_disk_dir=str(tmp_path / "kv"))
    engine.close()
    assert engine.runner.kv.states.snapshot_interval == 32
    assert "snapshots every 32 tokens" in engine.runner.memory_plan.describe()
    assert _engine(hybrid_dir, 100, interval=20).runner.kv.states.snapshot_interval == 20
