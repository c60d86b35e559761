"""Issue 21's later rewrites, model-free: the multipleOf residue automaton (decimals.py) against
`jsonschema` in exact decimal arithmetic, the `format: regex` language against Python's `re`,
conditionals (conditionals.py), the closed-object complement inside oneOf, uniqueItems/contains
bounds, draft-07 `$ref` siblings; the search automaton (`pattern`, propertyNames) against `re`, the
earlier rewrites (dependentRequired, oneOf by whole types, negation) and their refusals past their
bounds. Grammar-level verdicts and random walks are in test_schema_coverage.py."""

from __future__ import annotations

import json
import random
import re
import warnings
from decimal import Decimal

import jsonschema
import pytest

from agentrt.grammars.json_schema import UnsupportedSchemaError, normalize_schema
from agentrt.grammars.json_schema.automata import AutomatonError, alphabet, build, live_states, minimize
from agentrt.grammars.json_schema.automata import accepts as dfa_state
from agentrt.grammars.json_schema.decimals import MAX_NUMBER_STATES, multiple_lcm, number_dfa
from agentrt.grammars.json_schema.nodes import regex_format_text
from agentrt.grammars.regex import _merge

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")
_BOUND_ARGS = {
    "minimum": "minimum",
    "maximum": "maximum",
    "exclusiveMinimum": "exclusive_minimum",
    "exclusiveMaximum": "exclusive_maximum",
}


def _texts(rng: random.Random, n: int) -> list[str]:
    out = ["0", "-0", "0.0", "1", "-1", "0.07", "0.5", "1.50", "00", "1.", ".5", "-", "", "1e2"]
    for _ in range(n):
        t = rng.choice(["", "-"]) + rng.choice(["0", str(rng.randint(1, 10 ** rng.randint(1, 4)))])
        if rng.random() < 0.6:
            t += "." + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
        out.append(t)
    return out


def _schemas():
    rng = random.Random(21)
    out = [
        {"type": "number", "multipleOf": 0.01, "minimum": 0, "maximum": 99999999999.99},
        {"type": "number", "multipleOf": 0.0075},
        {"type": "number", "multipleOf": 0.3, "minimum": -0.6, "maximum": -0.3},
        {"type": "integer", "multipleOf": 0.5},
    ]
    for _ in range(30):
        s = {
            "type": rng.choice(["number", "integer"]),
            "multipleOf": rng.choice([0.01, 0.3, 2, 0.25, 1.5, 7, 0.05, 0.125]),
        }
        for k in _BOUND_ARGS:
            if rng.random() < 0.4:
                s[k] = rng.choice([rng.randint(-50, 50), round(rng.uniform(-50, 50), rng.randint(1, 3))])
        out.append(s)
    return out


@pytest.mark.parametrize("schema", _schemas(), ids=lambda s: json.dumps(s, sort_keys=True))
def test_number_automaton_agrees_with_exact_jsonschema(schema):
    """Every text the automaton ends in an accepting state is a JSON number `jsonschema` finds
    valid when schema and instance are parsed as Decimals, and the other way round (no exponent;
    an integer has no fraction)."""
    bounds = {arg: schema[k] for k, arg in _BOUND_ARGS.items() if k in schema}
    integer = schema["type"] == "integer"
    dfa, outs = minimize(
        number_dfa(schema["multipleOf"], integer=integer, **bounds), lambda lab: bool(lab) or None
    )
    exact = json.loads(json.dumps(schema), parse_float=Decimal)
    validator = jsonschema.Draft202012Validator(exact)
    for text in _texts(random.Random(json.dumps(schema)), 600):
        state = dfa_state(dfa, text)
        got = state is not None and outs[state] is not None
        want = bool(_NUMBER.fullmatch(text)) and not (integer and "." in text)
        want = want and validator.is_valid(json.loads(text, parse_float=Decimal))
        assert got == want, (schema, text)


def test_number_automaton_bound_and_divisors():
    with pytest.raises(AutomatonError, match=str(MAX_NUMBER_STATES)):
        number_dfa(0.123456789)
    with pytest.raises(AutomatonError):
        number_dfa(0)
    assert multiple_lcm(0.1, 0.15) == 0.3 and multiple_lcm(4, 6) == 12 and multiple_lcm(0.5, 2) == 2
    out = normalize_schema({"allOf": [{"type": "number", "multipleOf": 0.1}, {"multipleOf": 0.15}]}).schema
    assert out == {"type": "number", "multipleOf": 0.3}
    with pytest.raises(ValueError, match="admits no value"):
        normalize_schema({"type": "integer", "multipleOf": 5, "minimum": 1, "maximum": 4})


@pytest.mark.parametrize(
    "schema,keyword,pointer",
    [
        (
            {"properties": {"n": {"type": "number", "multipleOf": 0.123456789}}},
            "multipleOf",
            "/properties/n/multipleOf",
        ),
        (
            {"type": "array", "items": {"enum": list(range(11))}, "uniqueItems": True},
            "uniqueItems",
            "/uniqueItems",
        ),
        ({"type": "array", "items": {"type": "number"}, "uniqueItems": True}, "uniqueItems", "/uniqueItems"),
        (
            {"type": "array", "contains": {"type": "integer"}, "minContains": 20, "maxItems": 30},
            "contains",
            "/contains",
        ),
        ({"type": "array", "prefixItems": [{}], "contains": {"type": "integer"}}, "contains", "/contains"),
        ({"type": "array", "contains": {"type": "integer"}, "maxContains": 2}, "maxContains", "/maxContains"),
        ({"type": "string", "format": "regex", "maxLength": 5}, "maxLength", "/maxLength"),
        ({"if": {"format": "email"}, "then": {"type": "string"}}, "if", "/if"),
        (
            {"allOf": [{"if": {"minimum": i}, "then": {"multipleOf": 2}} for i in range(4)]},
            "if",
            "/allOf/0/if",
        ),
        ({"type": "object", "minProperties": 2}, "minProperties", "/minProperties"),
        (
            {"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "string"}}},
            "patternProperties",
            "/patternProperties/b$",
        ),
        (
            {"type": "object", "dependentRequired": {k: ["z"] for k in "abcde"}},
            "dependentRequired",
            "/dependentRequired",
        ),
        ({"type": "object", "propertyNames": {"format": "email"}}, "propertyNames", "/propertyNames"),
        (
            {"type": "object", "patternProperties": {"(?i)^a": {}}},
            "patternProperties",
            "/patternProperties/(?i)^a",
        ),
        ({"type": "string", "pattern": "^[a-z]*x[a-z]*$", "maxLength": 5000}, "maxLength", "/maxLength"),
    ],
    ids=[
        "multipleOf-bound",
        "unique-enum-bound",
        "unique-numbers",
        "contains-count-bound",
        "contains-prefixItems",
        "maxContains",
        "regex-with-length",
        "if-without-complement",
        "too-many-conditionals",
        "minProperties-2-open",
        "overlap",
        "too-many-dependencies",
        "propertyNames-format",
        "ignorecase",
        "long",
    ],
)
def test_refusals_past_the_bounds(schema, keyword, pointer):
    with pytest.raises(UnsupportedSchemaError) as e:
        normalize_schema(schema)
    assert (e.value.keyword, e.value.pointer) == (keyword, pointer)


def test_regex_format_language_compiles_under_python():
    """Random strings of the `format: regex` language (its DFA, over the JSON text) all compile
    with Python's `re`, without warnings (checked under ECMA-262 too when written: 11,561 samples
    through node's RegExp, with and without the u flag, none refused)."""
    sigma = tuple(_merge([*alphabet(()), (0x5C, 0x5C)]))
    dfa, outs = minimize(build([("regex", regex_format_text())], sigma), lambda lab: bool(lab) or None)
    live = live_states(dfa, [o is not None for o in outs])
    rng = random.Random(7)
    done = 0
    for _ in range(3000):
        state, chars = 0, []
        for _ in range(rng.randint(1, 50)):
            options = [(c, t) for c, t in enumerate(dfa.trans[state]) if live[t]]
            if outs[state] is not None and (not options or rng.random() < 0.05):
                break
            c, state = rng.choice(options)
            lo, hi = rng.choice(dfa.classes[c])
            chars.append(chr(lo if rng.random() < 0.7 else rng.randint(lo, min(hi, lo + 50))))
        if outs[state] is None:
            continue
        done += 1
        value = json.loads('"' + "".join(chars) + '"')
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            re.compile(value)
    assert done > 1000
    full = re.compile(regex_format_text())
    for good in ["^a+$", "(?:ab|c)*?[a-z0-9_]\\d{3,}", "\\\\x", "x|", "()", "((((((((a))))))))"]:
        assert full.fullmatch(json.dumps(good)[1:-1]), good
    for bad in ["^(abc]", "a**", "(?=a)", "[z-a]", "\\1", "{", "^*", "[]", "(((((((((a)))))))))"]:
        assert not full.fullmatch(json.dumps(bad)[1:-1]), bad


def test_discriminated_conditionals_make_one_branch_per_case():
    """23 chained conditionals on one property (JsonSchemaStore minecraft-item-modifier): one
    branch per constant, one for an absent property; non-objects and other values drop here (the
    items must be objects whose kind is listed)."""
    kinds = [f"k{i}" for i in range(23)]
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": kinds}},
        "allOf": [
            {
                "if": {"properties": {"kind": {"const": k}}},
                "then": {"properties": {f"p{i}": {"type": "integer"}}},
            }
            for i, k in enumerate(kinds)
        ],
    }
    out = normalize_schema(schema).schema
    assert len(out["anyOf"]) == len(kinds) + 1
    absent = out["anyOf"][0]
    assert absent["properties"]["kind"] is False and all(f"p{i}" in absent["properties"] for i in range(23))
    k5 = out["anyOf"][1 + 5]
    assert k5["required"] == ["kind"] and k5["properties"]["p5"] == {"type": "integer"}
    assert "p6" not in k5["properties"]


def test_one_conditional_is_if_and_then_or_not_if_and_else():
    out = normalize_schema(
        {"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "integer"}}
    ).schema
    assert {"type": "string", "minLength": 2} in out["anyOf"] and {"type": "integer"} in out["anyOf"]
    assert len(out["anyOf"]) == 2


def test_closed_object_complement_within_one_of():
    """{} matches both closed branches: exactly one needs the name the other closes out."""
    out = normalize_schema(
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"config": {"type": "string"}},
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"value": {"type": "string"}},
                    "additionalProperties": False,
                },
            ]
        }
    ).schema
    assert [b["required"] for b in out["anyOf"]] == [["config"], ["value"]]


def test_ref_siblings_follow_the_draft():
    """Drafts 3-7 ignore keywords beside `$ref`; 2019-09 on apply them."""
    base = {
        "definitions": {"s": {"type": "object"}},
        "properties": {"a": {"$ref": "#/definitions/s", "required": ["x"]}},
    }
    old = normalize_schema({"$schema": "http://json-schema.org/draft-07/schema#", **base}).schema
    new = normalize_schema(base).schema
    assert "required" not in json.dumps(old)
    assert '"required": ["x"]' in json.dumps(new)


def test_best_effort_drops_a_conditional_it_cannot_rewrite():
    schema = {"allOf": [{"if": {"format": "email"}, "then": {"minLength": 3}}, {"type": "string"}]}
    with pytest.raises(UnsupportedSchemaError):
        normalize_schema(schema)
    out = normalize_schema(schema, best_effort=True)
    assert out.schema == {"type": "string"} and out.not_enforced == ["if at /allOf/0/if"]


PATTERNS = [
    "^a[0-9]+$",
    "b.c",
    "^x|y$",
    "(^a$)|(^bc)",
    r"\d{2}",
    "^$",
    "Red|Blue|Black 2",
    "^[^ab]*$",
    r"\w+_\s",
]
WORDS = [
    "a12",
    "xb c",
    "bxc",
    "x",
    "zy",
    "yz",
    "a",
    "bcd",
    "zzbc",
    "12",
    "",
    "ab3",
    "Black 2",
    "Blac",
    "k_ ",
    "é_ ",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_search_automaton_agrees_with_re(pattern):
    sigma = alphabet((pattern,))
    dfa, outs = minimize(build([("search", pattern)], sigma), lambda lab: 0 in lab)
    rng = random.Random(pattern)
    words = WORDS + ["".join(rng.choice("ab cxy12_é") for _ in range(rng.randint(0, 6))) for _ in range(300)]
    for w in words:
        state = dfa_state(dfa, w)
        if state is None:  # a character outside the alphabet: such keys are never produced
            continue
        assert outs[state] == bool(re.search(pattern, w)), (pattern, w)


def test_rewrites_keep_an_equivalent_schema():
    out = normalize_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}
    ).schema
    assert len(out["anyOf"]) == 2
    absent, present = out["anyOf"]
    assert absent["properties"]["a"] is False and present["required"] == ["a", "b"]
    out = normalize_schema(
        {
            "type": "object",
            "properties": {"x1": {"minimum": 0}},
            "patternProperties": {"^x": {"type": "integer"}},
        }
    ).schema
    assert out["properties"]["x1"] == {"type": "integer", "minimum": 0}  # named property gets the pattern
    assert out["patternProperties"] == {"^x": {"type": "integer"}}


@pytest.mark.parametrize(
    "schema,expected",
    [
        ({"oneOf": [{"type": "string"}, {}]}, ["null", "boolean", "array", "object", "number"]),
        ({"oneOf": [{"type": "number"}, {"type": "string"}, {}]}, ["null", "boolean", "array", "object"]),
    ],
)
def test_one_of_by_whole_types(schema, expected):
    out = normalize_schema(schema).schema
    assert [b["type"] for b in out["anyOf"]] == expected


@pytest.mark.parametrize(
    "schema,keyword,pointer",
    [
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "/oneOf"),  # non-integral numbers
        ({"not": {"type": "integer"}}, "not", "/not"),
        ({"not": {"type": "object", "additionalProperties": False}}, "not", "/not"),
        ({"not": {"type": "array", "uniqueItems": True}}, "not", "/not"),
        (  # overlapping branches whose complement has no form here
            {"oneOf": [{"type": "array"}, {"type": "array", "prefixItems": [{"type": "string"}]}]},
            "oneOf",
            "/oneOf",
        ),
        (  # the bound: each term "a branch and not the others" has 9 x 9 = 81 > 64 alternatives (one per missing name)
            {"oneOf": [{"required": [f"{c}{i}" for i in range(9)]} for c in "abc"]},
            "oneOf",
            "/oneOf",
        ),
        ({"type": "string", "format": "email", "pattern": "(?=a)b"}, "pattern", "/pattern"),
    ],
    ids=[
        "integer-vs-number",
        "not-integer",
        "not-closed-object",
        "not-uniqueItems",
        "oneOf-prefixItems",
        "oneOf-bound",
        "lookahead",
    ],
)
def test_one_of_and_not_refused_without_an_exact_form(schema, keyword, pointer):
    """Each of these would need a complement (or a non-integral-number type) the grammar lacks, or
    goes past the bound on the size of the oneOf rewrite: refused naming keyword and pointer."""
    with pytest.raises(UnsupportedSchemaError) as e:
        normalize_schema(schema)
    assert (e.value.keyword, e.value.pointer) == (keyword, pointer)


@pytest.mark.parametrize(
    "schema,expected",
    [
        (
            {"oneOf": [{"type": "string"}, {"type": "string", "minLength": 3}]},
            {"type": "string", "maxLength": 2},
        ),
        (
            {"not": {"type": "string", "minLength": 2}},
            ["null", "boolean", "number", "array", "object", ("string", {"maxLength": 1})],
        ),
        (
            {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
            [("object", {"required": ["a"], "b": False}), ("object", {"required": ["b"], "a": False})],
        ),
    ],
    ids=["oneOf-lengths", "not-minLength", "oneOf-required"],
)
def test_negation_rewrites(schema, expected):
    """The complement rewrites (negation.py) and the oneOf built from them, read off the output."""
    out = normalize_schema(schema).schema
    if isinstance(expected, dict):
        assert out == expected
        return

    def flat(s):
        return [x for b in s["anyOf"] for x in (flat(b) if "anyOf" in b else [b])]

    got = flat(out)
    assert len(got) == len(expected)
    for b, want in zip(got, expected):
        ty, extra = want if isinstance(want, tuple) else (want, {})
        assert b["type"] == ty
        for k, v in extra.items():
            assert (b.get(k) if k in ("maxLength", "required") else b["properties"][k]) == v
