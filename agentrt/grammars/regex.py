"""Regular expressions for constraints, in one place: scanning a JSON Schema `pattern`, rewriting
it to a whole-string match, intersecting it with a length range, and translating a regex to EBNF.

Three dialects meet here. JSON Schema `pattern` is an ECMA-262 regex applied as a *search*
(JSON Schema 2020-12 validation §6.3.3; ECMA-262 §22.2); the grammar backend matches the *whole*
string; Python's `re` parses both dialects' common subset (`re._parser`) and checks instances in
the wild. So:
- `as_fullmatch` rewrites a search into a whole-string pattern (`p` -> `.*(?:p).*`, `^p$` -> `p`),
  with a small scanner (`_scan`) that tracks escapes, classes and group depth;
- `bound_repetition` / `width_within` intersect a pattern with minLength/maxLength;
- `matches_every_key` decides whether a `patternProperties` pattern matches every name;
- `RegexToEBNF` translates Python's regex AST node by node to EBNF (GBNF-style, xgrammar's
  dialect): for Lark terminals, `regex` constraints (`regex_to_ebnf`) and JSON-string patterns
  (`regex_to_json_string_ebnf`: the raw text inside a JSON string, RFC 8259 §7 escapes).

Errors: constructs that cannot be translated raise `agentrt.errors.ConstraintError` (a ValueError)
naming the construct; the caller that knows the keyword (e.g. `pattern`) reports it.
"""

from __future__ import annotations

import functools
import re

from agentrt.errors import ConstraintError

try:
    import re._constants as sre_c  # Python >= 3.11
    import re._parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants as sre_c
    import sre_parse

# ---- ECMA-262 search -> whole-string pattern ------------------------------------------------------

# regex features the grammar backend cannot express (ECMA-262 lookaround, backreferences, word
# boundaries, Unicode properties, named groups)
_UNSUPPORTED_ECMA = re.compile(r"\(\?[=!<]|\\[1-9bBpPk]")


def has_unsupported_feature(pattern: str) -> bool:
    """Does `pattern` use lookaround, a backreference, `\\b`/`\\B`, `\\p{...}` or a named group?"""
    return _UNSUPPORTED_ECMA.search(pattern) is not None


def _scan(text: str):
    """Yield (index, char, depth, in_class) for unescaped characters of a regex."""
    depth, in_class, i = 0, False, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            yield i, c, depth, True
        else:
            if c == "[":
                in_class = True
                if text[i + 1 : i + 2] == "^":
                    i += 1
                if text[i + 1 : i + 2] == "]":
                    i += 1
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            yield i, c, depth, False
        i += 1


def _split_top(text: str, sep: str) -> list[str]:
    cuts = [i for i, c, depth, in_class in _scan(text) if c == sep and depth == 0 and not in_class]
    parts, prev = [], 0
    for i in cuts:
        parts.append(text[prev:i])
        prev = i + 1
    return parts + [text[prev:]]


def _is_one_group(text: str) -> bool:
    if (
        not (text.startswith("(") and text.endswith(")"))
        or text.startswith("(?")
        and not text.startswith("(?:")
    ):
        return False
    for i, c, depth, in_class in _scan(text):
        if c == ")" and not in_class and depth == 0:
            return i == len(text) - 1
    return False


def _has_anchor(text: str) -> bool:
    return any(c in "^$" and not in_class for _i, c, _d, in_class in _scan(text))


def as_fullmatch(pattern: str) -> str | None:
    """JSON Schema `pattern` is a search (ECMA-262, unanchored); the backend matches the whole
    string and ignores anchors inside a pattern. Rewrite to a whole-string pattern: '^p$' -> 'p';
    'p' -> '.*(?:p).*'; top-level alternatives anchored one by one ('(^a$)|(^b)') each get their
    own padding. None when an anchor sits anywhere else (refused by the caller)."""
    body = pattern
    while _is_one_group(body):
        body = body[body.index(":") + 1 if body.startswith("(?:") else 1 : -1]
    alts = _split_top(body, "|")
    out = []
    for alt in alts:
        while _is_one_group(alt):
            alt = alt[alt.index(":") + 1 if alt.startswith("(?:") else 1 : -1]
        head = alt.startswith("^")
        tail = alt.endswith("$") and not alt.endswith("\\$")
        core = alt[1 if head else 0 : len(alt) - (1 if tail else 0)]
        if _has_anchor(core):
            return None
        out.append(
            ("" if head else ".*") + ("(?:" + core + ")" if "|" in core else core) + ("" if tail else ".*")
        )
    if len(out) == 1:
        return out[0]
    return "(?:" + "|".join(out) + ")"


def matches_every_key(pattern: str, strict: bool) -> bool:
    """Does an ECMA-262 search for `pattern` match every property name? True when the pattern can
    match the empty string at position 0 and has no end anchor. With strict=False a trailing `$`
    is allowed too (`^.*$` misses only names containing a newline: treating it as matching every
    name is then narrower than the schema, never wider)."""
    if has_unsupported_feature(pattern):
        return False
    core = pattern
    if not strict and core.endswith("$") and not core.endswith("\\$"):
        core = core[:-1]
    if "$" in core.replace("\\$", ""):
        return False
    try:
        return re.match(core, "") is not None
    except re.error:
        return False


# ---- length ranges ------------------------------------------------------------------------------

_ATOM = r"(?:\[(?:\\.|[^\]\\])+\]|\\[dDwWsS]|\\.|[^\\\[\](){}|*+?.^$])"
_REPEAT = re.compile(rf"^(?:\(\?:)?({_ATOM})(\*|\+|\?|\{{(\d+)(?:,(\d*))?\}})?(?:\))?$")


def bound_repetition(full: str, lo: int, hi: int | None) -> str | None:
    """Intersect a whole-string pattern that is one character class repeated (`[a-z]+`, `\\d{2,5}`,
    `x*`) with a length range; None when the pattern has another shape, "" when nothing matches."""
    m = _REPEAT.match(full)
    if not m or full.startswith("(?:") != full.endswith(")"):
        return None
    atom, q, qa, qb = m.groups()
    if q is None:
        a, b = 1, 1
    elif q in ("*", "+", "?"):
        a, b = {"*": (0, None), "+": (1, None), "?": (0, 1)}[q]
    else:
        a = int(qa)
        b = a if qb is None else (int(qb) if qb else None)
    a = max(a, lo)
    b = hi if b is None else (b if hi is None else min(b, hi))
    if b is not None and a > b:
        return ""  # no string matches both
    return f"{atom}{{{a},{'' if b is None else b}}}"


def width_within(full: str, lo: int, hi: int | None) -> bool:
    """Do all whole-string matches of `full` have lo..hi characters? (Python's regex parser gives
    the min/max match width; a pattern it cannot parse gives False.)"""
    try:
        wmin, wmax = sre_parse.parse(full).getwidth()
    except (re.error, OverflowError, RecursionError):
        return False
    return wmin >= lo and (hi is None or wmax <= hi)


# ---- regex -> EBNF ------------------------------------------------------------------------------

_CATEGORIES = {
    sre_c.CATEGORY_DIGIT: "0-9",
    sre_c.CATEGORY_WORD: "a-zA-Z0-9_",
    sre_c.CATEGORY_SPACE: " \\t\\n\\r\\f\\v",
}


def esc_char(cp: int, in_class: bool) -> str:
    """Code point `cp` as EBNF text inside a string literal (in_class=False) or a class."""
    c = chr(cp)
    if c == "\n":
        return "\\n"
    if c == "\t":
        return "\\t"
    if c == "\r":
        return "\\r"
    if c in ("\\", '"') or (in_class and c in "]-^["):
        return "\\" + c
    if cp < 0x20 or cp == 0x7F:
        return f"\\x{cp:02x}"
    return c


_JSON_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
_RAW_FORBIDDEN = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # must be escaped inside a JSON string
_CATEGORY_RANGES = {
    sre_c.CATEGORY_DIGIT: [(0x30, 0x39)],
    sre_c.CATEGORY_WORD: [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    sre_c.CATEGORY_SPACE: [(0x09, 0x0D), (0x20, 0x20)],
}
# JSON Schema patterns are ECMA-262 (\d, \w ASCII; \s Unicode spaces); instances are checked by
# Python's `re` in the wild (\d, \w, \s Unicode). Classes above are in both; a negated class is
# the complement of the union of both meanings, so it is sound under either.
_ECMA_SPACE = [
    (0x09, 0x0D),
    (0x20, 0x20),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
    (0xFEFF, 0xFEFF),
]


@functools.cache
def _python_class(cls: str) -> tuple[tuple[int, int], ...]:
    """Code-point ranges Python's `re` puts in \\d, \\w or \\s (Unicode)."""
    rx = re.compile(cls)
    inside, lo = [], None
    for cp in range(0x110000):
        hit = rx.match(chr(cp)) is not None
        if hit and lo is None:
            lo = cp
        elif not hit and lo is not None:
            inside.append((lo, cp - 1))
            lo = None
    return tuple(inside)


def _intersect(a, b):
    return _subtract(a, _subtract([(0, 0x10FFFF)], b))


_POSITIVE = {sre_c.CATEGORY_DIGIT: "\\d", sre_c.CATEGORY_WORD: "\\w", sre_c.CATEGORY_SPACE: "\\s"}
_NEGATION_OF = {
    sre_c.CATEGORY_NOT_DIGIT: sre_c.CATEGORY_DIGIT,
    sre_c.CATEGORY_NOT_WORD: sre_c.CATEGORY_WORD,
    sre_c.CATEGORY_NOT_SPACE: sre_c.CATEGORY_SPACE,
}


def _category_ranges(category, widest: bool) -> list[tuple[int, int]]:
    """\\d \\w \\s \\D \\W \\S as code-point ranges. widest=False: only what ECMA-262 and Python
    both put in the class; widest=True: all that either does."""
    positive = _NEGATION_OF.get(category, category)
    python = list(_python_class(_POSITIVE[positive]))
    ecma = _ECMA_SPACE if positive is sre_c.CATEGORY_SPACE else _CATEGORY_RANGES[positive]
    union = _merge(python + ecma + _CATEGORY_RANGES[positive])
    if category is positive:
        return union if widest else list(_CATEGORY_RANGES[positive])
    # a negation is the complement of the positive class taken at its opposite width
    return _subtract([(0, 0x10FFFF)], _intersect(python, ecma) if widest else union)


def _merge(ranges):
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _subtract(ranges, cut):
    out = []
    for lo, hi in ranges:
        pieces = [(lo, hi)]
        for clo, chi in cut:
            nxt = []
            for a, b in pieces:
                if chi < a or clo > b:
                    nxt.append((a, b))
                    continue
                if a < clo:
                    nxt.append((a, clo - 1))
                if chi < b:
                    nxt.append((chi + 1, b))
            pieces = nxt
        out += pieces
    return out


def ebnf_chars(text: str):
    """(index, character, depth) of each character of EBNF `text` outside string literals,
    character classes and escapes; depth: the parentheses open after it (a ')' is already closed)."""
    depth, in_str, in_cls, i = 0, False, False, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if in_str:
            in_str = c != '"'
        elif in_cls:
            in_cls = c != "]"
        elif c == '"':
            in_str = True
        elif c == "[":
            in_cls = True
        else:
            depth += (c == "(") - (c == ")")
            yield i, c, depth
        i += 1


def _balanced_group(text: str) -> bool:
    """Is `text` (EBNF) one parenthesized group (its first '(' closes at the end)?"""
    return all(not (c == ")" and d == 0 and i != len(text) - 1) for i, c, d in ebnf_chars(text))


class RegexToEBNF:
    """Python-regex AST -> EBNF. json_string=True: the EBNF spells the pattern's matches as the
    raw text inside a JSON string (quote, backslash and control characters escaped; `.` and
    negated classes never produce a raw one), which is how xgrammar applies a JSON Schema pattern.

    Translated: literals, classes, `\\d \\w \\s`, `.`, groups, alternation, greedy repetition,
    inline `(?i:...)`. Refused (ConstraintError "<terminal>: <construct> cannot be converted to a
    grammar"): lookaround, backreferences, anchors inside the pattern, lazy repetition (except in
    JSON-string patterns, whose language ignores laziness), `\\W \\S \\D` outside JSON strings."""

    def __init__(self, terminal: str, json_string: bool = False, max_repeat: int | None = None):
        """terminal: the name errors use; max_repeat: cap unbounded repetitions (`*`, `+`, `{n,}`)
        at this many (None: unbounded)."""
        self.terminal = terminal
        self.json_string = json_string
        self.max_repeat = max_repeat

    def fail(self, what: str):
        raise ConstraintError(f"{self.terminal}: {what} cannot be converted to a grammar")

    def convert(self, pattern: str, ignore_case: bool) -> str:
        try:
            tree = sre_parse.parse(pattern)
        except OverflowError:
            raise ConstraintError(f"{self.terminal}: a repetition count is too large") from None
        except re.error as e:
            self.fail(f"regex {pattern!r} ({e})")
        if tree.state.flags & re.IGNORECASE:
            ignore_case = True
        return self.seq(list(tree), ignore_case)

    def seq(self, items, ic: bool) -> str:
        parts = [self.node(op, av, ic) for op, av in items]
        parts = [p for p in parts if p != '""']
        if not parts:
            return '""'
        return parts[0] if len(parts) == 1 else "(" + " ".join(parts) + ")"

    def node(self, op, av, ic: bool) -> str:
        if op is sre_c.LITERAL:
            return self.literal(av, ic)
        if op is sre_c.NOT_LITERAL:
            if self.json_string:
                return self.ranges([(av, av)] + _RAW_FORBIDDEN, negate=True)
            return f"[^{esc_char(av, True)}]"
        if op is sre_c.ANY:
            return self.ranges([(0x0A, 0x0A)] + _RAW_FORBIDDEN, negate=True) if self.json_string else "[^\\n]"
        if op is sre_c.IN:
            return self.json_class(av, ic) if self.json_string else self.char_class(av, ic)
        if op is sre_c.BRANCH:
            return "(" + " | ".join(self.seq(list(b), ic) for b in av[1]) + ")"
        if op is sre_c.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            if add_flags & re.IGNORECASE:
                ic = True
            if del_flags & re.IGNORECASE:
                ic = False
            return self.seq(list(sub), ic)
        if op is sre_c.MIN_REPEAT and self.json_string:
            op = sre_c.MAX_REPEAT  # a pattern's language (the strings it matches) ignores laziness
        if op is sre_c.MAX_REPEAT:
            return self.repeat(*av, ic)
        self.refuse(op)
        return ""

    def literal(self, av: int, ic: bool) -> str:
        c = chr(av)
        if ic and c.isascii() and c.isalpha():
            return f"[{c.lower()}{c.upper()}]"
        if self.json_string and (av in _JSON_ESCAPES or av < 0x20):
            raw = _JSON_ESCAPES.get(av) or f"\\u{av:04x}"
            return '"' + "".join(esc_char(ord(ch), False) for ch in raw) + '"'
        return '"' + esc_char(av, False) + '"'

    def repeat(self, lo: int, hi: int, sub, ic: bool) -> str:
        inner = self.seq(list(sub), ic)
        if not re.fullmatch(r'\[(?:\\.|[^\]\\])*\]|"(?:\\.|[^"\\])*"|\(.*\)', inner) or (
            inner.startswith("(") and not _balanced_group(inner)
        ):
            inner = f"({inner})"
        if hi is sre_c.MAXREPEAT and self.max_repeat is not None:
            hi = max(lo, self.max_repeat)
        if hi is sre_c.MAXREPEAT:
            return f"{inner}*" if lo == 0 else (f"{inner}+" if lo == 1 else f"{inner}{{{lo},}}")
        if (lo, hi) == (0, 1):
            return f"{inner}?"
        return f"{inner}{{{lo},{hi}}}"

    def refuse(self, op) -> None:
        """Raise the ConstraintError naming a construct with no EBNF translation."""
        if op is sre_c.MIN_REPEAT:
            self.fail("lazy repetition (*?, +?)")
        if op in (sre_c.ASSERT, sre_c.ASSERT_NOT):
            self.fail("lookahead/lookbehind")
        if op is sre_c.GROUPREF or op is getattr(sre_c, "GROUPREF_EXISTS", None):
            self.fail("a backreference")
        if op is sre_c.AT:
            self.fail("an anchor or word boundary")
        if op is getattr(sre_c, "ATOMIC_GROUP", None) or op is getattr(sre_c, "POSSESSIVE_REPEAT", None):
            self.fail("atomic groups / possessive repetition")
        self.fail(f"regex construct {op}")

    def ranges(self, ranges, negate: bool) -> str:
        body = "".join(
            esc_char(lo, True) if lo == hi else f"{esc_char(lo, True)}-{esc_char(hi, True)}"
            for lo, hi in sorted(ranges)
        )
        if not body:
            return "[^\\0-\\U0010ffff]" if not negate else '""'
        return "[" + ("^" if negate else "") + body + "]"

    def json_class(self, items, ic: bool) -> str:
        negate, ranges = False, []
        for op, av in items:
            if op is sre_c.NEGATE:
                negate = True
            elif op is sre_c.LITERAL:
                ranges.append((av, av))
                c = chr(av)
                if ic and c.isascii() and c.isalpha():
                    ranges.append((ord(c.swapcase()),) * 2)
            elif op is sre_c.RANGE:
                ranges.append(av)
            elif op is sre_c.CATEGORY and (av in _POSITIVE or av in _NEGATION_OF):
                # in [...] a category must not hold more than both meanings agree on; in [^...] it
                # must hold all that either meaning does (its complement is what is allowed)
                ranges += _category_ranges(av, widest=negate)  # NEGATE comes first
            else:
                self.fail(f"class item {op}")
        if negate:
            return self.ranges(ranges + _RAW_FORBIDDEN, negate=True)
        allowed = _subtract(ranges, _RAW_FORBIDDEN)
        if not allowed:
            self.fail("a class of only quote, backslash or control characters")
        return self.ranges(allowed, negate=False)

    def char_class(self, items, ic: bool) -> str:
        negate = False
        out = []
        for op, av in items:
            if op is sre_c.NEGATE:
                negate = True
            elif op is sre_c.LITERAL:
                out.append(esc_char(av, True))
                c = chr(av)
                if ic and c.isascii() and c.isalpha():
                    out.append(c.swapcase())
            elif op is sre_c.RANGE:
                lo, hi = av
                out.append(f"{esc_char(lo, True)}-{esc_char(hi, True)}")
                if ic:
                    for a, b in ((ord("a"), ord("z")), (ord("A"), ord("Z"))):
                        s, e = max(lo, a), min(hi, b)
                        if s <= e:
                            out.append(f"{chr(s).swapcase()}-{chr(e).swapcase()}")
            elif op is sre_c.CATEGORY:
                if av not in _CATEGORIES:
                    self.fail("\\W, \\S and \\D (their Unicode meaning)")
                out.append(_CATEGORIES[av])
            else:
                self.fail(f"class item {op}")
        if not out:
            return "[^]" if negate else '""'
        return "[" + ("^" if negate else "") + "".join(out) + "]"


def regex_to_ebnf(pattern: str) -> str:
    """An EBNF expression for the strings that fully match `pattern` (a leading `^` and a
    trailing `$` are allowed; anchors elsewhere, lookaround and backreferences raise
    ConstraintError)."""
    core = pattern
    core = core.removeprefix("^")
    if core.endswith("$") and not core.endswith("\\$"):
        core = core[:-1]
    return RegexToEBNF("regex").convert(core, False)


def regex_to_json_string_ebnf(pattern: str) -> str:
    """An EBNF expression for the raw JSON-string text of values that fully match `pattern`
    (Python/ECMA regex without anchors). Raises ConstraintError on constructs it cannot express."""
    return RegexToEBNF("pattern", json_string=True).convert(pattern, False)


def unconvertible(full: str) -> str:
    """Why a whole-match pattern has no grammar inside a JSON string ("" when it has one)."""
    try:
        regex_to_json_string_ebnf(full)
    except ConstraintError as e:
        return e.message.split(": ", 1)[-1]
    return ""
