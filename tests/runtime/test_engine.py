"""Engine behaviour on the default model: batching, stops, context budget, preemption, abort."""

from __future__ import annotations

import pytest

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import SamplingParams
from tests.helpers import chat_ids

QUESTIONS = ["Name a red fruit.", "What is 2+2?", "Say hello in French.", "Name a planet.",
             "What color is the sky?", "Name a big cat.", "What do bees make?", "Name an ocean.",
             "Name a river in Asia.", "What is ice?", "Name a bird.", "What is 3*3?"]


def assert_kv_accounted(engine) -> None:
    """Every KV slot is free or held (unlocked) by the prefix cache: nothing leaked or locked."""
    kv, cache = engine.runner.kv, engine.scheduler.cache
    cached = cache.total_tokens if cache else 0
    assert kv.num_free + cached == kv.num_slots
    assert cache is None or cache.locked_tokens == 0


def _greedy(n=24):
    return SamplingParams(temperature=0, max_tokens=n)


def test_concurrent_requests_share_decode_steps(engine, tokenizer):
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:8]]
    steps_before = engine.stats.num_steps
    outs = engine.generate([(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), None)
                            for p in prompts])
    steps = engine.stats.num_steps - steps_before
    sizes = list(engine.stats.batch_sizes)[-steps:]
    assert all(len(o.token_ids) == 16 for o in outs)
    # 8 x 16 tokens came out of 16 steps (not 128): every step carried all 8 sequences
    assert steps == 16 and sizes == [8] * 16


def test_batched_output_equals_alone(engine, tokenizer):
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:4]]
    alone = [engine.generate([(p, _greedy(), None)])[0].token_ids for p in prompts]
    together = [o.token_ids for o in engine.generate([(p, _greedy(), None) for p in prompts])]
    assert together == alone


def test_requests_join_between_steps(engine, tokenizer):
    a = engine.add_request(chat_ids(tokenizer, [{"role": "user", "content": QUESTIONS[0]}]),
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.step()
    engine.step()
    b = engine.add_request(chat_ids(tokenizer, [{"role": "user", "content": QUESTIONS[1]}]),
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    sizes = []
    while engine.has_work():
        engine.step()
        sizes.append(engine.stats.batch_sizes[-1])
    assert len(a.output_ids) == 12 and len(b.output_ids) == 4
    assert sizes[:4] == [2, 2, 2, 2] and set(sizes[4:]) == {1}


def test_stop_string_is_cut_and_max_tokens_is_length(engine, tokenizer):
    ids = chat_ids(tokenizer, [{"role": "user", "content": "Count from 1 to 20, separated by commas."}])
    full = engine.generate([(ids, SamplingParams(temperature=0, max_tokens=40), None)])[0]
    assert "5" in full.text
    cut = engine.generate([(ids, SamplingParams(temperature=0, max_tokens=40, stop=["5"]), None)])[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index("5")]
    short = engine.generate([(ids, SamplingParams(temperature=0, max_tokens=3), None)])[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_context_budget(engine):
    limit = min(engine.max_model_len, engine.runner.kv.num_slots)
    with pytest.raises(ValueError, match="context limit"):
        engine.add_request([1] * limit, SamplingParams())
    with pytest.raises(ValueError, match=r"max_tokens \(100\) plus the prompt \(\d+ tokens\) exceeds the context limit"):
        engine.add_request([1] * (limit - 50), SamplingParams(max_tokens=100))
    r = engine.add_request([1] * (limit - 50), SamplingParams())  # unset max_tokens is capped
    assert r.max_tokens == 50
    engine.abort(r.request_id)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], SamplingParams())


def test_abort_frees_kv(engine, tokenizer):
    r = engine.add_request(chat_ids(tokenizer, [{"role": "user", "content": "Tell a story."}]), _greedy(50))
    engine.step()
    engine.step()
    assert engine.scheduler.cache.locked_tokens > 0
    out = engine.abort(r.request_id)
    assert out.finish_reason == "abort" and not engine.has_work()
    assert_kv_accounted(engine)


def test_small_kv_pool_preempts_and_outputs_stay_identical(default_model_dir, tokenizer, engine):
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]  # 12 requests
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = [engine.generate([(p, params, None)])[0].token_ids for p in prompts]
    per_token = engine.runner.kv.bytes_per_token
    room = 2 * (max(len(p) for p in prompts) + 30)  # about two sequences at once
    small = Engine(EngineConfig(model=ModelConfig(model=str(default_model_dir), device="cpu"),
                                cache=CacheConfig(kv_cache_bytes=room * per_token)))
    outs = small.generate([(p, params, None) for p in prompts])
    assert [o.token_ids for o in outs] == alone
    assert small.scheduler.num_preemptions > 0
    assert_kv_accounted(small)


def _random_prompts(tokenizer, rng, n, chars):
    alphabet = "abcdefghijklmnopqrstuvwxyz      .,"
    return [tokenizer.encode("".join(rng.choice(alphabet) for _ in range(chars)), add_special_tokens=False)
            for _ in range(n)]


def test_greedy_identical_cache_on_off_cold_warm_any_batch(default_model_dir, tokenizer):
    """16 prompts of 400 random characters + 8 sharing a 1,500-token prefix: alone, batched, cold and
    warm, prefix cache on and off, all give the same greedy tokens."""
    import random

    rng = random.Random(0)
    prefix = _random_prompts(tokenizer, rng, 1, 6000)[0][:1500]
    shared = [prefix + tail for tail in _random_prompts(tokenizer, rng, 8, 60)]
    prompts = _random_prompts(tokenizer, rng, 16, 400) + shared
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def engine_with(cache: bool) -> Engine:
        return Engine(EngineConfig(model=ModelConfig(model=str(default_model_dir), device="cpu"),
                                   cache=CacheConfig(kv_cache_bytes=256 << 20, enable_prefix_cache=cache)))

    off = engine_with(False)
    reference = [o.token_ids for o in off.generate([(p, params, None) for p in prompts])]  # batched, no cache
    on = engine_with(True)
    alone_idx = [0, 1, 16, 17]  # two random prompts and two sharing the prefix, one at a time, cold
    cold_alone = [on.generate([(prompts[i], params, None)])[0].token_ids for i in alone_idx]
    assert on.stats.num_cached_prompt_tokens >= 1500  # the second shared prompt hit the cache
    warm_batched = [o.token_ids for o in on.generate([(p, params, None) for p in prompts])]
    warm_mixed = [o.token_ids for o in on.generate([(p, params, None) for p in prompts[::-3]])]
    assert cold_alone == [reference[i] for i in alone_idx]
    assert warm_batched == reference
    assert warm_mixed == reference[::-3]
    assert_kv_accounted(on)
    assert_kv_accounted(off)


def test_chunked_prefill_keeps_decodes_running(default_model_dir, tokenizer):
    import random

    engine = Engine(EngineConfig(model=ModelConfig(model=str(default_model_dir), device="cpu"),
                                 cache=CacheConfig(kv_cache_bytes=256 << 20)))
    budget = engine.config.scheduler.max_num_batched_tokens
    decoders = [engine.add_request(chat_ids(tokenizer, [{"role": "user", "content": q}]),
                                   SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
                for q in QUESTIONS[:4]]
    engine.step()  # the four prompts are prefilled together
    long_prompt = _random_prompts(tokenizer, random.Random(1), 1, 12000)[0][:3000]
    big = engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=2))
    steps = []
    while not big.output_ids:
        before = [len(r.output_ids) for r in decoders]
        engine.step()
        steps.append(([len(r.output_ids) for r in decoders], before, engine.stats.prefill_sizes[-1]))
    # the 3,000-token prefill took several steps, each bounded by the token budget, and every
    # one of those steps also advanced all four decoding requests by one token
    assert len(steps) >= 3000 // budget
    for after, before, prefill in steps:
        assert prefill <= budget - 4
        assert [a - b for a, b in zip(after, before)] == [1, 1, 1, 1]


def test_stop_request_from_a_signal_handler_takes_no_lock():
    """`agentrt serve` stops on SIGTERM from a handler that runs on the engine loop's own thread,
    possibly while that thread holds the inbox lock (queue.get): the handler must not take it
    (calling shutdown() there hung the server once)."""
    import threading

    from agentrt.runtime.async_engine import AsyncEngine

    eng = AsyncEngine(engine=object(), start_thread=False)
    done = threading.Event()
    with eng._inbox.mutex:  # what the interrupted loop thread may hold
        t = threading.Thread(target=lambda: (eng.request_stop(), done.set()), daemon=True)
        t.start()
        assert done.wait(2), "request_stop blocked on the inbox lock"
    eng.run_forever()  # returns at once: the stop is seen before any work
