"""Client-controlled work is bounded per request (fake runner, real xgrammar compiles): a grammar
that forces billions of characters finishes at max_tokens with bounded jump-forward searches while a
plain request beside it is served as if alone; stop strings and tool-call heads have size caps."""

from __future__ import annotations

import re

import pytest
import xgrammar as xgr

from agentrt.api.tools import ToolCallParser
from agentrt.grammars.finite import forced_text_bound
from agentrt.grammars.jump_forward import FAST_MAX_CHARS, SLOW_MAX_CHARS, ForcedTextFinder
from agentrt.grammars.spec import ConstraintSpec
from agentrt.grammars.tool_calls import FORMATS
from agentrt.runtime.request import MAX_STOP_CHARS, SamplingParams
from agentrt.testing import fake_engine

pytestmark = pytest.mark.usefixtures("time_limit")

HUGE = [
    ConstraintSpec.grammar('root ::= "a"{2000000000,2147483647}'),
    ConstraintSpec.regex("a{1000000000}"),
    ConstraintSpec.grammar('root ::= "a"{10000000} "b"'),
    # rules that double each other: 2^40 characters from a 1 KB grammar
    ConstraintSpec.grammar(
        "".join(f"r{i + 1} ::= r{i} r{i}\n" for i in range(40)) + 'r0 ::= "a"\nroot ::= r40\n'
    ),
]
PLAIN = [ord(c) for c in "a plain request"]


@pytest.fixture
def searches(monkeypatch):
    """Lengths of every forced text the finder returned, and of every xgrammar search it ran."""
    seen = {"find": [], "xgrammar": []}
    find, xgr_find = ForcedTextFinder.find, xgr.GrammarMatcher.find_jump_forward_string

    def spy_find(self, matcher, bound, num_chars, max_chars):
        text = find(self, matcher, bound, num_chars, max_chars)
        assert len(text) <= max_chars
        seen["find"].append(len(text))
        return text

    def spy_xgr(self):
        text = xgr_find(self)
        seen["xgrammar"].append(len(text))
        return text

    monkeypatch.setattr(ForcedTextFinder, "find", spy_find)
    monkeypatch.setattr(xgr.GrammarMatcher, "find_jump_forward_string", spy_xgr)
    return seen


@pytest.mark.parametrize("spec", HUGE, ids=["ebnf-2e9", "regex-1e9", "ebnf-1e7", "doubling"])
def test_huge_forced_text_ends_at_max_tokens_and_others_are_served(spec, searches):
    engine = fake_engine()
    alone = engine.generate([(PLAIN, SamplingParams(temperature=0, max_tokens=24), None)])[0]
    bad, plain = engine.generate(
        [
            ([ord(c) for c in "say a"], SamplingParams(temperature=0, max_tokens=300), spec),
            (PLAIN, SamplingParams(temperature=0, max_tokens=24), None),
        ]
    )
    assert bad.finish_reason == "length" and bad.error is None
    assert len(bad.token_ids) == 300 and set(bad.text) == {"a"}
    assert engine.stats.num_jump_forward_tokens > 250  # forced, not sampled one by one
    assert max(searches["find"]) <= SLOW_MAX_CHARS  # the step-by-step search, a few chars a step
    assert searches["xgrammar"] == []  # xgrammar never materialised the forced run
    assert plain.token_ids == alone.token_ids and plain.finish_reason == "length"
    kv = engine.runner.kv
    assert kv.num_free + engine.scheduler.cache.evictable_tokens == kv.num_slots


def test_recursion_that_forces_text_per_level_stays_correct_and_bounded(searches):
    """`(` levels each owe 60 forced `a`: the bound grows with the output, so after a few levels
    the search steps instead of asking xgrammar for the whole tail."""
    engine = fake_engine()
    spec = ConstraintSpec.grammar('root ::= "(" root "a"{60} | "x"')
    params = SamplingParams(temperature=0, max_tokens=400)
    out = engine.generate([([ord(c) for c in "nest"], params, spec)])[0]
    assert out.error is None
    if out.finish_reason == "stop":
        depth = out.text.index("x")
        assert re.fullmatch(r"\(*x(a{60})*", out.text) and len(out.text) == 1 + depth * 61
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 400
    assert all(n <= FAST_MAX_CHARS for n in searches["xgrammar"])


def test_forced_text_bound_of_grammars():
    def bound(ebnf):
        return forced_text_bound(str(xgr.Grammar.from_ebnf(ebnf)))

    assert bound('root ::= "a"{2000000000,2147483647}').at(0) >= 2_000_000_000
    assert bound('root ::= "ab" "c"') == (3, 0)
    nested = bound('root ::= "(" root ")" | "x"')
    assert nested.per_output_char > 0 and nested.at(10) > nested.at(0)
    schema = xgr.Grammar.from_json_schema(
        '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}',
        strict_mode=False,
        any_whitespace=False,
    )
    assert forced_text_bound(str(schema)).at(100) <= FAST_MAX_CHARS  # ordinary JSON: xgrammar's search


def test_schema_jump_forward_is_unchanged(searches):
    """An ordinary schema still jumps over its forced keys with xgrammar's own search."""
    engine = fake_engine()
    schema = {
        "type": "object",
        "required": ["a_rather_long_property_name_to_force"],
        "properties": {"a_rather_long_property_name_to_force": {"type": "integer"}},
        "additionalProperties": False,
    }
    out = engine.generate(
        [(PLAIN, SamplingParams(temperature=0, max_tokens=64), ConstraintSpec.json_schema(schema))]
    )[0]
    assert out.finish_reason == "stop" and out.text.startswith('{"a_rather_long_property_name_to_force": ')
    assert max(searches["xgrammar"]) >= len('"a_rather_long_property_name_to_force": ')


def test_stop_strings_have_a_size_cap():
    engine = fake_engine()
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters") as e:
        engine.add_request(PLAIN, SamplingParams(max_tokens=4, stop=["x" * (MAX_STOP_CHARS + 1)]))
    assert e.value.param == "stop"
    long_stop = "q" * MAX_STOP_CHARS  # the longest allowed: generation is not slowed into a stall
    out = engine.generate([(PLAIN, SamplingParams(temperature=0, max_tokens=64, stop=[long_stop]), None)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 64


def test_tool_call_head_longer_than_any_name_is_not_matched_incrementally(monkeypatch):
    from agentrt.api.tools import parsing

    matched = []
    real = parsing.regex.match

    def match(pattern, string, *a, **kw):
        matched.append(len(string))
        return real(pattern, string, *a, **kw)

    monkeypatch.setattr(parsing.regex, "match", match)
    fmt = next(f for f in FORMATS.values() if not f.marker_in_body and not f.list_style)
    parser = ToolCallParser(fmt)
    text = f'{fmt.marker}{{"name": "' + "n" * 20_000
    for i in range(0, len(text), 7):
        parser.feed(text[i : i + 7])
    parser.finish()
    assert not parser.calls
    assert matched and max(matched) <= parsing._MAX_HEAD_CHARS  # each feed's work is bounded
