"""Runaway-value repair (agentrt/runtime/repetition.py): the tail-repeat detector on synthetic
token sequences, the JSON pointer tracker, and the engine on the fake runner (milliseconds): a
value forced to loop is closed under the grammar with repair on and runs to max_tokens with it off."""

from __future__ import annotations

import json

import jsonschema
import pytest

from agentrt.grammars.json_lexer import JsonPointerTracker
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.config import EngineConfig, SpecConfig
from agentrt.runtime.repetition import RepetitionConfig, TailRepeats
from agentrt.runtime.request import SamplingParams, TokenLogprob
from agentrt.testing import fake_engine

pytestmark = pytest.mark.usefixtures("time_limit")


def _first_hit(seq: list[int], config: RepetitionConfig) -> tuple[int, int] | None:
    """(index of the token where the detector fired, unit length) or None."""
    tail = TailRepeats(config)
    for i, t in enumerate(seq):
        n = tail.push(t)
        if n is not None:
            return i, n
    return None


# 67 and 74: the units of the two event titles that ran to max_tokens under the old max_n of 64
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 32, 67, 74, 96])
def test_unit_repeated_detected_at_the_kth_copy(n):
    cfg = RepetitionConfig(min_repeats=3, min_tokens=16)
    k = cfg.repeats_needed(n)
    unit = list(range(100, 100 + n))
    seq = [7, 8, 9] + unit * (k + 2)
    hit = _first_hit(seq, cfg)
    assert hit is not None
    i, found = hit
    assert found == n
    assert i == 3 + k * n - 1  # exactly when the k-th copy is complete, not before


def test_repeats_needed():
    cfg = RepetitionConfig(min_repeats=3, min_tokens=16)
    assert [cfg.repeats_needed(n) for n in (1, 2, 4, 5, 6, 8, 16)] == [16, 8, 4, 4, 3, 3, 3]
    # units of long_n (48) tokens or more count at two copies: 96+ tokens repeated verbatim
    assert [cfg.repeats_needed(n) for n in (47, 48, 96)] == [3, 2, 2]
    assert RepetitionConfig(long_n=None).repeats_needed(96) == 3


def test_one_copy_short_is_not_detected():
    cfg = RepetitionConfig(min_repeats=3, min_tokens=16)
    for n in (1, 2, 4, 7, 20):
        unit = list(range(50, 50 + n))
        seq = [1, 2] + unit * (cfg.repeats_needed(n) - 1) + unit[:-1]
        assert _first_hit(seq, cfg) is None, n


def test_unit_longer_than_max_n_is_not_detected():
    cfg = RepetitionConfig(max_n=8)
    assert _first_hit(list(range(9)) * 10, cfg) is None


def test_legitimate_lists_are_not_detected():
    # "red, green, blue, ...": separators repeat, items differ; numbered list items; an address
    sep = [11]
    items = [[200 + i, 300 + i] for i in range(30)]
    comma_list = [t for item in items for t in (*item, *sep)]
    numbered = [t for i in range(30) for t in (400 + i, 12, 13, 500 + i, 14)]
    address = [20, 21, 22, 11, 23, 24, 11, 25, 26, 11, 27, 11, 28]
    cfg = RepetitionConfig()
    for seq in (comma_list, numbered, address):
        assert _first_hit(seq, cfg) is None


def test_config_rejects_inconsistent_values():
    with pytest.raises(ValueError, match="min_n"):
        RepetitionConfig(min_n=5, max_n=4)
    with pytest.raises(ValueError, match="min_repeats"):
        RepetitionConfig(min_repeats=1)
    with pytest.raises(ValueError, match="long_n must be >= 2 or None, got 1"):
        RepetitionConfig(long_n=1)


def _track(text: str) -> JsonPointerTracker:
    t = JsonPointerTracker()
    t.feed(text.encode())
    return t


@pytest.mark.parametrize(
    ("prefix", "inside", "pointer"),
    [
        ('{"notes": "abc', True, "/notes"),
        ('{"notes": "a\\"b', True, "/notes"),  # an escaped quote does not close it
        ('{"notes": "a\\\\', True, "/notes"),
        ('{"notes": "a\\\\"', False, "/notes"),  # an escaped backslash then the closing quote
        ('{"not', False, "/"),  # in a key
        ('{"a": {"b/c~d": ["x", "y', True, "/a/b~1c~0d/1"),
        ('{"a": [{"k": 1}, {"k": "v', True, "/a/1/k"),
        ('{"a": "x", "b": "', True, "/b"),
        ('{"a":"{[,:", "b": [1, 2], "c": "', True, "/c"),  # structure inside strings is text
        ('"top', True, ""),
        ('{"caf\\u00e9": "', True, "/café"),
    ],
)
def test_pointer_tracker(prefix, inside, pointer):
    t = _track(prefix)
    assert t.in_value_string is inside
    if inside:
        assert t.pointer() == pointer


def test_array_boundary():
    t = _track('{"a": [{"k": "v"}')
    assert t.stack[-1].after_element and t.pointer(1) == "/a"
    t.feed(b", ")
    assert not t.stack[-1].after_element
    t.feed(b'"s"')
    assert t.stack[-1].after_element and t.pointer(1) == "/a" and t.pointer() == "/a/1"


def test_tracker_is_byte_level():
    t = JsonPointerTracker()
    data = '{"名前": "東京'.encode()
    for b in data:  # one byte at a time: split multi-byte characters
        t.feed(bytes([b]))
    assert t.in_value_string and t.pointer() == "/名前"


# ---- the engine, on the fake runner ---------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "notes": {"type": "string", "minLength": 30},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["name", "notes", "tags"],
    "additionalProperties": False,
}
PROMPT = [ord(c) for c in "Extract: "]


def _loop_params(repair: bool, **kw) -> SamplingParams:
    # +100 on "a": every free string is "aaaa..." until something ends it
    return SamplingParams(
        temperature=0, max_tokens=200, logit_bias={ord("a"): 100.0}, repetition_repair=repair, **kw
    )


def test_engine_closes_runaway_values():
    engine = fake_engine()
    spec = ConstraintSpec.json_schema(SCHEMA, strict=True)
    on, off = engine.generate(
        [(PROMPT, _loop_params(True, logprobs=0), spec), (PROMPT, _loop_params(False), spec)]
    )
    assert off.finish_reason == "length" and off.repaired == []
    assert on.finish_reason == "stop", on.text
    obj = json.loads(on.text)
    jsonschema.validate(obj, SCHEMA)
    assert on.repaired[:2] == ["/name", "/notes"]
    assert all(p in ("/name", "/notes", "/tags/0", "/tags/1") for p in on.repaired)
    assert obj["name"] == "a" * 24  # closed when the 24th copy of the 1-token unit was emitted
    # minLength 30: the closing path fills up to it (the planner's filler), then the quote
    assert obj["notes"].startswith("a" * 24) and len(obj["notes"]) == 30
    # the forced closing tokens are reported as forced (logprob 0.0)
    quote = engine.tokenizer.encode('"', add_special_tokens=False)[0]
    ids = on.token_ids
    k = next(i for i in range(1, len(ids)) if ids[i] == quote and ids[i - 1] == ord("a"))  # closes "name"
    # sampled, the quote would have a logprob near -100 (the bias on "a"); forced, it is 0.0
    assert on.logprobs[k] == TokenLogprob.forced(quote, 0)


ARRAY_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"d": {"enum": ["xy"]}, "q": {"type": "integer"}},
                "required": ["d", "q"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "integer"},
    },
    "required": ["items", "total"],
    "additionalProperties": False,
}


def test_engine_closes_runaway_arrays_after_a_whole_element():
    """A loop of identical array elements (the invoice line_items runaway) is ended by closing the
    array after a complete element, and the object goes on."""
    engine = fake_engine()
    spec = ConstraintSpec.json_schema(ARRAY_SCHEMA, strict=True)
    # the fake model's preferences: a new element, then q = 7 and "}", then "," over "]"
    bias = {ord("{"): 100.0, ord("}"): 90.0, ord(","): 80.0, ord("7"): 70.0}
    params = [
        SamplingParams(temperature=0, max_tokens=200, logit_bias=bias, repetition_repair=repair)
        for repair in (True, False)
    ]
    on, off = engine.generate([(PROMPT, p, spec) for p in params])
    assert off.finish_reason == "length" and off.repaired == []
    assert on.finish_reason == "stop", on.text
    obj = json.loads(on.text)
    jsonschema.validate(obj, ARRAY_SCHEMA)
    assert on.repaired == ["/items"]
    assert len(obj["items"]) >= 3 and all(it == obj["items"][0] for it in obj["items"])
    assert on.text.startswith(off.text[: on.text.index("]")])  # the same output up to the repair


def test_other_constraints_and_unconstrained_are_untouched():
    engine = fake_engine()
    params = _loop_params(True, ignore_eos=True)
    regex = ConstraintSpec.regex("[a-z]{150}")
    outs = engine.generate([(PROMPT, params, regex), (PROMPT, params, None)])
    assert outs[0].text == "a" * 150 and outs[0].repaired == []
    assert outs[1].finish_reason == "length" and outs[1].repaired == []


def test_repair_is_validated():
    with pytest.raises(ValueError, match="repetition_repair"):
        SamplingParams(repetition_repair="yes").validate()


def test_same_output_with_ngram_speculation_and_batched():
    """Repair under speculative verification (the n-gram proposer drafts the loop) and in a batch
    gives the token-identical output of plain decoding alone."""
    spec = ConstraintSpec.json_schema(SCHEMA, strict=True)
    plain = fake_engine().generate([(PROMPT, _loop_params(True), spec)])[0]
    config = EngineConfig(speculative=SpecConfig(method="ngram", num_speculative_tokens=4))
    other = [ord(c) for c in "Something else entirely: "]
    outs = fake_engine(config).generate(
        [(other, _loop_params(True), spec), (PROMPT, _loop_params(True), spec)]
    )
    assert outs[1].token_ids == plain.token_ids and outs[1].repaired == plain.repaired
    assert outs[1].finish_reason == "stop"


def test_guard_replaces_a_token_that_ran_past_the_element(tokenizer):
    """With the default model's tokenizer `},` is one token: the array cannot be closed at a token
    boundary after an element, so the guard replaces that token by `}` and closes the array there."""
    from agentrt.grammars.spec import GrammarConfig
    from agentrt.grammars.xgrammar_backend import GrammarBackend
    from agentrt.runtime.constraint_state import ConstraintState
    from agentrt.runtime.repetition import RepetitionGuard, vocab_bytes

    backend = GrammarBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), GrammarConfig())
    compiled = backend.compile(ConstraintSpec.json_schema(ARRAY_SCHEMA, strict=True))
    state = ConstraintState(backend.new_matcher(compiled))
    info = backend.info
    guard = RepetitionGuard(
        RepetitionConfig(), vocab_bytes(info.decoded_vocab, info.special_token_ids), backend.planner
    )
    item = '{"d": "xy", "q": 7}'
    text = '{"items": [' + ", ".join([item] * 12)
    out: list[int] = []
    for tok in tokenizer.encode(text, add_special_tokens=False):
        assert state.matcher.accept_token(tok)
        out.append(tok)
        drop, ids = guard.check(out, 0, state, left=100)
        if ids:
            break
    else:
        pytest.fail("the repetition was not repaired")
    assert drop == 1 and tokenizer.decode(out[-1:]).startswith("},")
    out = out[: len(out) - drop] + ids
    repaired = tokenizer.decode(out)
    assert repaired.endswith(item + "]") and guard.repaired == ["/items"]
    assert repaired.count(item) >= 3
    # the matcher followed: it accepts the rest of the object and then ends
    for tok in tokenizer.encode(', "total": 7}', add_special_tokens=False):
        assert state.matcher.accept_token(tok)
    assert state.matcher.is_completed()


@pytest.mark.parametrize("max_tokens", [80, 110, 200])  # closing needs 71 here
def test_with_max_tokens_policy_close(max_tokens):
    """Repair and the length-safe policy together: the output is always complete and valid."""
    engine = fake_engine()
    spec = ConstraintSpec.json_schema(SCHEMA, strict=True)
    params = _loop_params(True, max_tokens_policy="close")
    params.max_tokens = max_tokens
    out = engine.generate([(PROMPT, params, spec)])[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len(out.token_ids) <= max_tokens
