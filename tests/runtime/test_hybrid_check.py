"""`agentrt check` on a hybrid model (a tiny random Qwen3-Next: 2 Gated DeltaNet layers + 1 gated
attention layer): the recurrent state's bytes per sequence, and a capacity line that counts the
state pool's share of the KV budget as the engine builds it (checked against the engine's own pools,
and against its refusal when the budget cannot hold the states)."""

from __future__ import annotations

import pytest

from agentrt.commands.check import check_model
from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from tests.support.families import save_family

CPU = {"device": "cpu", "dtype": "float32"}
LEN = 64  # max_model_len


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory, default_model_dir):
    return save_family("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), default_model_dir)


def _runner(path, kv_bytes: int, max_num_seqs: int):
    return Engine(
        EngineConfig(
            model=ModelConfig(model=str(path), max_model_len=LEN, **CPU),
            cache=CacheConfig(kv_cache_bytes=kv_bytes),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        )
    ).runner


@pytest.mark.parametrize("kv_bytes,max_num_seqs", [(2 << 20, 4), (400_000, 16)])
def test_check_says_the_state_bytes_and_counts_the_state_pool(hybrid_dir, kv_bytes, max_num_seqs):
    """The state of one sequence is what the engine's pool allocates per slot; the capacity line's
    sequences are those the engine's KV pool holds once the state pool took its share (a quarter of
    the budget, or 2 x (max_num_seqs + 1) slots when that is more: the second case)."""
    report = check_model(str(hybrid_dir), LEN, max_num_seqs, kv_cache_bytes=kv_bytes, **CPU)
    runner = _runner(hybrid_dir, kv_bytes, max_num_seqs)
    states, kv = runner.kv.states, runner.kv
    assert report.exit_status == 0, report.describe()
    assert report.state_bytes == states.bytes_per_slot == 3584
    (state,) = report.of("recurrent state")
    assert "2 of 3 layers: 3,584 bytes per sequence" in state.message, state.message
    assert "per layer: gated_delta conv [" in state.message
    assert report.capacity.pool_sequences == kv.num_slots // LEN
    (line,) = report.of("capacity")
    share = f"less the recurrent-state pool's {states.pool_bytes:,} bytes ({states.num_slots:,} slots"
    assert share in line.message, line.message
    assert f"KV budget {kv_bytes - states.pool_bytes:,} bytes" in line.message


def test_check_refuses_a_budget_the_states_fill(hybrid_dir):
    """2 x 17 states of 3,584 bytes do not fit 100,000 bytes: check says so as the engine does."""
    with pytest.raises(ValueError) as refused:
        _runner(hybrid_dir, 100_000, 16)
    report = check_model(str(hybrid_dir), LEN, 16, kv_cache_bytes=100_000, **CPU)
    assert [(e.topic, e.message) for e in report.errors] == [("capacity", str(refused.value))]
