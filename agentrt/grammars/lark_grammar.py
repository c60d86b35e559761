"""Lark grammars -> the backend's EBNF.

The grammar is parsed and expanded by `lark` itself (imports such as `%import common.WS`,
templates, `?rule` inlining, EBNF operators -> plain BNF rules), then written out as EBNF:
- each rule alternative becomes an EBNF alternative of its symbols;
- each terminal becomes a rule: a string (case-insensitive strings spelled `[sS][eE]...`) or its
  regular expression translated node by node from Python's regex parser (`re._parser`):
  literals, classes, `\\d \\w \\s`, `.`, groups, alternation, greedy repetition, inline `(?i:...)`;
- `%ignore` terminals may follow every terminal and open the text (`root ::= ign start`), bounded
  so a model that favours blanks cannot run to max_tokens: at most four ignored tokens per gap, each
  unbounded repetition inside them capped at `max_ignore_repeat` (default 16) characters or groups.

Refused with ValueError naming the construct (the result would not be the same language):
lookahead/lookbehind (except lark's own `ESCAPED_STRING`, mapped to its meaning), backreferences,
lazy repetition, `\\W \\S \\D`, Unicode-wide case folding. Lark priorities and the contextual
lexer only choose among parses; they do not change the language of the text, with one caveat: a
CFG admits tokenizations lark's greedy lexers would not choose, so rare outputs may not parse with
lark: a keyword spelled where a NAME is expected (LALR), or an ignored comment ended early
(`key #c = 1` with `%ignore SH_COMMENT`: lark's comment runs to the end of the line; no lark
parser accepts it). xgrammar's lookahead `(= ...)` is not enforced, so maximal munch cannot be
written into the grammar; a sound fix needs first-character sets of the terminals (open).
"""

from __future__ import annotations

import functools
import re

try:
    import re._constants as sre_c  # Python >= 3.11
    import re._parser as sre_parse
except ImportError:  # pragma: no cover
    import sre_constants as sre_c
    import sre_parse

# lark's common.ESCAPED_STRING and the `"\"" _STRING_INNER "\""` spelling of it: a double-quoted
# string with backslash escapes. Their lazy repetition / lookbehind only find the closing quote,
# so the language is that of the greedy rule below.
_ESCAPED_STRING_RES = ('".*?(?<!\\\\)(\\\\\\\\)*?"', '"(?:[^"\\\\]|\\\\.)*?"')
_ESCAPED_STRING_EBNF = '"\\"" ([^"\\\\] | "\\\\" [^])* "\\""'
_CATEGORIES = {
    sre_c.CATEGORY_DIGIT: "0-9",
    sre_c.CATEGORY_WORD: "a-zA-Z0-9_",
    sre_c.CATEGORY_SPACE: " \\t\\n\\r\\f\\v",
}


def _esc_char(cp: int, in_class: bool) -> str:
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


def _literal(text: str, ignore_case: bool = False) -> str:
    if not text:
        return '""'
    if not ignore_case or not any(c.isalpha() for c in text):
        return '"' + "".join(_esc_char(ord(c), False) for c in text) + '"'
    parts = []
    for c in text:
        if c.isascii() and c.isalpha():
            parts.append(f"[{c.lower()}{c.upper()}]")
        elif c.isalpha():
            raise ValueError(f"case-insensitive non-ASCII text {text!r} is not supported")
        else:
            parts.append('"' + _esc_char(ord(c), False) + '"')
    return "(" + " ".join(parts) + ")"


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
_ECMA_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
               (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]

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
_NEGATION_OF = {sre_c.CATEGORY_NOT_DIGIT: sre_c.CATEGORY_DIGIT, sre_c.CATEGORY_NOT_WORD: sre_c.CATEGORY_WORD,
                sre_c.CATEGORY_NOT_SPACE: sre_c.CATEGORY_SPACE}


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


class _RegexToEBNF:
    """Python-regex AST -> EBNF. json_string=True: the EBNF spells the pattern's matches as the
    raw text inside a JSON string (quote, backslash and control characters escaped; `.` and
    negated classes never produce a raw one), which is how xgrammar applies a JSON Schema pattern."""

    def __init__(self, terminal: str, json_string: bool = False, max_repeat: int | None = None):
        """max_repeat: cap unbounded repetitions (`*`, `+`, `{n,}`) at this many (None: unbounded)."""
        self.terminal = terminal
        self.json_string = json_string
        self.max_repeat = max_repeat

    def fail(self, what: str):
        raise ValueError(f"{self.terminal}: {what} cannot be converted to a grammar")

    def convert(self, pattern: str, ignore_case: bool) -> str:
        try:
            tree = sre_parse.parse(pattern)
        except OverflowError:
            raise ValueError(f"{self.terminal}: a repetition count is too large") from None
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
            c = chr(av)
            if ic and c.isascii() and c.isalpha():
                return f"[{c.lower()}{c.upper()}]"
            if self.json_string and (av in _JSON_ESCAPES or av < 0x20):
                raw = _JSON_ESCAPES.get(av) or f"\\u{av:04x}"
                return '"' + "".join(_esc_char(ord(ch), False) for ch in raw) + '"'
            return '"' + _esc_char(av, False) + '"'
        if op is sre_c.NOT_LITERAL:
            if self.json_string:
                return self.ranges([(av, av)] + _RAW_FORBIDDEN, negate=True)
            return f"[^{_esc_char(av, True)}]"
        if op is sre_c.ANY:
            return self.ranges([(0x0A, 0x0A)] + _RAW_FORBIDDEN, negate=True) if self.json_string else "[^\\n]"
        if op is sre_c.IN:
            return self.char_class(av, ic)
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
            lo, hi, sub = av
            inner = self.seq(list(sub), ic)
            if not re.fullmatch(r'\[(?:\\.|[^\]\\])*\]|"(?:\\.|[^"\\])*"|\(.*\)', inner) or \
                    (inner.startswith("(") and not _balanced_group(inner)):
                inner = f"({inner})"
            if hi is sre_c.MAXREPEAT and self.max_repeat is not None:
                hi = max(lo, self.max_repeat)
            if hi is sre_c.MAXREPEAT:
                return f"{inner}*" if lo == 0 else (f"{inner}+" if lo == 1 else f"{inner}{{{lo},}}")
            if (lo, hi) == (0, 1):
                return f"{inner}?"
            return f"{inner}{{{lo},{hi}}}"
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
        return ""

    def ranges(self, ranges, negate: bool) -> str:
        body = "".join(_esc_char(lo, True) if lo == hi else f"{_esc_char(lo, True)}-{_esc_char(hi, True)}"
                       for lo, hi in sorted(ranges))
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
        if self.json_string:
            return self.json_class(items, ic)
        negate = False
        out = []
        for op, av in items:
            if op is sre_c.NEGATE:
                negate = True
            elif op is sre_c.LITERAL:
                out.append(_esc_char(av, True))
                c = chr(av)
                if ic and c.isascii() and c.isalpha():
                    out.append(c.swapcase())
            elif op is sre_c.RANGE:
                lo, hi = av
                out.append(f"{_esc_char(lo, True)}-{_esc_char(hi, True)}")
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
    trailing `$` are allowed; anchors elsewhere, lookaround and backreferences raise ValueError)."""
    core = pattern
    core = core.removeprefix("^")
    if core.endswith("$") and not core.endswith("\\$"):
        core = core[:-1]
    return _RegexToEBNF("regex").convert(core, False)


def regex_to_json_string_ebnf(pattern: str) -> str:
    """An EBNF expression for the raw JSON-string text of values that fully match `pattern`
    (Python/ECMA regex without anchors). Raises ValueError on constructs it cannot express."""
    return _RegexToEBNF("pattern", json_string=True).convert(pattern, False)


def _balanced_group(text: str) -> bool:
    """Is `text` one parenthesized group (its first '(' closes at the end)?"""
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
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0 and i != len(text) - 1:
                return False
        i += 1
    return True


def _rule_name(name: str) -> str:
    return "r_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def _term_name(name: str) -> str:
    return "t_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def lark_to_ebnf(text: str, start: str = "start", max_ignore_repeat: int = 16) -> str:
    """EBNF (root rule `root`) with the language of the Lark grammar `text` from rule `start`.
    Raises ValueError naming the problem (a Lark syntax error, or a construct above)."""
    import lark

    try:
        parser = lark.Lark(text, start=start, parser="earley", lexer="dynamic", keep_all_tokens=True)
    except (lark.exceptions.LarkError, OSError, OverflowError) as e:  # OSError: %import of an unknown module
        raise ValueError(f"not a valid Lark grammar: {e}") from None
    ignore = list(parser.ignore_tokens)
    lines = []
    alts: dict[str, list[str]] = {}
    ws = " ign" if ignore else ""
    for rule in parser.rules:
        syms = []
        for sym in rule.expansion:
            syms.append(_term_name(sym.name) + ws if sym.is_term else _rule_name(sym.name))
        alts.setdefault(rule.origin.name, []).append(" ".join(syms) if syms else '""')
    if start not in alts:
        raise ValueError(f"the Lark grammar has no '{start}' rule")
    lines.append(f"root ::= {'ign ' if ignore else ''}{_rule_name(start)}")
    for name, options in alts.items():
        lines.append(f"{_rule_name(name)} ::= " + " | ".join(f"({o})" for o in options))
    for t in parser.terminals:
        pat = t.pattern
        if pat.type == "str":
            body = _literal(pat.value, "i" in pat.flags)
        elif pat.value in _ESCAPED_STRING_RES:
            body = _ESCAPED_STRING_EBNF
        else:
            body = _RegexToEBNF(t.name).convert(pat.value, "i" in pat.flags)
        lines.append(f"{_term_name(t.name)} ::= {body}")
    if ignore:
        by_name = {t.name: t.pattern for t in parser.terminals}
        for n in ignore:
            pat = by_name[n]
            body = (_literal(pat.value, "i" in pat.flags) if pat.type == "str" else
                    _RegexToEBNF(n, max_repeat=max_ignore_repeat).convert(pat.value, "i" in pat.flags))
            lines.append(f"i_{_term_name(n)} ::= {body}")
        one = "(" + " | ".join(f"i_{_term_name(n)}" for n in ignore) + ")"
        lines.append(f"ign ::= ({one} ({one} ({one} {one}?)?)?)?")
    return "\n".join(lines) + "\n"
