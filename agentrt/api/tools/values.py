"""Argument values written as text (XML parameters, Python keyword arguments) -> JSON values, typed
by the tool's parameter schema, as vLLM's qwen3coder / glm45 / pythonic parsers do: a value the
schema types as a string is the raw text; one of another type is read as JSON (or as a Python
literal: `True`, `None`, `{'a': 1}`, which a template rendering `| string` writes)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

_INT = re.compile(r"[+-]?[0-9]+")
_ALL = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})


def property_schema(schema: dict | None, key: str) -> dict | None:
    """The schema of property `key` of a tool's parameters (None: not declared, and the object
    declares no schema for other properties)."""
    if not isinstance(schema, dict):
        return None
    props = schema.get("properties")
    if isinstance(props, dict) and key in props:
        return props[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) and not props else None


def types_of(schema: Any, root: dict | None, depth: int = 0) -> frozenset[str]:
    """The JSON types `schema` admits (every type when it does not say)."""
    if not isinstance(schema, dict) or depth > 32:
        return _ALL
    ref = schema.get("$ref")
    if isinstance(ref, str) and root is not None:
        target = _resolve(ref, root)
        if target is not None:
            return types_of(target, root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out: set[str] = set()
            for branch in schema[key]:
                out |= types_of(branch, root, depth + 1)
            return frozenset(out)
    if "const" in schema:
        return frozenset({_type(schema["const"])})
    if isinstance(schema.get("enum"), list):
        return frozenset(_type(v) for v in schema["enum"])
    t = schema.get("type")
    if isinstance(t, str):
        return frozenset({t})
    if isinstance(t, list):
        return frozenset(x for x in t if isinstance(x, str))
    return _ALL


def _resolve(ref: str, root: dict) -> Any:
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if v is None:
        return "null"
    return "object" if isinstance(v, dict) else "array"


def _fits(v: Any, types: frozenset[str]) -> bool:
    t = _type(v)
    return t in types or (t == "integer" and "number" in types)


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


def literal(text: str) -> tuple[bool, Any]:
    """(ok, value): `text` read as strict JSON, else as a Python literal that is strict JSON data:
    not ok for NaN / Infinity (and numbers that overflow to them) and for strings with a lone
    surrogate (arguments must be JSON that encodes as UTF-8), so the caller keeps such text as is."""
    try:
        value = json.loads(text, parse_constant=_not_json)
    except (ValueError, RecursionError):
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return False, None
    try:
        json.dumps(value, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (ValueError, TypeError, RecursionError):  # UnicodeEncodeError is a ValueError
        return False, None
    return True, value


def typed_value(text: str, schema: Any, root: dict | None) -> Any:
    """The JSON value of a raw parameter value `text` under its property `schema` (None: an
    undeclared property, kept as text)."""
    if schema is None:
        return text
    types = types_of(schema, root)
    if types - {"string"}:
        ok, value = literal(text)
        if not ok and "integer" in types and _INT.fullmatch(text.strip()):
            ok, value = True, int(text.strip())  # 007, as vLLM's int()
        if ok and _fits(value, types) and not isinstance(value, str):
            return value
    if "string" in types:
        return text
    ok, value = literal(text)
    return value if ok else text
