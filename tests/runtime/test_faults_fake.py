"""Fault isolation on the fake model runner: an unexpected exception while serving one request
(its matcher set-up, its per-token processing) fails that request alone with an InternalError;
the engine keeps stepping and the other requests finish with their normal output."""

from __future__ import annotations

import pytest

from agentrt.errors import InternalError
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine
from tests.support.models import finish_all

pytestmark = pytest.mark.usefixtures("time_limit")

PROMPTS = [[ord(c) for c in text] for text in ("first prompt", "second prompt", "third")]


def test_matcher_setup_fault_fails_only_that_request():
    engine = fake_engine()
    want = [
        o.token_ids
        for o in engine.generate([(p, SamplingParams(temperature=0, max_tokens=8), None) for p in PROMPTS])
    ]
    real = engine.grammar.new_matcher

    def broken(compiled, *args):
        raise RuntimeError("matcher exploded")

    engine.grammar.new_matcher = broken
    try:
        bad = engine.add_request(
            PROMPTS[0], SamplingParams(temperature=0, max_tokens=8), ConstraintSpec.regex("[a-z]+")
        )
        good = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8)) for p in PROMPTS]
        outs = finish_all(engine, [bad, *good])
    finally:
        engine.grammar.new_matcher = real
    assert outs[0].finish_reason == "error" and isinstance(outs[0].error, InternalError)
    assert "matcher exploded" in str(outs[0].error)
    assert [o.token_ids for o in outs[1:]] == want
    assert all(o.finish_reason == "length" for o in outs[1:])


def test_per_token_fault_fails_only_that_request_and_frees_its_kv():
    engine = fake_engine()
    want = [
        o.token_ids
        for o in engine.generate(
            [(p, SamplingParams(temperature=0, max_tokens=8), None) for p in PROMPTS[1:]]
        )
    ]
    reqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=8)) for p in PROMPTS]
    victim = reqs[0].request_id
    real = engine.output.update

    def update(r, reason):
        if r.request_id == victim and r.num_output_tokens == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "odd bytes")
        return real(r, reason)

    engine.output.update = update
    outs = finish_all(engine, reqs)
    assert outs[0].finish_reason == "error" and isinstance(outs[0].error, InternalError)
    assert [o.token_ids for o in outs[1:]] == want
    assert not engine.has_work()
    kv, cache = engine.runner.kv, engine.scheduler.cache  # every slot free, or cached and unlocked
    assert kv.num_free + (cache.evictable_tokens if cache is not None else 0) == kv.num_slots


def test_generate_refuses_a_batch_with_an_invalid_request_before_queuing_any():
    engine = fake_engine()
    ok = (PROMPTS[0], SamplingParams(temperature=0, max_tokens=4), None)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([ok, (PROMPTS[1], SamplingParams(top_p=0.0), None)])
    assert not engine.has_work()
    assert [o.finish_reason for o in engine.generate([ok])] == ["length"]
