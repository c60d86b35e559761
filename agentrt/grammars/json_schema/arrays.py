"""Arrays: `prefixItems`/`items` (draft-04 `items: [...]`/`additionalItems` already upgraded),
`minItems`/`maxItems`. An unsatisfiable position caps the length before it. `uniqueItems` holds
trivially over at most one item, and is kept (for nodes.py's grammar: one rule per set of values
used so far) when the items are finitely many scalars (an enum, booleans, null) whose sets of
distinct values number at most MAX_UNIQUE_SETS; otherwise it is refused. `contains` (and
`minContains`) is kept with the items schema merged in, for nodes.py's counting grammar;
`maxContains` below the length bound and `unevaluatedItems` are refused."""

from __future__ import annotations

import math

from agentrt.grammars.json_schema.errors import ptr
from agentrt.grammars.json_schema.keywords import UNSAT
from agentrt.grammars.json_schema.values import json_equal, unique_values
from agentrt.grammars.json_schema.walk import Walk

UNIQUE_STRINGS = "x-agentrt-unique-strings"
"""Output marker of an array of distinct free strings (value: the `uniqueItems` pointer). Not a
grammar keyword: grammars/unique_items.py builds the matcher's check from it and strips it."""
MAX_UNIQUE_SETS = 1024  # rules of the unique-items grammar: one per set of values used so far
MAX_CONTAINS_RULES = 256  # rules of the contains grammar: (items so far, matches so far)


def norm_array(n: Walk, s: dict, pointer: str):
    """The array branch of subschema `s`."""
    out: dict = {"type": "array"}
    lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
    hi = int(hi) if hi is not None else None
    lo, hi = n.count_bounds("minItems", lo, hi, pointer)
    lo = lo or 0
    if hi is not None and lo > hi:
        return UNSAT
    _refuse_unsupported(n, s, pointer)
    prefix = []
    for i, p in enumerate(s.get("prefixItems", [])):
        item = n.norm(p, ptr(pointer, "prefixItems", i))
        if item is UNSAT:  # no array reaches past this position
            hi = i if hi is None else min(hi, i)
            break
        prefix.append(item)
    if prefix:
        out["prefixItems"] = prefix
    items = s.get("items", True)
    n_items = n.norm(items, ptr(pointer, "items")) if "items" in s else {}
    if n_items is UNSAT:
        hi = len(prefix) if hi is None else min(hi, len(prefix))
    if hi is not None and hi <= len(prefix):
        out["prefixItems"] = prefix[:hi]
        if not out["prefixItems"]:
            out.pop("prefixItems")
        out["items"] = False
        if lo > hi:
            return UNSAT
    elif n_items != {}:
        out["items"] = n_items
    if lo:
        out["minItems"] = lo
    if hi is not None and out.get("items") is not False:
        out["maxItems"] = hi
    if "contains" in s:
        if s.get("uniqueItems") is True and (hi is None or hi > 1):
            n.unsupported(
                "contains", ptr(pointer, "contains"), "'contains' beside uniqueItems is not supported"
            )
        else:
            return _contains(n, s, out, pointer)
    if s.get("uniqueItems") is True and (hi is None or hi > 1):
        return _unique(n, out, pointer)
    return out


def _contains(n: Walk, s: dict, out: dict, pointer: str):
    """`contains` (with `minContains` k, default 1): at least k items match the items schema and
    `contains` together (their merge, normalized, kept as the output's `contains`); nodes.py counts
    them (rules: item count x matches, at most MAX_CONTAINS_RULES). `maxContains` below the
    array's length bound and `contains` beside `prefixItems` are refused."""
    from agentrt.grammars.json_schema.refs import inline

    where = ptr(pointer, "contains")
    k = s.get("minContains", 1)
    k = int(k) if isinstance(k, (int, float)) and not isinstance(k, bool) else 1
    lo, hi = out.get("minItems", 0), out.get("maxItems")
    m = s.get("maxContains")
    if m is not None and m < k:
        return UNSAT
    if m is not None and (hi is None or m < hi):
        n.unsupported("maxContains", ptr(pointer, "maxContains"), "'maxContains' is not supported")
    if k == 0:
        return out
    if out.get("items") is False or (hi is not None and hi < k):
        return UNSAT
    if "prefixItems" in out:
        n.unsupported("contains", where, "'contains' beside prefixItems is not supported")
        return out
    cap = hi if hi is not None else max(lo, k)
    if (cap + 1) * (k + 1) > MAX_CONTAINS_RULES:
        n.unsupported("contains", where, f"counting {k} matches among {cap} items is over the bound")
        return out
    merged = inline(n, {"allOf": [s.get("items", True), s["contains"]]}, where)
    both = UNSAT if merged is False else n.norm(merged, where)
    if both is UNSAT:
        return UNSAT
    if json_equal(both, out.get("items", {})):  # every item matches: k items suffice
        return {**out, "minItems": max(lo, k)}
    n.rewrite("contains", where)
    kept = {**out, "contains": both}
    if k > 1:
        kept["minContains"] = k
    return kept


def _unique(n: Walk, out: dict, pointer: str):
    """`uniqueItems` over more than one item: kept when every item is one of a few scalars (nodes.py
    enumerates the sets of values used); over free strings (items exactly `{"type": "string"}`,
    no prefixItems) marked with UNIQUE_STRINGS (its value: the keyword's pointer) for the matcher's
    check (grammars/unique_items.py), when `n.unique_strings`; else refused. UNSAT when minItems
    exceeds the values."""
    values = unique_values(out)
    where = ptr(pointer, "uniqueItems")
    if (
        values is None
        and n.unique_strings
        and out.get("items") == {"type": "string"}
        and "prefixItems" not in out
    ):
        n.rewrite("uniqueItems", where)
        return {**out, UNIQUE_STRINGS: where}
    if values is None:
        why = "an enum of scalars or free strings" if n.unique_strings else "an enum of scalars"
        n.unsupported("uniqueItems", where, f"unique array items are supported over {why} only")
        return out
    lo, hi = out.get("minItems", 0), min(out.get("maxItems", len(values)), len(values))
    if lo > hi:
        return UNSAT
    sets = sum(math.comb(len(values), k) for k in range(hi + 1))
    if sets > MAX_UNIQUE_SETS:
        n.unsupported(
            "uniqueItems",
            where,
            f"{len(values)} distinct item values make {sets} sets of values, over {MAX_UNIQUE_SETS}",
        )
        return out
    kept = {**out, "uniqueItems": True}
    if hi < out.get("maxItems", hi + 1):
        kept["maxItems"] = hi
    return kept


def _refuse_unsupported(n: Walk, s: dict, pointer: str) -> None:
    if "unevaluatedItems" in s:
        n.unsupported("unevaluatedItems", ptr(pointer, "unevaluatedItems"), "not supported")
