"""Grammar plumbing on the fake model runner (no weights; milliseconds): the fake's logits prefer
printable noise, so only the bitmask makes the output satisfy a constraint. Regex, choice and JSON
Schema outputs are validated; a compile error fails the request with a ConstraintError; EOS cannot
end an output early; jump-forward appends forced text without changing the output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from agentrt.errors import ConstraintError
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.runtime.config import CacheConfig, EngineConfig
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine

pytestmark = pytest.mark.usefixtures("time_limit")

PROMPTS = [[ord(c) for c in text] for text in ("Give me a code: ", "Another one please", "x")]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}


def _greedy(n: int = 64, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def _metric(engine, name: str, **labels) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or None) or 0.0


def _no_cache(**grammar) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(enable_prefix_cache=False), grammar=GrammarConfig(**grammar))


def test_regex_output_fullmatches():
    engine = fake_engine()
    pattern = r"[A-Z]{2}-[0-9]{3}(x|yy)"
    outs = engine.generate([(p, _greedy(), ConstraintSpec.regex(pattern)) for p in PROMPTS])
    for o in outs:
        assert o.finish_reason == "stop" and o.error is None
        assert re.fullmatch(pattern, o.text), o.text
    # the constraint changed the output: unconstrained greedy text does not match
    free = engine.generate([(PROMPTS[0], _greedy(8), None)])[0].text
    assert not re.fullmatch(pattern, free)


def test_choice_output_is_one_of_the_choices():
    engine = fake_engine()
    choices = ["apple", "banana", "cherry pie"]
    outs = engine.generate([(p, _greedy(), ConstraintSpec.choice(choices)) for p in PROMPTS])
    assert all(o.finish_reason == "stop" and o.text in choices for o in outs), [o.text for o in outs]


def test_json_schema_output_validates():
    engine = fake_engine()
    outs = engine.generate([(p, _greedy(200), ConstraintSpec.json_schema(SCHEMA)) for p in PROMPTS])
    for o in outs:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMA)
    out = engine.generate([(PROMPTS[0], _greedy(200), ConstraintSpec.json_object())])[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


def test_eos_cannot_end_a_constrained_output_early():
    """EOS forced by logit_bias: allowed only where the grammar may end, so the output is complete."""
    engine = fake_engine()
    eos = engine.tokenizer.eos_token_id
    bias = {eos: 100.0}
    out = engine.generate(
        [(PROMPTS[0], _greedy(logit_bias=bias), ConstraintSpec.regex(r"[a-z]{4}(-[0-9])?"))]
    )[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"[a-z]{4}", out.text)
    assert out.token_ids[-1] == eos and len(out.token_ids) == 5


def test_extra_stop_ids_cannot_end_json_early():
    """EOS and an extra stop id both forced by logit_bias: neither ends the JSON before it is complete;
    the one that ends it is the only stop id in the output, and it is last."""
    engine = fake_engine()
    extra = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    stops = {engine.tokenizer.eos_token_id, extra}
    params = _greedy(
        120, stop_token_ids=[extra], max_tokens_policy="close", logit_bias={t: 100.0 for t in stops}
    )
    out = engine.generate([(PROMPTS[0], params, ConstraintSpec.json_schema(SCHEMA))])[0]
    assert out.finish_reason == "stop", out
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert [t for t in out.token_ids if t in stops] == [out.token_ids[-1]]


def test_jump_forward_respects_max_tokens():
    schema = {
        "type": "object",
        "required": ["a_rather_long_property_name_to_force"],
        "properties": {"a_rather_long_property_name_to_force": {"type": "integer"}},
    }
    engine = fake_engine()
    out = engine.generate([(PROMPTS[0], _greedy(4), ConstraintSpec.json_schema(schema))])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text == '{"a_'
    # after the sampled '{' the forced '"a_rather...' is cut to leave the last token to sampling
    assert engine.stats.num_jump_forward_tokens == 2


def test_compile_error_fails_the_request_with_a_constraint_error():
    engine = fake_engine(_no_cache())
    kv = engine.runner.kv
    ok, bad = engine.generate(
        [
            (PROMPTS[0], _greedy(), ConstraintSpec.regex("[a-c]{2}")),
            (PROMPTS[1], _greedy(), ConstraintSpec.grammar("root ::= undefined_rule")),
        ]
    )
    assert ok.finish_reason == "stop" and re.fullmatch("[a-c]{2}", ok.text)
    assert bad.finished and bad.finish_reason == "error" and bad.token_ids == [] and bad.text == ""
    assert isinstance(bad.error, ConstraintError), bad.error
    assert "undefined_rule" in str(bad.error)
    assert kv.num_free == kv.num_slots and not engine.has_work()
    assert _metric(engine, "agentrt_requests_finished_total", reason="error") == 1


def test_abort_constrained_request_mid_output():
    engine = fake_engine(_no_cache())
    kv = engine.runner.kv
    r = engine.add_request(PROMPTS[0], _greedy(200), ConstraintSpec.json_schema(SCHEMA))
    while not r.output_ids:  # compiled, admitted, first token out
        engine.step()
    out = engine.abort(r.request_id)
    assert out.finish_reason == "abort" and out.token_ids
    assert kv.num_free == kv.num_slots and not engine.has_work()
    # the engine goes on serving constrained requests (the compiled grammar is reused)
    again = engine.generate([(PROMPTS[0], _greedy(200), ConstraintSpec.json_schema(SCHEMA))])[0]
    assert again.finish_reason == "stop"
    jsonschema.validate(json.loads(again.text), SCHEMA)


def test_jump_forward_appends_forced_text_in_fewer_forwards_with_the_same_output():
    spec = ConstraintSpec.json_schema(SCHEMA)
    runs = {}
    for jump in (True, False):
        engine = fake_engine(_no_cache(jump_forward=jump))
        out = engine.generate([(PROMPTS[0], _greedy(200), spec)])[0]
        runs[jump] = (engine, out)
    (on, out_on), (off, out_off) = runs[True], runs[False]
    # byte tokens: the forced text has one tokenization, so the output is token-identical
    assert out_on.token_ids == out_off.token_ids and out_on.finish_reason == "stop"
    jumped = on.stats.num_jump_forward_tokens
    # at least the keys and their quotes/colons: '{"name":"', '","age":', ',"kind":"', ...
    assert jumped >= sum(len(k) + 3 for k in SCHEMA["properties"])
    assert off.stats.num_jump_forward_tokens == 0
    assert _metric(on, "agentrt_jump_forward_tokens_total") == jumped
    assert on.runner.num_forwards <= off.runner.num_forwards - jumped + 1
    # forced tokens are computed as part of the next chunk, not as prefill
    assert on.stats.num_computed_prefill_tokens == off.stats.num_computed_prefill_tokens == len(PROMPTS[0])
    assert on.stats.num_generated_tokens + jumped == len(out_on.token_ids)


def test_close_policy_keeps_a_short_budget_valid():
    engine = fake_engine()
    schema = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"]}
    out = engine.generate(
        [(PROMPTS[0], _greedy(24, max_tokens_policy="close"), ConstraintSpec.json_schema(schema))]
    )[0]
    assert out.finish_reason == "stop" and len(out.token_ids) <= 24
    jsonschema.validate(json.loads(out.text), schema)
    assert out.closed_by_budget  # the budget, not the model, ended it: the caller is told
    cut = engine.generate([(PROMPTS[0], _greedy(24), ConstraintSpec.json_schema(schema))])[0]
    assert cut.finish_reason == "length" and not cut.closed_by_budget  # the default policy just stops
    short = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    roomy = engine.generate(
        [(PROMPTS[0], _greedy(24, max_tokens_policy="close"), ConstraintSpec.json_schema(short))]
    )[0]
    assert roomy.finish_reason == "stop" and not roomy.closed_by_budget  # closed by the model itself
