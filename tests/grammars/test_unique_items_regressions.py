"""Regressions found by trying to break the unique-strings check (grammars/unique_items.py), one
minimal reproducer per bug: accept_string dropped the rollback history (jump-forward's step-by-step
search then failed the request), an earlier element with a lone surrogate broke the mask's lookup,
and per-token snapshots copied the open string (memory quadratic in an element's length)."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.xgrammar_backend import GrammarBackend
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine

STOP = 2
UNIQUE = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
TAGS = {"type": "object", "properties": {"tags": UNIQUE}, "required": ["tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(tokenizer, 49152, (STOP,), GrammarConfig(compile_timeout_s=120))
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def compiled(backend):
    return backend.compile(ConstraintSpec.json_schema(TAGS))


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---- 1. jump-forward's step-by-step search (accept_string + rollback) ------------------------------
def test_stepwise_jump_forward_leaves_the_matcher_usable(backend, compiled, tokenizer):
    """ForcedTextFinder._stepwise accepts the forced characters with accept_string and undoes them
    with rollback(len(chars)); UniqueItemsMatcher.accept_string empties the rollback history, so
    the rollback raises IndexError (and the tracker no longer matches the inner matcher)."""
    m = backend.new_matcher(compiled)
    for t in _ids(tokenizer, '{"tags": ["a"'):
        assert m.accept_token(t)
    m.accept_string("]")  # one forced character, as _stepwise does
    m.rollback(1)  # IndexError: pop from empty list
    assert not m.accept_string(', "a"]}')  # the tracker still knows "a"
    assert m.accept_string(', "b"]}') and m.is_completed()


def test_stepwise_search_through_the_finder(backend, compiled):
    m = backend.new_matcher(compiled)
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
def test_lone_surrogate_element_does_not_break_the_mask(backend, compiled, tokenizer, prefix):
    """restrict() looks up closing tokens by `e[len(so_far):].encode()`: an earlier element with a
    lone surrogate (valid JSON: "\\ud800") raises UnicodeEncodeError, so the mask fill fails and the
    engine fails the request ('internal error in the grammar matcher')."""
    m = backend.new_matcher(compiled)
    for t in _ids(tokenizer, prefix):
        assert m.accept_token(t)
    bitmask = backend.allocate_bitmask(1)
    m.fill_next_token_bitmask(bitmask, 0)  # UnicodeEncodeError
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
    assert bits[_ids(tokenizer, "x")[0]]
    batched = backend.fill_bitmasks_async([m], [0], 1).result()
    assert (batched[0] == bitmask[0]).all()


def test_lone_surrogate_duplicate_is_still_refused(backend, compiled, tokenizer):
    m = backend.new_matcher(compiled)
    for t in _ids(tokenizer, '{"tags": ["\\ud800", "\\ud800'):
        assert m.accept_token(t)
    assert not m.accept_token(_ids(tokenizer, '"')[0])


# ---- 3. per-token history: memory quadratic in an element's length ----------------------------------
def test_history_memory_grows_linearly_in_a_long_element(backend, compiled, tokenizer):
    """accept_token keeps a full copy of the tracker per token, including key_bytes (the element's
    text so far): a runaway element of n tokens keeps O(n^2) bytes (measured: 4,000 tokens of
    ' lorem' ~45 MiB, 8,000 ~176 MiB, 16,000 ~695 MiB per request; the same schema without
    uniqueItems: ~0)."""
    m = backend.new_matcher(compiled)
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
