"""Objects: `properties`, `required`, `additionalProperties`, `patternProperties`,
`propertyNames`, `minProperties`/`maxProperties`, `dependentRequired`/`dependentSchemas`,
`unevaluatedProperties`.

Rewrites (each sound: the output admits only instances of the input):
- a `required` name missing from `properties` gets the `additionalProperties` schema;
- a `patternProperties` pattern every name matches applies to every property: merged into each
  named one and used as `additionalProperties`;
- one other pattern is kept only on a closed object when it matches no named property;
- `propertyNames` holds by construction on a closed object whose names all satisfy it;
- `minProperties`/`maxProperties` are dropped when the closed shape implies them;
- `dependentRequired` on a closed object (at most 4 entries) becomes one `anyOf` branch per
  choice of which trigger properties appear;
- `unevaluatedProperties: false` without `additionalProperties` closes the object.
Anything else is refused naming the keyword (UnsupportedSchemaError or, best-effort, reported).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentrt.grammars.json_schema.errors import UnsupportedSchemaError, ptr
from agentrt.grammars.json_schema.keywords import UNSAT
from agentrt.grammars.regex import as_fullmatch, has_unsupported_feature, matches_every_key, unconvertible

if TYPE_CHECKING:
    from agentrt.grammars.json_schema.normalizer import Normalizer

_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f]')
_MAX_DEPENDENT_REQUIRED = 4  # 2^4 branches


@dataclass
class _Shape:
    """An object subschema on its way out: `props` (normalized named properties), `required`
    names, `ap` (the normalized additionalProperties schema; UNSAT: no additional property),
    `patterns` (patternProperties not yet handled), `out_pp` (the one pattern kept)."""

    required: list[str]
    ap: Any
    patterns: dict
    props: dict = field(default_factory=dict)
    out_pp: dict = field(default_factory=dict)


def norm_object(n: Normalizer, s: dict, pointer: str):
    """The object branch of subschema `s`."""
    ap_raw = s.get("additionalProperties")
    if ap_raw is None:
        ap = UNSAT if n.close_objects else {}
    else:
        ap = n.norm(ap_raw, ptr(pointer, "additionalProperties"))
    shape = _Shape(list(dict.fromkeys(s.get("required", []))), ap, dict(s.get("patternProperties") or {}))
    _check_names(s, shape.required, pointer)
    if not _named_properties(n, s, shape, pointer) or not _universal_patterns(n, s, shape, pointer):
        return UNSAT
    _one_pattern(n, shape, pointer)
    if not _fill_required(n, shape, pointer):
        return UNSAT
    closed = shape.ap is UNSAT and not shape.out_pp
    dep_required = _dependencies(n, s, shape, closed, pointer)
    _unevaluated(n, s, ap_raw is None, shape, pointer)
    _property_names(n, s, shape, pointer)
    out: dict = {"type": "object"}
    if not _property_counts(n, s, shape, closed, out, pointer):
        return UNSAT
    out["properties"] = shape.props
    if shape.required:
        out["required"] = [k for k in shape.required if k in shape.props]
    if shape.out_pp:
        out["patternProperties"] = shape.out_pp
    out["additionalProperties"] = False if shape.ap is UNSAT else shape.ap
    if not dep_required:
        return out
    return _dependent_branches(n, out, dep_required, pointer)


def _check_names(s: dict, required: list[str], pointer: str) -> None:
    for k in list(s.get("properties", {})) + required:
        if _NEEDS_ESCAPE.search(k):
            raise UnsupportedSchemaError(
                "properties",
                ptr(pointer, "properties", k),
                "property names with quotes, backslashes or control characters are not supported",
            )


def _named_properties(n: Normalizer, s: dict, shape: _Shape, pointer: str) -> bool:
    """Normalize `properties` into shape.props; False when a required one admits nothing."""
    for k, v in s.get("properties", {}).items():
        prop = n.norm(v, ptr(pointer, "properties", k))
        if prop is UNSAT:
            if k in shape.required:
                return False
            if shape.ap is not UNSAT:
                n.unsupported(
                    "properties",
                    ptr(pointer, "properties", k),
                    "a forbidden property on an open object is not supported",
                )
            continue
        shape.props[k] = prop
    return True


def _universal_patterns(n: Normalizer, s: dict, shape: _Shape, pointer: str) -> bool:
    """Patterns every key matches: their schema holds for every property, additionalProperties
    never applies. False when a required property no longer admits anything."""
    named = s.get("properties", {})
    for pat in [p for p in shape.patterns if matches_every_key(p, strict=shape.ap is UNSAT)]:
        sub = shape.patterns.pop(pat)
        n.rewrite("patternProperties", ptr(pointer, "patternProperties", pat))
        every = n.norm(sub, ptr(pointer, "patternProperties", pat))
        for k in list(shape.props):
            merged = n.norm({"allOf": [named.get(k, True), sub]}, ptr(pointer, "properties", k))
            if merged is UNSAT:
                if k in shape.required:
                    return False
                del shape.props[k]
            else:
                shape.props[k] = merged
        shape.ap = every
    return True


def _one_pattern(n: Normalizer, shape: _Shape, pointer: str) -> None:
    """The remaining patternProperties: one pattern on a closed object that matches no named
    property is enforced; anything else is refused."""
    if not shape.patterns:
        return
    pat, sub = next(iter(shape.patterns.items()))
    if (
        len(shape.patterns) == 1
        and shape.ap is UNSAT
        and _matches_no_name(pat, list(shape.props) + shape.required)
    ):
        schema = n.norm(sub, ptr(pointer, "patternProperties", pat))
        if schema is not UNSAT:
            shape.out_pp = {as_fullmatch(pat): schema}
    else:
        n.unsupported(
            "patternProperties",
            ptr(pointer, "patternProperties"),
            "supported only as one pattern on a closed object "
            "(additionalProperties: false) that matches no named property, or as a "
            "pattern every name matches",
        )


def _matches_no_name(pat: str, names: list[str]) -> bool:
    """`pat` has a grammar and an ECMA search for it matches none of `names`."""
    if has_unsupported_feature(pat):
        return False
    full = as_fullmatch(pat)
    if full is None or unconvertible(full):
        return False
    try:
        return not any(re.search(pat, k) for k in names)
    except re.error:
        return False


def _fill_required(n: Normalizer, shape: _Shape, pointer: str) -> bool:
    """Required names missing from `properties` get the additionalProperties schema; False when
    the object is closed to them."""
    for k in shape.required:
        if k not in shape.props:
            if shape.ap is UNSAT:
                if shape.out_pp:
                    n.unsupported(
                        "required", ptr(pointer, "required"), f"required '{k}' must be a named property"
                    )
                    continue
                return False
            shape.props[k] = shape.ap
            n.rewrite("required", ptr(pointer, "required"))
    return True


def _dependencies(n: Normalizer, s: dict, shape: _Shape, closed: bool, pointer: str) -> dict:
    """The `dependentRequired` entries that can apply (enforced later by branching); refuses
    `dependentSchemas` and what branching cannot express."""
    dep_required = {
        k: list(v) for k, v in (s.get("dependentRequired") or {}).items() if k in shape.props or not closed
    }
    if s.get("dependentSchemas") and any(k in shape.props or not closed for k in s["dependentSchemas"]):
        n.unsupported(
            "dependentSchemas", ptr(pointer, "dependentSchemas"), "schema dependencies are not supported"
        )
    if dep_required and (not closed or len(dep_required) > _MAX_DEPENDENT_REQUIRED):
        n.unsupported(
            "dependentRequired",
            ptr(pointer, "dependentRequired"),
            "supported on closed objects (additionalProperties: false), at most 4 entries",
        )
        return {}
    return dep_required


def _unevaluated(n: Normalizer, s: dict, ap_absent: bool, shape: _Shape, pointer: str) -> None:
    if "unevaluatedProperties" not in s:
        return
    up = s["unevaluatedProperties"]
    if up is False and ap_absent and not shape.patterns:
        shape.ap = UNSAT
        n.rewrite("unevaluatedProperties", ptr(pointer, "unevaluatedProperties"))
    elif up is not True and up != {}:
        n.unsupported("unevaluatedProperties", ptr(pointer, "unevaluatedProperties"), "not supported")


def _property_names(n: Normalizer, s: dict, shape: _Shape, pointer: str) -> None:
    if "propertyNames" not in s:
        return
    sub = n.validator.evolve(schema=s["propertyNames"])
    if shape.ap is UNSAT and all(sub.is_valid(k) for k in shape.props):
        n.rewrite("propertyNames", ptr(pointer, "propertyNames"))
        if shape.out_pp:
            n.unsupported(
                "propertyNames",
                ptr(pointer, "propertyNames"),
                "propertyNames beside patternProperties is not supported",
            )
    else:
        n.unsupported(
            "propertyNames",
            ptr(pointer, "propertyNames"),
            "supported only on closed objects whose named properties all satisfy it",
        )


def _property_counts(n: Normalizer, s: dict, shape: _Shape, closed: bool, out: dict, pointer: str) -> bool:
    """minProperties/maxProperties into `out` unless the shape implies them; False when none fits."""
    n_req = len(shape.required)
    lo, hi = s.get("minProperties"), s.get("maxProperties")
    if lo is not None and int(lo) > n_req:
        if closed and int(lo) > len(shape.props):
            return False
        if not closed:  # the grammar may repeat an additional key, which counts once when parsed
            n.unsupported(
                "minProperties",
                ptr(pointer, "minProperties"),
                "minProperties beyond the required properties is supported on closed objects only",
            )
        else:
            out["minProperties"] = int(lo)
    if hi is not None:
        if int(hi) < n_req:
            return False
        if not (closed and int(hi) >= len(shape.props)):
            out["maxProperties"] = int(hi)
    return True


def _dependent_branches(n: Normalizer, out: dict, dep_required: dict, pointer: str):
    """dependentRequired on a closed object: one branch per choice of which trigger properties
    appear (absent: dropped from properties; present: required with its dependents)."""
    n.rewrite("dependentRequired", ptr(pointer, "dependentRequired"))
    branches = []
    for mask in range(1 << len(dep_required)):
        b = copy.deepcopy(out)
        req = list(b.get("required", []))
        ok = True
        for bit, (k, deps) in enumerate(dep_required.items()):
            if mask >> bit & 1:
                if any(d not in b["properties"] for d in [k, *deps]):
                    ok = False
                req += [k, *deps]
            elif k in req:
                ok = False
            else:
                b["properties"].pop(k, None)
        if ok:
            req = list(dict.fromkeys(req))
            b["required"] = [k for k in b["properties"] if k in req]
            branches.append(b)
    if not branches:
        return UNSAT
    return branches[0] if len(branches) == 1 else {"anyOf": branches}
