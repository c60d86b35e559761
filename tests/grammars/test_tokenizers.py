"""Tokenizer families: byte-level BPE (the default model, SmolLM2) and SentencePiece with byte
fallback (Gemma 3), and logits wider than the tokenizer's vocabulary. Model-free."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch

from agentrt.grammars.conformance import Counts, check_schema
from agentrt.grammars.jump_forward import forced_token_ids
from agentrt.grammars.length_policy import ClosingGuard
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.xgrammar_backend import GrammarBackend
from tests.support.paths import shared_path

RARE = "\U0001fae8"  # not in Gemma's vocabulary: four <0x..> byte-fallback tokens
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "tags", "n"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["new", "old"]}, "maxItems": 2},
        "n": {"type": "integer", "minimum": 0},
    },
}


@pytest.fixture(scope="module")
def sp_backend(sentencepiece_tokenizer):
    tok = sentencepiece_tokenizer
    stops = (tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>"))
    backend = GrammarBackend(tok, 262144, stops, GrammarConfig())
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def bpe_backend(tokenizer):
    backend = GrammarBackend(tokenizer, 49152, (2,), GrammarConfig())
    yield backend
    backend.shutdown()


@pytest.fixture(params=["bpe", "sentencepiece"])
def family(request):
    """(tokenizer, backend) of one tokenizer family."""
    if request.param == "bpe":
        return request.getfixturevalue("tokenizer"), request.getfixturevalue("bpe_backend")
    return request.getfixturevalue("sentencepiece_tokenizer"), request.getfixturevalue("sp_backend")


def test_byte_fallback_tokens_spell_json_strings(sp_backend, sentencepiece_tokenizer):
    """A character missing from the SentencePiece vocabulary arrives as byte tokens; the matcher
    assembles them into one character (maxLength counts it once) and rejects a truncated sequence."""
    tok = sentencepiece_tokenizer
    compiled = sp_backend.compile(ConstraintSpec.json_schema(SCHEMA))
    text = json.dumps({"name": f"Zoë {RARE} 日本", "tags": ["new"], "n": 3}, ensure_ascii=False)
    ids = tok.encode(text, add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert sum(p.startswith("<0x") for p in pieces) == 4, pieces
    m = sp_backend.new_matcher(compiled)
    assert all(m.accept_token(i) for i in ids)
    assert m.accept_token(tok.eos_token_id) and m.is_terminated()

    cut = next(i for i, p in enumerate(pieces) if p.startswith("<0x")) + 3  # the 4th byte dropped
    m = sp_backend.new_matcher(compiled)
    assert all(m.accept_token(i) for i in ids[:cut])
    assert not all(m.accept_token(i) for i in ids[cut + 1 :])

    too_long = json.dumps({"name": f"Zoë {RARE} 日本 and more", "tags": [], "n": 3}, ensure_ascii=False)
    m = sp_backend.new_matcher(compiled)
    assert not all(m.accept_token(i) for i in tok.encode(too_long, add_special_tokens=False))


def test_json_schema_test_suite_sample_on_sentencepiece(sp_backend):
    """The instance test of the JSON-Schema-Test-Suite on the Gemma tokenizer (a sample of files:
    the full suite runs on the default tokenizer in test_json_schema.py)."""
    suite = shared_path("json-schema-test-suite")
    total = Counts()
    for name in (
        "properties",
        "required",
        "enum",
        "const",
        "maxLength",
        "minLength",
        "pattern",
        "anyOf",
        "items",
        "type",
        "minimum",
        "maxItems",
    ):
        for i, group in enumerate(json.loads((suite / f"{name}.json").read_text())):
            total.add(check_schema(sp_backend, group["schema"], group["tests"], f"{name}[{i}]"))
    assert total.compiled >= 40
    assert total.wrong == []


def _allowed(bitmask: torch.Tensor, n: int) -> np.ndarray:
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:n]
    return np.flatnonzero(bits)


def _random_walk(backend, tok, compiled, rng: random.Random, budget: int) -> list[int]:
    """Uniformly random allowed tokens under the length-safe policy as the engine runs it
    (ClosingGuard after every token, jump-forward trimmed to what leaves a closing path)."""
    m = backend.new_matcher(compiled)
    guard = ClosingGuard(backend.planner, backend.stop_ids[0])
    assert guard.start(m) <= budget
    bm, out = backend.allocate_bitmask(1), []
    while not m.is_terminated() and len(out) < budget:
        m.fill_next_token_bitmask(bm, 0)
        t = int(rng.choice(_allowed(bm, len(tok))))
        assert m.accept_token(t)
        if not m.is_terminated():
            t = guard.keep(m, t, budget - len(out) - 1)
        out.append(t)
        if not m.is_terminated() and not guard.plan:
            jump = forced_token_ids(tok, backend.planner.token_texts, t, m.find_jump_forward_string())
            for j in jump:
                assert m.accept_token(j)
            while jump and (guard.start(m) or budget + 1) > budget - len(out) - len(jump):
                m.rollback(1)
                jump.pop()
            out += jump
    assert m.is_terminated(), f"the budget ran out before the grammar closed: {tok.decode(out)!r}"
    return [t for t in out if t not in backend.stop_ids]


def test_random_walks_close_and_validate(family):
    """Random tokens (byte pieces, '▁' words, multi-character JSON punctuation) under the length-safe
    policy always end in JSON that validates, on both tokenizer families."""
    tok, backend = family
    schemas = [
        SCHEMA,
        {"type": "string", "format": "date-time"},
        {
            "type": "object",
            "properties": {"when": {"type": "string", "format": "date"}, "ok": {"type": "boolean"}},
            "required": ["when"],
        },
        {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,4}$"}, "minItems": 1},
    ]
    rng = random.Random(0)
    for schema in schemas:
        compiled = backend.compile(ConstraintSpec.json_schema(schema))
        for budget in (30, 45, 60):
            text = tok.decode(_random_walk(backend, tok, compiled, rng, budget))
            jsonschema.validate(
                json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
            )


def test_jump_forward_tokens_are_canonical(family):
    """Walking a canonical instance, every jump-forward insertion is the tokenizer's own encoding:
    prefix + forced tokens re-encode to the same ids, and at least one jump happens."""
    tok, backend = family
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["customer_name", "status"],
        "properties": {"customer_name": {"type": "string"}, "status": {"enum": ["shipped_to_customer"]}},
    }
    compiled = backend.compile(ConstraintSpec.json_schema(schema))
    ids = tok.encode('{"customer_name": "Ada", "status": "shipped_to_customer"}', add_special_tokens=False)
    m, jumps = backend.new_matcher(compiled), 0
    for k, t in enumerate(ids):
        assert m.accept_token(t)
        forced = forced_token_ids(tok, backend.planner.token_texts, t, m.find_jump_forward_string())
        if forced:
            jumps += 1
            seq = ids[: k + 1] + forced
            assert tok.encode(tok.decode(seq), add_special_tokens=False) == seq
    assert jumps >= 1


def test_logits_wider_than_the_vocabulary(tokenizer):
    """Models pad their embedding rows (vocab 49,152 -> logits 49,216 here): padded ids are never
    allowed, and the mask applies to the wider logits."""
    backend = GrammarBackend(tokenizer, 49152 + 64, (2,), GrammarConfig())
    compiled = backend.compile(ConstraintSpec.json_schema({"type": "string"}))
    m = backend.new_matcher(compiled)
    bm = backend.allocate_bitmask(2)
    assert bm.shape == (2, (49152 + 64 + 31) // 32)
    m.fill_next_token_bitmask(bm, 1)
    allowed = _allowed(bm[1:], 49152 + 64)
    assert allowed.size > 0 and allowed.max() < 49152
    logits = torch.zeros(2, 49152 + 64)
    backend.apply_bitmask(logits, bm, [1])
    assert torch.isinf(logits[1, 49152:]).all() and torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1, allowed]).all()
    backend.shutdown()


def test_async_batched_fill_matches_single_fills(family):
    """The engine's overlapped, batched mask fill gives each row exactly the single-matcher mask;
    rows not listed stay all-allowed."""
    _tok, backend = family
    compiled = backend.compile(ConstraintSpec.json_schema(SCHEMA))
    prefixes = ['{"name": "Zo', '{"name": "a", "tags": [', '{"name": "a", "tags": ["new"], "n": 1']
    matchers = []
    for p in prefixes:
        m = backend.new_matcher(compiled)
        assert m.accept_string(p)
        matchers.append(m)
    rows = [0, 2, 3]
    bitmask = backend.fill_bitmasks_async(matchers, rows, 4).result()
    single = backend.allocate_bitmask(1)
    for m, row in zip(matchers, rows):
        backend.fill_bitmask(m, single, 0)
        assert torch.equal(bitmask[row], single[0])
    assert (bitmask[1] == -1).all()
    assert not torch.equal(bitmask[0], bitmask[2])


@pytest.mark.parametrize(
    "spec",
    [
        ConstraintSpec.regex("[α-ω]{2,5}"),
        ConstraintSpec.regex("(ab|cd)+x"),
        ConstraintSpec.json_schema({"type": "string", "pattern": "^[а-я]+$"}),
    ],
    ids=["greek", "cycle", "cyrillic-pattern"],
)
def test_closing_paths_beyond_ascii_and_cycles(family, spec):
    """The length-safe planner closes constraints that need non-ASCII characters (no single ASCII
    character fits) and loops of more than one character (`abab...` until `x`)."""
    _tok, backend = family
    compiled = backend.compile(spec)
    m = backend.new_matcher(compiled)
    path = backend.planner.closing_path(m)
    assert path is not None and path.num_tokens <= 16
    assert all(m.accept_token(t) for t in path.token_ids) and m.is_completed()
