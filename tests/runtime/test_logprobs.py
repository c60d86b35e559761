"""Token logprobs in the engine (SamplingParams.logprobs -> RequestOutput.logprobs): the arithmetic
on hand-made logits, alignment with the output, greedy identity with logprobs on and off, the
grammar's renormalised distribution (top only allowed tokens), forced tokens at 0.0, and
speculation (n-gram) giving the same logprobs as plain decoding."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import xgrammar as xgr

from agentrt.errors import InvalidRequestError
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
from agentrt.runtime.constraint_state import ConstraintState
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import Request, SamplingParams, TokenLogprob
from agentrt.runtime.sampler import apply_bitmask, sample
from tests.support.models import chat_ids

XGR_KERNEL = SimpleNamespace(
    apply_bitmask=lambda logits, bitmask, rows: xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
)


def _request(**params) -> Request:
    r = Request("r", [1], SamplingParams(**params))
    r.generator = torch.Generator().manual_seed(0)
    return r


def _by_hand(row: list[float], allowed: set[int]) -> dict[int, float]:
    """log p(i) = x_i - log(sum over allowed tokens of exp(x_j)), in float64."""
    z = math.log(sum(math.exp(row[j]) for j in allowed))
    return {i: row[i] - z for i in allowed}


# ---- the arithmetic, on known logits -------------------------------------------------------------
def test_sampler_logprobs_match_log_softmax_by_hand():
    """Four rows of known logits; rows 0, 1 and 3 masked by a bitmask: greedy with top 3, a
    sampled row at temperature 0.3 (logprobs are before temperature), logprobs=0 (no top), and a
    row where one token is allowed (logprob 0.0, top that token alone)."""
    vocab = 40
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, vocab, generator=gen) * 3
    raw = logits.tolist()
    allowed = [{1, 5, 7, 30}, {2, 3, 4, 5, 6, 39}, set(range(vocab)), {17}]
    bitmask = torch.zeros(4, 2, dtype=torch.int32)
    for i, ids in enumerate(allowed):
        words = [0, 0]
        for t in ids:
            words[t // 32] |= 1 << (t % 32)
        bitmask[i] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    apply_bitmask(logits, bitmask, [0, 1, 3], XGR_KERNEL)
    reqs = [
        _request(temperature=0.0, logprobs=3),
        _request(temperature=0.3, logprobs=5),
        _request(temperature=0.0, logprobs=0),
        _request(temperature=1.0, logprobs=4),
    ]
    out: dict[int, TokenLogprob] = {}
    ids = sample(logits, reqs, logprobs=out)
    assert sorted(out) == [0, 1, 2, 3]
    for i, (tok, r) in enumerate(zip(ids, reqs)):
        expect = _by_hand(raw[i], allowed[i])
        lp = out[i]
        assert lp.token_id == tok and tok in allowed[i]
        assert lp.logprob == pytest.approx(expect[tok], abs=1e-5)
        k = r.params.logprobs
        ranked = sorted(expect.items(), key=lambda kv: -kv[1])[:k]
        assert [t for t, _ in lp.top] == [t for t, _ in ranked]
        assert [v for _, v in lp.top] == pytest.approx([v for _, v in ranked], abs=1e-5)
    assert ids[0] == out[0].top[0][0]  # greedy: the most likely allowed token
    assert len(out[1].top) == 5 and all(t in allowed[1] for t, _ in out[1].top)
    assert out[2].top == ()
    assert out[3] == TokenLogprob(17, 0.0, ((17, 0.0),))


def test_rows_that_ask_nothing_get_nothing():
    logits = torch.randn(2, 16)
    out: dict[int, TokenLogprob] = {}
    sample(logits, [_request(temperature=0.0), _request(temperature=0.0, logprobs=2)], logprobs=out)
    assert list(out) == [1]


@pytest.mark.parametrize("value", [-1, 21, True, 2.0])
def test_invalid_logprobs_value_names_the_field(value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logprobs=value).validate()
    assert e.value.param == "logprobs"


def test_append_output_keeps_logprobs_aligned():
    r = _request(logprobs=2)
    r.append_output([5], [TokenLogprob(5, -0.5, ((5, -0.5),))])
    r.append_output([6, 7])  # forced
    assert r.logprobs[1:] == [TokenLogprob(6, 0.0, ((6, 0.0),)), TokenLogprob(7, 0.0, ((7, 0.0),))]
    with pytest.raises(ValueError):
        r.append_output([8], [TokenLogprob(9, -1.0, ())])
    assert len(r.logprobs) == r.num_output_tokens == 3


# ---- the engine on the default model --------------------------------------------------------------
def _prompt(engine, text: str) -> list[int]:
    return chat_ids(engine.tokenizer, [{"role": "user", "content": text}])


def test_greedy_logprobs_aligned_and_output_unchanged(engine):
    prompts = [_prompt(engine, "Name three colours."), _prompt(engine, "What is 2 + 2?")]
    plain = engine.generate([(p, SamplingParams(max_tokens=12, temperature=0.0), None) for p in prompts])
    asked = engine.generate(
        [
            (p, SamplingParams(max_tokens=12, temperature=0.0, logprobs=k), None)
            for p, k in zip(prompts, [5, 0])
        ]
    )
    for a, b, k in zip(plain, asked, [5, 0]):
        assert a.logprobs is None
        assert b.token_ids == a.token_ids and b.text == a.text
        assert [lp.token_id for lp in b.logprobs] == b.token_ids
        for lp in b.logprobs:
            assert lp.logprob <= 0.0
            if k:
                assert lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)
                assert len(lp.top) == k and [v for _, v in lp.top] == sorted(
                    (v for _, v in lp.top), reverse=True
                )
            else:
                assert lp.top == ()


def test_sampled_request_logprobs_are_before_temperature(engine):
    """The same sequence has the same logprobs whatever the temperature: replayed greedily as a
    prompt, each sampled token's logprob equals the greedy run's top entry for it."""
    p = _prompt(engine, "Say something about cats.")
    out = engine.generate([(p, SamplingParams(max_tokens=6, temperature=1.7, seed=3, logprobs=0), None)])[0]
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for i, tok in enumerate(out.token_ids[:3]):
        ref = engine.generate(
            [(p + out.token_ids[:i], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), None)]
        )
        top = dict(ref[0].logprobs[0].top)
        if tok in top:  # a sampled token outside the top 20 has nothing to compare with
            assert out.logprobs[i].logprob == pytest.approx(top[tok], abs=1e-4)


def test_constrained_top_holds_only_allowed_tokens(engine):
    """A choice of three: every step's top entries are tokens the matcher allows there, their
    probabilities sum to at most 1, and the end-of-sequence token the grammar forces is 0.0."""
    spec = ConstraintSpec.choice(["Paris", "London", "Berlin"])
    p = _prompt(engine, "What is the capital of France?")
    out = engine.generate([(p, SamplingParams(max_tokens=8, temperature=0.0, logprobs=20), spec)])[0]
    assert out.text in ("Paris", "London", "Berlin")
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    matcher = engine.grammar.new_matcher(engine.grammar.compile(spec))
    bitmask = engine.grammar.allocate_bitmask(1)
    for lp in out.logprobs:
        matcher.fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0].tolist()
        allowed = {t for t in range(engine.vocab_size) if (words[t // 32] >> (t % 32)) & 1}
        assert {t for t, _ in lp.top} <= allowed and lp.token_id in allowed
        assert len(lp.top) == min(20, len(allowed))
        assert sum(math.exp(v) for _, v in lp.top) <= 1.0 + 1e-5
        if len(allowed) == 1:
            assert lp == TokenLogprob(lp.token_id, 0.0, ((lp.token_id, 0.0),))
        assert matcher.accept_token(lp.token_id)
    assert out.logprobs[-1].logprob == 0.0  # after the choice only the end is allowed


def test_jump_forward_tokens_have_logprob_zero(engine, monkeypatch):
    """A schema with a long required key: its text is jump-forward; those tokens read 0.0."""
    forced_at: list[tuple[int, int]] = []  # (index of the first forced token, how many)
    original = ConstraintState.jump_forward

    def record(self, tokenizer, last_id, left):
        ids = original(self, tokenizer, last_id, left)
        if ids:
            forced_at.append((len(requests[0].output_ids), len(ids)))
        return ids

    monkeypatch.setattr(ConstraintState, "jump_forward", record)
    schema = {
        "type": "object",
        "properties": {"customer_full_legal_name": {"type": "string", "maxLength": 12}},
        "required": ["customer_full_legal_name"],
        "additionalProperties": False,
    }
    p = _prompt(engine, "Give the customer as JSON: Ada Lovelace.")
    r = engine.add_request(
        p, SamplingParams(max_tokens=40, temperature=0.0, logprobs=3), ConstraintSpec.json_schema(schema)
    )
    requests = [r]
    final = None
    while final is None:
        final = next((o for o in engine.step() if o.finished), None)
    assert final.finish_reason == "stop" and forced_at
    assert [lp.token_id for lp in final.logprobs] == final.token_ids
    for start, n in forced_at:
        for lp in final.logprobs[start : start + n]:
            assert lp == TokenLogprob(lp.token_id, 0.0, ((lp.token_id, 0.0),))
    sampled = [lp for lp in final.logprobs if lp.logprob < 0.0]
    assert sampled  # the name's tokens were sampled


@pytest.fixture(scope="module")
def ngram_engine(default_model_dir):
    return Engine(
        EngineConfig(
            model=ModelConfig(model=str(default_model_dir), device="cpu", dtype="float32"),
            cache=CacheConfig(kv_cache_bytes=64 << 20),
            speculative=SpecConfig(method="ngram", num_speculative_tokens=4),
        )
    )


REPEAT = "Repeat exactly: red, green, blue, red, green, blue, red, green, blue."


def test_speculation_gives_the_same_logprobs(engine, ngram_engine):
    """Greedy with n-gram speculation: same tokens and the same logprobs (1e-4) as plain decoding,
    with draft tokens accepted (their logprobs come from the verify rows)."""
    prompts = [
        _prompt(engine, REPEAT),
        _prompt(engine, "Write a JSON object for a person named Ada aged 36."),
    ]
    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reqs = [
        (prompts[0], SamplingParams(max_tokens=24, temperature=0.0, logprobs=4), None),
        (
            prompts[1],
            SamplingParams(max_tokens=24, temperature=0.0, logprobs=2),
            ConstraintSpec.json_schema(person),
        ),
    ]
    plain = engine.generate(reqs)
    before = ngram_engine.stats.num_accepted_tokens
    spec = ngram_engine.generate(reqs)
    assert ngram_engine.stats.num_accepted_tokens > before
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert len(b.logprobs) == len(a.logprobs) == len(a.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert y.token_id == x.token_id
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-4)


def test_sampled_speculation_logprobs_are_the_targets(engine, ngram_engine):
    """Sampling with n-gram speculation (accepted drafts and sampled bonus tokens): each token's
    logprob is the target model's at its position, as plain decoding computes it there."""
    p = _prompt(engine, REPEAT)
    before = ngram_engine.stats.num_accepted_tokens
    params = SamplingParams(max_tokens=10, temperature=0.7, seed=5, logprobs=20)
    out = ngram_engine.generate([(p, params, None)])[0]
    assert ngram_engine.stats.num_accepted_tokens > before
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    compared = 0
    for i, tok in enumerate(out.token_ids):
        ref = engine.generate(
            [(p + out.token_ids[:i], SamplingParams(max_tokens=1, temperature=0.0, logprobs=20), None)]
        )
        top = dict(ref[0].logprobs[0].top)
        assert [t for t, _ in out.logprobs[i].top] == [t for t, _ in ref[0].logprobs[0].top]
        if tok in top:
            assert out.logprobs[i].logprob == pytest.approx(top[tok], abs=1e-4)
            compared += 1
    assert compared >= len(out.token_ids) // 2
