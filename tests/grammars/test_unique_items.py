"""`uniqueItems` over free strings, checked by the matcher at string completion
(grammars/unique_items.py): instance verdicts, the plan's refusals in ambiguous places, random
walks that only ever produce distinct elements, rollback, and the engine (batched masks, n-gram
speculation, the length-safe policy) writing distinct elements where the model wants repeats.
Then regressions found by trying to break it, one minimal reproducer per bug: accept_string dropped
the rollback history (jump-forward's step-by-step search then failed the request), an earlier
element with a lone surrogate broke the mask's lookup, and per-token snapshots copied the open
string (memory quadratic in an element's length)."""

from __future__ import annotations

import json
import random
import tracemalloc

import jsonschema
import numpy as np
import pytest

from agentrt.grammars.conformance import accepts
from agentrt.grammars.json_lexer import JsonPointerTracker
from agentrt.grammars.json_schema import UnsupportedSchemaError, normalize_schema
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.unique_items import UniqueItemsMatcher, unique_plan
from agentrt.grammars.xgrammar_backend import ConstraintError, GrammarBackend
from agentrt.runtime.config import EngineConfig, SpecConfig
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine

STOP = 2
UNIQUE = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
SCHEMA = {
    "type": "object",
    "properties": {
        "tags": UNIQUE,
        "groups": {"type": "object", "additionalProperties": UNIQUE},
        "pair": {"type": "array", "prefixItems": [{"type": "string"}, UNIQUE], "items": False},
        "plain": {"type": "array", "items": {"type": "string"}},
    },
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer, 49152, (STOP,), GrammarConfig(compile_timeout_s=120))
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def compiled(backend):
    return backend.compile(ConstraintSpec.json_schema(SCHEMA))


@pytest.mark.parametrize(
    "instance",
    [
        {"tags": ["a", "b", "ab"]},
        {"tags": []},
        {"tags": ["x"], "plain": ["x", "x"]},  # other arrays may repeat
        {"groups": {"g": ["a", "b"], "h": ["a", "b"]}},  # each array has its own elements
        {"pair": ["a", ["a", "b"]]},
        {"tags": ["a", "A", "a "]},
        {"tags": ["\u00e9", "e\u0301"]},  # different code points
    ],
)
def test_valid_instances_are_accepted(backend, compiled, instance):
    jsonschema.validate(instance, SCHEMA)
    assert accepts(backend, compiled, json.dumps(instance, ensure_ascii=False))


@pytest.mark.parametrize(
    "text",
    [
        '{"tags": ["a", "a"]}',
        '{"tags": ["a", "b", "c", "b"]}',
        '{"tags": ["", ""]}',
        '{"tags": ["a", "\\u0061"]}',  # equal as JSON strings
        '{"tags": ["\\"", "\\""]}',
        '{"groups": {"g": ["x", "y"], "h": ["z", "z"]}}',
        '{"pair": ["a", ["b", "b"]]}',
    ],
)
def test_duplicates_are_rejected(backend, compiled, text):
    assert not jsonschema.Draft202012Validator(SCHEMA).is_valid(json.loads(text))
    assert not accepts(backend, compiled, text)


def test_the_token_completing_a_duplicate_is_masked_and_refused(backend, compiled, tokenizer):
    m = backend.new_matcher(compiled)
    assert isinstance(m, UniqueItemsMatcher)
    for t in tokenizer.encode('{"tags": ["ab", "ab', add_special_tokens=False):
        assert m.accept_token(t)
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    one_by_one = backend.allocate_bitmask(1)
    m.fill_next_token_bitmask(one_by_one, 0)
    for bitmask in (backend.fill_bitmasks_async([m], [0], 1).result(), one_by_one):
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
        assert not bits[quote]  # closing here would repeat "ab"
        assert bits[tokenizer.encode("c", add_special_tokens=False)[0]]  # going on is allowed
    assert not m.accept_token(quote)
    assert m.accept_token(tokenizer.encode("c", add_special_tokens=False)[0]) and m.accept_token(quote)


def test_rollback_restores_the_elements(backend, compiled, tokenizer):
    m = backend.new_matcher(compiled)
    head = tokenizer.encode('{"tags": ["a"', add_special_tokens=False)
    tail = tokenizer.encode(', "b"', add_special_tokens=False)
    for t in head + tail:
        assert m.accept_token(t)
    m.rollback(len(tail))  # "b" is no longer an element, "a" still is
    assert m.accept_string(', "b"]}') and m.is_completed()
    m.reset()
    for t in head:
        assert m.accept_token(t)
    assert not m.accept_string(', "a"]}')


def test_plan_refuses_ambiguous_places_and_best_effort_drops_them():
    both_objects = {
        "anyOf": [
            {"type": "object", "properties": {"t": UNIQUE}, "required": ["t"]},
            {"type": "object", "properties": {"u": {"type": "integer"}}, "required": ["u"]},
        ]
    }
    norm = normalize_schema(both_objects).schema
    with pytest.raises(UnsupportedSchemaError) as e:
        unique_plan(norm)
    assert e.value.keyword == "uniqueItems" and e.value.pointer.endswith("/t/uniqueItems")
    dropped: list[str] = []
    unique_plan(norm, best_effort=True, not_enforced=dropped)
    assert dropped and dropped[0].startswith("uniqueItems at ")
    by_type = {"anyOf": [{"type": "object", "properties": {"t": UNIQUE}}, {"type": "string"}, UNIQUE]}
    plan = unique_plan(normalize_schema(by_type).schema)  # decided by the container type
    assert plan[0]["array"]["u"] and plan[0]["object"]["p"]["t"] is not None
    patterns = {"type": "object", "patternProperties": {"^x": UNIQUE}}
    with pytest.raises(UnsupportedSchemaError, match="patternProperties"):
        unique_plan(normalize_schema(patterns).schema)


def test_refusals_reach_the_backend(backend):
    both = {"anyOf": [{"type": "array", "items": {"type": "string"}, "uniqueItems": True}, {"type": "array"}]}
    with pytest.raises(ConstraintError) as e:
        backend.compile(ConstraintSpec.json_schema(both))
    assert e.value.keyword == "uniqueItems"
    loose = backend.compile(ConstraintSpec.json_schema(both, strict=False))
    assert any(x.startswith("uniqueItems at ") for x in loose.not_enforced)
    # tool arguments get no matcher check: refused as before
    assert normalize_schema(UNIQUE).schema.get("items") == {"type": "string"}
    with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):
        normalize_schema(UNIQUE, unique_strings=False)


def test_random_walks_only_write_distinct_elements(backend, tokenizer):
    """Walks that prefer short strings (1-2 letters from a 2-letter alphabet) and closing quotes,
    so that duplicates are tried often: every finished text is valid, and the check refused
    something on the way."""
    schema = {
        "type": "object",
        "properties": {"tags": {**UNIQUE, "minItems": 6, "maxItems": 6}},
        "required": ["tags"],
        "additionalProperties": False,
    }
    compiled = backend.compile(ConstraintSpec.json_schema(schema))
    vocab = len(tokenizer)
    short = np.zeros(vocab, dtype=bool)
    for s in ('"', '",', '"]', "a", "b", "ab", "ba", "]", "}", ", ", " ", "\\u0061"):
        short[tokenizer.encode(s, add_special_tokens=False)[0]] = True
    rng = random.Random(0)
    finished = refused = 0
    for _ in range(12):
        m = backend.new_matcher(compiled)
        bm = backend.allocate_bitmask(1)
        ids: list[int] = []
        for _ in range(150):
            m.inner.fill_next_token_bitmask(bm, 0)
            before = np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
            refused += m.restrict(bm, 0)
            bits = np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
            assert not (bits & ~before).any()  # the check only removes tokens
            # the table lookups agree with simulating every allowed quote token
            brute = {
                int(x) for x in m.vocab.quote_ids if before[x] and m._after(m.vocab.token_bytes[x]) is None
            }
            assert brute == set(np.flatnonzero(before & ~bits).tolist())
            if bits[STOP]:
                finished += 1
                break
            pick = np.flatnonzero(bits & short) if rng.random() < 0.9 else np.flatnonzero(bits)
            tok = int(rng.choice(pick if len(pick) else np.flatnonzero(bits)))
            assert m.accept_token(tok)
            ids.append(tok)
        else:
            continue
        out = json.loads(tokenizer.decode(ids))
        jsonschema.validate(out, schema)
    assert finished >= 8 and refused > 0


def test_a_property_named_like_the_marker_is_kept(backend):
    from agentrt.grammars.json_schema.arrays import UNIQUE_STRINGS

    schema = {
        "type": "object",
        "properties": {
            UNIQUE_STRINGS: {"type": "string"},
            "t": UNIQUE,
            "e": {"enum": [{UNIQUE_STRINGS: "x"}]},
        },
        "required": [UNIQUE_STRINGS],
        "additionalProperties": False,
    }
    c = backend.compile(ConstraintSpec.json_schema(schema))
    assert accepts(backend, c, json.dumps({UNIQUE_STRINGS: "v", "t": ["a"], "e": {UNIQUE_STRINGS: "x"}}))
    assert not accepts(backend, c, json.dumps({UNIQUE_STRINGS: "v", "t": ["a", "a"]}))
    assert not accepts(backend, c, json.dumps({"t": ["a"]}))


def test_lexer_hooks_leave_repair_tracking_alone():
    t = JsonPointerTracker()
    t.feed(b'{"a": ["x", "y"')
    assert t.pointer() == "/a/1" and t.in_value_string is False


# ---- the engine (fake model over the byte tokenizer) ------------------------------------------------
ENGINE_SCHEMA = {
    "type": "object",
    "properties": {"tags": {**UNIQUE, "minItems": 4, "maxItems": 4}},
    "required": ["tags"],
    "additionalProperties": False,
}
PROMPT = [ord(c) for c in "Tags: "]
# the fake model's preferences: close a string at once, then "," (another element; inside a string,
# a comma), then "a"
BIAS = {ord('"'): 60.0, ord(","): 55.0, ord("a"): 50.0}


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=80, logit_bias=BIAS, **kw)


def test_engine_writes_distinct_elements_where_the_model_repeats():
    engine = fake_engine()
    with_check = ConstraintSpec.json_schema(ENGINE_SCHEMA)
    tags = ENGINE_SCHEMA["properties"]["tags"]
    without = ConstraintSpec.json_schema(
        {**ENGINE_SCHEMA, "properties": {"tags": {**tags, "uniqueItems": False}}}
    )
    on, off = engine.generate([(PROMPT, _params(), with_check), (PROMPT, _params(), without)])
    assert json.loads(off.text) == {"tags": ["", "", "", ""]}  # what the model wants
    assert json.loads(on.text) == {"tags": ["", ",", ",,", ",,,"]}, on.text
    assert on.finish_reason == "stop"


def test_engine_same_output_with_ngram_speculation_and_close_policy():
    spec = ConstraintSpec.json_schema(ENGINE_SCHEMA)
    plain = fake_engine().generate([(PROMPT, _params(), spec)])[0]
    config = EngineConfig(speculative=SpecConfig(method="ngram", num_speculative_tokens=4))
    spec_out = fake_engine(config).generate([(PROMPT, _params(), spec)])[0]
    assert spec_out.token_ids == plain.token_ids
    for max_tokens in (33, 36, 45):  # the closing path must not repeat an element either (33: the least)
        p = _params(max_tokens_policy="close")
        p.max_tokens = max_tokens
        out = fake_engine().generate([(PROMPT, p, spec)])[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), ENGINE_SCHEMA)


# ---- regressions ------------------------------------------------------------------------------------
TAGS = {"type": "object", "properties": {"tags": UNIQUE}, "required": ["tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tags_compiled(backend):
    return backend.compile(ConstraintSpec.json_schema(TAGS))


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---- 1. jump-forward's step-by-step search (accept_string + rollback) ------------------------------
def test_stepwise_jump_forward_leaves_the_matcher_usable(backend, tags_compiled, tokenizer):
    """ForcedTextFinder._stepwise accepts the forced characters with accept_string and undoes them
    with rollback(len(chars)); UniqueItemsMatcher.accept_string empties the rollback history, so
    the rollback raises IndexError (and the tracker no longer matches the inner matcher)."""
    m = backend.new_matcher(tags_compiled)
    for t in _ids(tokenizer, '{"tags": ["a"'):
        assert m.accept_token(t)
    m.accept_string("]")  # one forced character, as _stepwise does
    m.rollback(1)  # IndexError: pop from empty list
    assert not m.accept_string(', "a"]}')  # the tracker still knows "a"
    assert m.accept_string(', "b"]}') and m.is_completed()


def test_stepwise_search_through_the_finder(backend, tags_compiled):
    m = backend.new_matcher(tags_compiled)
    # bound None (unknown, or too large): the step-by-step search, as for recursive schemas
    assert backend.jump_finder.find(m, None, 0, 100) == '{"tags": ['
    assert m.accept_string('{"tags": ["a"]}') and m.is_completed()


def test_engine_recursive_schema_with_unique_strings_does_not_fail():
    """A $ref-recursive schema's forced-text bound grows with the output (grammars/finite.py), so
    after ~40 characters jump-forward uses the step-by-step search: the request failed with
    'internal error: IndexError: pop from empty list'."""
    node = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tags": UNIQUE,
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
        },
        "required": ["name", "tags", "children"],
        "additionalProperties": False,
    }
    schema = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    bias = {ord('"'): 60.0, ord(","): 55.0, ord("a"): 50.0}
    params = SamplingParams(temperature=0, max_tokens=300, logit_bias=bias)
    out = fake_engine().generate([([ord(c) for c in "Tree: "], params, ConstraintSpec.json_schema(schema))])[
        0
    ]
    assert out.finish_reason in ("stop", "length"), (out.finish_reason, getattr(out, "error", None))


# ---- 2. an earlier element holding a lone surrogate (\ud800) -------------------------------------------
@pytest.mark.parametrize("prefix", ['{"tags": ["\\ud800", "', '{"tags": ["a\\udc00b", "a'])
def test_lone_surrogate_element_does_not_break_the_mask(backend, tags_compiled, tokenizer, prefix):
    """restrict() looks up closing tokens by `e[len(so_far):].encode()`: an earlier element with a
    lone surrogate (valid JSON: "\\ud800") raises UnicodeEncodeError, so the mask fill fails and the
    engine fails the request ('internal error in the grammar matcher')."""
    m = backend.new_matcher(tags_compiled)
    for t in _ids(tokenizer, prefix):
        assert m.accept_token(t)
    bitmask = backend.allocate_bitmask(1)
    m.fill_next_token_bitmask(bitmask, 0)  # UnicodeEncodeError
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
    assert bits[_ids(tokenizer, "x")[0]]
    batched = backend.fill_bitmasks_async([m], [0], 1).result()
    assert (batched[0] == bitmask[0]).all()


def test_lone_surrogate_duplicate_is_still_refused(backend, tags_compiled, tokenizer):
    m = backend.new_matcher(tags_compiled)
    for t in _ids(tokenizer, '{"tags": ["\\ud800", "\\ud800'):
        assert m.accept_token(t)
    assert not m.accept_token(_ids(tokenizer, '"')[0])


# ---- 3. per-token history: memory quadratic in an element's length ----------------------------------
def test_history_memory_grows_linearly_in_a_long_element(backend, tags_compiled, tokenizer):
    """accept_token keeps a full copy of the tracker per token, including key_bytes (the element's
    text so far): a runaway element of n tokens keeps O(n^2) bytes (measured: 4,000 tokens of
    ' lorem' ~45 MiB, 8,000 ~176 MiB, 16,000 ~695 MiB per request; the same schema without
    uniqueItems: ~0)."""
    m = backend.new_matcher(tags_compiled)
    for t in _ids(tokenizer, '{"tags": ["a", "'):
        assert m.accept_token(t)
    word = _ids(tokenizer, " lorem")[0]
    tracemalloc.start()
    try:
        for _ in range(4000):
            assert m.accept_token(word)
        used, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert used < 8 << 20, f"{used / 2**20:.1f} MiB kept for a 24 KB element"
    assert m.accept_string('"]}') and m.is_completed()
    json.loads('{"tags": ["a", "' + " lorem" * 4000 + '"]}')


def test_a_surrogate_pair_escape_of_an_earlier_emoji_is_masked(backend, tags_compiled, tokenizer):
    """One character can take 12 bytes (`\\ud83d\\ude00`): the shortcut that skips the lookup for
    texts longer than every earlier element must count that, or the closing quote after
    `\\ude00` (12 bytes, one character) is allowed by the mask and refused by accept_token."""
    m = backend.new_matcher(tags_compiled)
    for t in _ids(tokenizer, '{"tags": ["\U0001f600", "\\ud83d\\ude00'):
        assert m.accept_token(t)
    bitmask = backend.allocate_bitmask(1)
    m.fill_next_token_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
    closers = [t for t, data in enumerate(m.vocab.token_bytes) if data in (b'"', b'",', b'"]')]
    assert len(closers) == 3
    for tok in closers:
        assert not bits[tok] and not m.accept_token(tok)
