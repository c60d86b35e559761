"""The rule table the schema-aware SQL grammar is written from (agentrt/sql/grammar.py), and its
two spellings: Lark (start rule `start`) and xgrammar EBNF (root rule `root`).

A rule is a list of alternatives; an alternative a list of symbols: a rule name (str), a `Lit`
(literal text), a `Re` (a regular-expression terminal) or a `Rep` (a rule repeated a bounded
number of times, written natively as Lark's `~ lo..hi` and EBNF's `{lo,hi}`, never expanded).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentrt.sql.errors import SchemaError


class Lit(str):
    """A literal terminal."""


class Re(str):
    """A regular-expression terminal (Python syntax, as Lark writes /.../); `max_bytes`: the
    longest text it matches, in UTF-8 bytes (given, not derived from the pattern)."""

    max_bytes: int

    def __new__(cls, pattern: str, max_bytes: int):
        self = super().__new__(cls, pattern)
        self.max_bytes = max_bytes
        return self


@dataclass(frozen=True)
class Rep:
    """Rule `rule` repeated lo..hi times: Lark `rule ~ lo..hi`, EBNF `rule{lo,hi}` (xgrammar
    repeats natively; nothing is expanded)."""

    rule: str
    lo: int
    hi: int


def _lark_string(text: str) -> str:
    """`text` as a Lark string literal: printable ASCII as is, everything else (quote, backslash,
    non-ASCII) as \\uXXXX / \\UXXXXXXXX escapes, which Lark decodes exactly."""
    out = []
    for ch in text:
        o = ord(ch)
        if 0x20 <= o < 0x7F and ch not in '"\\':
            out.append(ch)
        elif o <= 0xFFFF:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    return '"' + "".join(out) + '"'


NUM = Re(r"-?(0|[1-9][0-9]{0,14})(\.[0-9]{1,6})?", 23)
NUM_NONZERO = Re(r"-?[1-9][0-9]{0,14}(\.[0-9]{1,6})?", 23)
SMALL_INT = Re(r"[1-9][0-9]{0,2}", 3)
MAX_TEXT_CHARS = 64
"""The longest string literal, in characters (a doubled quote counts as one)."""
TEXT = Re(r"'([^'\x00-\x1f\x7f]|''){0,64}'", 2 + 4 * MAX_TEXT_CHARS)
LIKE_TEXT = Re(r"'([^'\\\x00-\x1f\x7f]|''){0,64}'", 2 + 4 * MAX_TEXT_CHARS)
DATE = Re(r"'[12][0-9]{3}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])'", 12)
LIMIT_N = Re(r"(0|[1-9][0-9]{0,5})", 6)

CMP = [" = ", " <> ", " != ", " < ", " > ", " <= ", " >= "]
SETOPS = [" UNION ", " UNION ALL ", " INTERSECT ", " EXCEPT "]
JOINS = [" JOIN ", " INNER JOIN ", " LEFT JOIN "]


class Rules:
    """Rules as {name: [alternative: [symbol]]}; a symbol is a rule name (str), Lit, Re or Rep."""

    def __init__(self):
        self.rules: dict[str, list[list]] = {}

    def add(self, name: str, alts: list[list]) -> str:
        self.rules.setdefault(name, []).extend(alts)
        return name

    def bounded(self, name: str, item, seps: list[str], hi: int) -> str:
        """Rule `name`: 1..hi `item`s (a symbol), each after the first preceded by one of
        `seps`; the repeat is a `Rep`, so the rule's size does not grow with `hi`."""
        if hi <= 1:
            return self.add(name, [[item]])
        more = self.add(name + "_more", [[Lit(sep), item] if sep else [item] for sep in seps])
        return self.add(name, [[item, Rep(more, 0, hi - 1)]])

    def prune(self, start: str) -> None:
        """Drop alternatives that use rules deriving nothing, then rules unreachable from start."""
        productive: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, alts in self.rules.items():
                if name in productive:
                    continue
                if any(all(self._ok(s, productive) for s in alt) for alt in alts):
                    productive.add(name)
                    changed = True
        if start not in productive:
            raise SchemaError("the schema gives no query at all (no table with a usable column)")
        for name in list(self.rules):
            if name not in productive:
                del self.rules[name]
            else:
                self.rules[name] = [a for a in self.rules[name] if all(self._ok(s, productive) for s in a)]
        seen, todo = {start}, [start]
        while todo:
            for alt in self.rules[todo.pop()]:
                for s in alt:
                    s = s.rule if type(s) is Rep else s
                    if type(s) is str and s not in seen:
                        seen.add(s)
                        todo.append(s)
        for name in list(self.rules):
            if name not in seen:
                del self.rules[name]

    def max_bytes(self, start: str) -> int:
        """The longest sentence of rule `start`, in UTF-8 bytes (each token of a byte-level or
        byte-fallback tokenizer spells at least one byte, so it also bounds the tokens). Raises
        ValueError when a rule reaches itself (the language is infinite)."""
        memo: dict[str, int] = {}
        active: set[str] = set()

        def longest(name: str) -> int:
            if name in memo:
                return memo[name]
            if name in active:
                raise ValueError(f"rule {name} reaches itself: the language is infinite")
            active.add(name)
            memo[name] = max(sum(size(x) for x in alt) for alt in self.rules[name])
            active.discard(name)
            return memo[name]

        def size(x) -> int:
            if isinstance(x, Lit):
                return len(x.encode())
            if isinstance(x, Re):
                return x.max_bytes
            if isinstance(x, Rep):
                return x.hi * longest(x.rule)
            return longest(x)

        return longest(start)

    @staticmethod
    def _ok(sym, productive: set[str]) -> bool:
        if type(sym) is Rep:
            return sym.rule in productive
        return type(sym) is not str or sym in productive

    def lark(self) -> str:
        lines = []
        for name, alts in self.rules.items():
            body = " | ".join(" ".join(_sym(s) for s in alt) if alt else '""' for alt in alts)
            lines.append(f"{name}: {body}")
        return "\n".join(lines) + "\n"

    def ebnf(self, start: str) -> str:
        """The same rules as xgrammar EBNF (root rule `root`), literals and regular expressions
        written by agentrt's own converters (grammars/lark_grammar.py, grammars/regex.py)."""
        from agentrt.grammars.lark_grammar import _literal
        from agentrt.grammars.regex import RegexToEBNF

        terms: dict[str, str] = {}

        def sym(x) -> str:
            if isinstance(x, Lit):
                return _literal(str(x))
            if isinstance(x, Re):
                if x not in terms:
                    terms[x] = f"re{len(terms)}"
                return terms[x]
            if isinstance(x, Rep):
                return f"{x.rule}{{{x.lo},{x.hi}}}"
            return x

        lines = [f"root ::= {start}"]
        for name, alts in self.rules.items():
            body = " | ".join("(" + (" ".join(sym(s) for s in alt) if alt else '""') + ")" for alt in alts)
            lines.append(f"{name} ::= {body}")
        for pattern, name in terms.items():
            lines.append(f"{name} ::= {RegexToEBNF(name).convert(str(pattern), False)}")
        return "\n".join(lines) + "\n"


def _sym(s) -> str:
    if isinstance(s, Lit):
        return _lark_string(str(s))
    if isinstance(s, Re):
        return "/" + str(s).replace("/", "\\/") + "/"
    if isinstance(s, Rep):
        return f"{s.rule} ~ {s.lo}..{s.hi}"
    return s


def fn_call(fn: str, *args) -> list:
    seq: list = [Lit(fn + "(")]
    for i, x in enumerate(args):
        if i:
            seq.append(Lit(", "))
        seq.append(x)
    return seq + [Lit(")")]


def optional(*parts: list) -> list[list]:
    """Every combination of optional parts (each part: a list of symbols, present or absent)."""
    out = [[]]
    for part in parts:
        out = [o + extra for o in out for extra in ([], part)]
    return out


def joined(items: list, sep: str = ", ") -> list:
    out: list = []
    for i, x in enumerate(items):
        if i:
            out.append(Lit(sep))
        out.append(x)
    return out
