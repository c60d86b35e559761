"""Cases from ../shared/testdata/cases/cases.jsonl, checked on the matcher (model-free) and, where
the behaviour is about sampling, on the default model."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.xgrammar_backend import GrammarBackend
from agentrt.runtime.request import SamplingParams
from tests.support.models import chat_ids
from tests.support.paths import load_case


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, 49152, (2,), GrammarConfig())


def _accepts(backend, spec, text: str) -> bool:
    m = backend.new_matcher(backend.compile(spec))
    return m.accept_string(text) and m.is_completed()


@pytest.mark.parametrize("case_id", ["max-items-zero", "exact-item-count", "anyof-null-or-bool"])
def test_schema_cases_on_matcher(backend, case_id):
    case = load_case(case_id)
    spec = ConstraintSpec.json_schema(case["schema"])
    for inst in case.get("valid", []):
        assert _accepts(backend, spec, json.dumps(inst)), inst
    for inst in case.get("invalid", []):
        assert not _accepts(backend, spec, json.dumps(inst)), inst
    for text in case.get("invalid_text", []):
        assert not _accepts(backend, spec, text), text


def test_exact_item_count_on_model(engine, tokenizer):
    case = load_case("exact-item-count")
    ids = chat_ids(tokenizer, [{"role": "user", "content": case["prompt"]}])
    out = engine.generate(
        [(ids, SamplingParams(temperature=0, max_tokens=60), ConstraintSpec.json_schema(case["schema"]))]
    )[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), case["schema"])
    assert len(json.loads(out.text)["cities"]) == 2


def test_broken_constraints_are_value_errors(backend):
    case = load_case("broken-constraint-is-an-error")
    for request in case["requests"]:
        schema = request["response_format"]["json_schema"]["schema"]
        with pytest.raises(ValueError, match="not a valid JSON Schema"):
            backend.compile(ConstraintSpec.json_schema(schema))
    with pytest.raises(ValueError, match="regex constraint cannot be compiled"):
        backend.compile(ConstraintSpec.regex("(ab"))
    with pytest.raises(ValueError, match="grammar constraint cannot be compiled: .*not defined"):
        backend.compile(ConstraintSpec.grammar("root ::= missing_rule"))


def _whitespace_run(backend, matcher, ws: str) -> int:
    """How many whitespace characters the matcher accepts in a row here (probing on a fork)."""
    n = 0
    probe = matcher.fork()
    while n < 50 and probe.accept_string(ws):
        n += 1
    return n


@pytest.mark.parametrize(
    "config", [GrammarConfig(), GrammarConfig(any_whitespace=True, max_whitespace_cnt=2)]
)
def test_bounded_whitespace(tokenizer, config):
    case = load_case("bounded-whitespace")
    backend = GrammarBackend(tokenizer, 49152, (2,), config)
    compiled = backend.compile(ConstraintSpec.json_schema(case["schema"]))
    bound = config.max_whitespace_cnt if config.any_whitespace else 1
    m = backend.new_matcher(compiled)
    # probe each gap between JSON tokens of {"kind": "x"}
    for piece in ["{", '"kind"', ":", '"x"', "}"]:
        for ws in (" ", "\n", "\t"):
            assert _whitespace_run(backend, m, ws) <= bound
        m.accept_string(piece)
    # a policy that always prefers whitespace, then '}' , must still close the object promptly
    m = backend.new_matcher(compiled)
    vocab = tokenizer.get_vocab()
    ws_ids = [
        i
        for t, i in vocab.items()
        if tokenizer.convert_tokens_to_string([t]).strip() == ""
        and tokenizer.convert_tokens_to_string([t]) != ""
    ]
    logits_base = torch.zeros(1, 49152)
    logits_base[0, ws_ids] = 10.0
    logits_base[0, tokenizer.convert_tokens_to_ids("}")] = 5.0
    steps = 0
    while not m.is_terminated():
        bitmask = backend.allocate_bitmask(1)
        backend.fill_bitmask(m, bitmask, 0)
        logits = logits_base.clone()
        backend.apply_bitmask(logits, bitmask, [0])
        assert m.accept_token(int(logits.argmax()))
        steps += 1
        assert steps < 10, "whitespace ran on"
