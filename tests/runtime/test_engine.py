"""Engine invariants on the default model (real numerics): greedy output identical with the prefix
cache on/off, cold/warm, alone/batched; preemption recompute. Scheduling, stops, context budget and
abort bookkeeping are tested model-free in test_engine_fake.py / test_scheduler_fake.py."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import SamplingParams
from tests.support.models import chat_ids

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


FORMATS = ["none", "int8", "int4"]  # the formats `auto` picks on a CPU (float32 activations)


@pytest.mark.parametrize(
    "quantization,kv_cache_dtype",
    [
        ("int4", "auto"),  # make run's configuration
        *(
            pytest.param(q, kv, marks=pytest.mark.slow)
            for q, kv in (("none", "auto"), ("int8", "auto"), ("int4", "int8"), ("int4", "float16"))
        ),
    ],
)  # int4 + int8 or float16 KV: make run's weights with a smaller KV cache; all but make run's
# configuration are slow tests (13-25 s each on 2 cores; the suite's 10 minutes)
def test_greedy_identical_cache_on_off_cold_warm_any_batch(
    default_model_dir, tokenizer, quantization, kv_cache_dtype
):
    """8 prompts of 400 random characters + 4 sharing a 400-token prefix: alone, batched, cold and
    warm, prefix cache on and off, prefill chunks of 128 or 96 tokens, all give the same greedy
    tokens, in every weight format `auto` picks on a CPU, at the default dtype (the invariance is the
    engine's, not a test setting), and with the int8 KV cache (a chunk's own K/V are read as the pool
    stores them, so a cached prefix and a fresh one attend the same values). The scheduler's limits are small (8 sequences) so the same paths
    run on fewer tokens: prompts queue behind the running batch, every prompt is prefilled in chunks
    interleaved with decodes, and a cached prefix longer than a chunk is extended."""
    import random

    rng = random.Random(0)
    prefix = _random_prompts(tokenizer, rng, 1, 2000)[0][:400]
    shared = [prefix + tail for tail in _random_prompts(tokenizer, rng, 4, 60)]
    prompts = _random_prompts(tokenizer, rng, 8, 400) + shared
    assert min(len(p) for p in prompts) > 128  # each prompt takes more than one chunk
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def engine_with(cache: bool, chunk: int) -> Engine:
        return Engine(
            EngineConfig(
                model=ModelConfig(model=str(default_model_dir), device="cpu", quantization=quantization),
                cache=CacheConfig(
                    kv_cache_bytes=256 << 20, enable_prefix_cache=cache, kv_cache_dtype=kv_cache_dtype
                ),
                scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=chunk),
            )
        )

    off = engine_with(False, 128)
    assert off.runner.weight_format.quantization == quantization
    assert off.runner.kv.quantized == (kv_cache_dtype == "int8")
    assert off.runner.kv.dtype == {"int8": torch.int8, "float16": torch.float16}.get(
        kv_cache_dtype, torch.float32
    )
    reference = [o.token_ids for o in off.generate([(p, params, None) for p in prompts])]  # batched, no cache
    on = engine_with(True, 96)
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


def test_speculation_and_seeded_sampling_are_batch_invariant_on_the_default_format(
    default_model_dir, tokenizer
):
    """`make run`'s format (int4 + int8 head on the default model's 4-bit weights): n-gram speculation
    at temperature 0 gives plain decoding's tokens, and a seeded request at temperature 0.8 gives the
    same tokens alone, in a batch, and again with its prompt in the prefix cache."""
    from agentrt.runtime.config import SpecConfig

    prompts = [
        chat_ids(tokenizer, [{"role": "user", "content": f"Repeat this list twice: {q}"}])
        for q in QUESTIONS[:6]
    ]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def engine_with(spec: SpecConfig) -> Engine:
        model = ModelConfig(model=str(default_model_dir), device="cpu", quantization="auto")
        return Engine(EngineConfig(model=model, speculative=spec, scheduler=SchedulerConfig(max_num_seqs=4)))

    plain = engine_with(SpecConfig())
    assert plain.runner.weight_format.quantization == "int4"
    want = [o.token_ids for o in plain.generate([(p, greedy, None) for p in prompts])]
    ngram = engine_with(SpecConfig(method="ngram", num_speculative_tokens=4))
    assert [o.token_ids for o in ngram.generate([(p, greedy, None) for p in prompts])] == want
    assert ngram.stats.num_accepted_tokens > 0  # the drafts were verified, some accepted
    sampled = SamplingParams(temperature=0.8, seed=1234, max_tokens=16, ignore_eos=True)
    alone = plain.generate([(prompts[0], sampled, None)])[0].token_ids
    others = [
        (p, SamplingParams(temperature=0.8, seed=i, max_tokens=16), None) for i, p in enumerate(prompts[1:])
    ]
    batched = plain.generate([*others[:2], (prompts[0], sampled, None), *others[2:]])[2].token_ids
    assert batched == alone
    assert plain.generate([(prompts[0], sampled, None)])[0].token_ids == alone  # prompt cached now


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
