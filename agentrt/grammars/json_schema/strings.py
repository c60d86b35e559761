"""Strings: `minLength`/`maxLength`, `pattern` and `format`.

- `pattern` is an ECMA-262 search: rewritten to a whole-string pattern (`grammars/regex.py`);
  with a length range it is intersected when it is one repeated character class (`^[a-z]+$` +
  maxLength 3 -> `[a-z]{1,3}`) or when every match already has an allowed length.
- `format`: the formats xgrammar enforces pass through (GRAMMAR_FORMATS); ipv4, date, time,
  date-time and hostname become exact patterns (FORMAT_PATTERNS: RFC 3339 §5.6, RFC 1123 §2.1,
  RFC 2673 §3.2 dotted quads); `regex` gets nodes.py's grammar of a regex subset that both
  ECMA-262 and Python compile (NODE_FORMATS: narrower); formats jsonschema asserts that no grammar
  here enforces are refused (CHECKED_FORMATS); any other format is an annotation.
- `pattern` beside a format that has a pattern (FORMAT_SEARCHES: the exact patterns, and email
  as jsonschema checks it, a string with "@"): the product automaton of both and the length range
  (nodes.py); otherwise a length range or `pattern` beside `format` is refused (best-effort: the
  format wins).
- `not` of patterns (`{"not": {"pattern": p}}`, and what negation.py makes of a negated enum or
  pattern): kept beside the rest, enforced by nodes.py's product DFA (a string matching a negated
  pattern is left out); refused beside `format`.
"""

from __future__ import annotations

from agentrt.grammars.json_schema.automata import AutomatonError, alphabet, build
from agentrt.grammars.json_schema.errors import ptr
from agentrt.grammars.json_schema.keywords import UNSAT
from agentrt.grammars.json_schema.negation import not_patterns
from agentrt.grammars.json_schema.nodes import string_automaton
from agentrt.grammars.json_schema.walk import Walk
from agentrt.grammars.regex import (
    as_fullmatch,
    bound_repetition,
    has_unsupported_feature,
    unconvertible,
    width_within,
)

# formats xgrammar's JSON-schema converter enforces (probed one by one against jsonschema's checkers)
GRAMMAR_FORMATS = frozenset(
    {
        "email",
        "uri",
        "uuid",
        "ipv6",
        "duration",
        "uri-reference",
        "json-pointer",
        "uri-template",
        "relative-json-pointer",
    }
)
# formats jsonschema's FormatChecker asserts that the grammar does not: refused (unless best-effort)
CHECKED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference"})
# formats nodes.py prints a grammar for (regex: a subset both ECMA-262 and Python's re compile)
NODE_FORMATS = frozenset({"regex"})
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
IPV4_PATTERN = rf"^{_OCTET}(?:\.{_OCTET}){{3}}$"
# RFC 3339 dates/times as exact patterns: xgrammar's date-time admits 1990-02-31. February stops at
# 28 and seconds at 59 (leap days and leap seconds are valid but left out: narrower, never wrong).
# Year 0000 is left out too: Python's date (and jsonschema's format checker) starts at year 1; seen
# when the length-safe policy closed a date-time with zeros.
_DATE = (
    r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_TIME = (
    r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
)


# RFC 1123 hostnames: labels of 1-63 letters, digits and inner hyphens, at most 253 characters in
# all (jsonschema's checker; xgrammar's hostname admitted 64-character labels). The total is kept by
# a narrower shape, sound and compact: a first label up to 63 and at most 9 more of up to 20
# (63 + 9 * 21 = 252), an optional trailing dot.
def _label(n: int) -> str:
    return f"[A-Za-z0-9](?:[A-Za-z0-9-]{{0,{n - 2}}}[A-Za-z0-9])?"


HOSTNAME_PATTERN = rf"^{_label(63)}(?:\.{_label(20)}){{0,9}}\.?$"
FORMAT_PATTERNS = {
    "ipv4": IPV4_PATTERN,
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "hostname": HOSTNAME_PATTERN,
}
# a format as a pattern, for a product with a `pattern` beside it: the exact patterns, and email
# as jsonschema's checker defines it (a string containing "@")
FORMAT_SEARCHES = {**FORMAT_PATTERNS, "email": "@"}
FORMAT_LENGTHS = {
    "ipv4": (7, 15),
    "date": (10, 10),
    "time": (9, 29),
    "date-time": (20, 40),
    "hostname": (1, 253),
}


def norm_string(n: Walk, s: dict, pointer: str):
    """The string branch of subschema `s`."""
    nots = not_patterns(s.get("not"))
    if not nots:
        return _norm_string(n, s, pointer)
    out = _norm_string(n, {k: v for k, v in s.items() if k != "not"}, pointer)
    return out if out is UNSAT else _with_not(n, out, nots, pointer)


def _with_not(n: Walk, out: dict, nots: list[str], pointer: str):
    """String schema `out` with the patterns of a `not` none may match (nodes.py's product DFA);
    refused beside a format, for a pattern without an automaton, or past the automaton bounds."""
    where = ptr(pointer, "not")
    if "format" in out:
        n.unsupported("not", where, "'not' beside format is not supported")
        return out
    kept = {
        **out,
        "not": {"pattern": nots[0]} if len(nots) == 1 else {"anyOf": [{"pattern": p} for p in nots]},
    }
    try:
        dfa, ok = string_automaton(kept)
    except AutomatonError as e:
        n.unsupported("not", where, f"a negated pattern: {e}")
        return out
    if not any(ok(lab) for lab in dfa.labels):
        return UNSAT
    n.rewrite("not", where)
    return kept


def _norm_string(n: Walk, s: dict, pointer: str):
    lo, hi = n.count_bounds("minLength", s.get("minLength"), s.get("maxLength"), pointer)
    lo = int(lo) if lo is not None else None
    hi = int(hi) if hi is not None else None
    if lo is not None and hi is not None and lo > hi:
        return UNSAT
    fmt = s.get("format")
    pattern = s.get("pattern")
    if pattern is not None and fmt in FORMAT_SEARCHES:
        got = _format_with_pattern(n, fmt, pattern, lo, hi, pointer)
        if got is not None:
            return got
    if fmt in FORMAT_PATTERNS:
        return _pattern_format(n, fmt, pattern, lo, hi, pointer)
    if fmt is not None and fmt not in GRAMMAR_FORMATS | NODE_FORMATS:
        if fmt in CHECKED_FORMATS:
            n.unsupported("format", ptr(pointer, "format"), f"format '{fmt}' is not supported")
        fmt = None  # an annotation
    if fmt is not None:
        return _grammar_format(n, fmt, pattern, lo, hi, pointer)
    if pattern is not None and _expressible(n, pattern, pointer):
        return _norm_pattern(n, pattern, lo, hi, pointer)
    out = {"type": "string"}
    if lo:
        out["minLength"] = lo
    if hi is not None:
        out["maxLength"] = hi
    return out


def _pattern_format(n: Walk, fmt: str, pattern, lo, hi, pointer: str):
    """A format we enforce as an exact pattern (FORMAT_PATTERNS)."""
    n.rewrite("format", ptr(pointer, "format"))
    if pattern is not None:
        n.unsupported("pattern", ptr(pointer, "pattern"), "pattern beside format is not supported")
    flo, fhi = FORMAT_LENGTHS[fmt]
    if (lo or 0) > fhi or (hi is not None and hi < flo):
        return UNSAT
    if (lo or 0) > flo or (hi is not None and hi < fhi):
        kw = "minLength" if (lo or 0) > flo else "maxLength"
        n.unsupported(kw, ptr(pointer, kw), f"'{kw}' beside format '{fmt}' is not supported")
    return {"type": "string", "pattern": FORMAT_PATTERNS[fmt][1:-1]}


def _format_with_pattern(n: Walk, fmt: str, pattern: str, lo, hi, pointer: str):
    """`format` and `pattern` (and a length range) side by side: nodes.py's product automaton of
    the format (as a pattern: FORMAT_SEARCHES), the pattern (`allOf` of searches) and the lengths.
    None (the caller refuses as before) when the pattern has no automaton or it is too large."""
    out: dict = {"type": "string", "allOf": [{"pattern": pattern}]}
    whole = FORMAT_SEARCHES[fmt]
    if whole.startswith("^") and whole.endswith("$"):
        out["pattern"] = whole[1:-1]
    else:
        out["allOf"].append({"pattern": whole})
    if lo:
        out["minLength"] = lo
    if hi is not None:
        out["maxLength"] = hi
    try:
        dfa, ok = string_automaton(out)
    except AutomatonError:
        return None
    if not any(ok(lab) for lab in dfa.labels):
        return UNSAT
    n.rewrite("format", ptr(pointer, "format"))
    n.rewrite("pattern", ptr(pointer, "pattern"))
    return out


def _grammar_format(n: Walk, fmt: str, pattern, lo, hi, pointer: str) -> dict:
    """A format the backend enforces itself (GRAMMAR_FORMATS); nothing may sit beside it."""
    if pattern is not None or lo or hi is not None:
        kw = "pattern" if pattern is not None else ("minLength" if lo else "maxLength")
        n.unsupported(kw, ptr(pointer, kw), f"'{kw}' beside format '{fmt}' is not supported")
    return {"type": "string", "format": fmt}


def _expressible(n: Walk, pattern: str, pointer: str) -> bool:
    """False (after reporting it) when the pattern uses what no grammar here can express."""
    if "\\\\" in pattern:
        # the backend matches patterns against the raw JSON text, where a backslash starts an
        # escape: measured, the pattern a-backslash-n-b admitted the JSON string "a\\nb" (a newline)
        n.unsupported("pattern", ptr(pointer, "pattern"), "a literal backslash in a pattern is not supported")
        return False
    if has_unsupported_feature(pattern):
        n.unsupported(
            "pattern",
            ptr(pointer, "pattern"),
            "lookaround, backreferences, \\b and \\p{...} are not supported",
        )
        return False
    return True


def _norm_pattern(n: Walk, pattern: str, lo, hi, pointer: str):
    """`pattern` as a whole-string pattern, intersected with the length range lo..hi."""
    out = {"type": "string"}
    full = as_fullmatch(pattern)
    if full is None:
        n.unsupported(
            "pattern", ptr(pointer, "pattern"), "anchors (^, $) inside the pattern are not supported"
        )
        return out
    why = unconvertible(full)
    if why:
        n.unsupported("pattern", ptr(pointer, "pattern"), why)
        return out
    if full != pattern:
        n.rewrite("pattern", ptr(pointer, "pattern"))
    if lo or hi is not None:
        bounded = bound_repetition(full, lo or 0, hi)
        if bounded == "":
            return UNSAT
        if bounded is None and width_within(full, lo or 0, hi):
            bounded = full  # every match already has an allowed length
        if bounded is None:
            return _pattern_with_length(n, full, lo or 0, hi, pointer)
        n.rewrite("pattern", ptr(pointer, "pattern"))
        full = bounded
    out["pattern"] = full
    return out


def _pattern_with_length(n: Walk, full: str, lo: int, hi, pointer: str):
    """`pattern` and a length range kept side by side: nodes.py enforces both with the product
    automaton of the pattern and a length counter (automata.py); refused when it is too large."""
    kw = "maxLength" if hi is not None else "minLength"
    try:
        dfa = build([("regex", full), ("length", (lo, hi))], alphabet((full,)))
    except AutomatonError as e:
        n.unsupported(kw, ptr(pointer, kw), f"'{kw}' beside this pattern: {e}")
        return {"type": "string", "pattern": full}
    if not any(lab == {0, 1} for lab in dfa.labels):
        return UNSAT
    n.rewrite(kw, ptr(pointer, kw))
    out = {"type": "string", "pattern": full}
    if lo:
        out["minLength"] = lo
    if hi is not None:
        out["maxLength"] = hi
    return out
