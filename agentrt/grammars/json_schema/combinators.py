"""`enum`/`const`, `anyOf` and `oneOf`.

- `enum`/`const`: the listed values are filtered by the rest of the subschema with `jsonschema`
  (so every sibling keyword holds) and deduplicated; scalars become one `enum`, objects and arrays
  exact schemas (`value_to_schema`).
- `anyOf`: each branch merged with the sibling keywords and normalized; unsatisfiable branches drop.
- `oneOf`: enforced as `anyOf` when its live branches are provably pairwise exclusive (disjoint
  types, disjoint enums, or a required property whose schemas are disjoint / that the other
  branch's closed object forbids); else, when the overlapping branches have complements
  (negation.py; within a closed-object branch i, the complement of branch j relative to i's names:
  `negation_within`), as the anyOf of "branch i and not each branch j that may overlap it" (at most
  MAX_ONE_OF_TERMS alternatives per term); otherwise refused: exactly-one has no grammar.
"""

from __future__ import annotations

from typing import Any

from agentrt.grammars.json_schema.errors import UnsupportedSchemaError, ptr
from agentrt.grammars.json_schema.keywords import KNOWN, UNSAT
from agentrt.grammars.json_schema.refs import inline, resolve
from agentrt.grammars.json_schema.values import json_equal, json_key, type_name, value_to_schema
from agentrt.grammars.json_schema.walk import Walk

MAX_ONE_OF_TERMS = 64
_MAX_RELAX_DEPTH = 4  # alternatives of one "branch and not the others" term


def norm_enum(n: Walk, s: dict, pointer: str):
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


def norm_alternatives(n: Walk, s: dict, pointer: str):
    """`anyOf` or `oneOf` (both present: the `oneOf` stays beside each `anyOf` branch)."""
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
        elif (exact := _exactly_one_by_type(n, live)) is not None or (
            exact := _exactly_one_by_negation(n, s[kw], base, branches, pointer)
        ) is not None:
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


def _exactly_one_by_negation(n: Walk, raw: list, base: dict, branches: list, pointer: str):
    """oneOf as the anyOf of "branch i and not branch j" for every j that may overlap branch i
    (negation.py), when each such branch has a complement and each term stays within
    MAX_ONE_OF_TERMS alternatives; the normalized terms, or None (refused by the caller)."""
    live = [i for i, b in enumerate(branches) if b is not UNSAT]
    negs: dict[int, Any] = {}
    terms = []
    for i in live:
        parts, size = [base, raw[i]], 1
        for j in live:
            if j == i or disjoint(n, branches[i], branches[j]):
                continue
            if j not in negs:
                negs[j] = n.negated(raw[j], ptr(pointer, "oneOf", j))
            neg = negs[j] if negs[j] is not None else negation_within(n, branches[i], branches[j])
            if neg is None:
                return None
            if neg is False:
                parts = None  # branch j matches all of branch i: branch i never matches alone
                break
            if neg is not True:
                size *= len(neg["anyOf"]) if set(neg) == {"anyOf"} else 1
                parts.append(neg)
        if parts is None:
            continue
        if size > MAX_ONE_OF_TERMS:
            return None
        terms.append((i, parts))
    out = []
    for i, parts in terms:
        bp = ptr(pointer, "oneOf", i)
        merged = inline(n, {"allOf": parts}, bp)
        nb = UNSAT if merged is False else n.norm(merged, bp)
        if nb is not UNSAT:
            out.append(nb)
    return out or [UNSAT]


def negation_within(n: Walk, a, b):
    """The instances of normalized schema `a` that fail normalized schema `b`, as a raw schema to
    merge with `a` (False: none), when `a` is a closed object (additionalProperties false, no
    patterns): within its names, `b` fails by a missing required name, a present name `b` closes
    out, or a shared name whose value fails `b`'s (negation.py). None when `b` has other object
    keywords, `a` is not closed, or a value has no complement."""
    from agentrt.grammars.json_schema.negation import negation

    a, b = _deref(n, a), _deref(n, b)
    if not (isinstance(a, dict) and isinstance(b, dict)) or a.get("type") != "object":
        return None
    if a.get("additionalProperties") is not False or a.get("patternProperties"):
        return None
    if b.get("type") != "object" or not set(b) <= {"type", "properties", "required", "additionalProperties"}:
        return None
    b_closed = b.get("additionalProperties") is False
    if not (b_closed or b.get("additionalProperties", {}) == {}):
        return None
    names_a = [k for k, v in a.get("properties", {}).items() if v is not False]
    pb = b.get("properties", {})
    alts = [{"type": "object", "properties": {r: False}} for r in b.get("required", [])]
    pa = a.get("properties", {})
    for k in names_a:
        if k not in pb:
            if b_closed:
                alts.append({"type": "object", "required": [k]})
            continue
        if json_equal(pa[k], pb[k]):  # a's value there always passes b's
            continue
        neg = negation(pb[k])
        if neg is None:
            return None
        if neg is not False:
            alts.append({"type": "object", "required": [k], "properties": {k: neg}})
    if not alts:
        return False
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


_ALL_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")


def _pure_types(n: Walk, s) -> set | None:
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


def _deref(n: Walk, s):
    """A normalized schema with bare `$ref`s followed to their `$defs` entry; None for an entry
    still being normalized (its content is not known yet)."""
    busy = {n.def_names.get(f) for f in n.in_progress}
    while isinstance(s, dict) and set(s) == {"$ref"}:
        name = s["$ref"].rsplit("/", 1)[-1]
        if name in busy or name not in n.defs:
            return None
        s = n.defs[name]
    return s


def _busy_def(n: Walk, s):
    """For a `$ref` to a `$defs` entry still being normalized (a recursive schema): a relaxation of
    its raw target (`_relaxed`), enough to prove disjointness; anything else unchanged."""
    if not (isinstance(s, dict) and set(s) == {"$ref"}):
        return s
    name = s["$ref"].rsplit("/", 1)[-1]
    frag = next((f for f, d in n.def_names.items() if d == name), None)
    if frag is None:
        return s
    try:
        return _relaxed(n, resolve(n, "#" + frag, "")[1], 0)
    except UnsupportedSchemaError:
        return {}


def _relaxed(n: Walk, s, depth: int):
    """A schema in the normalized vocabulary that admits every instance raw `s` admits (keywords
    left out only widen it): one `type`, `enum`/`const`, and for objects `required`, `properties`
    (relaxed) and a closed `additionalProperties`. `disjoint` of two relaxations implies disjoint
    originals."""
    if s is False:
        return {"enum": []}
    if not isinstance(s, dict) or depth > _MAX_RELAX_DEPTH:
        return {}
    s = n.upgrade(dict(s), "")
    if "$ref" in s:
        try:
            return _relaxed(n, resolve(n, s["$ref"], "")[1], depth + 1)
        except UnsupportedSchemaError:
            return {}
    if "const" in s:
        return {"enum": [s["const"]]}
    if isinstance(s.get("enum"), list):
        return {"enum": list(s["enum"])}
    if not isinstance(s.get("type"), str):
        return {}
    out: dict = {"type": s["type"]}
    if s["type"] == "object":
        if isinstance(s.get("required"), list):
            out["required"] = list(s["required"])
        if isinstance(s.get("properties"), dict):
            out["properties"] = {k: _relaxed(n, v, depth + 1) for k, v in s["properties"].items()}
        if s.get("additionalProperties") is False and not s.get("patternProperties"):
            out["additionalProperties"] = False
    return out


def _exactly_one_by_type(n: Walk, live: list):
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


def _pairwise_disjoint(n: Walk, schemas: list) -> bool:
    return all(
        disjoint(n, schemas[i], schemas[j]) for i in range(len(schemas)) for j in range(i + 1, len(schemas))
    )


def types_of(n: Walk, s) -> set | None:
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


def disjoint(n: Walk, a, b) -> bool:
    """Provably no instance matches both normalized schemas (False: maybe some does)."""
    a, b = _deref(n, a) or _busy_def(n, a), _deref(n, b) or _busy_def(n, b)
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
