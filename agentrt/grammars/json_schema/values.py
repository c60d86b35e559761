"""JSON values as JSON Schema compares them (RFC 8259 numbers: 1 == 1.0, true != 1; object key
order ignored), the schema that admits exactly one value, and the values a normalized schema
allows as both the normalizer's keyword families and the emitter (nodes.py) read them: the
finitely many values of an array's items, a number's bounds as decimals.number_dfa's arguments."""

from __future__ import annotations

import json
from typing import Any


def is_int(x) -> bool:
    """An integral JSON number (1 and 1.0 alike; booleans are not numbers)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and float(x).is_integer()


def type_name(v) -> str:
    """The JSON Schema type of a value ("integer" for integral numbers)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "integer" if float(v).is_integer() else "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def json_equal(a, b) -> bool:
    """Equality as JSON Schema's `const`/`enum` define it."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def json_key(v) -> str:
    """A key equal for JSON-equal values (1 == 1.0, true != 1, object key order ignored)."""

    def norm(x):
        if isinstance(x, float) and x.is_integer():
            return int(x)
        if isinstance(x, list):
            return [norm(i) for i in x]
        if isinstance(x, dict):
            return {k: norm(i) for k, i in x.items()}
        return x

    return json.dumps(norm(v), sort_keys=True)


def value_to_schema(value: Any) -> dict:
    """A schema whose only instance is `value` (objects and arrays spelled out, so the backend
    renders them with its usual separators)."""
    if isinstance(value, dict):
        return {
            "type": "object",
            "properties": {k: value_to_schema(v) for k, v in value.items()},
            "required": list(value),
            "additionalProperties": False,
        }
    if isinstance(value, list):
        return {"type": "array", "prefixItems": [value_to_schema(v) for v in value], "items": False}
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return {"enum": [value]}


def unique_values(s: dict) -> list | None:
    """The values a normalized array schema's items may take when they are finitely many scalars
    (`enum` of scalars, `boolean`, `null`) and there is no `prefixItems`; else None."""
    items = s.get("items", {})
    if "prefixItems" in s or not isinstance(items, dict):
        return None
    if set(items) == {"enum"} and not any(isinstance(v, (dict, list)) for v in items["enum"]):
        return list(items["enum"])
    if items == {"type": "boolean"}:
        return [True, False]
    if items == {"type": "null"}:
        return [None]
    return None


def number_dfa_bounds(s: dict) -> dict:
    """decimals.number_dfa's bound arguments (minimum, maximum, exclusive_minimum, exclusive_maximum:
    those present) from a normalized number schema's bound keywords."""
    names = {
        "minimum": "minimum",
        "maximum": "maximum",
        "exclusiveMinimum": "exclusive_minimum",
        "exclusiveMaximum": "exclusive_maximum",
    }
    return {arg: s[k] for k, arg in names.items() if k in s}
