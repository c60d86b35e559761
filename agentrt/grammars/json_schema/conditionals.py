"""`if`/`then`/`else` as alternatives the grammar can branch on.

JSON Schema 2020-12 core §10.2.2: when an instance is valid against `if`, it must be valid against
`then` (when present), else against `else` (when present); a lone `if` asserts nothing. So one
conditional is `(if and then) or (not if and else)`, with `not if` from negation.py.

Several conditionals side by side (in one schema or across `allOf` parts) are rewritten together:
- discriminated: every `if` tests one property p against a scalar constant, as in
  `{"properties": {"p": {"const": c}}}` (with `"required": ["p"]` and `"type": "object"` or
  not). Each instance falls in exactly one case: not an object, an object without p, an object
  whose p is one of the constants, an object whose p is none of them. In each case every `if` is
  decided, so each case is one branch "case and the `then`/`else` each `if` picks": at most
  (number of constants + 3) branches, pairwise exclusive by construction, whatever the number of
  conditionals (JsonSchemaStore's minecraft schemas chain 23 of them on "function");
- otherwise, at most MAX_CONDITIONALS of them, each with a complement: the 2^k combinations of
  "if_i and then_i" / "not if_i and else_i".
Anything else is refused naming `if` and its pointer.
"""

from __future__ import annotations

import itertools

from agentrt.grammars.json_schema.errors import UnsupportedSchemaError, ptr
from agentrt.grammars.json_schema.keywords import KNOWN
from agentrt.grammars.json_schema.values import json_equal, json_key
from agentrt.grammars.json_schema.walk import Walk

MAX_CONDITIONALS = 3
_NON_OBJECT = ["null", "boolean", "number", "string", "array"]


def take_conditional(s: dict, pointer: str) -> tuple | None:
    """Pop `if`/`then`/`else` from raw schema `s` at `pointer` (in place): (if, then, else, the
    pointer of `if`) with True for an absent `then`/`else`, or None when there is no `if` with a
    `then` or an `else` (a lone `if`, or `then`/`else` without `if`, asserts nothing: dropped)."""
    has = "if" in s and ("then" in s or "else" in s)
    cond = (s.get("if"), s.get("then", True), s.get("else", True), ptr(pointer, "if")) if has else None
    for k in ("if", "then", "else"):
        s.pop(k, None)
    return cond


def conditionals_schema(n: Walk, conds: list[tuple]) -> dict | bool:
    """A raw schema (an anyOf; False when nothing is left) equal to the conjunction of the
    conditionals `conds` (`take_conditional`'s tuples). Raises UnsupportedSchemaError naming `if`
    and its pointer when no rewrite applies."""
    triples = [c[:3] for c in conds]
    found = _discriminated(triples)
    if found is not None:
        return _by_discriminator(triples, *found)
    if len(conds) > MAX_CONDITIONALS:
        raise UnsupportedSchemaError(
            "if",
            conds[0][3],
            f"more than {MAX_CONDITIONALS} conditionals that do not test one property's value",
        )
    negs = []
    for test, _then, _else, where in conds:
        neg = n.negated(test, where)
        if neg is None:
            raise UnsupportedSchemaError(
                "if", where, "its subschema has no complement here, so the 'else' case cannot be told"
            )
        negs.append(neg)
    branches = []
    for picks in itertools.product((True, False), repeat=len(conds)):
        parts = []
        for (test, then, other), neg, taken in zip(triples, negs, picks):
            parts += [test, then] if taken else [neg, other]
        if any(p is False for p in parts):
            continue
        branches.append({"allOf": [p for p in parts if p is not True]})
    return {"anyOf": branches} if branches else False


def _discriminator(test):
    """(property, constant, requires it, requires an object) for an `if` of the discriminated
    form, else None."""
    if not isinstance(test, dict):
        return None
    kws = {k for k in test if k in KNOWN}
    props = test.get("properties")
    if not kws <= {"properties", "required", "type"} or not isinstance(props, dict) or len(props) != 1:
        return None
    ((p, sub),) = props.items()
    if not isinstance(sub, dict) or {k for k in sub if k in KNOWN} not in ({"const"}, {"enum"}):
        return None
    if "enum" in sub and not (isinstance(sub["enum"], list) and len(sub["enum"]) == 1):
        return None
    c = sub["const"] if "const" in sub else sub["enum"][0]
    if isinstance(c, (dict, list)):
        return None
    req = test.get("required", [])
    if req not in ([], [p]) or test.get("type", "object") != "object":
        return None
    return p, c, req == [p], "type" in test


def _discriminated(conds):
    """(property, [(constant, requires it, requires an object)]) when every `if` is discriminated
    on one property, else None."""
    found = [_discriminator(test) for test, _t, _e in conds]
    if not found or any(f is None for f in found) or len({f[0] for f in found}) != 1:
        return None
    return found[0][0], [f[1:] for f in found]


def _by_discriminator(conds, p: str, tests) -> dict:
    cases = [
        ({"type": _NON_OBJECT}, lambda c, req, obj: not obj),
        ({"type": "object", "properties": {p: False}}, lambda c, req, obj: not req),
    ]
    consts = list({json_key(c): c for c, _r, _o in tests}.values())
    for value in consts:
        cases.append(
            (
                {"type": "object", "required": [p], "properties": {p: {"const": value}}},
                lambda c, req, obj, value=value: json_equal(c, value),
            )
        )
    cases.append(
        (
            {"type": "object", "required": [p], "properties": {p: {"not": {"enum": consts}}}},
            lambda c, req, obj: False,
        )
    )
    branches = []
    for selector, holds in cases:
        parts = [selector]
        for (_test, then, other), t in zip(conds, tests):
            parts.append(then if holds(*t) else other)
        if any(x is False for x in parts):
            continue
        branches.append({"allOf": [x for x in parts if x is not True]})
    return {"anyOf": branches} if branches else False
