"""The canonical text of a JSON value under a normalized schema: what the compiled grammar prints."""

from __future__ import annotations

import json
import re
from typing import Any


def canonical_json(value: Any, schema: dict) -> str:
    """`value` serialized the way the grammar compiled from `schema` (a `normalize_schema` output)
    prints it: ", " and ": " separators, literal UTF-8, integral numbers without a fraction, object
    keys in the order of the matching subschema's `properties` (then the others in their order).
    Used to feed instances through a matcher; the text parses back to an equal value."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)

    def sub(s):
        while isinstance(s, dict) and "$ref" in s:
            s = schema["$defs"][s["$ref"].rsplit("/", 1)[-1]]
        if isinstance(s, dict) and "anyOf" in s:
            for b in s["anyOf"]:
                if validator.evolve(schema={**b, "$defs": schema.get("$defs", {})}).is_valid(value_of[0]):
                    return sub(b)
        return s if isinstance(s, dict) else {}

    value_of = [None]

    def dump(v, s) -> str:
        value_of[0] = v
        s = sub(s)
        if isinstance(v, dict):
            props = s.get("properties", {})
            keys = [k for k in props if k in v] + [k for k in v if k not in props]
            inner = []
            for k in keys:
                child = props.get(k)
                if child is None:
                    pp = s.get("patternProperties", {})
                    hits = [sub for pat, sub in pp.items() if re.search(pat, k)]
                    child = hits[0] if hits else s.get("additionalProperties", {})
                inner.append(json.dumps(k, ensure_ascii=False) + ": " + dump(v[k], child))
            return "{" + ", ".join(inner) + "}"
        if isinstance(v, list):
            prefix = s.get("prefixItems", [])
            items = s.get("items", {})
            return (
                "["
                + ", ".join(dump(x, prefix[i] if i < len(prefix) else items) for i, x in enumerate(v))
                + "]"
            )
        if isinstance(v, float) and v.is_integer() and abs(v) < 1e16:
            return str(int(v))
        return json.dumps(v, ensure_ascii=False)

    return dump(value, schema)
