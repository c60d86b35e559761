"""Checks of compiled constraints against texts. `accepts`: does a fresh matcher of a compiled
constraint take a whole text and end there (any constraint kind; the grammar, SQL and tool-call
tests use it). `check_schema` and its `Counts`: a JSON Schema's conformance, valid and invalid
instances (in the grammar's canonical form, json_schema/canonical.py) fed through a matcher and
counted against the schema's verdict (tests/grammars, `bench/constraint.py`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from agentrt.grammars.json_schema import UnsupportedSchemaError, canonical_json, normalize_schema


@dataclass
class Counts:
    compiled: int = 0
    refused: int = 0
    accepted_valid: int = 0
    rejected_invalid: int = 0
    rejected_valid: int = 0  # over-narrow: sound, but a valid answer the grammar cannot produce
    # of those, instances with a character JSON escapes (quote, backslash, control) under a schema
    # with maxLength/minLength: the documented limit of length-bounded strings (grammars/pipeline.py)
    rejected_valid_escaped: int = 0
    accepted_invalid: int = 0  # unsound: the grammar lets an invalid instance through
    compile_s: list = field(default_factory=list)
    refusals: list = field(default_factory=list)
    wrong: list = field(default_factory=list)

    def add(self, other: Counts) -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)


def accepts(backend, compiled, text: str) -> bool:
    m = backend.new_matcher(compiled)
    return m.accept_string(text) and m.is_completed()


def check_schema(backend, schema, tests: list[dict], name: str = "") -> Counts:
    """tests: [{"data": instance, "valid": bool}]. Compiles `schema` with `backend` (a
    GrammarBackend, default options: refuse what cannot be enforced). `format` is an assertion in
    this runtime, so where the schema uses it, validity is recomputed by jsonschema with its
    format checker."""
    from agentrt.grammars.spec import ConstraintSpec

    c = Counts()
    t0 = time.perf_counter()
    try:
        spec = ConstraintSpec.json_schema(schema)
        compiled = backend.compile(spec)
    except ValueError as e:
        c.refused += 1
        c.refusals.append(f"{name}: {e}")
        return c
    c.compile_s.append(time.perf_counter() - t0)
    c.compiled += 1
    normalized = normalize_schema(json.loads(spec.value)).schema
    asserting = None
    if '"format"' in spec.value:  # formats are assertions here, annotations in the 2020-12 default
        import jsonschema

        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        asserting = cls(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for t in tests:
        if asserting is not None:
            t = {**t, "valid": asserting.is_valid(t["data"])}
        try:
            text = canonical_json(t["data"], normalized)
        except (TypeError, ValueError, RecursionError):
            text = json.dumps(t["data"], ensure_ascii=False)
        ok = accepts(backend, compiled, text)
        if t["valid"]:
            c.accepted_valid += ok
            c.rejected_valid += not ok
            c.rejected_valid_escaped += not ok and _bounded(spec.value) and _has_escaped_chars(t["data"])
        else:
            c.rejected_invalid += not ok
            c.accepted_invalid += ok
        if ok != t["valid"]:
            c.wrong.append(f"{name}: {'accepted invalid' if ok else 'rejected valid'} {text[:120]}")
    return c


def _bounded(schema_text: str) -> bool:
    return '"maxLength"' in schema_text or '"minLength"' in schema_text


def _has_escaped_chars(x) -> bool:
    if isinstance(x, str):
        return any(ch in '"\\' or ord(ch) < 0x20 for ch in x)
    if isinstance(x, dict):
        return any(_has_escaped_chars(k) or _has_escaped_chars(v) for k, v in x.items())
    if isinstance(x, list):
        return any(_has_escaped_chars(v) for v in x)
    return False


__all__ = ["Counts", "UnsupportedSchemaError", "accepts", "check_schema"]
