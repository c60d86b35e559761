"""Keywords enforced by our own automata and object grammars (json_schema/automata.py, nodes.py,
objects.py): model-free random walks through each compiled grammar produce only `jsonschema`-valid
instances and hand-picked instances get the right verdict. The automata against Python's `re` and
the rewrites' refusals (keyword + JSON pointer) past their bounds are in test_schema_rewrites.py."""

from __future__ import annotations

import json
import random
from decimal import Context, Decimal, localcontext

import jsonschema
import numpy as np
import pytest
from jsonschema.validators import validator_for

from agentrt.grammars.conformance import accepts
from agentrt.grammars.json_schema import canonical_json, normalize_schema
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.xgrammar_backend import GrammarBackend

STOP = 2


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer, 49152, (STOP,), GrammarConfig(compile_timeout_s=300))
    yield b
    b.shutdown()


def _walk(backend, compiled, tokenizer, rng: random.Random, max_steps: int = 80) -> str | None:
    """One random path through the grammar: a random allowed token per step, a short structural
    one (quote, brackets, digits, ...) 70% of the time so strings and containers close, the stop
    token with probability 0.3 once allowed. Returns the text, or None when the walk did not
    finish within max_steps."""
    m = backend.new_matcher(compiled)
    bm = backend.allocate_bitmask(1)
    preferred = _preferred(tokenizer)
    ids = []
    for _ in range(max_steps):
        backend.fill_bitmask(m, bm, 0)
        bits = np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")[: len(preferred)].astype(bool)
        if bits[STOP] and (rng.random() < 0.3 or bits.sum() == 1):
            return tokenizer.decode(ids)
        bits[STOP] = False
        allowed = np.flatnonzero(bits)
        if not len(allowed):
            return None
        short = np.flatnonzero(bits & preferred)
        tok = int(rng.choice(short if len(short) and rng.random() < 0.7 else allowed))
        assert m.accept_token(tok)
        ids.append(tok)
    return None


_PREFERRED: dict = {}
_STRUCTURAL = {
    '"',
    "}",
    "]",
    ",",
    ":",
    " ",
    "{",
    "[",
    "0",
    "1",
    "7",
    "a",
    "x",
    "-",
    "_",
    "null",
    "true",
    '",',
    '"}',
}


def _preferred(tokenizer) -> np.ndarray:
    if "v" not in _PREFERRED:
        _PREFERRED["v"] = np.array([tokenizer.decode([i]) in _STRUCTURAL for i in range(len(tokenizer))])
    return _PREFERRED["v"]


# (schema, valid instances as text, invalid instances as text)
CASES = {
    "patternProperties-open": (
        {"type": "object", "patternProperties": {"^[0-9]+$": {"type": "integer"}}},
        ['{"12": 3}', '{"a": "x"}', '{"a1": [1]}', "{}"],
        ['{"12": "x"}', '{"7": 1.5}'],
    ),
    "patternProperties-named-and-additional": (
        {
            "type": "object",
            "properties": {"id": {"type": "string"}},
            "patternProperties": {"^x-": {"type": "boolean"}, "^n_": {"type": "number"}},
            "additionalProperties": {"type": "null"},
        },
        ['{"id": "a", "x-y": true, "n_k": 2, "z": null}', '{"x-n_": true}', '{"xn_": null}'],
        ['{"id": 1}', '{"x-y": 1}', '{"z": 1}', '{"n_k": null}'],
    ),
    "propertyNames": (
        {"type": "object", "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 3}},
        ['{"ab": 1}', "{}", '{"abc": {"x": 1}}'],
        ['{"abcd": 1}', '{"A": 1}', '{"a1": 2}'],
    ),
    "forbidden-property-open": (
        {"type": "object", "properties": {"a": False, "b": {"type": "integer"}}},
        ['{"b": 1, "c": "a"}', "{}"],
        ['{"a": 1}', '{"b": 1, "a": 2}'],
    ),
    "dependentRequired-open": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
        ['{"a": 1, "b": 2}', '{"c": 1}', "{}"],
        ['{"a": 1}', '{"a": 1, "c": 2}'],
    ),
    "dependentSchemas-open": (
        {
            "type": "object",
            "dependentSchemas": {"a": {"properties": {"b": {"type": "string"}}, "required": ["b"]}},
        },
        ['{"a": 1, "b": "x"}', '{"b": 3}'],
        ['{"a": 1}', '{"a": 1, "b": 2}'],
    ),
    "maxProperties-open": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "maxProperties": 2},
        ['{"a": 1, "b": 2}', '{"x": 1, "y": 2}', "{}"],
        ['{"a": 1, "b": 2, "c": 3}', '{"x": 1, "y": 2, "z": 3}'],
    ),
    "minProperties-1-open": (
        {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
        ['{"q": 1}', '{"q": 1, "r": 2}'],
        ["{}", '{"q": "s"}'],
    ),
    "pattern-with-maxLength": (
        {"type": "string", "pattern": "^[a-z]+:[0-9]+$", "maxLength": 6},
        ['"ab:12"', '"a:1"'],
        ['"abc:123"', '"ab12"', '"a:"'],
    ),
    "escaped-named-key": (  # an escaped spelling of a named key is not an additional key
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": {"type": "string"},
        },
        ['{"a": 1, "b": "x"}'],
        ['{"\\u0061": "x"}', '{"a": 1, "\\u0061": "x"}'],
    ),
    "unevaluatedProperties": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "unevaluatedProperties": {"type": "string"},
        },
        ['{"a": 1, "b": "x"}'],
        ['{"a": 1, "b": 2}'],
    ),
    "oneOf-string-or-anything": (
        {"oneOf": [{"type": "string"}, {}]},
        ["1", "null", "[1]", '{"k": 1}'],
        ['"s"'],
    ),
    "not-type-and-required": (
        {"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "not": {"required": ["a", "b"]}},
        ['{"a": 1}', '{"b": "x"}', '{"a": null, "c": 2}'],
        ['{"a": "s"}', '{"a": 1, "b": 2}'],
    ),
    # issue 21, part 2: oneOf by negation, not of patterns/enums/properties, pattern beside format
    "oneOf-by-required": (  # exactly one of a, b present
        {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        ['{"a": 1}', '{"b": [2], "c": 3}'],
        ["{}", '{"a": 1, "b": 2}', '{"c": 1}'],
    ),
    "oneOf-overlapping-lengths": (
        {"oneOf": [{"type": "string"}, {"type": "string", "minLength": 3}]},
        ['"ab"', '""'],
        ['"abc"', "1", "null"],
    ),
    "oneOf-beside-anyOf": (
        {"anyOf": [{"type": "object"}, {"type": "string"}], "oneOf": [{"required": ["a"]}, {"minLength": 2}]},
        ["{}", '"a"', '{"b": 1}'],
        ['{"a": 1}', '"ab"', "1"],
    ),
    "oneOf-object-or-object-with-config": (  # JsonSchemaStore task.json's parameter default
        {
            "oneOf": [
                {"type": "string"},
                {"type": "object", "properties": {"config": {"type": "string"}}, "required": ["config"]},
                {"type": "object"},
            ]
        },
        ['"s"', "{}", '{"config": 1}', '{"x": "y"}'],
        ['{"config": "c"}', "1", "[]"],
    ),
    "not-pattern": (  # Github_ultra o65423: a name that is not only punctuation
        {"type": "string", "minLength": 1, "not": {"pattern": "^[.,*\\\\\\-\\s{}()]+$"}},
        ['"a."', '"x y"', '".a"'],
        ['".."', '""', '"- ,"', '"{}"'],
    ),
    "not-enum": (
        {"not": {"enum": ["a", "b c", 1, None]}},
        ['"b"', "2", "true", "[]", '{"k": 1}', '"a "', "0.5"],
        ['"a"', '"b c"', "1", "null"],
    ),
    "not-properties-required": (
        {"type": "object", "not": {"properties": {"a": {"type": "string"}}, "required": ["a"]}},
        ['{"a": 1}', "{}", '{"b": "x"}'],
        ['{"a": "x"}', '{"a": "", "b": 1}'],
    ),
    "not-length-and-bounds": (
        {"not": {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "number", "minimum": 5}]}},
        ['"abc"', "4", "-1.5", "null", "[1]"],
        ['"ab"', '""', "5", "7.5"],
    ),
    "pattern-and-format-date": (
        {"type": "string", "format": "date", "pattern": "^2024"},
        ['"2024-01-05"', '"2024-12-31"'],
        ['"2023-01-05"', '"2024-13-01"', '"2024"'],
    ),
    "pattern-and-format-email": (  # JsonSchemaStore 0.5.2; format email as jsonschema checks it
        {"type": "string", "format": "email", "pattern": "^[a-z]{1,4}(@[a-z]{1,4})?\\.[a-z]{2,3}$"},
        ['"ab@cd.ef"', '"a@c.de"'],
        ['"ab.cd"', '"ab@cd"', '"AB@cd.ef"'],
    ),
    "oneOf-recursive-disjoint-by-type": (  # Github_medium o17127: a branch is the root in progress
        {
            "type": "object",
            "properties": {"sub": {"type": "array", "items": {"oneOf": [{"type": "string"}, {"$ref": "#"}]}}},
            "additionalProperties": False,
        },
        ['{"sub": ["a", {"sub": []}]}', "{}"],
        ['{"sub": [1]}', '{"x": 1}'],
    ),
    "ref-with-implied-sibling": (  # Github_ultra o39449: {"type": "object", "$ref": ...} recursion
        {
            "$defs": {
                "n": {
                    "type": "object",
                    "properties": {"v": {"type": "integer"}, "next": {"type": "object", "$ref": "#/$defs/n"}},
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/n",
        },
        ['{"v": 1, "next": {"next": {}}}', "{}"],
        ['{"next": {"v": "x"}}', '{"next": 1}'],
    ),
    "propertyNames-by-ref": (  # Github_hard o39233
        {
            "$defs": {"k": {"type": "string", "enum": ["x", "y"]}},
            "type": "object",
            "propertyNames": {"$ref": "#/$defs/k"},
        },
        ['{"x": 1}', '{"x": 1, "y": "z"}', "{}"],
        ['{"z": 1}', '{"x": 1, "xx": 2}'],
    ),
    # issue 21, part 3: multipleOf (decimals.py), uniqueItems over scalars, contains, not items,
    # if/then/else (conditionals.py), format regex, allOf beside a closed object, draft-07 $ref
    "multipleOf-decimal-bounded": (  # Github_easy o46379: money with cents
        {"type": "number", "multipleOf": 0.01, "minimum": 0, "maximum": 99999999999.99},
        ["0.07", "10000.89", "0", "12.5", "99999999999.99", "3"],
        ["0.071", "-1", "100000000000", "-0.01"],
    ),
    "multipleOf-integer-residue": (
        {"type": "integer", "multipleOf": 3, "exclusiveMinimum": -7, "maximum": 30},
        ["-6", "0", "27", "30"],
        ["-9", "31", "4", "33"],
    ),
    "multipleOf-negative-range": (
        {"type": "number", "multipleOf": 1.5, "maximum": -3},
        ["-3", "-4.5", "-300"],
        ["-3.5", "0", "1.5", "-2.25"],
    ),
    "uniqueItems-enum": (
        {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True, "minItems": 1},
        ['["a"]', '["c", "a", "b"]'],
        ['["a", "a"]', "[]", '["d"]', '["a", "b", "c", "a"]'],
    ),
    "uniqueItems-booleans": (
        {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
        ["[true, false]", "[]", "[false]"],
        ["[true, true]", "[false, true, false]"],
    ),
    "contains-counted": (
        {
            "type": "array",
            "items": {"type": "integer"},
            "contains": {"minimum": 5},
            "minContains": 2,
            "maxItems": 4,
        },
        ["[5, 6]", "[1, 7, 9]", "[9, 1, 2, 5]"],
        ["[5]", "[1, 2, 3]", "[5, 6, 1, 2, 3]", '[5, "x", 6]'],
    ),
    "contains-untyped": (
        {"contains": {"type": "string"}},
        ['["a"]', '[1, "b"]', "5", "{}"],
        ["[]", "[1, 2]"],
    ),
    "not-items": (
        {"not": {"type": "array", "items": {"type": "string"}}},
        ["[1]", '["a", 2]', "5", "null"],
        ["[]", '["a"]'],
    ),
    "oneOf-array-or-strings": (  # "array, not all strings" or "all strings, not an array": never
        {"oneOf": [{"type": "array"}, {"type": "array", "items": {"type": "string"}}]},
        ["[1]", '["a", 1]'],
        ["[]", '["a"]', "5"],
    ),
    "if-then-else": (
        {"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "integer"}},
        ['"ab"', "3"],
        ['"a"', "1.5", "null"],
    ),
    "if-discriminated-allOf": (  # JsonSchemaStore minecraft-item-modifier's form
        {
            "type": "object",
            "properties": {"kind": {"enum": ["a", "b", "c"]}},
            "allOf": [
                {
                    "if": {"properties": {"kind": {"const": "a"}}},
                    "then": {"required": ["x"], "properties": {"x": {"type": "integer"}}},
                },
                {
                    "if": {"properties": {"kind": {"const": "b"}}, "required": ["kind"]},
                    "then": {"properties": {"x": {"type": "string"}}},
                    "else": {"properties": {"y": {"type": "null"}}},
                },
            ],
        },
        [
            '{"x": 1}',
            '{"x": 1, "y": null}',
            '{"kind": "a", "x": 2}',
            '{"kind": "b", "x": "s"}',
            '{"kind": "b", "y": 3}',
            '{"kind": "c", "y": null}',
        ],
        [
            "{}",
            '{"x": 1, "y": 2}',
            '{"kind": "a"}',
            '{"kind": "b", "x": 1}',
            '{"kind": "c", "y": 1}',
            '{"kind": "d"}',
        ],
    ),
    "format-regex": (
        {"type": "string", "format": "regex"},
        ['"^a+$"', '"(?:ab|c)*[a-z]\\\\d{2,}"', '""'],
        ['"(a"', '"a**"', '"[z-a]"'],
    ),
    "allOf-patterns-beside-closed": (  # Github_hard o55320's form, in 2020-12
        {
            "$defs": {
                "s": {
                    "type": "object",
                    "properties": {
                        "alpha": {"type": "string"},
                        "ig": {
                            "type": "object",
                            "properties": {"p": {"type": "array"}},
                            "additionalProperties": False,
                        },
                    },
                    "additionalProperties": False,
                }
            },
            "properties": {
                "sync": {
                    "type": "object",
                    "patternProperties": {"^[a-z]+$": {"$ref": "#/$defs/s"}},
                    "$ref": "#/$defs/s",
                }
            },
        },
        ['{"sync": {}}', '{"sync": {"ig": {}}}', "{}"],
        ['{"sync": {"alpha": "x"}}', '{"sync": {"ig": {"p": []}}}', '{"sync": {"z": {}}}'],
    ),
    "draft-07-ref-siblings-ignored": (
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "definitions": {"s": {"type": "object"}},
            "properties": {"a": {"$ref": "#/definitions/s", "required": ["x"]}},
        },
        ['{"a": {}}', '{"a": {"x": 1}}'],
        ['{"a": 1}'],
    ),
    "oneOf-closed-objects": (  # JsonSchemaStore task.json's envVars: {} matches two branches
        {
            "type": "object",
            "additionalProperties": {
                "oneOf": [
                    {"type": "string"},
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
            },
        },
        ['{"a": "s"}', '{"a": {"config": "c"}}', '{"b": {"value": "v"}}'],
        ['{"a": {}}', '{"a": {"config": 1}}', '{"a": {"x": 1}}'],
    ),
}


def _exact(text: str):
    """A JSON text with its decimals exact (multipleOf is decimal arithmetic, decimals.py)."""
    return json.loads(text, parse_float=Decimal)


def _valid(validator, value) -> bool:
    with localcontext(Context(prec=1000)):  # walks print integers past Decimal's 28 digits
        return validator.is_valid(value)


@pytest.mark.parametrize("name", list(CASES))
def test_verdicts_and_random_walks(backend, tokenizer, name):
    schema, valid, invalid = CASES[name]
    compiled = backend.compile(ConstraintSpec.json_schema(schema))
    # formats are assertions in this runtime; the schema's draft decides the rest
    exact_schema = _exact(json.dumps(schema))
    validator = validator_for(exact_schema, default=jsonschema.Draft202012Validator)(
        exact_schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    normalized = normalize_schema(schema).schema
    for text in valid:  # fed in the grammar's key order (named properties in schema order)
        assert _valid(validator, _exact(text)), text  # the case itself is right
        assert accepts(backend, compiled, canonical_json(json.loads(text), normalized)), text
    for text in invalid:
        assert not _valid(validator, _exact(text)), text
        assert not accepts(backend, compiled, text), text
        assert not accepts(backend, compiled, canonical_json(json.loads(text), normalized)), text
    rng = random.Random(name)
    done = 0
    for _ in range(40):
        text = _walk(backend, compiled, tokenizer, rng)
        if text is None:
            continue
        done += 1
        value = _exact(text)
        assert _valid(validator, value), (text, next(validator.iter_errors(value)).message)
    assert done >= 5, f"only {done} of 40 random walks finished"


def test_indent_layout_refuses_own_object_grammar(tokenizer):
    pretty = GrammarBackend(tokenizer, 49152, (STOP,), GrammarConfig(indent=2))
    try:
        with pytest.raises(ValueError, match="patternProperties"):
            pretty.compile(
                ConstraintSpec.json_schema(
                    {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}
                )
            )
    finally:
        pretty.shutdown()
