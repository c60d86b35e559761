"""`enum`/`const`, `anyOf` and `oneOf`.

- `enum`/`const`: the listed values are filtered by the rest of the subschema with `jsonschema`
  (so every sibling keyword holds) and deduplicated; scalars become one `enum`, objects and arrays
  exact schemas (`value_to_schema`).
- `anyOf`: each branch merged with the sibling keywords and normalized; unsatisfiable branches drop.
- `oneOf`: enforced as `anyOf` when its live branches are provably pairwise exclusive (disjoint
  types, disjoint enums, or a required property whose schemas are disjoint / that the other
  branch's closed object forbids); otherwise refused: exactly-one has no grammar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrt.grammars.json_schema.errors import ptr
from agentrt.grammars.json_schema.keywords import KNOWN, UNSAT
from agentrt.grammars.json_schema.refs import inline
from agentrt.grammars.json_schema.values import json_equal, json_key, type_name, value_to_schema

if TYPE_CHECKING:
    from agentrt.grammars.json_schema.normalizer import Normalizer


def norm_enum(n: Normalizer, s: dict, pointer: str):
    """`enum`/`const` with whatever else the subschema says: the values that satisfy all of it."""
    values = [s["const"]] if "const" in s else list(s["enum"])
    others = [k for k in s if k in KNOWN and k not in ("enum", "const")]
    # validate against the rest of the schema (membership is given) and dedup by a canonical
    # key: both were quadratic (a 10k-value enum took 29 s)
    source = "const" if "const" in s else "enum"
    sub = n.validator.evolve(schema={k: v for k, v in s.items() if k != source})
    kept, seen = [], set()
    for v in values:
        key = json_key(v)
        if key not in seen and sub.is_valid(v):
            seen.add(key)
            kept.append(v)
    if others:
        n.rewrite("enum" if "enum" in s else "const", pointer)
    if not kept:
        return UNSAT
    scalars = [
        int(v) if isinstance(v, float) and v.is_integer() else v
        for v in kept
        if not isinstance(v, (dict, list))
    ]
    alts = ([{"enum": scalars}] if scalars else []) + [
        value_to_schema(v) for v in kept if isinstance(v, (dict, list))
    ]
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def norm_alternatives(n: Normalizer, s: dict, pointer: str):
    """`anyOf` or `oneOf` (both present: the `oneOf` moves into an `allOf`)."""
    if "anyOf" in s and "oneOf" in s:
        s = dict(s)
        one = s.pop("oneOf")
        n.rewrite("oneOf", ptr(pointer, "oneOf"))
        s["allOf"] = [{"oneOf": one}]
        return n.norm(s, pointer)
    kw = "anyOf" if "anyOf" in s else "oneOf"
    base = {k: v for k, v in s.items() if k != kw}
    branches = []
    for i, b in enumerate(s[kw]):
        bp = ptr(pointer, kw, i)
        if any(k in KNOWN for k in base):
            merged = inline(n, {"allOf": [base, b]}, bp)
            nb = UNSAT if merged is False else n.norm(merged, bp)
        else:
            nb = n.norm(b, bp)
        branches.append(nb)
    live = [b for b in branches if b is not UNSAT]
    if kw == "oneOf" and len(live) > 1:
        if _pairwise_disjoint(n, live):
            n.rewrite("oneOf", ptr(pointer, "oneOf"))
        elif (exact := _exactly_one_by_type(n, live)) is not None:
            n.rewrite("oneOf", ptr(pointer, "oneOf"))
            live = exact
        else:
            n.unsupported(
                "oneOf",
                ptr(pointer, "oneOf"),
                "its branches are not provably exclusive (exactly-one cannot be "
                "enforced); use anyOf if any branch may match",
            )
    if not live:
        return UNSAT
    return live[0] if len(live) == 1 else {"anyOf": live}


_ALL_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")


def _pure_types(n: Normalizer, s) -> set | None:
    """The types a normalized schema admits when it admits every value of them (`{}`, `{"type": t}`
    or an anyOf of such), else None."""
    if s == {}:
        return set(_ALL_TYPES)
    if set(s) == {"type"} and isinstance(s["type"], str):
        return {"integer", "number"} if s["type"] == "number" else {s["type"]}
    if set(s) == {"anyOf"}:
        out: set = set()
        for b in s["anyOf"]:
            t = _pure_types(n, b)
            if t is None:
                return None
            out |= t
        return out
    return None


def _deref(n: Normalizer, s):
    """A normalized schema with bare `$ref`s followed to their `$defs` entry; None for an entry
    still being normalized (its content is not known yet)."""
    busy = {n.def_names.get(f) for f in n.in_progress}
    while isinstance(s, dict) and set(s) == {"$ref"}:
        name = s["$ref"].rsplit("/", 1)[-1]
        if name in busy or name not in n.defs:
            return None
        s = n.defs[name]
    return s


def _exactly_one_by_type(n: Normalizer, live: list):
    """oneOf whose branches are whole types plus pairwise-disjoint others: the types exactly one
    branch covers, and each other branch on types no whole-type branch covers. Two equal other
    branches always match together, so both drop. None when this does not decide it (a type
    covered once by a whole-type branch and also by another branch would need a negation; integers
    covered twice but other numbers once have no grammar)."""
    live = [_deref(n, b) for b in live]
    if any(b is None for b in live):
        return None
    pure, rest = [], []
    for b in live:
        t = _pure_types(n, b)
        (pure if t is not None else rest).append(t if t is not None else b)
    rest = [b for b in rest if sum(json_equal(b, c) for c in rest) == 1]
    if not _pairwise_disjoint(n, rest):
        return None
    count = {t: sum(t in p for p in pure) for t in _ALL_TYPES}
    if count["number"] == 1 and count["integer"] != 1:  # non-integral numbers only: no grammar
        return None
    out = []
    for b in rest:
        ts = types_of(n, b)
        if ts is None or any(count[t] == 1 for t in ts):
            return None
        if any(count[t] >= 2 for t in ts):
            if not all(count[t] >= 2 for t in ts):
                return None
            continue  # every value it admits matches two whole-type branches as well
        out.append(b)
    once = [t for t in _ALL_TYPES if count[t] == 1 and t not in ("integer", "number")]
    if count["integer"] == 1:
        once.append("number" if count["number"] == 1 else "integer")
    out += [{"type": t} for t in once]
    return out or [UNSAT]


def _pairwise_disjoint(n: Normalizer, schemas: list) -> bool:
    return all(
        disjoint(n, schemas[i], schemas[j]) for i in range(len(schemas)) for j in range(i + 1, len(schemas))
    )


def types_of(n: Normalizer, s) -> set | None:
    """Instance types a normalized schema can match (None: unknown / any)."""
    if not isinstance(s, dict):
        return None
    if "$ref" in s:
        return types_of(n, n.defs.get(s["$ref"].rsplit("/", 1)[-1]))
    if "enum" in s:
        return {type_name(v) for v in s["enum"]}
    if "anyOf" in s:
        out = set()
        for b in s["anyOf"]:
            t = types_of(n, b)
            if t is None:
                return None
            out |= t
        return out
    if "type" in s:
        return {"integer", "number"} if s["type"] == "number" else {s["type"]}
    return None


def disjoint(n: Normalizer, a, b) -> bool:
    """Provably no instance matches both normalized schemas (False: maybe some does)."""
    a, b = _deref(n, a) or a, _deref(n, b) or b
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    ta, tb = types_of(n, a), types_of(n, b)
    if (
        ta is not None
        and tb is not None
        and not (ta & tb)
        and not ({"integer", "number"} & ta and {"integer", "number"} & tb)
    ):
        return True
    if "enum" in a and "enum" in b:
        return not any(json_equal(x, y) for x in a["enum"] for y in b["enum"])
    if a.get("type") == "object" and b.get("type") == "object":
        pa, pb = a.get("properties", {}), b.get("properties", {})
        for k in set(a.get("required", [])) & set(b.get("required", [])):
            ea, eb = pa.get(k, {}), pb.get(k, {})
            if isinstance(ea, dict) and isinstance(eb, dict) and disjoint(n, ea, eb):
                return True
        for x, y in ((a, b), (b, a)):
            closed = y.get("additionalProperties") is False and not y.get("patternProperties")
            yp = y.get("properties", {})
            for k in x.get("required", []):
                if yp.get(k, None if closed else {}) in (None, False):  # y cannot have k
                    return True
    return False
