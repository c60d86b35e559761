"""Faithful JSON Schema: rewrite a user's schema into the subset the grammar backend enforces
exactly, and refuse (or, best-effort, report) every keyword it would silently drop.

Why: xgrammar compiles any schema, but ignores keywords it does not implement (`not`, `if`,
`contains`, `uniqueItems`, `multipleOf`, `maxLength` beside `pattern` or `format`, type-specific
keywords on an untyped schema, `$ref` siblings, ...), so "constrained" output can violate the
schema. Measured on the JSON-Schema-Test-Suite (draft 2020-12): raw xgrammar accepts 300+ invalid
instances; after this pass none (tests/grammars/test_json_schema_suite.py).

The pass walks the schema once (`normalize_schema`). Each keyword is
- enforced by the grammar: emitted unchanged in the subset below;
- enforced by a rewrite: untyped keywords split per type (`{"maxLength": 2}` becomes
  "a string of at most 2 characters, or any non-string"); `allOf` merged into one schema;
  `$ref` siblings merged with the target; `enum`/`const` filtered by the whole subschema with
  `jsonschema` (so every other keyword beside an enum holds); `oneOf` turned into `anyOf` when its
  branches are provably exclusive; `required` names missing from `properties` added with the
  `additionalProperties` schema; unanchored `pattern` made a search (`.*(?:p).*`); `pattern` with
  `minLength`/`maxLength` intersected when the pattern is one repeated character class
  (`^[a-z]+$` + maxLength 3 -> `^[a-z]{1,3}$`); `format: ipv4` as an exact pattern; draft-04/07
  forms (`exclusiveMinimum: true`, `items: [...]`/`additionalItems`, `definitions`) mapped to 2020-12;
  `propertyNames`/`minProperties`/`maxProperties` dropped when the schema already implies them;
- an annotation (`title`, `description`, `default`, `examples`, unknown keywords, formats no
  validator asserts such as `int64`): ignored, as the spec says;
- unsupported: `UnsupportedSchemaError` naming the keyword and its JSON pointer, unless
  `best_effort=True`, which drops it and lists it in `NormalizedSchema.not_enforced`.

Output subset (all xgrammar enforces exactly, checked by the test suite): every subschema has one
`type` (or is `anyOf`, `enum`, `$ref` into the output's `$defs`, or `{}`); objects with
`properties`/`required`/`additionalProperties`/`minProperties`/`maxProperties` and at most one
`patternProperties` pattern on a closed object; arrays with `prefixItems`/`items`/`minItems`/
`maxItems`; strings with `minLength`/`maxLength` or `pattern` or `format`; numbers with bounds.
"""

from __future__ import annotations

import copy
import json
import math
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from agentrt.grammars.regex import (
    as_fullmatch,
    bound_repetition,
    has_unsupported_feature,
    matches_every_key,
    unconvertible,
    width_within,
)

TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
# formats xgrammar's JSON-schema converter enforces (probed one by one against jsonschema's checkers)
GRAMMAR_FORMATS = frozenset({
    "email", "uri", "uuid", "ipv6", "duration", "uri-reference",
    "json-pointer", "uri-template", "relative-json-pointer"})
# formats jsonschema's FormatChecker asserts that the grammar does not: refused (unless best-effort)
CHECKED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
IPV4_PATTERN = rf"^{_OCTET}(?:\.{_OCTET}){{3}}$"
# RFC 3339 dates/times as exact patterns: xgrammar's date-time admits 1990-02-31. February stops at
# 28 and seconds at 59 (leap days and leap seconds are valid but left out: narrower, never wrong).
# Year 0000 is left out too: Python's date (and jsonschema's format checker) starts at year 1; seen
# when the length-safe policy closed a date-time with zeros.
_DATE = (r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
         r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
# RFC 1123 hostnames: labels of 1-63 letters, digits and inner hyphens, at most 253 characters in
# all (jsonschema's checker; xgrammar's hostname admitted 64-character labels). The total is kept by
# a narrower shape, sound and compact: a first label up to 63 and at most 9 more of up to 20
# (63 + 9 * 21 = 252), an optional trailing dot.
def _label(n: int) -> str:
    return f"[A-Za-z0-9](?:[A-Za-z0-9-]{{0,{n - 2}}}[A-Za-z0-9])?"


HOSTNAME_PATTERN = rf"^{_label(63)}(?:\.{_label(20)}){{0,9}}\.?$"
FORMAT_PATTERNS = {"ipv4": IPV4_PATTERN, "date": f"^{_DATE}$", "time": f"^{_TIME}$",
                   "date-time": f"^{_DATE}T{_TIME}$", "hostname": HOSTNAME_PATTERN}
FORMAT_LENGTHS = {"ipv4": (7, 15), "date": (10, 10), "time": (9, 29), "date-time": (20, 40), "hostname": (1, 253)}

STRING_KW = ("minLength", "maxLength", "pattern", "format")
NUMBER_KW = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
ARRAY_KW = ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains",
            "minContains", "maxContains", "unevaluatedItems")
OBJECT_KW = ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
             "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "dependencies",
             "unevaluatedProperties")
KNOWN = frozenset(STRING_KW + NUMBER_KW + ARRAY_KW + OBJECT_KW) | {
    "type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
    "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor"}
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f]')


class UnsupportedSchemaError(ValueError):
    """A keyword the runtime cannot enforce. `keyword` and `pointer` (RFC 6901) name it."""

    def __init__(self, keyword: str, pointer: str, reason: str):
        self.keyword, self.pointer, self.reason = keyword, pointer or "/", reason
        super().__init__(f"JSON Schema keyword '{keyword}' at {pointer or '/'} cannot be enforced: {reason}")


class UnsatisfiableSchemaError(ValueError):
    def __init__(self, pointer: str, reason: str):
        super().__init__(f"JSON Schema at {pointer or '/'} admits no value: {reason}")


@dataclass
class NormalizedSchema:
    """`schema`: the rewritten schema (JSON-serializable, 2020-12, in the enforced subset);
    `not_enforced`: "keyword at pointer" strings dropped under best-effort (empty otherwise);
    `rewritten`: "keyword at pointer" strings enforced by a rewrite rather than as written."""

    schema: dict
    not_enforced: list[str] = field(default_factory=list)
    rewritten: list[str] = field(default_factory=list)


_UNSAT = None  # a subschema no value satisfies


def _ptr(base: str, *parts) -> str:
    return base + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _is_int(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and float(x).is_integer()


def value_to_schema(value: Any) -> dict:
    """A schema whose only instance is `value` (objects and arrays spelled out, so the backend
    renders them with its usual separators)."""
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: value_to_schema(v) for k, v in value.items()},
                "required": list(value), "additionalProperties": False}
    if isinstance(value, list):
        return {"type": "array", "prefixItems": [value_to_schema(v) for v in value], "items": False}
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return {"enum": [value]}


class _Normalizer:
    def __init__(self, root, best_effort: bool, close_objects: bool):
        import jsonschema
        from jsonschema.validators import validator_for

        self.root = root
        self.best_effort = best_effort
        self.close_objects = close_objects
        cls = validator_for(root, default=jsonschema.Draft202012Validator) if isinstance(root, dict) else \
            jsonschema.Draft202012Validator
        # formats are assertions here, whatever the draft (draft-04's checker lacks `date`, ...)
        self.validator = cls(root, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        self.defs: dict[str, Any] = {}
        self.def_names: dict[str, str] = {}
        self.in_progress: set[str] = set()
        self.first_unsat: tuple[str, str] | None = None  # (pointer, its keywords) for the error
        self.not_enforced: list[str] = []
        self.rewritten: list[str] = []

    # ---- bookkeeping -------------------------------------------------------------------------
    def unsupported(self, keyword: str, pointer: str, reason: str) -> None:
        if not self.best_effort:
            raise UnsupportedSchemaError(keyword, pointer, reason)
        self.not_enforced.append(f"{keyword} at {pointer or '/'}")

    def rewrite(self, keyword: str, pointer: str) -> None:
        self.rewritten.append(f"{keyword} at {pointer or '/'}")

    def resolve(self, ref: str, pointer: str) -> tuple[str, Any]:
        """Local `$ref` ('#', '#/json/pointer') -> (fragment, target). Anything else is unsupported."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise UnsupportedSchemaError("$ref", pointer, f"only local references ('#/...') are resolved, "
                                         f"not {ref!r}")
        frag = urllib.parse.unquote(ref[1:])
        if frag and not frag.startswith("/"):
            raise UnsupportedSchemaError("$ref", pointer, f"anchor references ({ref!r}) are not supported")
        target = self.root
        for part in frag.split("/")[1:] if frag else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            elif isinstance(target, dict) and part in target:
                target = target[part]
            else:
                raise UnsupportedSchemaError("$ref", pointer, f"reference {ref!r} does not resolve in this schema")
        return frag, target

    # ---- entry points ------------------------------------------------------------------------
    def run(self) -> dict:
        out = self.norm(self.root, "")
        if out is _UNSAT:
            where, kws = self.first_unsat or ("", "")
            raise UnsatisfiableSchemaError(where, f"the subschema there ({kws}) rejects every instance")
        if self.defs:
            if "$ref" in out and len(out) == 1:
                out = {"anyOf": [out]}
            out = {**out, "$defs": {k: (v if v is not _UNSAT else {"enum": []}) for k, v in self.defs.items()}}
        return out

    def norm_ref(self, ref: str, pointer: str):
        frag, target = self.resolve(ref, pointer)
        name = self.def_names.get(frag)
        if name is None:
            name = self.def_names[frag] = f"d{len(self.def_names)}"
            self.in_progress.add(frag)
            self.defs[name] = {}
            result = self.norm(target, "#" + frag)
            self.in_progress.discard(frag)
            if result is _UNSAT:
                del self.defs[name]
                self.def_names[frag] = "__unsat__"
                return _UNSAT
            self.defs[name] = result
        if name == "__unsat__":
            return _UNSAT
        return {"$ref": f"#/$defs/{name}"}

    # ---- the walk ----------------------------------------------------------------------------
    def norm(self, s, pointer: str):
        """The normalized subschema, or _UNSAT; the first subschema found unsatisfiable is kept for
        the error message (deepest first: the walk returns bottom-up)."""
        out = self._norm(s, pointer)
        if out is _UNSAT and self.first_unsat is None:
            kws = sorted(k for k in s if k in KNOWN) if isinstance(s, dict) else []
            self.first_unsat = (pointer, ", ".join(kws) or json.dumps(s))
        return out

    def _norm(self, s, pointer: str):
        if s is True or s == {}:
            return {}
        if s is False:
            return _UNSAT
        if not isinstance(s, dict):
            raise UnsupportedSchemaError("(schema)", pointer, "a subschema must be an object or a boolean")
        s = self.upgrade(dict(s), pointer)
        for kw in NUMBER_KW + ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
            v = s.get(kw)
            if isinstance(v, float) and not math.isfinite(v):
                raise UnsupportedSchemaError(kw, _ptr(pointer, kw), "must be a finite number")
        for kw in ("$dynamicRef", "$recursiveRef"):
            if kw in s:
                self.unsupported(kw, _ptr(pointer, kw), "dynamic references are not supported")
                s.pop(kw)
        assertions = {k for k in s if k in KNOWN}
        if "$ref" in s:
            if assertions == {"$ref"}:
                return self.norm_ref(s["$ref"], _ptr(pointer, "$ref"))
            rest = {k: v for k, v in s.items() if k != "$ref"}
            self.rewrite("$ref", _ptr(pointer, "$ref"))
            return self.norm({"allOf": [{"$ref": s["$ref"]}, rest]}, pointer)
        if "enum" in s or "const" in s:
            return self.norm_enum(s, pointer)
        if "allOf" in s:
            s = self.merge_all_of(s, pointer)
            if s is _UNSAT:
                return _UNSAT
            if "$ref" in s or "allOf" in s:
                return self.norm(s, pointer)
            if "enum" in s or "const" in s:
                return self.norm_enum(s, pointer)
        for kw in ("not",):
            if kw in s:
                self.unsupported(kw, _ptr(pointer, kw), "negation cannot be expressed as a grammar")
                s.pop(kw)
        if "if" in s:
            if "then" in s or "else" in s or "unevaluatedProperties" in s or "unevaluatedItems" in s:
                self.unsupported("if", _ptr(pointer, "if"), "conditional subschemas are not supported")
            s.pop("if")
        s.pop("then", None)
        s.pop("else", None)
        if "anyOf" in s or "oneOf" in s:
            return self.norm_alternatives(s, pointer)
        return self.norm_typed(s, pointer)

    def upgrade(self, s: dict, pointer: str) -> dict:
        """Draft-04/06/07 spellings -> 2020-12."""
        for ex, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(s.get(ex), bool):
                if s[ex] and bound in s:
                    s[ex] = s.pop(bound)
                else:
                    s.pop(ex)
        if isinstance(s.get("items"), list):
            s["prefixItems"] = s.pop("items")
            if "additionalItems" in s:
                s["items"] = s.pop("additionalItems")
        else:
            s.pop("additionalItems", None)  # ignored in 2020-12 when items is not an array
        if "dependencies" in s:
            deps = s.pop("dependencies")
            req = {k: v for k, v in deps.items() if isinstance(v, list)}
            sch = {k: v for k, v in deps.items() if not isinstance(v, list)}
            if req:
                s["dependentRequired"] = req
            if sch:
                s["dependentSchemas"] = sch
        return s

    def norm_enum(self, s: dict, pointer: str):
        values = [s["const"]] if "const" in s else list(s["enum"])
        others = [k for k in s if k in KNOWN and k not in ("enum", "const")]
        # validate against the rest of the schema (membership is given) and dedup by a canonical
        # key: both were quadratic (a 10k-value enum took 29 s)
        source = "const" if "const" in s else "enum"
        sub = self.validator.evolve(schema={k: v for k, v in s.items() if k != source})
        kept, seen = [], set()
        for v in values:
            key = _json_key(v)
            if key not in seen and sub.is_valid(v):
                seen.add(key)
                kept.append(v)
        if others:
            self.rewrite("enum" if "enum" in s else "const", pointer)
        if not kept:
            return _UNSAT
        scalars = [int(v) if isinstance(v, float) and v.is_integer() else v for v in kept
                   if not isinstance(v, (dict, list))]
        alts = ([{"enum": scalars}] if scalars else []) + [value_to_schema(v) for v in kept
                                                            if isinstance(v, (dict, list))]
        return alts[0] if len(alts) == 1 else {"anyOf": alts}

    # ---- allOf -------------------------------------------------------------------------------
    def inline(self, s, pointer: str, depth: int = 0):
        """A raw subschema with `$ref` and nested `allOf` expanded (refused on recursion)."""
        if s is True:
            return {}
        if s is False or not isinstance(s, dict):
            return s
        s = self.upgrade(dict(s), pointer)
        if depth > 32:
            raise UnsupportedSchemaError("allOf", pointer, "allOf/$ref nesting is too deep to merge")
        if "$ref" in s:
            frag, target = self.resolve(s.pop("$ref"), _ptr(pointer, "$ref"))
            if frag in self.in_progress:
                raise UnsupportedSchemaError("allOf", pointer, "merging a recursive $ref with sibling keywords "
                                             "is not supported")
            self.in_progress.add(frag)
            try:
                target = self.inline(target, "#" + frag, depth + 1)
            finally:
                self.in_progress.discard(frag)
            if target is False:
                return False
            s = {"allOf": [target, s]} if any(k in KNOWN for k in s) else target
        if isinstance(s, dict) and "allOf" in s:
            parts = s.pop("allOf")
            acc = s
            for i, part in enumerate(parts):
                part = self.inline(part, _ptr(pointer, "allOf", i), depth + 1)
                if part is False:
                    return False
                acc = self.merge(acc, part, _ptr(pointer, "allOf", i))
                if acc is False:
                    return False
            return acc
        return s

    def merge_all_of(self, s: dict, pointer: str):
        self.rewrite("allOf", _ptr(pointer, "allOf"))
        out = self.inline(s, pointer)
        return _UNSAT if out is False else out

    def merge(self, a: dict, b: dict, pointer: str):
        """The intersection of two raw schemas as one schema (no allOf/$ref inside a or b at top)."""
        a, b = dict(a), dict(b)
        out = {k: v for k, v in a.items() if k not in KNOWN}
        # object keywords interact: a property of one side is "additional" to the other
        for x, y in ((a, b), (b, a)):
            if "patternProperties" in x and ("properties" in y or "additionalProperties" in y):
                raise UnsupportedSchemaError("allOf", pointer, "merging patternProperties across allOf branches "
                                             "is not supported")
        for k in ("unevaluatedProperties", "unevaluatedItems"):
            if any(k in x and x[k] is not True and x[k] != {} for x in (a, b)):
                raise UnsupportedSchemaError(k, pointer, f"'{k}' combined with allOf/$ref/anyOf siblings is not "
                                             "supported")
        if "prefixItems" in a or "prefixItems" in b:  # a side's `items` also covers the other's prefix
            n = max(len(a.get("prefixItems", [])), len(b.get("prefixItems", [])))

            def at(x, i):
                p = x.get("prefixItems", [])
                return p[i] if i < len(p) else x.get("items", True)

            out["prefixItems"] = [{"allOf": [at(a, i), at(b, i)]} for i in range(n)]
            a.pop("prefixItems", None)
            b.pop("prefixItems", None)
        pa, pb = a.get("properties", {}), b.get("properties", {})
        if "properties" in a or "properties" in b:
            props = {}
            for k in list(pa) + [k for k in pb if k not in pa]:
                parts = []
                for side, other in ((a, b), (b, a)):
                    sp = side.get("properties", {})
                    if k in sp:
                        parts.append(sp[k])
                    elif "additionalProperties" in side and side["additionalProperties"] is not True:
                        parts.append(side["additionalProperties"])
                props[k] = parts[0] if len(parts) == 1 else {"allOf": parts}
            out["properties"] = props
        for k in set(a) | set(b):
            if k not in KNOWN or k in ("properties", "prefixItems"):
                continue
            if k not in a or k not in b:
                out[k] = a[k] if k in a else b[k]
                continue
            va, vb = a[k], b[k]
            if _json_equal(va, vb):
                out[k] = va
            elif k == "type":
                ta = {va} if isinstance(va, str) else set(va)
                tb = {vb} if isinstance(vb, str) else set(vb)
                t = ta & tb
                if "integer" in ta and "number" in tb or "integer" in tb and "number" in ta:
                    t.add("integer")
                if not t:
                    return False
                out[k] = sorted(t)
            elif k == "required":
                out[k] = list(dict.fromkeys(list(va) + list(vb)))
            elif k in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
                out[k] = max(va, vb)
            elif k in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
                out[k] = min(va, vb)
            elif k in ("additionalProperties", "items", "propertyNames", "contains", "not"):
                out[k] = {"allOf": [va, vb]} if k != "not" else {"anyOf": [va, vb]}
            elif k == "enum":
                out[k] = [v for v in va if any(_json_equal(v, w) for w in vb)]
            elif k in ("uniqueItems",):
                out[k] = va or vb
            elif k == "anyOf" or k == "oneOf":
                out[k] = [{"allOf": [x, {k: vb}]} for x in va] if k == "anyOf" else None
                if out[k] is None:
                    raise UnsupportedSchemaError("allOf", pointer, "two oneOf lists in one allOf are not supported")
            else:
                raise UnsupportedSchemaError("allOf", _ptr(pointer, k),
                                             f"two different '{k}' values in one allOf cannot be merged")
        return out

    # ---- anyOf / oneOf -----------------------------------------------------------------------
    def norm_alternatives(self, s: dict, pointer: str):
        if "anyOf" in s and "oneOf" in s:
            s = dict(s)
            one = s.pop("oneOf")
            self.rewrite("oneOf", _ptr(pointer, "oneOf"))
            s["allOf"] = [{"oneOf": one}]
            return self.norm(s, pointer)
        kw = "anyOf" if "anyOf" in s else "oneOf"
        base = {k: v for k, v in s.items() if k != kw}
        branches = []
        for i, b in enumerate(s[kw]):
            bp = _ptr(pointer, kw, i)
            if any(k in KNOWN for k in base):
                merged = self.inline({"allOf": [base, b]}, bp)
                nb = _UNSAT if merged is False else self.norm(merged, bp)
            else:
                nb = self.norm(b, bp)
            branches.append(nb)
        live = [b for b in branches if b is not _UNSAT]
        if kw == "oneOf" and len(live) > 1:
            for i in range(len(live)):
                for j in range(i + 1, len(live)):
                    if not self.disjoint(live[i], live[j]):
                        self.unsupported("oneOf", _ptr(pointer, "oneOf"),
                                         "its branches are not provably exclusive (exactly-one cannot be "
                                         "enforced); use anyOf if any branch may match")
                        break
                else:
                    continue
                break
            else:
                self.rewrite("oneOf", _ptr(pointer, "oneOf"))
        if not live:
            return _UNSAT
        return live[0] if len(live) == 1 else {"anyOf": live}

    def types_of(self, s) -> set | None:
        """Instance types a normalized schema can match (None: unknown / any)."""
        if not isinstance(s, dict):
            return None
        if "$ref" in s:
            return self.types_of(self.defs.get(s["$ref"].rsplit("/", 1)[-1]))
        if "enum" in s:
            return {_type_name(v) for v in s["enum"]}
        if "anyOf" in s:
            out = set()
            for b in s["anyOf"]:
                t = self.types_of(b)
                if t is None:
                    return None
                out |= t
            return out
        if "type" in s:
            return {"integer", "number"} if s["type"] == "number" else {s["type"]}
        return None

    def disjoint(self, a, b) -> bool:
        ta, tb = self.types_of(a), self.types_of(b)
        if ta is not None and tb is not None and not (ta & tb) and not ({"integer", "number"} & ta and
                                                                        {"integer", "number"} & tb):
            return True
        if "enum" in a and "enum" in b:
            return not any(_json_equal(x, y) for x in a["enum"] for y in b["enum"])
        if a.get("type") == "object" and b.get("type") == "object":
            pa, pb = a.get("properties", {}), b.get("properties", {})
            for k in set(a.get("required", [])) & set(b.get("required", [])):
                ea, eb = pa.get(k, {}), pb.get(k, {})
                if self.disjoint(ea, eb):
                    return True
            for x, y in ((a, b), (b, a)):
                closed = y.get("additionalProperties") is False and "patternProperties" not in y
                if closed and any(k not in y.get("properties", {}) for k in x.get("required", [])):
                    return True
        return False

    # ---- typed -------------------------------------------------------------------------------
    def norm_typed(self, s: dict, pointer: str):
        t = s.get("type")
        types = list(TYPES) if t is None else ([t] if isinstance(t, str) else list(t))
        if "number" in types and "integer" in types:
            types.remove("integer")
        specific = [k for k in s if k in KNOWN and k != "type"]
        if t is None and not specific:
            return {}
        if t is None or len(types) > 1:
            self.rewrite("type", pointer)
        branches = []
        for ty in types:
            b = getattr(self, f"norm_{ty}")(s, pointer)
            if b is not _UNSAT:
                branches.append(b)
        # keywords that apply to no listed type are no-ops
        if not branches:
            return _UNSAT
        return branches[0] if len(branches) == 1 else {"anyOf": branches}

    def norm_null(self, s, pointer):
        return {"type": "null"}

    def norm_boolean(self, s, pointer):
        return {"type": "boolean"}

    def count_bounds(self, min_kw: str, lo, hi, pointer):
        """minLength/minItems over 2^31 - 1 are refused (the backend's counters are 32-bit); a
        maximum that large is dropped: no output within a context window reaches it."""
        if lo is not None and lo > _INT32_MAX:
            self.unsupported(min_kw, _ptr(pointer, min_kw), f"{min_kw} over {_INT32_MAX} is not supported")
            lo = None
        if hi is not None and hi > _INT32_MAX:
            hi = None
        return lo, hi

    def norm_integer(self, s, pointer):
        return self.norm_number(s, pointer, integer=True)

    def norm_number(self, s, pointer, integer: bool = False):
        out = {"type": "integer" if integer else "number"}
        lo, lo_x = s.get("minimum"), s.get("exclusiveMinimum")
        hi, hi_x = s.get("maximum"), s.get("exclusiveMaximum")
        if integer:
            bounds = []
            if lo is not None:
                bounds.append(math.ceil(lo))
            if lo_x is not None:
                bounds.append(math.floor(lo_x) + 1)
            if bounds:
                out["minimum"] = max(bounds)
            bounds = []
            if hi is not None:
                bounds.append(math.floor(hi))
            if hi_x is not None:
                bounds.append(math.ceil(hi_x) - 1)
            if bounds:
                out["maximum"] = min(bounds)
            if "minimum" in out and "maximum" in out and out["minimum"] > out["maximum"]:
                return _UNSAT
            # the backend's integer ranges are 64-bit: a wider bound is clamped (stricter), a range
            # wholly outside is refused
            if out.get("minimum", 0) > _INT64_MAX or out.get("maximum", 0) < _INT64_MIN:
                kw = "minimum" if out.get("minimum", 0) > _INT64_MAX else "maximum"
                self.unsupported(kw, _ptr(pointer, kw), "integer bounds beyond 64 bits are not supported")
                out.pop("minimum", None)
                out.pop("maximum", None)
            if out.get("minimum", 0) < _INT64_MIN:
                out["minimum"] = _INT64_MIN
            if out.get("maximum", 0) > _INT64_MAX:
                out["maximum"] = _INT64_MAX
        else:
            for k in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
                if k in s:
                    v = s[k]
                    if not _is_int(v) and abs(v - round(v, 6)) > 1e-12:
                        # the backend's decimal range grammar loses such bounds (measured: a range
                        # of width 1e-9 admitted an empty value)
                        self.unsupported(k, _ptr(pointer, k), "number bounds with more than 6 decimals are "
                                         "not supported")
                        continue
                    out[k] = int(v) if _is_int(v) else v
            lo_b = max((out[k] for k in ("minimum", "exclusiveMinimum") if k in out), default=None)
            hi_b = min((out[k] for k in ("maximum", "exclusiveMaximum") if k in out), default=None)
            if lo_b is not None and hi_b is not None:
                if lo_b > hi_b or (lo_b == hi_b and ("exclusiveMinimum" in out or "exclusiveMaximum" in out)):
                    return _UNSAT
                if hi_b - lo_b < 1e-6 and lo_b != hi_b:
                    self.unsupported("maximum", pointer, "a number range narrower than 1e-6 is not supported")
        if "multipleOf" in s:
            m = s["multipleOf"]
            if integer and _is_int(m) and int(m) == 1:
                pass
            elif not integer and _is_int(m) and int(m) == 1:
                out["type"] = "integer"
                self.rewrite("multipleOf", _ptr(pointer, "multipleOf"))
                return self.norm_number({**s, "multipleOf": 1}, pointer, integer=True)
            else:
                self.unsupported("multipleOf", _ptr(pointer, "multipleOf"), "multiples other than 1 are not "
                                 "supported")
        return out

    def norm_string(self, s, pointer):
        out = {"type": "string"}
        lo, hi = s.get("minLength"), s.get("maxLength")
        lo, hi = self.count_bounds("minLength", lo, hi, pointer)
        lo = int(lo) if lo is not None else None
        hi = int(hi) if hi is not None else None
        if lo is not None and hi is not None and lo > hi:
            return _UNSAT
        fmt = s.get("format")
        pattern = s.get("pattern")
        if fmt in FORMAT_PATTERNS:
            self.rewrite("format", _ptr(pointer, "format"))
            if pattern is not None:
                self.unsupported("pattern", _ptr(pointer, "pattern"), "pattern beside format is not supported")
            flo, fhi = FORMAT_LENGTHS[fmt]
            if (lo or 0) > fhi or (hi is not None and hi < flo):
                return _UNSAT
            if (lo or 0) > flo or (hi is not None and hi < fhi):
                kw = "minLength" if (lo or 0) > flo else "maxLength"
                self.unsupported(kw, _ptr(pointer, kw), f"'{kw}' beside format '{fmt}' is not supported")
            return {"type": "string", "pattern": FORMAT_PATTERNS[fmt][1:-1]}
        if fmt is not None and fmt not in GRAMMAR_FORMATS:
            if fmt in CHECKED_FORMATS:
                self.unsupported("format", _ptr(pointer, "format"), f"format '{fmt}' is not supported")
            fmt = None  # an annotation
        if fmt is not None:
            if pattern is not None or lo or hi is not None:
                kw = "pattern" if pattern is not None else ("minLength" if lo else "maxLength")
                self.unsupported(kw, _ptr(pointer, kw), f"'{kw}' beside format '{fmt}' is not supported")
                return {"type": "string", "format": fmt}
            out["format"] = fmt
            return out
        if pattern is not None:
            if "\\\\" in pattern:
                # the backend matches patterns against the raw JSON text, where a backslash starts an
                # escape: measured, the pattern a-backslash-n-b admitted the JSON string "a\\nb" (a newline)
                self.unsupported("pattern", _ptr(pointer, "pattern"), "a literal backslash in a pattern is not "
                                 "supported")
                pattern = None
            elif has_unsupported_feature(pattern):
                self.unsupported("pattern", _ptr(pointer, "pattern"),
                                 "lookaround, backreferences, \\b and \\p{...} are not supported")
                pattern = None
            else:
                full = as_fullmatch(pattern)
                if full is None:
                    self.unsupported("pattern", _ptr(pointer, "pattern"), "anchors (^, $) inside the pattern are "
                                     "not supported")
                    return out
                why = unconvertible(full)
                if why:
                    self.unsupported("pattern", _ptr(pointer, "pattern"), why)
                    return out
                if full != pattern:
                    self.rewrite("pattern", _ptr(pointer, "pattern"))
                if lo or hi is not None:
                    bounded = bound_repetition(full, lo or 0, hi)
                    if bounded == "":
                        return _UNSAT
                    if bounded is None and width_within(full, lo or 0, hi):
                        bounded = full  # every match already has an allowed length
                    if bounded is None:
                        kw = "maxLength" if hi is not None else "minLength"
                        self.unsupported(kw, _ptr(pointer, kw), f"'{kw}' beside a pattern that is not one "
                                         "repeated character class is not supported")
                        out["pattern"] = full
                        return out
                    self.rewrite("pattern", _ptr(pointer, "pattern"))
                    full = bounded
                    lo = hi = None
                out["pattern"] = full
                return out
        if lo:
            out["minLength"] = lo
        if hi is not None:
            out["maxLength"] = hi
        return out

    def norm_array(self, s, pointer):
        out: dict = {"type": "array"}
        lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
        hi = int(hi) if hi is not None else None
        lo, hi = self.count_bounds("minItems", lo, hi, pointer)
        lo = lo or 0
        if hi is not None and lo > hi:
            return _UNSAT
        if s.get("uniqueItems") is True and (hi is None or hi > 1):
            self.unsupported("uniqueItems", _ptr(pointer, "uniqueItems"), "unique array items are not supported")
        if "contains" in s:
            self.unsupported("contains", _ptr(pointer, "contains"), "'contains' is not supported")
        if "unevaluatedItems" in s:
            self.unsupported("unevaluatedItems", _ptr(pointer, "unevaluatedItems"), "not supported")
        prefix = []
        for i, p in enumerate(s.get("prefixItems", [])):
            n = self.norm(p, _ptr(pointer, "prefixItems", i))
            if n is _UNSAT:  # no array reaches past this position
                hi = i if hi is None else min(hi, i)
                break
            prefix.append(n)
        if prefix:
            out["prefixItems"] = prefix
        items = s.get("items", True)
        n_items = self.norm(items, _ptr(pointer, "items")) if "items" in s else {}
        if n_items is _UNSAT:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        if hi is not None and hi <= len(prefix):
            out["prefixItems"] = prefix[:hi]
            if not out["prefixItems"]:
                out.pop("prefixItems")
            out["items"] = False
            if lo > hi:
                return _UNSAT
        elif n_items != {}:
            out["items"] = n_items
        if lo:
            out["minItems"] = lo
        if hi is not None and out.get("items") is not False:
            out["maxItems"] = hi
        return out

    def norm_object(self, s, pointer):
        out: dict = {"type": "object"}
        ap_raw = s.get("additionalProperties")
        if ap_raw is None:
            ap = _UNSAT if self.close_objects else {}
        else:
            ap = self.norm(ap_raw, _ptr(pointer, "additionalProperties"))
        required = list(dict.fromkeys(s.get("required", [])))
        props = {}
        for k in list(s.get("properties", {})) + required:
            if _NEEDS_ESCAPE.search(k):
                raise UnsupportedSchemaError("properties", _ptr(pointer, "properties", k),
                                             "property names with quotes, backslashes or control characters are "
                                             "not supported")
        for k, v in s.get("properties", {}).items():
            n = self.norm(v, _ptr(pointer, "properties", k))
            if n is _UNSAT:
                if k in required:
                    return _UNSAT
                if ap is not _UNSAT:
                    self.unsupported("properties", _ptr(pointer, "properties", k),
                                     "a forbidden property on an open object is not supported")
                continue
            props[k] = n
        pattern_props = dict(s.get("patternProperties") or {})
        out_pp = {}
        for pat in [p for p in pattern_props if matches_every_key(p, strict=ap is _UNSAT)]:
            # every key matches: the pattern's schema holds for every property, additionalProperties
            # never applies
            sub = pattern_props.pop(pat)
            self.rewrite("patternProperties", _ptr(pointer, "patternProperties", pat))
            n = self.norm(sub, _ptr(pointer, "patternProperties", pat))
            for k in list(props):
                merged = self.norm({"allOf": [s["properties"][k] if k in s.get("properties", {}) else True, sub]},
                                   _ptr(pointer, "properties", k))
                if merged is _UNSAT:
                    if k in required:
                        return _UNSAT
                    del props[k]
                else:
                    props[k] = merged
            ap = n
        if pattern_props:
            first = next(iter(pattern_props))
            ok = (len(pattern_props) == 1 and ap is _UNSAT and not has_unsupported_feature(first)
                  and as_fullmatch(first) is not None and not unconvertible(as_fullmatch(first)))
            if ok:
                pat, sub = next(iter(pattern_props.items()))
                try:
                    ok = not any(re.search(pat, k) for k in list(props) + required)
                except re.error:
                    ok = False
            if ok:
                n = self.norm(sub, _ptr(pointer, "patternProperties", pat))
                if n is not _UNSAT:
                    out_pp = {as_fullmatch(pat): n}
            else:
                self.unsupported("patternProperties", _ptr(pointer, "patternProperties"),
                                 "supported only as one pattern on a closed object "
                                 "(additionalProperties: false) that matches no named property, or as a "
                                 "pattern every name matches")
        for k in required:
            if k not in props:
                if ap is _UNSAT:
                    if out_pp:
                        self.unsupported("required", _ptr(pointer, "required"),
                                         f"required '{k}' must be a named property")
                        continue
                    return _UNSAT
                props[k] = ap
                self.rewrite("required", _ptr(pointer, "required"))
        closed = ap is _UNSAT and not out_pp
        dep_required = {k: list(v) for k, v in (s.get("dependentRequired") or {}).items()
                        if k in props or not closed}
        if s.get("dependentSchemas") and any(k in props or not closed for k in s["dependentSchemas"]):
            self.unsupported("dependentSchemas", _ptr(pointer, "dependentSchemas"),
                             "schema dependencies are not supported")
        if dep_required and (not closed or len(dep_required) > 4):
            self.unsupported("dependentRequired", _ptr(pointer, "dependentRequired"),
                             "supported on closed objects (additionalProperties: false), at most 4 entries")
            dep_required = {}
        if "unevaluatedProperties" in s:
            up = s["unevaluatedProperties"]
            if up is False and ap_raw is None and not pattern_props:
                ap = _UNSAT
                self.rewrite("unevaluatedProperties", _ptr(pointer, "unevaluatedProperties"))
            elif up is not True and up != {}:
                self.unsupported("unevaluatedProperties", _ptr(pointer, "unevaluatedProperties"), "not supported")
        if "propertyNames" in s:
            pn = s["propertyNames"]
            sub = self.validator.evolve(schema=pn)
            names_ok = ap is _UNSAT and all(sub.is_valid(k) for k in props)
            if names_ok:
                self.rewrite("propertyNames", _ptr(pointer, "propertyNames"))
                if out_pp:
                    self.unsupported("propertyNames", _ptr(pointer, "propertyNames"),
                                     "propertyNames beside patternProperties is not supported")
            else:
                self.unsupported("propertyNames", _ptr(pointer, "propertyNames"),
                                 "supported only on closed objects whose named properties all satisfy it")
        n_req = len(required)
        lo, hi = s.get("minProperties"), s.get("maxProperties")
        if lo is not None and int(lo) > n_req:
            if closed and int(lo) > len(props):
                return _UNSAT
            if not closed:  # the grammar may repeat an additional key, which counts once when parsed
                self.unsupported("minProperties", _ptr(pointer, "minProperties"),
                                 "minProperties beyond the required properties is supported on closed objects only")
            else:
                out["minProperties"] = int(lo)
        if hi is not None:
            if int(hi) < n_req:
                return _UNSAT
            if not (closed and int(hi) >= len(props)):
                out["maxProperties"] = int(hi)
        out["properties"] = props
        if required:
            out["required"] = [k for k in required if k in props]
        if out_pp:
            out["patternProperties"] = out_pp
        out["additionalProperties"] = False if ap is _UNSAT else ap
        if not dep_required:
            return out
        # dependentRequired on a closed object: one branch per choice of which trigger properties
        # appear (absent: dropped from properties; present: required with its dependents)
        self.rewrite("dependentRequired", _ptr(pointer, "dependentRequired"))
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
            return _UNSAT
        return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _type_name(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "integer" if float(v).is_integer() else "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _json_equal(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _json_key(v) -> str:
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


_INT64_MIN, _INT64_MAX, _INT32_MAX = -(2**63), 2**63 - 1, 2**31 - 1


def normalize_schema(schema: Any, *, best_effort: bool = False, close_objects: bool = False) -> NormalizedSchema:
    """Rewrite `schema` (a dict or bool, already meta-validated) into the enforced subset.

    best_effort: drop unsupported keywords and list them in `not_enforced` instead of raising.
    close_objects: objects without `additionalProperties` get `false` (OpenAI strict mode) instead
    of the spec's default (any additional property allowed).
    Raises UnsupportedSchemaError (keyword + JSON pointer) or UnsatisfiableSchemaError (ValueErrors).
    """
    n = _Normalizer(copy.deepcopy(schema), best_effort, close_objects)
    try:
        out = n.run()
    except RecursionError:
        raise UnsupportedSchemaError("(schema)", "", "nested too deeply") from None
    return NormalizedSchema(out, n.not_enforced, n.rewritten)


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
                    child = next(iter(pp.values())) if pp else s.get("additionalProperties", {})
                inner.append(json.dumps(k, ensure_ascii=False) + ": " + dump(v[k], child))
            return "{" + ", ".join(inner) + "}"
        if isinstance(v, list):
            prefix = s.get("prefixItems", [])
            items = s.get("items", {})
            return "[" + ", ".join(dump(x, prefix[i] if i < len(prefix) else items) for i, x in enumerate(v)) + "]"
        if isinstance(v, float) and v.is_integer() and abs(v) < 1e16:
            return str(int(v))
        return json.dumps(v, ensure_ascii=False)

    return dump(value, schema)
