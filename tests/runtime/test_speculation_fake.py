"""Speculative decoding bookkeeping on the fake model runner with the n-gram proposer (no weights;
milliseconds). The fake's logits depend on the last token only (`window=1`), so greedy output soon
repeats and prompt lookup drafts get accepted. Greedy output must be identical with speculation on
and off; the counters must add up; rejected draft slots must go back to the pool."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.config import CacheConfig, EngineConfig, SpecConfig
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine

pytestmark = pytest.mark.usefixtures("time_limit")


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(length)] for _ in range(n)]


def _config(spec: bool, prefix_cache: bool = False, k: int = 4) -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(enable_prefix_cache=prefix_cache),
        speculative=SpecConfig(method="ngram", num_speculative_tokens=k) if spec else SpecConfig(),
    )


def _params(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def _metric(engine, name: str) -> float:
    return engine.metrics.registry.get_sample_value(name) or 0.0


def test_ngram_greedy_output_identical_and_saves_forwards():
    prompt = _prompts(1, 16, seed=1)[0]
    n = 60
    on = fake_engine(_config(True), window=1)
    off = fake_engine(_config(False), window=1)
    out_on = on.generate([(prompt, _params(n), None)])[0]
    out_off = off.generate([(prompt, _params(n), None)])[0]
    assert out_on.token_ids == out_off.token_ids == on.runner.greedy_continuation(prompt, n)
    assert out_on.text == out_off.text and out_on.finish_reason == "length"
    s = on.stats
    assert s.num_spec_steps > 0 and s.num_accepted_tokens > 0
    assert off.stats.num_spec_steps == 0 and off.runner.num_forwards == n  # prefill + n - 1 decodes
    # each verify pass emits its accepted tokens + one: every accepted token saved one forward
    assert on.runner.num_forwards == n - s.num_accepted_tokens
    assert s.num_generated_tokens == off.stats.num_generated_tokens == n
    # a verify chunk computes the last token and the draft
    verify = [c for f in on.runner.forwards for c in f.chunks if c[2] > 1]
    assert len(verify) == s.num_spec_steps
    assert sum(c[1] - 1 for c in verify) == s.num_draft_tokens
    assert on.runner.kv.num_free == on.runner.kv.num_slots  # rejected draft slots went back


def test_ngram_counters_add_up_in_a_batch():
    prompts = _prompts(4, 12, seed=2)
    on = fake_engine(_config(True, prefix_cache=True, k=3), window=1)
    outs = on.generate([(p, _params(40), None) for p in prompts])
    assert [o.token_ids for o in outs] == [on.runner.greedy_continuation(p, 40) for p in prompts]
    s = on.stats
    assert 0 < s.num_accepted_tokens <= s.num_draft_tokens <= 3 * s.num_spec_steps
    assert s.drafted_per_position[0] == s.num_spec_steps  # every pass drafts depth 1
    assert sum(s.accepted_per_position) == s.num_accepted_tokens
    # accepting depth d + 1 needs depth d: acceptance never grows with depth
    acc = s.accepted_per_position
    assert all(a >= b for a, b in itertools.pairwise(acc)) and len(acc) <= 3
    assert all(a <= d for a, d in zip(acc, s.drafted_per_position))
    assert _metric(on, "agentrt_spec_drafts_total") == s.num_spec_steps
    assert _metric(on, "agentrt_spec_draft_tokens_total") == s.num_draft_tokens
    assert _metric(on, "agentrt_spec_accepted_tokens_total") == s.num_accepted_tokens
    assert (
        abs(_metric(on, "agentrt_spec_acceptance_rate") - s.num_accepted_tokens / s.num_draft_tokens) < 1e-9
    )


def test_requests_that_opt_out_or_use_penalties_do_not_speculate():
    prompt = _prompts(1, 16, seed=3)[0]
    engine = fake_engine(_config(True), window=1)
    outs = engine.generate(
        [
            (prompt, _params(30, speculative=False), None),
            (prompt, _params(30, repetition_penalty=1.2), None),
            (prompt, _params(30, presence_penalty=0.5), None),
            (prompt, _params(30, frequency_penalty=0.5), None),
        ]
    )
    assert engine.stats.num_spec_steps == 0  # penalties depend on the verified tokens: no speculation
    assert outs[0].token_ids == engine.runner.greedy_continuation(prompt, 30)
    engine.generate([(prompt, _params(30), None)])
    assert engine.stats.num_spec_steps > 0
    text = engine.metrics.render().decode()
    assert 'agentrt_spec_position_acceptance_rate{position="1"}' in text


def test_max_tokens_is_exact_with_speculation():
    engine = fake_engine(_config(True, k=8), window=1)
    prompts = _prompts(3, 10, seed=4)
    outs = engine.generate([(p, _params(n), None) for p, n in zip(prompts, (5, 17, 33))])
    assert [len(o.token_ids) for o in outs] == [5, 17, 33]
    assert engine.stats.num_accepted_tokens > 0


def test_stop_inside_an_accepted_draft_ends_the_output_there():
    prompt = _prompts(1, 16, seed=5)[0]
    off = fake_engine(_config(False), window=1)
    on = fake_engine(_config(True), window=1)
    full = off.runner.greedy_continuation(prompt, 60)
    text = off.tokenizer.decode(full)
    # the shortest stop string whose first occurrence ends at token 45 (one byte per token):
    # by then the output repeats itself and drafts are being accepted
    k = 45
    j = max(j for j in range(k + 1) if text[j : k + 1] not in text[:k])
    stop = SamplingParams(temperature=0, max_tokens=60, stop=[text[j : k + 1]])
    out_on, out_off = (e.generate([(prompt, stop, None)])[0] for e in (on, off))
    assert out_on.token_ids == out_off.token_ids == full[: k + 1]
    assert out_on.text == out_off.text == text[:j]
    assert out_on.finish_reason == "stop"
    assert on.stats.num_accepted_tokens > 0
    assert on.runner.kv.num_free == on.runner.kv.num_slots


def test_constrained_request_speculates_within_its_grammar():
    prompt = [ord(c) for c in "abcabcabc-"]
    pattern = r"([a-c]{3}-){6}"
    outs = {}
    for spec in (True, False):
        engine = fake_engine(_config(spec), window=1)
        outs[spec] = (
            engine,
            engine.generate(
                [(prompt, SamplingParams(temperature=0, max_tokens=40), ConstraintSpec.regex(pattern))]
            )[0],
        )
    (on, out_on), (_, out_off) = outs[True], outs[False]
    assert out_on.token_ids == out_off.token_ids and out_on.finish_reason == "stop"
    assert re.fullmatch(pattern, out_on.text)
    assert on.stats.num_spec_steps > 0
    assert on.runner.kv.num_free == on.runner.kv.num_slots


def test_grammar_cuts_drafts_it_rejects_greedy_and_sampled():
    """Prompt lookup proposes what followed a token in the prompt (an uppercase letter here), which
    the grammar rejects: those draft nodes are cut before verification, and outputs stay valid."""
    prompt = [ord(c) for c in "aZbZcZaYbYcY"]
    pattern = r"[a-c]{24}"
    engine = fake_engine(_config(True), window=1)
    reqs = [
        (
            prompt,
            SamplingParams(temperature=0.0 if i < 2 else 0.9, seed=i, max_tokens=40),
            ConstraintSpec.regex(pattern),
        )
        for i in range(6)
    ]
    outs = engine.generate(reqs)
    for o in outs:
        assert o.error is None and o.finish_reason == "stop", (o.error, o.text)
        assert re.fullmatch(pattern, o.text)
    assert engine.stats.num_spec_steps > 0
    assert engine.stats.num_draft_tokens_cut_by_grammar > 0
    assert engine.runner.kv.num_free == engine.runner.kv.num_slots


def test_a_drafting_fault_fails_that_request_alone():
    """The matcher raising while a draft is fitted to one request's grammar fails that request
    (InternalError); the batch's other requests finish exactly as without the fault."""
    prompts = [[ord(c) for c in p] for p in ("abcabcabc-", "bcabcabca-", "cabcabcab-")]
    pattern = r"([a-c]{3}-){6}"

    def run(fault: bool):
        engine = fake_engine(_config(True), window=1)
        fit = engine.speculator._fit_to_grammar
        calls = []

        def fit_or_raise(r, tree):
            if fault and r.prompt_ids == prompts[1]:
                calls.append(r)
                if len(calls) > 1:  # after one good draft: the matcher breaks mid-request
                    raise RuntimeError("injected matcher fault")
            return fit(r, tree)

        engine.speculator._fit_to_grammar = fit_or_raise
        reqs = [
            (p, SamplingParams(temperature=0, max_tokens=40), ConstraintSpec.regex(pattern)) for p in prompts
        ]
        return engine, engine.generate(reqs)

    _, clean = run(fault=False)
    engine, faulty = run(fault=True)
    assert faulty[1].finish_reason == "error" and "speculative drafting" in faulty[1].error.message
    for i in (0, 2):
        assert faulty[i].error is None and faulty[i].finish_reason == "stop"
        assert faulty[i].token_ids == clean[i].token_ids and re.fullmatch(pattern, faulty[i].text)
    assert not engine.has_work() and engine.runner.kv.num_free == engine.runner.kv.num_slots
