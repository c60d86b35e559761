"""Objects: `properties`, `required`, `additionalProperties`, `patternProperties`,
`propertyNames`, `minProperties`/`maxProperties`, `dependentRequired`/`dependentSchemas`,
`unevaluatedProperties`.

Rewrites (each exact unless said otherwise; the output is a JSON Schema equivalent to the input,
in the subset the grammar enforces: xgrammar's converter, or our own object grammar in nodes.py):
- a named property gets the schemas of the patterns its name matches (allOf), and of
  `propertyNames`' verdict on the name: a name that no value may take becomes `"k": false`
  (forbidden; `required` then makes the object unsatisfiable);
- a `required` name missing from `properties` gets the schemas of the patterns it matches, or the
  `additionalProperties` schema;
- a `patternProperties` pattern every name matches applies to every property: merged into each
  named one and used as `additionalProperties`; the other patterns stay, with exact key languages
  (automata.py): patterns whose keys overlap must have the same schema (or `{}`), else refused;
- `propertyNames` holds by construction for named properties and is kept for the others when it is
  a string pattern, a length range or an enum (else refused);
- `minProperties`/`maxProperties` are dropped when the shape implies them; on an object that admits
  other keys, `maxProperties` is kept (our grammar counts members) and `minProperties` is kept up to
  1 (refused above: a repeated key counts once when parsed, so a member count cannot bound it);
- `dependentRequired`/`dependentSchemas` (at most 4 trigger names) become one `anyOf` branch per
  choice of which trigger names appear (absent: `"k": false`; present: required, with its
  dependents or its schema);
- `unevaluatedProperties` on a schema without in-place applicators (they are merged before this;
  `allOf`/`$ref` with it are refused in refs.py) is `additionalProperties` when that is absent, a
  no-op otherwise.
Anything else is refused naming the keyword (UnsupportedSchemaError or, best-effort, reported).
"""

from __future__ import annotations

import re
from typing import Any

from agentrt.grammars.json_schema.automata import AutomatonError, alphabet, build
from agentrt.grammars.json_schema.errors import UnsupportedSchemaError, ptr
from agentrt.grammars.json_schema.keywords import UNSAT
from agentrt.grammars.json_schema.nodes import key_components
from agentrt.grammars.json_schema.refs import inline
from agentrt.grammars.json_schema.walk import Walk
from agentrt.grammars.regex import matches_every_key

_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f]')
MAX_DEPENDENCIES = 4  # 2^4 anyOf branches


def norm_object(n: Walk, s: dict, pointer: str):
    """The object branch of subschema `s`."""
    if s.get("dependentRequired") or s.get("dependentSchemas"):
        return _dependencies(n, s, pointer)
    ap_raw = s.get("additionalProperties")
    if ap_raw is None and "unevaluatedProperties" in s:
        ap_raw = s["unevaluatedProperties"]  # no in-place applicator evaluated anything else
        n.rewrite("unevaluatedProperties", ptr(pointer, "unevaluatedProperties"))
    if ap_raw is None:
        ap = UNSAT if n.close_objects else {}
    else:
        ap = n.norm(ap_raw, ptr(pointer, "additionalProperties"))
    required = list(dict.fromkeys(s.get("required", [])))
    _check_names(s, required, pointer)
    patterns = _checked_patterns(n, s, pointer)
    universal = [p for p in patterns if matches_every_key(p, strict=ap is UNSAT)]
    if universal:  # they apply to every property: additionalProperties never does
        n.rewrite("patternProperties", ptr(pointer, "patternProperties"))
        where = ptr(pointer, "patternProperties", *universal[:1]) if len(universal) == 1 else pointer
        ap = _all_of(n, [patterns[p] for p in universal], where)
    pn_ok = _names_check(n, s)
    props: dict[str, Any] = {}
    for k in list(s.get("properties", {})) + [k for k in required if k not in s.get("properties", {})]:
        prop = _named(n, s, k, patterns, ap, pointer) if pn_ok(k) else UNSAT
        if prop is UNSAT:
            if k in required:
                return UNSAT
            props[k] = False
        else:
            props[k] = prop
    out_pp = {}
    for p, sub in patterns.items():
        if p not in universal:
            v = _all_of(n, [sub] + [patterns[u] for u in universal], ptr(pointer, "patternProperties", p))
            out_pp[p] = False if v is UNSAT else v
    out: dict = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    if out_pp:
        out["patternProperties"] = out_pp
    out["additionalProperties"] = False if ap is UNSAT else ap
    if "propertyNames" in s and (out_pp or ap is not UNSAT):
        _property_names(n, s, out, pointer)
    if out.get("patternProperties"):
        _check_overlaps(n, out, pointer)
    others = bool(out.get("patternProperties")) or out["additionalProperties"] is not False
    if not others:  # closed: a forbidden name cannot appear anyway
        out["properties"] = {k: v for k, v in props.items() if v is not False}
    if not _property_counts(n, s, required, others, out, pointer):
        return UNSAT
    return out


def _check_names(s: dict, required: list[str], pointer: str) -> None:
    for k in list(s.get("properties", {})) + required:
        if _NEEDS_ESCAPE.search(k):
            raise UnsupportedSchemaError(
                "properties",
                ptr(pointer, "properties", k),
                "property names with quotes, backslashes or control characters are not supported",
            )


def _checked_patterns(n: Walk, s: dict, pointer: str) -> dict:
    """`patternProperties` whose patterns have automata (the others refused, or dropped under
    best-effort)."""
    out = {}
    for p, sub in (s.get("patternProperties") or {}).items():
        try:
            build([("search", p)], alphabet((p,)))
        except AutomatonError as e:
            n.unsupported("patternProperties", ptr(pointer, "patternProperties", p), str(e))
            continue
        out[p] = sub
    return out


def _all_of(n: Walk, parts: list, pointer: str):
    """The normalized intersection of raw schemas `parts`."""
    if len(parts) == 1:
        return n.norm(parts[0], pointer)
    merged = inline(n, {"allOf": parts}, pointer)
    return UNSAT if merged is False else n.norm(merged, pointer)


def _names_check(n: Walk, s: dict):
    """name -> may a property have this name (`propertyNames`)?"""
    if "propertyNames" not in s:
        return lambda k: True
    v = n.validator.evolve(schema=s["propertyNames"])
    return v.is_valid


def _named(n: Walk, s: dict, k: str, patterns: dict, ap, pointer: str):
    """The normalized schema of property `k`: its own (or additionalProperties') with the schemas of
    the patterns its name matches."""
    parts = [re_sub for p, re_sub in patterns.items() if re.search(p, k)]
    own = s.get("properties", {})
    p_ptr = ptr(pointer, "properties", k)
    if k in own:
        parts.insert(0, own[k])
    elif not parts:
        if k in s.get("required", []) and k not in own:
            n.rewrite("required", ptr(pointer, "required"))
        return ap  # already normalized (UNSAT when closed)
    if len(parts) > 1:
        n.rewrite("patternProperties", ptr(pointer, "patternProperties"))
    return _all_of(n, parts, p_ptr)


def _property_names(n: Walk, s: dict, out: dict, pointer: str) -> None:
    """Keep `propertyNames` (normalized to its string part) for the keys outside `properties`."""
    where = ptr(pointer, "propertyNames")
    pn = n.norm(s["propertyNames"], where)
    if pn is UNSAT:  # no name is allowed: only the named properties that passed remain possible
        out.pop("patternProperties", None)
        out["additionalProperties"] = False
        return
    while isinstance(pn, dict) and set(pn) == {"$ref"}:  # a finished $defs entry: its schema
        name = pn["$ref"].rsplit("/", 1)[-1]
        if name not in n.defs or name in {n.def_names.get(f) for f in n.in_progress}:
            break
        pn = n.defs[name]
    pn = _string_part(pn)
    if pn == {}:
        return
    try:
        if pn is UNSAT:
            raise ValueError("no string")
        comps = key_components(pn)
        build(comps, alphabet(tuple(r for kind, r in comps if kind in ("regex", "search"))))
    except (ValueError, AutomatonError) as e:
        n.unsupported(
            "propertyNames", where, f"propertyNames must be a string pattern, length range or enum ({e})"
        )
        return
    n.rewrite("propertyNames", where)
    out["propertyNames"] = pn


def _string_part(pn):
    """The part of a normalized schema that applies to strings (keys): {} (all), UNSAT (none),
    or one string / enum schema; anything else is returned as is (refused by the caller)."""
    branches = pn["anyOf"] if "anyOf" in pn and len(pn) == 1 else [pn]
    keep = []
    for b in branches:
        if "enum" in b:
            words = [v for v in b["enum"] if isinstance(v, str)]
            if words:
                keep.append({"enum": words})
        elif b.get("type") == "string" or b == {}:
            keep.append(b)
        elif "type" not in b:
            return pn
    if not keep:
        return UNSAT
    if any(b == {} or b == {"type": "string"} for b in keep):
        return {}
    return keep[0] if len(keep) == 1 else {"anyOf": keep}


def _check_overlaps(n: Walk, out: dict, pointer: str) -> None:
    """Refuse patterns whose key languages overlap (outside the named properties) with different
    schemas: the overlap would need both at once."""
    pats = list(out["patternProperties"].items())
    for i in range(len(pats)):
        for j in range(i + 1, len(pats)):
            (pi, vi), (pj, vj) = pats[i], pats[j]
            if vi == vj or vi == {} or vj == {}:
                continue
            try:
                dfa = build(
                    [("search", pi), ("search", pj), ("words", list(out["properties"]))], alphabet((pi, pj))
                )
            except AutomatonError as e:
                n.unsupported("patternProperties", ptr(pointer, "patternProperties"), str(e))
                return
            if any({0, 1} <= lab and 2 not in lab for lab in dfa.labels):
                n.unsupported(
                    "patternProperties",
                    ptr(pointer, "patternProperties", pj),
                    f"names matching both {pi!r} and {pj!r} would need both schemas at once",
                )
                out["patternProperties"].pop(pj, None)


def _property_counts(n: Walk, s: dict, required: list, others: bool, out: dict, pointer: str) -> bool:
    """minProperties/maxProperties into `out` unless the shape implies them; False when none fits."""
    n_req = len(required)
    named = [k for k, v in out["properties"].items() if v is not False]
    lo, hi = s.get("minProperties"), s.get("maxProperties")
    if lo is not None and int(lo) > n_req:
        if not others and int(lo) > len(named):
            return False
        if others and int(lo) > 1:  # the grammar may repeat an additional key, which counts once when parsed
            n.unsupported(
                "minProperties",
                ptr(pointer, "minProperties"),
                "minProperties over 1 (beyond the required properties) is supported on closed objects only",
            )
        else:
            out["minProperties"] = int(lo)
    if hi is not None:
        if int(hi) < n_req:
            return False
        if others or int(hi) < len(named):
            out["maxProperties"] = int(hi)
    return True


def _dependencies(n: Walk, s: dict, pointer: str):
    """dependentRequired / dependentSchemas: one branch per choice of which trigger names appear."""
    dr = dict(s.get("dependentRequired") or {})
    ds = dict(s.get("dependentSchemas") or {})
    base = {k: v for k, v in s.items() if k not in ("dependentRequired", "dependentSchemas", "type")}
    base["type"] = "object"
    triggers = list(dict.fromkeys(list(dr) + list(ds)))
    kw = "dependentRequired" if dr else "dependentSchemas"
    if len(triggers) > MAX_DEPENDENCIES:
        n.unsupported(kw, ptr(pointer, kw), f"at most {MAX_DEPENDENCIES} trigger properties are supported")
        return n.norm(base, pointer)
    for k in dr:
        n.rewrite("dependentRequired", ptr(pointer, "dependentRequired", k))
    for k in ds:
        n.rewrite("dependentSchemas", ptr(pointer, "dependentSchemas", k))
    branches = []
    for mask in range(1 << len(triggers)):
        parts = [base]
        for bit, k in enumerate(triggers):
            if mask >> bit & 1:
                parts.append({"required": [k, *dr.get(k, [])]})
                if k in ds:
                    parts.append(ds[k])
            else:
                parts.append({"properties": {k: False}})
        merged = inline(n, {"allOf": parts}, pointer)
        b = UNSAT if merged is False else n.norm(merged, pointer)
        if b is not UNSAT:
            branches.append(b)
    if not branches:
        return UNSAT
    return branches[0] if len(branches) == 1 else {"anyOf": branches}
