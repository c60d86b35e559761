"""Arrays: `prefixItems`/`items` (draft-04 `items: [...]`/`additionalItems` already upgraded),
`minItems`/`maxItems`. An unsatisfiable position caps the length before it; `uniqueItems` (over
one item), `contains` and `unevaluatedItems` are refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrt.grammars.json_schema.errors import ptr
from agentrt.grammars.json_schema.keywords import UNSAT

if TYPE_CHECKING:
    from agentrt.grammars.json_schema.normalizer import Normalizer


def norm_array(n: Normalizer, s: dict, pointer: str):
    """The array branch of subschema `s`."""
    out: dict = {"type": "array"}
    lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
    hi = int(hi) if hi is not None else None
    lo, hi = n.count_bounds("minItems", lo, hi, pointer)
    lo = lo or 0
    if hi is not None and lo > hi:
        return UNSAT
    _refuse_unsupported(n, s, hi, pointer)
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
    return out


def _refuse_unsupported(n: Normalizer, s: dict, hi, pointer: str) -> None:
    if s.get("uniqueItems") is True and (hi is None or hi > 1):
        n.unsupported("uniqueItems", ptr(pointer, "uniqueItems"), "unique array items are not supported")
    if "contains" in s:
        n.unsupported("contains", ptr(pointer, "contains"), "'contains' is not supported")
    if "unevaluatedItems" in s:
        n.unsupported("unevaluatedItems", ptr(pointer, "unevaluatedItems"), "not supported")
