"""`$ref` and `allOf`: local references become `$defs` entries of the output (recursion allowed);
`allOf` (and `$ref` with sibling keywords) is merged into one schema, keyword by keyword.

Merging follows the meaning of each keyword (JSON Schema 2020-12 validation §6): bounds take the
tighter value, `required` the union, `type` the intersection (integer within number), `enum` the
common values, `multipleOf` the least common multiple, subschema-valued keywords nest as `allOf`; a property named on one side is checked
against the other side's `additionalProperties`, and likewise a `prefixItems` position against the
other side's `items`; `patternProperties` beside a closed object (`additionalProperties: false`, no
patterns) apply to its named properties only and fold into them. What cannot be merged raises UnsupportedSchemaError naming `allOf` (or the
keyword) and its pointer.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

from agentrt.grammars.json_schema.conditionals import conditionals_schema, take_conditional
from agentrt.grammars.json_schema.errors import UnsupportedSchemaError, ptr
from agentrt.grammars.json_schema.keywords import KNOWN, UNSAT
from agentrt.grammars.json_schema.values import json_equal
from agentrt.grammars.json_schema.walk import Walk

_MAX_MERGE_DEPTH = 32
_MAX_RECURSIVE_INLINES = 8
_DISJOINT = object()  # two values of one keyword that no instance satisfies together
_TIGHTER = {
    **dict.fromkeys(("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"), max),
    **dict.fromkeys(("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"), min),
}


def resolve(n: Walk, ref: str, pointer: str) -> tuple[str, Any]:
    """Local `$ref` ('#', '#/json/pointer') -> (fragment, target). Anything else is unsupported."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise UnsupportedSchemaError(
            "$ref", pointer, f"only local references ('#/...') are resolved, not {ref!r}"
        )
    frag = urllib.parse.unquote(ref[1:])
    if frag and not frag.startswith("/"):
        raise UnsupportedSchemaError("$ref", pointer, f"anchor references ({ref!r}) are not supported")
    target = n.root
    for part in frag.split("/")[1:] if frag else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        elif isinstance(target, dict) and part in target:
            target = target[part]
        else:
            raise UnsupportedSchemaError(
                "$ref", pointer, f"reference {ref!r} does not resolve in this schema"
            )
    return frag, target


def norm_ref(n: Walk, ref: str, pointer: str):
    """A bare `$ref`: its target normalized once into the output's `$defs` (a recursive reference
    meets the entry in progress), returned as a reference to it; UNSAT when the target is."""
    frag, target = resolve(n, ref, pointer)
    name = n.def_names.get(frag)
    if name is None:
        name = n.def_names[frag] = f"d{len(n.def_names)}"
        n.in_progress.add(frag)
        n.defs[name] = {}
        result = n.norm(target, "#" + frag)
        n.in_progress.discard(frag)
        if result is UNSAT:
            del n.defs[name]
            n.def_names[frag] = "__unsat__"
            return UNSAT
        n.defs[name] = result
    if name == "__unsat__":
        return UNSAT
    return {"$ref": f"#/$defs/{name}"}


def merge_all_of(n: Walk, s: dict, pointer: str):
    """`s` with its `allOf` (and any `$ref`) merged in, as one raw schema; UNSAT when the parts
    contradict each other."""
    n.rewrite("allOf", ptr(pointer, "allOf"))
    out = inline(n, s, pointer)
    return UNSAT if out is False else out


def inline(n: Walk, s, pointer: str, depth: int = 0):
    """A raw subschema with `$ref` and nested `allOf` expanded (refused on recursion); False when
    it admits nothing."""
    if s is True:
        return {}
    if s is False or not isinstance(s, dict):
        return s
    s = n.upgrade(dict(s), pointer)
    if depth > _MAX_MERGE_DEPTH:
        raise UnsupportedSchemaError("allOf", pointer, "allOf/$ref nesting is too deep to merge")
    if "$ref" in s:
        frag, target = resolve(n, s.pop("$ref"), ptr(pointer, "$ref"))
        # a target being inlined right now would inline itself forever; one being normalized
        # (an enclosing $defs entry) is inlined once more, within a budget (a recursive schema
        # merged with siblings unrolls one level per merge)
        if frag in n.inlining or (frag in n.in_progress and n.recursive_inlines >= _MAX_RECURSIVE_INLINES):
            raise UnsupportedSchemaError(
                "allOf", pointer, "merging a recursive $ref with sibling keywords is not supported"
            )
        if frag in n.in_progress:
            n.recursive_inlines += 1
        n.inlining.add(frag)
        try:
            target = inline(n, target, "#" + frag, depth + 1)
        finally:
            n.inlining.discard(frag)
        if target is False:
            return False
        s = {"allOf": [target, s]} if any(k in KNOWN for k in s) else target
    if isinstance(s, dict) and "allOf" in s:
        parts = s.pop("allOf")
        acc = s
        # conditionals of the parts are rewritten together (conditionals.py), then merged in
        conds = [c] if (c := take_conditional(acc, pointer)) else []
        for i, part in enumerate(parts):
            part = inline(n, part, ptr(pointer, "allOf", i), depth + 1)
            if part is False:
                return False
            if isinstance(part, dict) and (c := take_conditional(part, ptr(pointer, "allOf", i))):
                conds.append(c)
            acc = merge(acc, part, ptr(pointer, "allOf", i))
            if acc is False:
                return False
        if conds:
            try:
                cond = conditionals_schema(n, conds)
            except UnsupportedSchemaError as e:
                n.unsupported(e.keyword, e.pointer, e.reason)  # raises unless best-effort: dropped
                return acc
            return False if cond is False else merge(acc, cond, pointer)
        return acc
    return s


def merge(a: dict, b: dict, pointer: str):
    """The intersection of two raw schemas as one schema (no allOf/$ref inside a or b at top);
    False when their types are disjoint."""
    a, b = dict(a), dict(b)
    _refuse_unmergeable(a, b, pointer)
    out = {k: v for k, v in a.items() if k not in KNOWN}
    if "prefixItems" in a or "prefixItems" in b:
        out["prefixItems"] = _merged_prefix_items(a, b)
        a.pop("prefixItems", None)
        b.pop("prefixItems", None)
    if "properties" in a or "properties" in b:
        out["properties"] = _merged_properties(a, b)
    for x, y in ((a, b), (b, a)):
        if x.get("patternProperties") and _closed(y):
            # y admits only the names it lists: x's patterns apply to those names alone, so their
            # schemas fold into the named properties and the patterns themselves drop
            for k in y.get("properties", {}):
                hits = [v for p, v in x["patternProperties"].items() if _search(p, k)]
                if hits:
                    out["properties"][k] = {"allOf": [out["properties"][k], *hits]}
            x.pop("patternProperties")
    for x, y in ((a, b), (b, a)):
        # keys a pattern of x matches that y does not name get y's additionalProperties
        if x.get("patternProperties") and not json_equal(x["patternProperties"], y.get("patternProperties")):
            ap = y.get("additionalProperties")
            out["patternProperties"] = {
                p: ({"allOf": [v, ap]} if _restricts(ap) else v) for p, v in x["patternProperties"].items()
            }
            a.pop("patternProperties", None)
            b.pop("patternProperties", None)
    for k in list(a) + [k for k in b if k not in a]:  # a fixed order: the first conflict is reported
        if k not in KNOWN or k in ("properties", "prefixItems"):
            continue
        if k not in a or k not in b:
            out[k] = a[k] if k in a else b[k]
            continue
        value = _merged_value(k, a[k], b[k], pointer)
        if value is _DISJOINT:
            return False
        out[k] = value
    return out


def _refuse_unmergeable(a: dict, b: dict, pointer: str) -> None:
    # object keywords interact: a property of one side is "additional" to the other
    if (
        a.get("patternProperties")
        and b.get("patternProperties")
        and not json_equal(a["patternProperties"], b["patternProperties"])
    ):
        raise UnsupportedSchemaError(
            "allOf", pointer, "merging two different patternProperties in one allOf is not supported"
        )
    for x, y in ((a, b), (b, a)):
        if x.get("patternProperties") and _restricts(y.get("additionalProperties")) and not _closed(y):
            for k in y.get("properties", {}):
                if _matching(x, k):
                    raise UnsupportedSchemaError(
                        "allOf",
                        pointer,
                        f"property '{k}' matches a patternProperties pattern of another allOf branch "
                        "that has additionalProperties",
                    )
    for k in ("unevaluatedProperties", "unevaluatedItems"):
        if any(k in x and x[k] is not True and x[k] != {} for x in (a, b)):
            raise UnsupportedSchemaError(
                k, pointer, f"'{k}' combined with allOf/$ref/anyOf siblings is not supported"
            )


def _merged_prefix_items(a: dict, b: dict) -> list:
    """Position by position; a side's `items` also covers the other side's longer prefix."""
    n = max(len(a.get("prefixItems", [])), len(b.get("prefixItems", [])))

    def at(x, i):
        p = x.get("prefixItems", [])
        return p[i] if i < len(p) else x.get("items", True)

    return [{"allOf": [at(a, i), at(b, i)]} for i in range(n)]


def _restricts(ap) -> bool:
    return ap is not None and ap is not True and ap != {}


def _closed(side: dict) -> bool:
    """Does `side` admit only the property names it lists (additionalProperties false, no patterns)?"""
    return side.get("additionalProperties") is False and not side.get("patternProperties")


def _search(pattern: str, k: str) -> bool:
    try:
        return re.search(pattern, k) is not None
    except re.error:
        raise UnsupportedSchemaError("patternProperties", "", "a pattern Python cannot parse") from None


def _matching(side: dict, k: str) -> bool:
    """Does a patternProperties pattern of `side` match name `k` (then its additionalProperties
    does not apply to k)?"""
    return any(_search(p, k) for p in side.get("patternProperties") or {})


def _merged_properties(a: dict, b: dict) -> dict:
    """Every property either side names, with the other side's `additionalProperties` (when it
    restricts anything) where the other side does not name it."""
    pa, pb = a.get("properties", {}), b.get("properties", {})
    props = {}
    for k in list(pa) + [k for k in pb if k not in pa]:
        parts = []
        for side in (a, b):
            sp = side.get("properties", {})
            if k in sp:
                parts.append(sp[k])
            elif _restricts(side.get("additionalProperties")) and not _matching(side, k):
                parts.append(side["additionalProperties"])
        props[k] = parts[0] if len(parts) == 1 else {"allOf": parts}
    return props


def _merged_value(k: str, va, vb, pointer: str):
    """One keyword present on both sides, merged; _DISJOINT for disjoint types."""
    if json_equal(va, vb):
        return va
    if k == "type":
        ta = {va} if isinstance(va, str) else set(va)
        tb = {vb} if isinstance(vb, str) else set(vb)
        t = ta & tb
        if "integer" in ta and "number" in tb or "integer" in tb and "number" in ta:
            t.add("integer")
        return sorted(t) if t else _DISJOINT
    if k == "required":
        return list(dict.fromkeys(list(va) + list(vb)))
    if k in _TIGHTER:
        return _TIGHTER[k](va, vb)
    if k == "contains":  # two items may match one each: no single schema says both
        raise UnsupportedSchemaError("allOf", ptr(pointer, k), "two different 'contains' in one allOf")
    if k in ("additionalProperties", "items", "propertyNames"):
        return {"allOf": [va, vb]}
    if k == "not":
        return {"anyOf": [va, vb]}
    if k == "enum":
        return [v for v in va if any(json_equal(v, w) for w in vb)]
    if k == "uniqueItems":
        return va or vb
    if k == "multipleOf":  # the multiples of both are the multiples of their least common multiple
        from agentrt.grammars.json_schema.decimals import multiple_lcm

        m = multiple_lcm(va, vb)
        if m is None:
            raise UnsupportedSchemaError(
                "allOf",
                ptr(pointer, k),
                "the least common multiple of these multipleOf values has no exact float",
            )
        return m
    if k == "anyOf":
        return [{"allOf": [x, {k: vb}]} for x in va]
    if k == "oneOf":
        raise UnsupportedSchemaError("allOf", pointer, "two oneOf lists in one allOf are not supported")
    raise UnsupportedSchemaError(
        "allOf", ptr(pointer, k), f"two different '{k}' values in one allOf cannot be merged"
    )
