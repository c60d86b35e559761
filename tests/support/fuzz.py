"""Hypothesis strategies for constraint and API fuzzing, and the guards that keep a fuzz run bounded.

Constraints come as the user sends them: JSON Schemas (recursive: nested objects/arrays, anyOf/allOf/
oneOf, $ref, huge minItems/maxLength/bounds, enums of odd strings, patterns, keywords that cannot be
enforced), regexes (huge and nested repetition counts, lookaround, backreferences, invalid syntax,
surrogate and byte escapes), EBNF texts (GBNF style, root rule `root`: huge `{n,m}` counts, deep
nesting, undefined rules, odd escapes) and Lark texts, plus raw random text for each. `bounded=True`
keeps every count and size small enough that a short generation over the constraint is cheap (the
unbounded variants are for the compile path only: a forced run of 10^9 characters materialised by
jump-forward takes gigabytes, see issue 17).

`memory_cap` lowers this process's address-space limit so that a runaway allocation fails (a
MemoryError / std::bad_alloc in the test) instead of the kernel's OOM killer taking the machine.
"""

from __future__ import annotations

import contextlib
import json
import resource
from collections.abc import Iterator

from hypothesis import strategies as st

HUGE_COUNTS = (1000, 10**6, 10**9, 2**31 - 1, 2**31, 2**32, 2**63, 10**20)
"""Repetition counts and sizes a client may send: past any output budget, past int32/int64."""

ODD_CHARS = '"\\\n\r\t\x00\x01\x7f\u00e9\u2028\u2029\ufeff\U0001f600{}[]()|*+?.^$/:,'
"""Characters that need escaping somewhere: quotes, backslash, control characters, line/paragraph
separators, BOM, an astral character, regex and grammar metacharacters."""


def counts(bounded: bool) -> st.SearchStrategy[int]:
    small = st.integers(0, 12)
    return small if bounded else st.one_of(small, st.sampled_from(HUGE_COUNTS))


def odd_text(min_size: int = 0, max_size: int = 12, surrogates: bool = False) -> st.SearchStrategy[str]:
    """Short text mixing ODD_CHARS with any printable Unicode (lone surrogates only when asked:
    JSON can carry them as \\ud800 escapes, UTF-8 cannot)."""
    alphabet = st.one_of(
        st.sampled_from(ODD_CHARS),
        st.characters(codec="utf-8"),
        *([st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)] if surrogates else []),
    )
    return st.text(alphabet, min_size=min_size, max_size=max_size)


# ---- JSON Schema -------------------------------------------------------------------------------------
PATTERNS = (
    "^[a-z]+$",
    "a{1000000000}",
    "(a+)+$",
    "^(?=a)b",
    "\\d{3}-\\d{4}",
    "[",
    "\\p{L}+",
    "(x|y){2,5}",
    "\\ud800",
    "^.*$",
)
FORMATS = ("date", "date-time", "time", "email", "ipv4", "uuid", "uri", "int64", "nonsense")


def _string_schema(bounded: bool) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={
            "minLength": counts(bounded),
            "maxLength": counts(bounded),
            "pattern": st.sampled_from(PATTERNS),
            "format": st.sampled_from(FORMATS),
        },
    )


def _number_schema(bounded: bool) -> st.SearchStrategy[dict]:
    big = st.integers(-(10**30), 10**30) if not bounded else st.integers(-1000, 1000)
    return st.fixed_dictionaries(
        {"type": st.sampled_from(["integer", "number"])},
        optional={
            "minimum": big,
            "maximum": big,
            "exclusiveMinimum": big,
            "multipleOf": st.sampled_from([1, 2, 0.5]),
        },
    )


def _leaf_schema(bounded: bool) -> st.SearchStrategy:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), odd_text())
    return st.one_of(
        _string_schema(bounded),
        _number_schema(bounded),
        st.sampled_from([{"type": "boolean"}, {"type": "null"}, {}, True, False]),
        st.builds(lambda xs: {"enum": xs}, st.lists(scalars, min_size=1, max_size=5)),
        st.builds(lambda x: {"const": x}, scalars),
        st.sampled_from([{"not": {}}, {"type": "array", "uniqueItems": True}, {"if": {}, "then": {}}]),
    )


def _extend_schema(children: st.SearchStrategy, bounded: bool) -> st.SearchStrategy:
    props = st.dictionaries(odd_text(max_size=8), children, max_size=4)
    obj = st.builds(
        lambda p, req, extra: {
            "type": "object",
            "properties": p,
            "required": [k for k in p if req],
            **({"additionalProperties": extra} if extra is not None else {}),
        },
        props,
        st.booleans(),
        st.one_of(st.none(), st.booleans(), children),
    )
    arr = st.builds(
        lambda items, lo, hi: {
            "type": "array",
            "items": items,
            **({"minItems": lo} if lo is not None else {}),
            **({"maxItems": hi} if hi is not None else {}),
        },
        children,
        st.one_of(st.none(), counts(bounded)),
        st.one_of(st.none(), counts(bounded)),
    )
    combo = st.builds(
        lambda kw, xs: {kw: xs},
        st.sampled_from(["anyOf", "allOf", "oneOf"]),
        st.lists(children, min_size=1, max_size=3),
    )
    ref = st.builds(lambda d: {"$defs": {"d": d}, "$ref": "#/$defs/d"}, children)
    return st.one_of(obj, arr, combo, ref)


def json_schemas(bounded: bool = False, max_leaves: int = 12) -> st.SearchStrategy:
    """A JSON Schema (dict or bool), valid or not, enforceable or not."""
    return st.recursive(_leaf_schema(bounded), lambda c: _extend_schema(c, bounded), max_leaves=max_leaves)


def deep_schema(depth: int, kind: str = "array") -> dict:
    """A schema nested `depth` levels (arrays of arrays, or objects of objects)."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        if kind == "array":
            schema = {"type": "array", "items": schema}
        else:
            schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# ---- regex -------------------------------------------------------------------------------------------
_REGEX_ATOMS = (
    "a",
    "\\d",
    "\\w",
    "\\s",
    ".",
    "[a-z]",
    "[^x]",
    "\\.",
    "\\xff",
    "\\u00e9",
    "\\ud800",
    "\\udfff",
    "\\U0001F600",
    "\\p{L}",
    "\\1",
    "(?=a)",
    "(?<!b)",
    "(?P<n>a)",
    "(?i)",
    "\\b",
    "^",
    "$",
    "[",
    ")",
    "(",
    "{",
    "\\",
    "[z-a]",
    "é",
)


def _quantifier(bounded: bool) -> st.SearchStrategy[str]:
    n = counts(bounded)
    return st.one_of(
        st.sampled_from(["", "", "*", "+", "?", "*?", "+?", "{,}", "{-1}"]),
        n.map(lambda k: f"{{{k}}}"),
        st.tuples(n, n).map(lambda p: f"{{{p[0]},{p[1]}}}"),
        n.map(lambda k: f"{{{k},}}"),
    )


def regexes(bounded: bool = False) -> st.SearchStrategy[str]:
    """A regex text: atoms, groups, alternation and quantifiers (nested, huge counts), odd escapes,
    invalid syntax; or raw random text."""
    atom = st.one_of(st.sampled_from(_REGEX_ATOMS), odd_text(1, 3).map(lambda s: s))
    piece = st.tuples(atom, _quantifier(bounded)).map("".join)

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        group = st.tuples(inner, _quantifier(bounded)).map(lambda p: f"({p[0]}){p[1]}")
        alt = st.lists(inner, min_size=2, max_size=3).map("|".join)
        seq = st.lists(inner, min_size=2, max_size=3).map("".join)
        return st.one_of(group, alt, seq)

    structured = st.recursive(piece, extend, max_leaves=8)
    return st.one_of(structured, odd_text(1, 20)).filter(bool)


# ---- EBNF (GBNF style) and Lark ----------------------------------------------------------------------
def _ebnf_literal() -> st.SearchStrategy[str]:
    escapes = st.sampled_from(['"\\ud800"', '"\\xff"', '"\\u0000"', '"\\n"', '"\\""', '"\\\\"', '""'])
    plain = st.text(st.characters(codec="utf-8", exclude_characters='"\\\n'), min_size=1, max_size=4)
    return st.one_of(escapes, plain.map(lambda s: json.dumps(s, ensure_ascii=False)))


def _grouped(quant: st.SearchStrategy[str]):
    """Grammar bodies one level up from `inner`: a quantified group, an alternation or a sequence."""

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.tuples(inner, quant).map(lambda p: f"({p[0]}){p[1]}"),
            st.lists(inner, min_size=2, max_size=3).map(" | ".join),
            st.lists(inner, min_size=2, max_size=3).map(" ".join),
        )

    return extend


def ebnf_grammars(bounded: bool = False) -> st.SearchStrategy[str]:
    """An EBNF text with rules root, r1, r2: literals, classes, references (r3 is undefined),
    groups, alternation, `*`/`+`/`?`/`{n,m}` with huge counts, deep nesting; or raw text."""
    n = counts(bounded)
    quant = st.one_of(
        st.sampled_from(["", "", "*", "+", "?"]),
        n.map(lambda k: f"{{{k}}}"),
        st.tuples(n, n).map(lambda p: f"{{{p[0]},{p[1]}}}"),
        n.map(lambda k: f"{{{k},}}"),
    )
    atom = st.one_of(
        _ebnf_literal(), st.sampled_from(["[a-z]", "[^\\n]", "[\\ud800]", "r1", "r2", "r3", "root", "[z-a]"])
    )
    piece = st.tuples(atom, quant).map("".join)

    body = st.recursive(piece, _grouped(quant), max_leaves=8)
    text = st.tuples(body, body, body).map(lambda b: f"root ::= {b[0]}\nr1 ::= {b[1]}\nr2 ::= {b[2]}\n")
    nested = st.integers(1, 3000).map(lambda d: "root ::= " + "(" * d + '"a"' + ")" * d + "\n")
    return st.one_of(text, nested, odd_text(1, 30).filter(str.strip))


def lark_grammars(bounded: bool = False) -> st.SearchStrategy[str]:
    """A Lark text with rule start and terminals: literals, regex terminals, `~ n..m` repeats with
    huge counts, %ignore, undefined names; or raw text."""
    n = counts(bounded)
    quant = st.one_of(
        st.sampled_from(["", "", "*", "+", "?"]),
        n.map(lambda k: f" ~ {k}"),
        st.tuples(n, n).map(lambda p: f" ~ {p[0]}..{p[1]}"),
    )
    atom = st.one_of(
        _ebnf_literal(),
        st.sampled_from(["/[a-z]+/", "/a{1000000000}/", "/(?=a)b/", "NUM", "item", "missing", "/\\ud800/"]),
    )
    piece = st.tuples(atom, quant).map("".join)

    # `~ n..m` on a group: Lark alone expanded it into every combination (issue 17:
    # `("b" ~ 5 | "c" ~ 5 | "d") ~ 6..12` took ~150 s in lark.Lark(); grammars/lark_grammar.py)
    body = st.recursive(piece, _grouped(quant), max_leaves=8)
    text = st.tuples(body, body, st.booleans()).map(
        lambda b: f"start: {b[0]}\nitem: {b[1]}\nNUM: /[0-9]+/\n" + ("%ignore /[ ]+/\n" if b[2] else "")
    )
    return st.one_of(text, odd_text(1, 30).filter(str.strip))


def choices(surrogates: bool = False) -> st.SearchStrategy[list[str]]:
    return st.lists(odd_text(0, 10, surrogates=surrogates), min_size=0, max_size=6)


# ---- guards ------------------------------------------------------------------------------------------
def _vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def memory_cap(extra_bytes: int = 3 << 30) -> Iterator[None]:
    """Limit this process's address space to its current size plus `extra_bytes` (soft
    RLIMIT_AS), restored on exit: an allocation past it fails in the test instead of the machine
    running out of memory. Linux only (reads /proc); elsewhere a no-op."""
    try:
        limit = _vm_size_bytes() + extra_bytes
    except OSError:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
