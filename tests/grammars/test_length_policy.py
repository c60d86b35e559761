"""Length-safe output (`max_tokens_policy="close"`) and streaming validity on the extraction
workload; random-walk soundness of compiled schemas on a random-weight model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from jsonschema.validators import validator_for

from agentrt.extract.prompt import extraction_messages
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.runtime.request import SamplingParams
from tests.support.api import sse_chunks
from tests.support.models import make_tiny_model
from tests.support.paths import SHARED, shared_path

MODEL = "smollm2-135m-instruct"
MIN_CHECKED_LENGTH_POLICY = 2  # of the 3 documents (one per schema), default policy: measured 2 at 300 tokens


def _validate(instance, schema) -> list[str]:
    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    v = cls(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return [e.message for e in v.iter_errors(instance)]


def _stream_text(client, body) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in sse_chunks(client, {**body, "stream": True}):
        choice = chunk["choices"][0]
        text += choice["delta"].get("content") or ""
        finish = choice["finish_reason"] or finish
    return text, finish


@pytest.mark.parametrize(
    "max_tokens,policy",
    [  # the 300-token runs take ~80 s each: slow
        pytest.param(300, "length", marks=pytest.mark.slow),
        pytest.param(300, "close", marks=pytest.mark.slow),
        (80, "close"),
    ],
)
def test_extraction_stream_is_valid(client, max_tokens, policy):
    """Streamed extraction outputs validate against their schema. With the default policy an
    output cut by max_tokens is reported as `length` (and only then may be incomplete); with
    the length-safe policy every output is complete and valid, even with a small budget."""
    docs = [json.loads(line) for line in shared_path("extraction", "docs.jsonl").read_text().splitlines()]
    by_schema = {}
    for d in docs:
        by_schema.setdefault(d["schema_name"], []).append(d)
    picked = [group[0] for group in by_schema.values()]
    checked = 0
    for d in picked:
        schema = json.loads(shared_path("extraction", "schemas", f"{d['schema_name']}.json").read_text())
        body = {
            "model": MODEL,
            "messages": extraction_messages(d["text"], schema),
            "temperature": 0,
            "max_tokens": max_tokens,
            "max_tokens_policy": policy,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }
        text, finish = _stream_text(client, body)
        if policy == "length" and finish == "length":
            continue
        assert finish == "stop", (d["id"], finish, text)
        assert _validate(json.loads(text), schema) == [], (d["id"], text)
        if policy == "close":
            assert len(text) > 2
        checked += 1
    print(f"\n{checked} of {len(picked)} documents checked ({policy}, max_tokens {max_tokens})")
    # the default policy skips outputs cut by max_tokens: it must not skip them all
    assert checked == len(picked) if policy == "close" else checked >= MIN_CHECKED_LENGTH_POLICY


def test_regex_stream_is_valid_with_small_budget(client):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Give a phone number and an order id."}],
        "temperature": 0,
        "max_tokens": 32,
        "max_tokens_policy": "close",
        "regex": r"PHONE \+1-[0-9]{3}-[0-9]{3}-[0-9]{4}; ORDER [A-Z]{2}[0-9]{6}",
    }
    text, finish = _stream_text(client, body)
    assert finish == "stop"
    import re

    assert re.fullmatch(body["regex"], text), text


def test_budget_below_the_minimum_is_a_400(client):
    schema = {
        "type": "object",
        "required": ["a_long_property_name", "another_long_property_name"],
        "properties": {
            "a_long_property_name": {"type": "string"},
            "another_long_property_name": {"type": "string"},
        },
    }
    resp = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "max_tokens_policy": "close",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        },
    )
    assert resp.status_code == 400, resp.text
    assert "needs to close" in resp.json()["error"]["message"]
    # a constraint the planner cannot close says why
    resp = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1000,
            "max_tokens_policy": "close",
            "regex": "x{600}",
        },
    )
    assert resp.status_code == 400, resp.text
    assert re.search("gave up after|passed 512 characters", resp.json()["error"]["message"])


def test_best_effort_names_dropped_keywords_in_header_and_body(client):
    schema = {
        "type": "object",
        "required": ["tags"],
        "properties": {
            # unique objects: refused (unique free strings are checked by the matcher)
            "tags": {"type": "array", "items": {"type": "object"}, "maxItems": 3, "uniqueItems": True}
        },
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Give tags."}],
        "temperature": 0,
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    refused = client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400
    assert "'uniqueItems' at /properties/tags/uniqueItems" in refused.json()["error"]["message"]
    body["response_format"]["json_schema"]["strict"] = False
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-agentrt-not-enforced"] == "uniqueItems at /properties/tags/uniqueItems"
    assert resp.json()["not_enforced"] == ["uniqueItems at /properties/tags/uniqueItems"]


def test_lark_field(client):
    grammar = 'start: "yes" | "no"'
    resp = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Is water wet?"}],
            "temperature": 0,
            "max_tokens": 5,
            "lark": grammar,
        },
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] in ("yes", "no")
    bad = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "lark": "start: /(?=a)a/"},
    )
    assert bad.status_code == 400 and "lookahead" in bad.json()["error"]["message"]


def _bench_schemas(step: int) -> list[tuple[str, dict]]:
    root = SHARED / "jsonschemabench" / "schemas"
    if not root.exists():
        pytest.skip(f"{root} not present (the shared test data sits beside the repo in CI)")
    return [(f.name, json.loads(f.read_text())) for f in sorted(root.glob("*.json"))[::step]]


def _random_walks(tmp_path_factory, default_model_dir, schemas, samples: int, max_tokens: int):
    """Sample `samples` outputs per compiled schema from a random-weight model (near-uniform
    logits under the mask) with the length-safe policy; returns (outputs validated, invalid, no_path)."""
    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
    from agentrt.runtime.engine import Engine

    path = make_tiny_model(
        tmp_path_factory.mktemp("walk") / "tiny",
        Path(default_model_dir),
        "llama",
        max_position_embeddings=4096,
    )
    eng = Engine(
        EngineConfig(
            model=ModelConfig(model=str(path), device="cpu", dtype="float32"),
            cache=CacheConfig(kv_cache_bytes=64 << 20),
            # soundness, not compile time: a large schema's compile passes the server's 30 s when
            # the box is busy, and the walks then never start
            grammar=GrammarConfig(compile_timeout_s=600, compile_queue_timeout_s=1200),
        )
    )
    reqs, names = [], []
    for name, schema in schemas:
        spec = ConstraintSpec.json_schema(schema)
        try:
            eng.grammar.compile(spec)
        except ValueError:
            continue
        for k in range(samples):
            reqs.append(
                (
                    [1, 2, 3],
                    SamplingParams(temperature=1.0, seed=k, max_tokens=max_tokens, max_tokens_policy="close"),
                    spec,
                )
            )
            names.append((name, schema))
    invalid, no_path, checked = [], set(), 0
    for (name, schema), out in zip(names, eng.generate(reqs)):
        if out.finish_reason == "error" and "found no way to complete" in str(out.error or ""):
            no_path.add(name)
            continue
        checked += 1
        try:
            errors = _validate(json.loads(out.text), schema)
        except json.JSONDecodeError as e:
            errors = [f"not JSON ({e}); finish={out.finish_reason} error={out.error}"]
        if errors:
            invalid.append((name, out.text[:200], errors[:2]))
    eng.grammar.shutdown()
    return checked, invalid, no_path


@pytest.mark.slow  # minutes on 2 CPU cores: `make test-slow`
def test_random_walk_soundness_sample(tmp_path_factory, default_model_dir):
    """Every 15th JSONSchemaBench schema, 3 random walks each: all outputs are valid JSON that
    passes jsonschema with format checking (all schemas x 5 walks is the slow test below)."""
    n, invalid, no_path = _random_walks(tmp_path_factory, default_model_dir, _bench_schemas(15), 3, 300)
    print(f"\nrandom walks: {n} outputs, {len(invalid)} invalid, no closing path for {sorted(no_path)}")
    assert invalid == []
    # refused at admission with a clear 400 (no closing path): 4 of the 10 that compile since more
    # keywords compile (2026-12-01); the greedy planner loops past 512-2,048 characters on 2 of them
    # and passes its 256 bitmask fills on 2 more (Snowplow closes at 330 fills)
    assert len(no_path) <= 4
    # 10 schemas x 3 walks; about 4 in 5 JSONSchemaBench schemas compile: most walks must be checked
    assert n >= 15


def _matcher_walks(tokenizer, schemas, samples: int, max_tokens: int):
    """Model-free random walks: at each step a uniformly random token among those the bitmask
    allows (random logits, without a forward pass), under the length-safe policy exactly as the
    engine applies it (ClosingGuard.keep after each accepted token). Returns (outputs checked,
    invalid, schemas with no closing path, schemas whose shortest output exceeds max_tokens)."""
    import random

    import numpy as np

    from agentrt.grammars.length_policy import ClosingGuard
    from agentrt.grammars.spec import GrammarConfig
    from agentrt.grammars.xgrammar_backend import GrammarBackend

    backend = GrammarBackend(
        tokenizer, 49152, (tokenizer.eos_token_id,), GrammarConfig(compile_timeout_s=900)
    )
    stop = tokenizer.eos_token_id
    bitmask = backend.allocate_bitmask(1)
    n, invalid, no_path, too_long = 0, [], set(), set()
    for name, schema in schemas:
        try:
            compiled = backend.compile(ConstraintSpec.json_schema(schema))
        except ValueError:
            continue
        for k in range(samples):
            rng = random.Random(k)
            matcher = backend.new_matcher(compiled)
            guard = ClosingGuard(backend.planner, stop)
            need = guard.start(matcher)
            if need is None or need > max_tokens:  # a 400 at admission: no path, or over the budget
                (no_path if need is None else too_long).add(name)
                break
            ids = []
            while not matcher.is_terminated() and len(ids) < max_tokens:
                matcher.fill_next_token_bitmask(bitmask, 0)
                bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[: len(tokenizer)]
                tok = int(rng.choice(np.flatnonzero(bits)))
                assert matcher.accept_token(tok)
                if not matcher.is_terminated():
                    tok = guard.keep(matcher, tok, max_tokens - len(ids) - 1)
                ids.append(tok)
            n += 1
            text = tokenizer.decode([t for t in ids if t != stop])
            try:
                errors = _validate(json.loads(text), schema)
            except json.JSONDecodeError as e:
                errors = [f"not JSON ({e}); {len(ids)} tokens, terminated={matcher.is_terminated()}"]
            if errors:
                invalid.append((name, text[:200], errors[:2]))
    backend.shutdown()
    return n, invalid, no_path, too_long


@pytest.mark.slow
def test_random_walk_soundness_all(tokenizer):
    """Every compiled JSONSchemaBench schema, 5 model-free random walks of up to 600 tokens under
    the length-safe policy: all outputs valid with format checking. (Through the engine with a
    random-weight model, the 610 walks took hours on 2 cores: the sample test above keeps that
    path.)"""
    n, invalid, no_path, too_long = _matcher_walks(tokenizer, _bench_schemas(1), 5, 600)
    print(
        f"\nrandom walks: {n} outputs, {len(invalid)} invalid, no closing path for {sorted(no_path)}, "
        f"shortest output over 600 tokens for {sorted(too_long)}"
    )
    assert invalid == []
    # measured 2026-12-05: 16 of the 143 schemas that compile now are refused for the close policy (a
    # clear 400: the planner's search passes its 256-fill limit or gives up in a repeating part). On
    # 2026-11-29 it was 8 of 122, the same 8 among these; the 8 others (5 WashingtonPost schemas,
    # Github_ultra o21312 and o62895, JsonSchemaStore 0.5.2) came with the schemas the JSON Schema
    # keyword work made compile. More schemas run under the policy (127 against 114). No schema's
    # shortest output is over the budget.
    assert len(no_path) <= 16 and not too_long
    assert n >= 600  # (143 compiled - 16 without a closing path) x 5 walks = 635 outputs checked
