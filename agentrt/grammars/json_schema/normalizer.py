"""The walk: one pass over a schema that dispatches each subschema to its keyword family
(refs.py, combinators.py, strings.py, numbers.py, arrays.py, objects.py) and keeps the state they
share: the root (for `$ref`), the output `$defs`, the options, and what was rewritten or dropped.

Order per subschema: draft upgrade -> finite-number check -> `$ref` (bare: a `$defs` entry; with
siblings: merged as `allOf`) -> `enum`/`const` -> `allOf` merge -> `not`/`if` -> `anyOf`/`oneOf`
-> per type (an untyped subschema splits into one branch per type its keywords allow).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any

from agentrt.grammars.json_schema.arrays import norm_array
from agentrt.grammars.json_schema.combinators import norm_alternatives, norm_enum
from agentrt.grammars.json_schema.conditionals import conditionals_schema, take_conditional
from agentrt.grammars.json_schema.errors import UnsatisfiableSchemaError, UnsupportedSchemaError, ptr
from agentrt.grammars.json_schema.keywords import COUNT_KW, INT32_MAX, KNOWN, NUMBER_KW, TYPES, UNSAT
from agentrt.grammars.json_schema.negation import is_not_pattern, negation
from agentrt.grammars.json_schema.numbers import norm_integer, norm_number
from agentrt.grammars.json_schema.objects import norm_object
from agentrt.grammars.json_schema.refs import inline, merge_all_of, norm_ref, resolve
from agentrt.grammars.json_schema.strings import norm_string


@dataclass
class NormalizedSchema:
    """`schema`: the rewritten schema (JSON-serializable, 2020-12, in the enforced subset);
    `not_enforced`: "keyword at pointer" strings dropped under best-effort (empty otherwise);
    `rewritten`: "keyword at pointer" strings enforced by a rewrite rather than as written."""

    schema: dict
    not_enforced: list[str] = field(default_factory=list)
    rewritten: list[str] = field(default_factory=list)


def normalize_schema(
    schema: Any, *, best_effort: bool = False, close_objects: bool = False, unique_strings: bool = True
) -> NormalizedSchema:
    """Rewrite `schema` (a dict or bool, already meta-validated) into the enforced subset.

    best_effort: drop unsupported keywords and list them in `not_enforced` instead of raising.
    close_objects: objects without `additionalProperties` get `false` (OpenAI strict mode) instead
    of the spec's default (any additional property allowed).
    unique_strings: `uniqueItems` over free strings is kept, as the marker UNIQUE_STRINGS on the
    array, for the matcher's check at string completion (grammars/unique_items.py); False (tool
    arguments, where no such check runs) refuses it as before.
    Raises UnsupportedSchemaError (keyword + JSON pointer) or UnsatisfiableSchemaError (ValueErrors).
    """
    n = Normalizer(copy.deepcopy(schema), best_effort, close_objects)
    n.unique_strings = unique_strings
    try:
        out = n.run()
    except RecursionError:
        raise UnsupportedSchemaError("(schema)", "", "nested too deeply") from None
    return NormalizedSchema(out, n.not_enforced, n.rewritten)


class Normalizer:
    """State of one `normalize_schema` walk. `norm(s, pointer)` returns the normalized subschema
    or UNSAT; `unsupported` raises (or, best-effort, records); `rewrite` records a rewrite. The
    keyword families see it as a `walk.Walk`."""

    def __init__(self, root, best_effort: bool, close_objects: bool):
        import jsonschema
        from jsonschema.validators import validator_for

        self.root = root
        self.best_effort = best_effort
        self.close_objects = close_objects
        self.unique_strings = True  # uniqueItems over free strings kept as a marker (arrays._unique)
        cls = (
            validator_for(root, default=jsonschema.Draft202012Validator)
            if isinstance(root, dict)
            else jsonschema.Draft202012Validator
        )
        # formats are assertions here, whatever the draft (draft-04's checker lacks `date`, ...)
        self.validator = cls(root, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        # drafts 3 to 7 ignore every keyword beside `$ref` (draft-07 core §8.3); 2019-09 on apply them
        self.ref_alone = cls in (
            jsonschema.Draft3Validator,
            jsonschema.Draft4Validator,
            jsonschema.Draft6Validator,
            jsonschema.Draft7Validator,
        )
        self.defs: dict[str, Any] = {}  # output $defs by name ("d0", ...)
        self.def_names: dict[str, str] = {}  # input fragment -> output $defs name
        self.in_progress: set[str] = set()  # fragments being normalized (recursion)
        self.inlining: set[str] = set()  # fragments being inlined (refs.inline)
        self.recursive_inlines = 0  # inlines of a fragment being normalized (bounded)
        self.first_unsat: tuple[str, str] | None = None  # (pointer, its keywords) for the error
        self.not_enforced: list[str] = []
        self.rewritten: list[str] = []

    # ---- bookkeeping -------------------------------------------------------------------------
    def unsupported(self, keyword: str, pointer: str, reason: str) -> None:
        """Raise UnsupportedSchemaError, or under best-effort record "keyword at pointer"."""
        if not self.best_effort:
            raise UnsupportedSchemaError(keyword, pointer, reason)
        self.not_enforced.append(f"{keyword} at {pointer or '/'}")

    def rewrite(self, keyword: str, pointer: str) -> None:
        self.rewritten.append(f"{keyword} at {pointer or '/'}")

    def count_bounds(self, min_kw: str, lo, hi, pointer: str):
        """minLength/minItems over 2^31 - 1 are refused (the backend's counters are 32-bit); a
        maximum that large is dropped: no output within a context window reaches it."""
        if lo is not None and lo > INT32_MAX:
            self.unsupported(min_kw, ptr(pointer, min_kw), f"{min_kw} over {INT32_MAX} is not supported")
            lo = None
        if hi is not None and hi > INT32_MAX:
            hi = None
        return lo, hi

    # ---- the walk ----------------------------------------------------------------------------
    def run(self) -> dict:
        if isinstance(self.root, dict) and isinstance(self.root.get("$schema"), str):
            from jsonschema.validators import validator_for

            uri = self.root["$schema"]
            if validator_for(self.root, default=None) is None and "//json-schema.org/" not in uri:
                # a custom metaschema may turn vocabularies off: what would be enforced is unknown
                raise UnsupportedSchemaError(
                    "$schema", "/$schema", f"only the published drafts are supported, not {uri!r}"
                )
        out = self.norm(self.root, "")
        if out is UNSAT:
            where, kws = self.first_unsat or ("", "")
            raise UnsatisfiableSchemaError(where, f"the subschema there ({kws}) rejects every instance")
        if self.defs:
            if "$ref" in out and len(out) == 1:
                out = {"anyOf": [out]}
            out = {**out, "$defs": {k: (v if v is not UNSAT else {"enum": []}) for k, v in self.defs.items()}}
        return out

    def norm(self, s, pointer: str):
        """The normalized subschema, or UNSAT; the first subschema found unsatisfiable is kept for
        the error message (deepest first: the walk returns bottom-up)."""
        out = self._norm(s, pointer)
        if out is UNSAT and self.first_unsat is None:
            kws = sorted(k for k in s if k in KNOWN) if isinstance(s, dict) else []
            self.first_unsat = (pointer, ", ".join(kws) or json.dumps(s))
        return out

    def _norm(self, s, pointer: str):
        if s is True or s == {}:
            return {}
        if s is False:
            return UNSAT
        if not isinstance(s, dict):
            raise UnsupportedSchemaError("(schema)", pointer, "a subschema must be an object or a boolean")
        s = self._checked(self.upgrade(dict(s), pointer), pointer)
        if "$ref" in s:
            if {k for k in s if k in KNOWN} == {"$ref"}:
                return norm_ref(self, s["$ref"], ptr(pointer, "$ref"))
            rest = {k: v for k, v in s.items() if k != "$ref"}
            if self._implied_by_target(s["$ref"], rest, pointer):  # e.g. {"type": "object", "$ref": ...}
                return norm_ref(self, s["$ref"], ptr(pointer, "$ref"))
            self.rewrite("$ref", ptr(pointer, "$ref"))
            return self.norm({"allOf": [{"$ref": s["$ref"]}, rest]}, pointer)
        if "enum" in s or "const" in s:
            return norm_enum(self, s, pointer)
        if "allOf" in s:
            s = merge_all_of(self, s, pointer)
            if s is UNSAT:
                return UNSAT
            if "$ref" in s or "allOf" in s:
                return self.norm(s, pointer)
            if "enum" in s or "const" in s:
                return norm_enum(self, s, pointer)
        if (
            "not" in s
            and not is_not_pattern(s["not"])
            and (neg := self.negated(s["not"], pointer)) is not None
        ):
            self.rewrite("not", ptr(pointer, "not"))
            rest = {k: v for k, v in s.items() if k != "not"}
            return self.norm({"allOf": [rest, neg]} if neg is not True else rest, pointer)
        if "if" in s and ("then" in s or "else" in s):
            cond = None
            try:
                if "unevaluatedProperties" in s or "unevaluatedItems" in s:
                    raise UnsupportedSchemaError(
                        "if", ptr(pointer, "if"), "not supported beside unevaluated*"
                    )
                cond = conditionals_schema(self, [take_conditional(s, pointer)])
            except UnsupportedSchemaError as e:
                self.unsupported(e.keyword, e.pointer, e.reason)  # best-effort: dropped
            else:
                self.rewrite("if", ptr(pointer, "if"))
                return UNSAT if cond is False else self.norm({"allOf": [s, cond]}, pointer)
        self._drop_conditionals(s, pointer)
        if "anyOf" in s or "oneOf" in s:
            return norm_alternatives(self, s, pointer)
        return self.norm_typed(s, pointer)

    def _implied_by_target(self, ref, rest: dict, pointer: str) -> bool:
        """Does the `$ref` target say every sibling keyword in `rest` itself (same value)? Then the
        reference alone is equivalent, and a recursive target stays a `$defs` reference instead of
        being merged (unrolled) level by level."""
        from agentrt.grammars.json_schema.values import json_equal

        try:
            target = resolve(self, ref, ptr(pointer, "$ref"))[1]
        except UnsupportedSchemaError:
            return False
        if not isinstance(target, dict):
            return False
        return all(k in target and json_equal(target[k], v) for k, v in rest.items() if k in KNOWN)

    def negated(self, sub, pointer: str):
        """`negation` of raw `sub` with its `$ref`s and `allOf`s inlined first; None when it has no
        complement here (or cannot be inlined: a recursive reference)."""
        neg = negation(sub)
        if neg is None and isinstance(sub, dict) and ("$ref" in sub or "allOf" in sub):
            try:
                flat = inline(self, sub, ptr(pointer, "not"))
            except UnsupportedSchemaError:
                return None
            neg = negation(flat if flat is not False else False)
        return neg

    def _checked(self, s: dict, pointer: str) -> dict:
        """Refuse non-finite bounds; drop (or refuse) dynamic references."""
        for kw in NUMBER_KW + COUNT_KW:
            v = s.get(kw)
            if isinstance(v, float) and not math.isfinite(v):
                raise UnsupportedSchemaError(kw, ptr(pointer, kw), "must be a finite number")
        for kw in ("$dynamicRef", "$recursiveRef"):
            if kw in s:
                self.unsupported(kw, ptr(pointer, kw), "dynamic references are not supported")
                s.pop(kw)
        return s

    def _drop_conditionals(self, s: dict, pointer: str) -> None:
        """`not` (other than `negation`'s forms) has no grammar: refused (best-effort: dropped).
        What is left of `if`/`then`/`else` after `_norm`'s rewrite (conditionals.py) is dropped: a
        lone `if` asserts nothing, nor do `then`/`else` without `if`, and a refused conditional
        was reported there."""
        if "not" in s and not is_not_pattern(s["not"]):
            self.unsupported("not", ptr(pointer, "not"), "negation cannot be expressed as a grammar")
            s.pop("not")
        lone = "if" in s and "then" not in s and "else" not in s
        if lone and ("unevaluatedProperties" in s or "unevaluatedItems" in s):  # its annotations count
            self.unsupported("if", ptr(pointer, "if"), "'if' beside unevaluated* is not supported")
        for k in ("if", "then", "else"):  # a lone `if` asserts nothing; refusals were made in _norm
            s.pop(k, None)

    def upgrade(self, s: dict, pointer: str) -> dict:
        """Draft-04/06/07 spellings -> 2020-12 (in place; returns `s`). Under drafts 3 to 7 the
        keywords beside a `$ref` are dropped: those drafts ignore them."""
        if self.ref_alone and "$ref" in s:
            for k in [k for k in s if k in KNOWN and k != "$ref"]:
                del s[k]
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

    def norm_typed(self, s: dict, pointer: str):
        """One branch per instance type `s` allows (`type`, or every type when absent); keywords
        of other types are no-ops on each branch."""
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
            b = self._norm_type(ty, s, pointer)
            if b is not UNSAT:
                branches.append(b)
        if not branches:
            return UNSAT
        return branches[0] if len(branches) == 1 else {"anyOf": branches}

    def _norm_type(self, ty: str, s: dict, pointer: str):
        if ty == "null":
            return {"type": "null"}
        if ty == "boolean":
            return {"type": "boolean"}
        family = {
            "integer": norm_integer,
            "number": norm_number,
            "string": norm_string,
            "array": norm_array,
            "object": norm_object,
        }[ty]
        return family(self, s, pointer)
