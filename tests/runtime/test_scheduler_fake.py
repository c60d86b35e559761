"""Scheduling on the fake model runner (no weights; milliseconds): admission, chunked prefill under
the token budget, preemption when the KV pool runs out. Every output is checked against the fake's
own greedy reference (`greedy_continuation`), so batching, chunking and recompute must be invisible."""

from __future__ import annotations

import random

import pytest

from agentrt.runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine

pytestmark = pytest.mark.usefixtures("time_limit")


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(n)]


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _config(
    max_num_seqs: int = 16, max_num_batched_tokens: int = 512, prefix_cache: bool = True
) -> EngineConfig:
    return EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        cache=CacheConfig(enable_prefix_cache=prefix_cache),
    )


def _metric(engine, name: str, **labels) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_max_num_seqs_bounds_every_batch_and_outputs_match_reference():
    engine = fake_engine(_config(max_num_seqs=3))
    runner = engine.runner
    prompts = _prompts(7, 12)
    outs = engine.generate([(p, _params(10), None) for p in prompts])
    assert [o.token_ids for o in outs] == [runner.greedy_continuation(p, 10) for p in prompts]
    assert all(o.finish_reason == "length" for o in outs)
    sizes = [len(f.chunks) for f in runner.forwards]
    assert max(sizes) == 3  # full batches, never more than max_num_seqs
    assert sum(sizes) == 7 * 10  # one prefill chunk + 9 decodes per request, nothing recomputed


def test_decodes_share_steps():
    """8 requests x 6 tokens come out of 6 forwards, each carrying all 8 sequences."""
    engine = fake_engine(_config())
    prompts = _prompts(8, 10, seed=1)
    engine.generate([(p, _params(6), None) for p in prompts])
    assert [len(f.chunks) for f in engine.runner.forwards] == [8] * 6
    assert list(engine.stats.batch_sizes) == [8] * 6


def test_requests_join_between_steps():
    engine = fake_engine(_config())
    a_prompt, b_prompt = _prompts(2, 9, seed=2)
    a = engine.add_request(a_prompt, _params(8))
    engine.step()
    engine.step()
    b = engine.add_request(b_prompt, _params(3))
    finals = {}
    while engine.has_work():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    sizes = [len(f.chunks) for f in engine.runner.forwards]
    assert sizes == [1, 1, 2, 2, 2, 1, 1, 1]
    assert finals[a.request_id].token_ids == engine.runner.greedy_continuation(a_prompt, 8)
    assert finals[b.request_id].token_ids == engine.runner.greedy_continuation(b_prompt, 3)


def test_chunked_prefill_stays_under_the_token_budget_and_decodes_keep_running():
    budget = 16
    engine = fake_engine(_config(max_num_batched_tokens=budget, prefix_cache=False))
    runner = engine.runner
    decoders = _prompts(3, 5, seed=3)
    reqs = [engine.add_request(p, _params(30)) for p in decoders]
    engine.step()  # the three short prompts prefill together
    long_prompt = _prompts(1, 100, seed=4)[0]
    big = engine.add_request(long_prompt, _params(2))
    first = runner.num_forwards
    outs = {}
    while engine.has_work():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    prefill_steps = []
    for f in runner.forwards[first:]:
        assert f.num_tokens <= budget
        prefills = [n for _, n, _ in f.chunks if n > 1]
        if prefills:
            # the prefill chunk took what the three decodes left of the budget
            assert sorted(n for _, n, _ in f.chunks) == [1, 1, 1, prefills[0]]
            prefill_steps.append(prefills[0])
    assert sum(prefill_steps) == 100 and len(prefill_steps) >= 100 // (budget - 3)
    assert outs[big.request_id].token_ids == runner.greedy_continuation(long_prompt, 2)
    for r, p in zip(reqs, decoders):
        assert outs[r.request_id].token_ids == runner.greedy_continuation(p, 30)
    assert engine.stats.num_computed_prefill_tokens == 3 * 5 + 100


def test_prompt_longer_than_the_budget_alone_is_prefilled_in_chunks():
    engine = fake_engine(_config(max_num_batched_tokens=8))
    prompt = _prompts(1, 30, seed=5)[0]
    out = engine.generate([(prompt, _params(4), None)])[0]
    assert out.token_ids == engine.runner.greedy_continuation(prompt, 4)
    assert [f.chunks[0][1] for f in engine.runner.forwards] == [8, 8, 8, 6, 1, 1, 1]
    # only the chunk that reaches the end of the prompt asks for logits
    assert [f.chunks[0][2] for f in engine.runner.forwards] == [0, 0, 0, 1, 1, 1, 1]


def _preemption_run(prefix_cache: bool):
    prompts = _prompts(6, 20, seed=6)
    engine = fake_engine(_config(prefix_cache=prefix_cache), num_kv_slots=2 * (20 + 30))  # ~two sequences
    outs = engine.generate([(p, _params(30), None) for p in prompts])
    return engine, prompts, outs


def test_preempted_requests_finish_with_the_output_they_have_alone():
    for prefix_cache in (False, True):
        engine, prompts, outs = _preemption_run(prefix_cache)
        runner = engine.runner
        assert [o.token_ids for o in outs] == [runner.greedy_continuation(p, 30) for p in prompts]
        assert all(o.finish_reason == "length" for o in outs)
        assert _metric(engine, "agentrt_preemptions_total") > 0
        assert max(len(f.chunks) for f in runner.forwards) >= 2  # it did batch while room lasted
        if not prefix_cache:
            assert runner.kv.num_free == runner.kv.num_slots  # nothing leaked
            # recompute: more prefill than the prompts hold
            assert engine.stats.num_computed_prefill_tokens > 6 * 20


def test_preemption_never_loses_a_request_with_a_one_sequence_pool():
    prompts = _prompts(4, 10, seed=7)
    engine = fake_engine(_config(prefix_cache=False), num_kv_slots=10 + 20)
    outs = engine.generate([(p, _params(20), None) for p in prompts])
    assert [o.token_ids for o in outs] == [engine.runner.greedy_continuation(p, 20) for p in prompts]
    assert engine.runner.kv.num_free == engine.runner.kv.num_slots
