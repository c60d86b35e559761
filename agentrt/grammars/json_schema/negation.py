"""`not` as a positive schema: the complement of a raw subschema, for the forms that have one in
the enforced subset. Used for `{"not": ...}` and for `oneOf` branches that overlap (exactly one
of A, B = (A and not B) or (B and not A)).

The complement follows the meaning of each keyword (JSON Schema 2020-12 validation §6): an instance
fails a schema when its type is outside `type`, or when it has a type some keyword applies to and
fails that keyword. So `not S` is the anyOf of "a type S does not allow" and, per keyword of S, "a
value of that keyword's type that fails it":

- `type`: the other types (refused when `integer` is allowed but `number` is not: the rest would be
  the non-integral numbers, which have no type of their own);
- `required` [k...]: an object lacking some k (`"k": false`);
- `properties` {k: S}: an object having k with a value in `not S` (recursively);
- `enum`/`const` of scalars: null/boolean by value, numbers below or above each listed number,
  strings that do not match the listed words (a string `not` pattern, enforced by nodes.py);
- `minLength`/`maxLength`, `minimum`/`maximum` (and exclusive), `minItems`/`maxItems`,
  `minProperties`/`maxProperties`: the values past the bound;
- `items` S: an array containing an item in `not S`; `contains` C: an array whose items are all in
  `not C` (with no `minContains`/`maxContains` beside it);
- `pattern`: the strings it does not match (`{"type": "string", "not": {"pattern": p}}`, kept for
  strings.py and nodes.py);
- `anyOf`: the allOf of the complements; `allOf`: their anyOf; `not`: the inner schema;
- annotations: nothing (they never fail).
Any other keyword (objects' additionalProperties, patternProperties, arrays' items, formats, ...)
has no complement here: `negation` returns None and the caller refuses.
"""

from __future__ import annotations

import itertools
import re

from agentrt.grammars.json_schema.keywords import KNOWN, TYPES

_NUMERIC = ("integer", "number")
_BOUNDS = {
    # keyword -> (instance type, the complementary keyword, how the bound moves)
    "minLength": ("string", "maxLength", -1),
    "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1),
    "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1),
    "maxProperties": ("object", "minProperties", 1),
    "minimum": ("number", "exclusiveMaximum", 0),
    "maximum": ("number", "exclusiveMinimum", 0),
    "exclusiveMinimum": ("number", "maximum", 0),
    "exclusiveMaximum": ("number", "minimum", 0),
}
_ANNOTATION_OK = frozenset(
    {
        "type",
        "required",
        "properties",
        "enum",
        "const",
        "pattern",
        "anyOf",
        "allOf",
        "not",
        "items",
        "contains",
    }
)
MAX_NEGATION_DEPTH = 8


def negation(sub, depth: int = 0):
    """A raw schema equal to `{"not": sub}`, or None when `sub` uses a keyword without a complement
    here. `sub` is raw (draft 2020-12 spellings, `$ref` already inlined by the caller; a `$ref`
    left inside makes this None). Never raises."""
    if sub is False:
        return True
    if sub is True or sub == {}:
        return False
    if not isinstance(sub, dict) or depth > MAX_NEGATION_DEPTH:
        return None
    kws = {k for k in sub if k in KNOWN}
    if not kws:
        return False
    if not kws <= _ANNOTATION_OK | set(_BOUNDS):
        return None
    t = sub.get("type")
    allowed = set(TYPES) if t is None else ({t} if isinstance(t, str) else set(t))
    if not allowed <= set(TYPES):
        return None
    if "number" in allowed:
        allowed.add("integer")
    if "integer" in allowed and "number" not in allowed:
        return None  # the complement would hold the non-integral numbers
    alts: list = []
    rest = [x for x in TYPES if x not in allowed]
    if rest:
        alts.append({"type": rest})
    for kw in sorted(kws - {"type"}):
        part = _keyword_negation(kw, sub[kw], allowed, depth)
        if part is None:
            return None
        alts += part
    if not alts:
        return False
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def _typed(ty: str, allowed: set) -> bool:
    return ty in allowed or (ty == "number" and "integer" in allowed)


def _keyword_negation(kw: str, v, allowed: set, depth: int):
    """The instances that fail keyword `kw` (value `v`) among the types `allowed`, as a list of
    alternatives (empty: none fail); None when there is no complement here."""
    if kw in _BOUNDS:
        ty, other, step = _BOUNDS[kw]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        if not _typed(ty, allowed) or (step < 0 and v + step < 0):
            return []  # no value of this type here, or no count below 0
        return [{"type": ty, other: v + step}]
    if kw == "required":
        if not isinstance(v, list) or not _typed("object", allowed):
            return [] if isinstance(v, list) else None
        return [{"type": "object", "properties": {k: False}} for k in dict.fromkeys(v)]
    if kw == "properties":
        if not isinstance(v, dict):
            return None
        if not _typed("object", allowed):
            return []
        out = []
        for k, s in v.items():
            neg = negation(s, depth + 1)
            if neg is None:
                return None
            if neg is not False:
                out.append({"type": "object", "required": [k], "properties": {k: neg}})
        return out
    if kw in ("items", "contains"):  # some item fails `items` / no item matches `contains`
        if isinstance(v, list):
            return None  # draft-04 tuple items (upgraded to prefixItems before a negation)
        if not _typed("array", allowed):
            return []
        neg = negation(v, depth + 1)
        if neg is None:
            return None
        if kw == "items":
            return [] if neg is False else [{"type": "array", "contains": neg}]
        return [{"type": "array", "items": neg}] if neg is not True else [{"type": "array"}]
    if kw == "pattern":
        if not isinstance(v, str):
            return None
        return [{"type": "string", "not": {"pattern": v}}] if _typed("string", allowed) else []
    if kw in ("enum", "const"):
        return _enum_negation([v] if kw == "const" else v, allowed)
    if kw in ("anyOf", "allOf"):
        if not isinstance(v, list) or not v:
            return None
        negs = [negation(b, depth + 1) for b in v]
        if any(x is None for x in negs):
            return None
        if kw == "allOf":
            return [x for x in negs if x is not False]
        if any(x is False for x in negs):
            return []
        return [negs[0] if len(negs) == 1 else {"allOf": negs}]
    if kw == "not":  # failing `not v` is matching v
        return [] if v is False else [{} if v is True else v]
    return None


def _enum_negation(values, allowed: set):
    """The values of types `allowed` outside the listed scalars (None for object/array members)."""
    if not isinstance(values, list):
        return None
    if any(isinstance(x, (dict, list)) for x in values):
        return None
    out = []
    if "null" in allowed and None not in values:
        out.append({"type": "null"})
    if "boolean" in allowed:
        bools = [b for b in (True, False) if not any(x is b for x in values)]
        if bools:
            out.append({"enum": bools})
    numbers = sorted({x for x in values if isinstance(x, (int, float)) and not isinstance(x, bool)})
    if "number" in allowed:
        if not numbers:
            out.append({"type": "number"})
        else:
            out.append({"type": "number", "exclusiveMaximum": numbers[0]})
            out += [
                {"type": "number", "exclusiveMinimum": a, "exclusiveMaximum": b}
                for a, b in itertools.pairwise(numbers)
            ]
            out.append({"type": "number", "exclusiveMinimum": numbers[-1]})
    out += [{"type": t} for t in ("array", "object") if t in allowed]  # never listed here
    if "string" in allowed:
        words = [x for x in values if isinstance(x, str)]
        if not words:
            out.append({"type": "string"})
        else:
            alts = "|".join(_ecma_escape(w) for w in dict.fromkeys(words))
            out.append({"type": "string", "not": {"pattern": f"^(?:{alts})$"}})
    return out


def _ecma_escape(word: str) -> str:
    """`word` as a regex matching itself, in the syntax ECMA-262 and Python share."""
    return "".join(c if c.isalnum() or c in " _" else re.escape(c) if ord(c) < 128 else c for c in word)


def is_not_pattern(inner) -> bool:
    """Is `inner` (the value of a `not`) a pattern form strings.py enforces itself: `{"pattern": p}`
    or an anyOf of such (two merged `not`s)? Such a `not` fails no non-string."""
    return bool(not_patterns(inner))


def not_patterns(inner) -> list[str]:
    """The patterns of a `not` that is_not_pattern accepts (a string must match none), else []."""
    if not isinstance(inner, dict):
        return []
    if set(inner) == {"pattern"} and isinstance(inner["pattern"], str):
        return [inner["pattern"]]
    if set(inner) == {"anyOf"} and isinstance(inner["anyOf"], list) and inner["anyOf"]:
        out = []
        for b in inner["anyOf"]:
            got = not_patterns(b)
            if not got:
                return []
            out += got
        return out
    return []
