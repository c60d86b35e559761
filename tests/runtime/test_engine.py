"""Engine invariants on the default model (real numerics): greedy output identical with the prefix
cache on/off, cold/warm, alone/batched; preemption recompute. Scheduling, stops, context budget and
abort bookkeeping are tested model-free in test_engine_fake.py / test_scheduler_fake.py."""

from __future__ import annotations

import pytest

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import SamplingParams
from tests.helpers import chat_ids

QUESTIONS = [
    "Name a red fruit.",
    "What is 2+2?",
    "Say hello in French.",
    "Name a planet.",
    "What color is the sky?",
    "Name a big cat.",
    "What do bees make?",
    "Name an ocean.",
    "Name a river in Asia.",
    "What is ice?",
    "Name a bird.",
    "What is 3*3?",
]


def assert_kv_accounted(engine) -> None:
    """Every KV slot is free or held (unlocked) by the prefix cache: nothing leaked or locked."""
    kv, cache = engine.runner.kv, engine.scheduler.cache
    cached = cache.total_tokens if cache else 0
    assert kv.num_free + cached == kv.num_slots
    assert cache is None or cache.locked_tokens == 0


def _greedy(n=24):
    return SamplingParams(temperature=0, max_tokens=n)


@pytest.mark.slow  # ~70 s; preemption identity is in the default suite on the fake runner
# (test_scheduler_fake.py); this checks recomputed KV numerically on the real model
def test_small_kv_pool_preempts_and_outputs_stay_identical(default_model_dir, tokenizer, engine):
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]  # 12 requests
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = [engine.generate([(p, params, None)])[0].token_ids for p in prompts]
    per_token = engine.runner.kv.bytes_per_token
    room = 2 * (max(len(p) for p in prompts) + 30)  # about two sequences at once
    small = Engine(
        EngineConfig(
            model=ModelConfig(model=str(default_model_dir), device="cpu"),
            cache=CacheConfig(kv_cache_bytes=room * per_token),
        )
    )
    outs = small.generate([(p, params, None) for p in prompts])
    assert [o.token_ids for o in outs] == alone
    assert small.scheduler.num_preemptions > 0
    assert_kv_accounted(small)


def _random_prompts(tokenizer, rng, n, chars):
    alphabet = "abcdefghijklmnopqrstuvwxyz      .,"
    return [
        tokenizer.encode("".join(rng.choice(alphabet) for _ in range(chars)), add_special_tokens=False)
        for _ in range(n)
    ]


def test_greedy_identical_cache_on_off_cold_warm_any_batch(default_model_dir, tokenizer):
    """8 prompts of 400 random characters + 4 sharing a 400-token prefix: alone, batched, cold and
    warm, prefix cache on and off, all give the same greedy tokens. The scheduler's limits are
    small (8 sequences, 128-token steps) so the same paths run on fewer tokens: prompts queue behind
    the running batch, every prompt is prefilled in chunks interleaved with decodes, and a cached
    prefix longer than a chunk is extended."""
    import random

    rng = random.Random(0)
    prefix = _random_prompts(tokenizer, rng, 1, 2000)[0][:400]
    shared = [prefix + tail for tail in _random_prompts(tokenizer, rng, 4, 60)]
    prompts = _random_prompts(tokenizer, rng, 8, 400) + shared
    assert min(len(p) for p in prompts) > 128  # each prompt takes more than one chunk
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def engine_with(cache: bool) -> Engine:
        return Engine(
            EngineConfig(
                model=ModelConfig(model=str(default_model_dir), device="cpu"),
                cache=CacheConfig(kv_cache_bytes=256 << 20, enable_prefix_cache=cache),
                scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128),
            )
        )

    off = engine_with(False)
    reference = [o.token_ids for o in off.generate([(p, params, None) for p in prompts])]  # batched, no cache
    on = engine_with(True)
    alone_idx = [0, 1, 8, 9]  # two random prompts and two sharing the prefix, one at a time, cold
    cold_alone = [on.generate([(prompts[i], params, None)])[0].token_ids for i in alone_idx]
    assert on.stats.num_cached_prompt_tokens >= len(prefix)  # the second shared prompt hit the cache
    warm_batched = [o.token_ids for o in on.generate([(p, params, None) for p in prompts])]
    warm_mixed = [o.token_ids for o in on.generate([(p, params, None) for p in prompts[::-3]])]
    assert cold_alone == [reference[i] for i in alone_idx]
    assert warm_batched == reference
    assert warm_mixed == reference[::-3]
    assert_kv_accounted(on)
    assert_kv_accounted(off)


def test_stop_request_from_a_signal_handler_takes_no_lock():
    """`agentrt serve` stops on SIGTERM from a handler that runs on the engine loop's own thread,
    possibly while that thread holds the inbox lock (queue.get): the handler must not take it
    (calling shutdown() there hung the server once)."""
    import threading

    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.testing import fake_engine

    eng = AsyncEngine(engine=fake_engine(), start_thread=False)
    done = threading.Event()
    with eng._inbox.mutex:  # what the interrupted loop thread may hold
        t = threading.Thread(target=lambda: (eng.request_stop(), done.set()), daemon=True)
        t.start()
        assert done.wait(2), "request_stop blocked on the inbox lock"
    eng.run_forever()  # returns at once: the stop is seen before any work
