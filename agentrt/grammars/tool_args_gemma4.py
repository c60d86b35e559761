"""Gemma 4's call syntax: the values (`gemma4_value`) and the argument grammar of a tool
(`gemma4_arguments_ebnf`), built from its parameter schema.

Gemma 4's chat template writes a call as ``<|tool_call>call:NAME{key:value,...}<tool_call|>``,
several back to back. A value is ``<|"|>text<|"|>`` (a string: the text raw, no escaping, so a
string holding ``<|"|>`` cannot be written), a number as JSON writes it, ``true`` / ``false`` /
``null``, ``[v,...]`` or ``{key:v,...}``; keys are bare at every depth, each object's keys sorted
(Jinja's ``dictsort``: by the lower-cased key), no whitespace between tokens. A key that cannot be
written bare (empty, holding a line break or one of ``:,{}[]<>``, or a space at an end) is written
between ``<|"|>``, as the template writes the keys of tool declarations (its calls write every key
bare, which cannot be read back for those); the parser (api/tools/parse_gemma4.py) reads both.

The JSON grammars of sub-schemas cannot be reused whole here (strings and keys are written
differently), so each normalized sub-schema (json_schema/: the same faithful normalization as
``response_format``) is turned into this syntax:

- numbers, integers and booleans: their JSON grammar (``schema_ebnf``), the same text; null as
  ``null`` or ``None`` (the template writes a None so; both read back as null);
- strings: free text that never holds ``<|"|>``; with a length range only, that many characters
  other than ``"`` (stricter: no ``"``, so the closing quote can never be written early); with a
  pattern, a format the normalizer turns into a pattern, or negated patterns, json_schema's raw
  string automaton (``string_automaton``: no quote, backslash or control character); formats
  xgrammar enforces itself (email, uri, ...) by its grammar when it takes no escape, else refused;
- objects: the declared properties in the template's key order, required ones present, each at
  most once; other keys (identifiers) only where the object declares no property;
- arrays: ``prefixItems``, ``items``, ``minItems`` / ``maxItems``;
- ``anyOf`` (alternatives), ``enum`` / ``const`` (the values as written here), ``$ref`` (a rule per
  definition, recursion allowed), ``{}`` (any value).

What this syntax cannot enforce is refused, or dropped into `dropped` when the tool is
``strict: false``: ``uniqueItems``, ``contains``, ``patternProperties``, ``propertyNames``,
``minProperties`` / ``maxProperties``, ``format: regex``, a format whose grammar takes escapes.
So a call the grammar accepts parses back to arguments valid for the schema (tests walk it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from agentrt.grammars.json_schema.automata import dfa_ebnf, minimize
from agentrt.grammars.json_schema.nodes import string_automaton
from agentrt.grammars.tool_args import _STRING_ROOT, _Builder, _object_parts, _sequence, excluding, lit

QUOTE = '<|"|>'
"""Gemma 4's string delimiter (one special token of its vocabulary)."""

BARE_KEY = re.compile(r"[^\s:,{}\[\]<>](?:[^:,{}\[\]<>\r\n]*[^\s:,{}\[\]<>])?")
"""A key written without quotes, as the template writes every key (what the parser reads as a bare
key: none of `:,{}[]<>`, no line break, no space at either end)."""

MAX_KEY_CHARS = 256
"""The longest key the parser reads (a longer one is not a key: bounded work per feed)."""
_OPEN_KEY = "[A-Za-z_] [A-Za-z0-9_]{0,63}"  # the keys offered where an object declares no property
_STRING_KEYS = {"type", "minLength", "maxLength", "pattern", "format", "allOf", "not"}
_NULL = '"null" | "None"'
_NUMBER = '"-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+\\-]? [0-9]+)?'


def dictsort(keys) -> list[str]:
    """`keys` in the order Jinja's `dictsort` gives them (by the lower-cased key, ties as given)."""
    return sorted(keys, key=lambda k: k.lower())


def gemma4_key(key: str) -> str:
    """A key as written: bare when it can be (BARE_KEY), else between quotes."""
    return key if BARE_KEY.fullmatch(key) else QUOTE + key + QUOTE


def gemma4_value(value) -> str:
    """The text of JSON value `value` in Gemma 4's syntax (module docstring). A string holding the
    delimiter is written as is (the template does the same: it cannot be read back whole)."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + gemma4_members(value) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(gemma4_value(v) for v in value) + "]"
    return json.dumps(value)


def gemma4_members(obj: dict) -> str:
    """The members of object `obj`, `key:value,...`, in the template's key order (no braces)."""
    return ",".join(f"{gemma4_key(k)}:{gemma4_value(obj[k])}" for k in dictsort(obj))


def writable(value) -> bool:
    """Whether `value` reads back the same once written (no string or key holds the delimiter)."""
    if isinstance(value, str):
        return QUOTE not in value
    if isinstance(value, dict):
        return all(writable(k) and writable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(writable(v) for v in value)
    return True


class _Gemma4(_Builder):
    """One tool's argument grammar in Gemma 4's syntax: `value(schema, pointer)` -> an EBNF
    expression, rules collected in `rules`."""

    def __init__(
        self, schema_ebnf: Callable, ws: dict, defs: dict | None, strict: bool | None, dropped: list
    ):
        super().__init__(schema_ebnf, ws, defs, "gemma4")
        self.strict, self.dropped = strict, dropped
        self.refs: dict[str, str] = {}
        self.any_rule = ""

    def unsupported(self, keyword: str, pointer: str, why: str) -> None:
        """Refuse `keyword` (ValueError), or drop it when the tool is strict: false."""
        where = f"{keyword} at {pointer or '/'}"
        if self.strict is False:
            self.dropped.append(where)
            return
        raise ValueError(
            f"'{keyword}' at {pointer or '/'} cannot be enforced in the gemma4 call format ({why})"
        )

    def value(self, s, pointer: str) -> str:
        if s is True or s == {}:
            return self.any_value()
        if s is False:
            raise ValueError(f"the schema at {pointer or '/'} admits no value")
        if "$ref" in s:
            return self.ref(s["$ref"])
        if "anyOf" in s:
            alts = [self.value(b, f"{pointer}/anyOf/{i}") for i, b in enumerate(s["anyOf"])]
            return self.rule(" | ".join(f"({a})" for a in alts))
        if "enum" in s or "const" in s:
            values = s["enum"] if "enum" in s else [s["const"]]
            alts = [lit(gemma4_value(v)) for v in values if writable(v)] + (
                ['"None"'] if None in values else []
            )
            return self.rule(" | ".join(alts) or "[^\\0-\\U0010ffff]")
        t = s.get("type")
        if t == "string":
            return self.string(s, pointer)
        if t == "object":
            return self.object(s, pointer)
        if t == "array":
            return self.array(s, pointer)
        if t == "null":
            return self.rule(_NULL)
        if t in ("number", "integer", "boolean"):
            return self.add(self.schema_ebnf(s, None, [], self.ws))  # the JSON text is this syntax's
        if t is None:
            return self.any_value()
        raise ValueError(f"the schema at {pointer or '/'} has a type this call format cannot write: {t!r}")

    def ref(self, ref: str) -> str:
        name = ref.rsplit("/", 1)[-1]
        if name not in self.refs:
            target = (self.defs or {}).get(name)
            if target is None:
                raise ValueError(f"$ref {ref!r} names no definition")
            self.refs[name] = rule = self.fresh() + "def"
            self.rules.append(f"{rule} ::= {self.value(target, f'/$defs/{name}')}")
        return self.refs[name]

    def string(self, s: dict, pointer: str) -> str:
        q = lit(QUOTE)
        for key in sorted(set(s) - _STRING_KEYS):
            self.unsupported(key, f"{pointer}/{key}", "not a keyword of strings here")
        if set(s) == {"type"}:
            raw = self.fresh() + "raw"
            self.rules.append(excluding(raw, QUOTE).strip())
            return self.rule(f"{q} {raw} {q}")
        if "format" in s:
            return self.formatted(s, pointer)
        if set(s) <= {"type", "minLength", "maxLength"}:
            lo, hi = s.get("minLength", 0), s.get("maxLength")
            return self.rule(f'{q} [^"]{{{lo},{"" if hi is None else hi}}} {q}')
        dfa, ok = string_automaton(s)
        name = self.fresh() + "s"
        dfa, outs = minimize(dfa, lambda lab: q if ok(lab) else None)
        lines, live = dfa_ebnf(dfa, outs, name)
        if not live:
            raise ValueError(f"no string satisfies the schema at {pointer or '/'}")
        self.rules.extend(lines)
        return self.rule(f"{q} {name}_0")

    def formatted(self, s: dict, pointer: str) -> str:
        """A format the backend enforces itself: the inside of its JSON string grammar, when that
        takes no escape (then the raw text is the value)."""
        fmt = s["format"]
        ebnf = self.schema_ebnf(s, None, [], self.ws) if fmt != "regex" else ""
        m = _STRING_ROOT.search(ebnf)
        # a backslash anywhere in the rules from the root on: the grammar may write an escape
        if m is None or "\\\\" in ebnf[m.start() :]:
            self.unsupported("format", f"{pointer}/format", f"format {fmt!r} is written with escapes")
            return self.string({"type": "string"}, pointer)
        root = self.add(ebnf[: m.start()] + f"root ::= (({m.group(1)}))" + ebnf[m.end() :])
        return self.rule(f"{lit(QUOTE)} {root} {lit(QUOTE)}")

    def object(self, s: dict, pointer: str) -> str:
        for key in ("patternProperties", "propertyNames", "minProperties", "maxProperties"):
            if key in s:
                self.unsupported(key, f"{pointer}/{key}", "not enforced over written keys")
        props = s.get("properties") or {}
        extra = s.get("additionalProperties", {})
        body = self.members(props, set(s.get("required") or []), extra if not props else None, pointer)
        return self.rule(f'"{{" {body} "}}"')

    def members(self, props: dict, required: set, extra, pointer: str) -> str:
        """The members of an object (no braces): `props` in the template's order, the `required`
        ones present; `extra` (a schema or None): other members with identifier keys."""
        parts = []
        for k in dictsort(k for k, v in props.items() if v is not False):
            if QUOTE in k or len(k) > MAX_KEY_CHARS:
                raise ValueError(
                    f"property name {k[:40]!r} cannot be written in the gemma4 call format "
                    f"(it holds {QUOTE} or is longer than {MAX_KEY_CHARS} characters)"
                )
            value = self.value(props[k], f"{pointer}/properties/{k}")
            parts.append((self.rule(f"{lit(gemma4_key(k) + ':')} {value}"), k in required))
        body = _sequence(self, parts, ",")
        if isinstance(extra, dict) or extra is True:
            one = f'{_OPEN_KEY} ":" {self.value(extra, f"{pointer}/additionalProperties")}'
            body = f'({one} ("," {one})*)?'
        return body

    def array(self, s: dict, pointer: str) -> str:
        for key in ("uniqueItems", "contains", "minContains", "maxContains"):
            if key in s and s[key] is not False:
                self.unsupported(key, f"{pointer}/{key}", "not enforced over written items")
        prefix = s.get("prefixItems") or []
        items = s.get("items", {})
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if items is False:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        k = len(prefix) if hi is None else min(len(prefix), hi)
        if lo > k and (items is False or (hi is not None and lo > hi)):
            raise ValueError(f"no array satisfies the schema at {pointer or '/'}")
        item = self.value(items, f"{pointer}/items") if items is not False and (hi is None or hi > k) else ""
        # the items after the prefix: count in [max(lo - k, 0), hi - k]
        rest_lo, rest_hi = max(lo - k, 0), (None if hi is None else hi - k)
        if not item or rest_hi == 0:
            tail = '""'
        elif k == 0:
            more = f'("," {item}){{{max(rest_lo - 1, 0)},{"" if rest_hi is None else rest_hi - 1}}}'
            tail = f"{item} {more}" if rest_lo >= 1 else f"({item} {more})?"
        else:
            tail = f'("," {item}){{{rest_lo},{"" if rest_hi is None else rest_hi}}}'
        nxt = self.rule(tail)
        for i in range(k - 1, -1, -1):  # position i, then the rest (a position past minItems may end it)
            elem = self.value(prefix[i], f"{pointer}/prefixItems/{i}")
            sep = '"," ' if i > 0 else ""
            nxt = self.rule(f"{sep}{elem} {nxt}" + (' | ""' if i >= lo else ""))
        return self.rule(f'"[" {nxt} "]"')

    def any_value(self) -> str:
        """Any JSON value in this syntax (keys: identifiers)."""
        if not self.any_rule:
            p = self.fresh()
            self.any_rule = v = p + "any"
            raw = p + "raw"
            q = lit(QUOTE)
            self.rules += [
                f'{v} ::= {p}str | {p}num | "true" | "false" | {_NULL} | {p}obj | {p}arr',
                f"{p}str ::= {q} {raw} {q}",
                excluding(raw, QUOTE).strip(),
                f"{p}num ::= {_NUMBER}",
                f'{p}obj ::= "{{" ({_OPEN_KEY} ":" {v} ("," {_OPEN_KEY} ":" {v})*)? "}}"',
                f'{p}arr ::= "[" ({v} ("," {v})*)? "]"',
            ]
        return self.any_rule


def gemma4_arguments_ebnf(
    schema: dict, strict: bool | None, dropped: list[str], ws: dict, schema_ebnf: Callable
) -> str:
    """EBNF (root `root`) of a tool's arguments in Gemma 4's syntax: the members of the arguments
    object, `key:value,...` (the format's tags write the braces). Raises ValueError naming the
    keyword and its pointer for what the syntax cannot enforce (module docstring), unless `strict`
    is False (then appended to `dropped`, as the normalizer's own drops)."""
    props, _names, required, extra, defs = _object_parts(schema, strict, dropped, "gemma4")
    b = _Gemma4(schema_ebnf, ws, defs, strict, dropped)
    body = b.members(props, required, extra, "")
    return "\n".join([f"root ::= {body}", *b.rules]) + "\n"
