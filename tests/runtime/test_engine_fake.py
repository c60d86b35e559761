"""Engine behaviour on the fake model runner (no weights; milliseconds): prefix cache on/off, stop
handling (stop strings held back across deltas, stop_token_ids, EOS and ignore_eos, max_tokens,
context limit), abort. Outputs are checked against the fake's greedy reference."""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from agentrt.errors import ContextLengthError, InvalidRequestError
from agentrt.runtime.config import CacheConfig, EngineConfig
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine

pytestmark = pytest.mark.usefixtures("time_limit")


def _prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(length)]


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def _no_cache() -> EngineConfig:
    return EngineConfig(cache=CacheConfig(enable_prefix_cache=False))


def _metric(engine, name: str, **labels) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or None) or 0.0


def _stream(engine, prompt, params):
    """Run one request to the end with step(); returns (its outputs in order, the final one)."""
    req = engine.add_request(prompt, params)
    outs = []
    while engine.has_work():
        outs.extend(o for o in engine.step() if o.request_id == req.request_id)
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    return outs, outs[-1]


# ---- prefix cache ----------------------------------------------------------------------------------
def test_prefix_cache_on_off_same_greedy_output_and_counts_cached_tokens():
    shared = _prompt(60, seed=1)
    prompts = [shared + _prompt(8, seed=10 + i) for i in range(5)] + [_prompt(30, seed=20)]
    params = _greedy(12, ignore_eos=True)
    results = {}
    for cache in (False, True):
        engine = fake_engine(EngineConfig(cache=CacheConfig(enable_prefix_cache=cache)))
        first = engine.generate([(prompts[0], params, None)])[0]  # cold: fills the cache
        rest = engine.generate([(p, params, None) for p in prompts[1:]])
        again = engine.generate([(p, params, None) for p in prompts[::-2]])  # warm, another batch
        results[cache] = (engine, [first, *rest], again)
    (off, outs_off, again_off), (on, outs_on, again_on) = results[False], results[True]
    reference = [off.runner.greedy_continuation(p, 12) for p in prompts]
    assert [o.token_ids for o in outs_off] == reference
    assert [o.token_ids for o in outs_on] == reference
    assert [o.token_ids for o in again_on] == [o.token_ids for o in again_off] == reference[::-2]
    assert off.stats.num_cached_prompt_tokens == 0 and all(o.num_cached_tokens == 0 for o in outs_off)
    assert outs_on[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 60 for o in outs_on[1:5])  # the shared prefix came from the cache
    assert all(o.num_cached_tokens == len(p) - 1 for o, p in zip(again_on, prompts[::-2]))
    assert on.stats.num_cached_prompt_tokens == sum(o.num_cached_tokens for o in outs_on + again_on)
    assert _metric(on, "agentrt_cached_prompt_tokens_total") == on.stats.num_cached_prompt_tokens
    assert on.runner.num_computed_tokens < off.runner.num_computed_tokens - 4 * 60


def test_cache_salt_keeps_tenants_apart():
    engine = fake_engine()
    prompt = _prompt(40, seed=2)
    a = engine.add_request(prompt, _greedy(4), cache_salt="tenant-a")
    while engine.has_work():
        engine.step()
    outs = []
    for salt in ("tenant-b", "tenant-a"):
        r = engine.add_request(prompt, _greedy(4), cache_salt=salt)
        while engine.has_work():
            outs.extend(o for o in engine.step() if o.finished and o.request_id == r.request_id)
    assert a.request_id != outs[0].request_id
    assert [o.num_cached_tokens for o in outs] == [0, 39]
    assert outs[0].token_ids == outs[1].token_ids == engine.runner.greedy_continuation(prompt, 4)


# ---- stops ------------------------------------------------------------------------------------------
def test_max_tokens_finishes_with_length():
    engine = fake_engine()
    prompt = _prompt(10)
    out = engine.generate([(prompt, _greedy(7), None)])[0]
    assert out.finish_reason == "length" and out.error is None
    assert out.token_ids == engine.runner.greedy_continuation(prompt, 7)
    assert out.text == engine.tokenizer.decode(out.token_ids)
    assert out.num_prompt_tokens == 10


def test_stop_string_is_cut_and_never_streamed():
    engine = fake_engine()
    prompt = _prompt(10, seed=3)
    full = engine.generate([(prompt, _greedy(40), None)])[0].text
    stop = full[20:23]  # three characters: three tokens, three steps
    assert full.index(stop) >= 3
    outs, final = _stream(engine, prompt, _greedy(40, stop=["zzzzzzzz", stop]))
    assert final.finish_reason == "stop"
    assert final.text == full[: full.index(stop)]
    assert "".join(o.delta_text for o in outs) == final.text  # nothing of the stop string went out
    assert all(final.text.startswith(o.text) for o in outs)
    assert len(final.token_ids) == len(final.text) + len(stop)  # one byte per token: the stop's tokens count


def _first_new(full: str, start: int, width: int) -> str:
    """A substring of `full` from `start` (or later) of `width` characters not occurring earlier."""
    for i in range(start, len(full) - width):
        if full[i : i + width] not in full[: i + width - 1]:
            return full[i : i + width]
    raise AssertionError("no fresh substring")


def test_stop_until_limits_stop_strings_to_the_text_before_it():
    """stop_until (a tool-call trigger): a stop string only counts before its first occurrence,
    including one that is the trigger's own beginning; one before it still cuts."""
    engine = fake_engine()
    prompt = _prompt(10, seed=8)
    full = engine.generate([(prompt, _greedy(40), None)])[0].text
    trigger = _first_new(full, 15, 4)
    at = full.index(trigger)
    after = _first_new(full, at + 6, 2)  # occurs only after the trigger
    for stop in (after, trigger[:2], trigger):
        # one trigger, or several (Llama 3's calls open with a tool's JSON or <|python_tag|>): the first
        for until in ((trigger,), ("\x00never", trigger), (trigger, full[-3:])):
            outs, final = _stream(engine, prompt, _greedy(40, stop=[stop], stop_until=until))
            assert (final.finish_reason, final.text) == ("length", full), (stop, until)
            assert "".join(o.delta_text for o in outs) == full
    before = full[at - 3 : at - 1]
    outs, final = _stream(engine, prompt, _greedy(40, stop=[before], stop_until=(trigger,)))
    assert final.finish_reason == "stop" and final.text == full[: full.index(before)]
    assert "".join(o.delta_text for o in outs) == final.text


def test_possible_stop_start_is_held_back_then_released():
    engine = fake_engine()
    prompt = _prompt(10, seed=4)
    full = engine.generate([(prompt, _greedy(30), None)])[0].text
    stop = full[10] + "\x01\x02"  # its first character occurs; the whole string never does
    outs, final = _stream(engine, prompt, _greedy(30, stop=[stop]))
    assert final.finish_reason == "length" and final.text == full
    assert "".join(o.delta_text for o in outs) == full
    texts = [o.text for o in outs if not o.finished]
    assert full[:10] in texts and full[:11] not in texts  # the candidate waited for the next token
    assert all(len(o.text) <= len(o.token_ids) for o in outs)


def test_stop_token_ids_end_the_output_and_are_not_in_the_text():
    engine = fake_engine()
    prompt = _prompt(10, seed=5)
    full = engine.runner.greedy_continuation(prompt, 30)
    k = next(i for i in range(5, 30) if full[i] not in full[:i])
    out = engine.generate([(prompt, _greedy(30, stop_token_ids=[full[k]]), None)])[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full[: k + 1]
    assert out.text == engine.tokenizer.decode(full[:k])


def test_eos_stops_unless_ignore_eos():
    engine = fake_engine()
    eos = engine.tokenizer.eos_token_id
    prompt = _prompt(10, seed=6)
    bias = {eos: 100.0}
    out = engine.generate([(prompt, _greedy(5, logit_bias=bias), None)])[0]
    assert out.finish_reason == "stop" and out.token_ids == [eos] and out.text == ""
    out = engine.generate([(prompt, _greedy(5, logit_bias=bias, ignore_eos=True), None)])[0]
    assert out.finish_reason == "length" and out.token_ids == [eos] * 5 and out.text == ""
    out = engine.generate(
        [(prompt, _greedy(5, logit_bias=bias, ignore_eos=True, skip_special_tokens=False), None)]
    )[0]
    assert out.text == "<|endoftext|>" * 5


def test_context_limit_caps_unset_max_tokens_and_refuses_overflow():
    engine = fake_engine(max_model_len=64)
    out = engine.generate([(_prompt(60), SamplingParams(temperature=0), None)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    with pytest.raises(ContextLengthError) as e:
        engine.add_request(_prompt(64), SamplingParams())
    assert e.value.param == "prompt" and e.value.limit == 64 and e.value.num_prompt_tokens == 64
    with pytest.raises(ContextLengthError) as e:
        engine.add_request(_prompt(40), SamplingParams(max_tokens=30))
    assert e.value.param == "max_tokens"
    small = fake_engine(max_model_len=64, num_kv_slots=32)  # the pool is the tighter limit
    with pytest.raises(ContextLengthError) as e:
        small.add_request(_prompt(40), SamplingParams())
    assert e.value.limit == 32
    assert not engine.has_work() and not small.has_work()


def test_invalid_requests_are_refused_naming_the_field():
    engine = fake_engine()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request([], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request([engine.runner.arch.vocab_size], SamplingParams())
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request([1, 2], SamplingParams(stop_token_ids=[10**6]))
    assert e.value.param == "stop_token_ids"
    assert not engine.has_work()


# ---- abort ------------------------------------------------------------------------------------------
def test_abort_running_request_frees_its_kv():
    engine = fake_engine(_no_cache())
    kv = engine.runner.kv
    baseline = kv.num_free
    keep = engine.add_request(_prompt(12, seed=7), _greedy(20, ignore_eos=True))
    victim = engine.add_request(_prompt(30, seed=8), _greedy(50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert kv.num_free == baseline - (12 + 3) - (30 + 3) + 2  # the two last tokens have no KV yet
    out = engine.abort(victim.request_id)
    assert out.finished and out.finish_reason == "abort" and len(out.token_ids) == 3
    assert kv.num_free == baseline - (12 + 2)
    assert engine.abort(victim.request_id) is None  # gone
    finals = []
    while engine.has_work():
        finals.extend(o for o in engine.step() if o.finished)
    assert [o.request_id for o in finals] == [keep.request_id]
    assert finals[0].token_ids == engine.runner.greedy_continuation(_prompt(12, seed=7), 20)
    assert kv.num_free == baseline
    assert _metric(engine, "agentrt_requests_finished_total", reason="abort") == 1


def test_abort_waiting_request_and_engine_forgets_it():
    engine = fake_engine()
    req = engine.add_request(_prompt(12, seed=9), _greedy(5))
    rid = req.request_id
    ref = weakref.ref(req)
    del req
    out = engine.abort(rid)
    assert out.finish_reason == "abort" and out.token_ids == [] and out.text == ""
    assert not engine.has_work() and engine.step() == []
    gc.collect()
    assert ref() is None  # no queue, cache or table still holds the request (or its state)
    assert engine.runner.kv.num_free == engine.runner.kv.num_slots


def test_abort_with_prefix_cache_leaves_every_slot_free_or_evictable():
    """After aborting, a request that needs the whole pool still runs: the aborted request's KV
    went to the cache unlocked (evictable), nothing stayed locked."""
    engine = fake_engine(num_kv_slots=64)
    r = engine.add_request(_prompt(20, seed=11), _greedy(30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort(r.request_id)
    big = _prompt(40, seed=12)
    out = engine.generate([(big, _greedy(24, ignore_eos=True), None)])[0]
    assert out.token_ids == engine.runner.greedy_continuation(big, 24)
    assert _metric(engine, "agentrt_preemptions_total") == 0


def test_a_prompt_sharing_a_short_prefix_with_a_long_cached_one_is_admitted():
    """A cached 580-token prompt fills most of a 650-slot pool; a new prompt shares its first 30
    tokens. The match ends inside the cached edge: admission locks only the shared 30 tokens (the
    edge is split there), so the other 550 can be evicted and the new prompt runs (before, the
    whole edge was locked and the request went back to the queue at every step, forever)."""
    engine = fake_engine(num_kv_slots=650, max_model_len=1024)
    shared = _prompt(30, seed=1)
    a = shared + _prompt(550, seed=2)
    b = shared + _prompt(560, seed=3)
    out_a = engine.generate([(a, _greedy(8), None)])[0]
    assert out_a.token_ids == engine.runner.greedy_continuation(a, 8)
    req = engine.add_request(b, _greedy(8))
    outs = []
    for _ in range(200):  # a few dozen steps are enough
        outs += [o for o in engine.step() if o.request_id == req.request_id and o.finished]
        if outs:
            break
    assert outs and outs[0].token_ids == engine.runner.greedy_continuation(b, 8)
    assert outs[0].num_cached_tokens == 30
