"""Lark grammars -> the backend's EBNF.

The grammar is parsed and expanded by `lark` itself (imports such as `%import common.WS`,
templates, `?rule` inlining, EBNF operators -> plain BNF rules), then written out as EBNF:
- each rule alternative becomes an EBNF alternative of its symbols;
- each terminal becomes a rule: a string (case-insensitive strings spelled `[sS][eE]...`) or its
  regular expression translated by `grammars/regex.py` (`RegexToEBNF`, node by node from Python's
  regex parser): literals, classes, `\\d \\w \\s`, `.`, groups, alternation, greedy repetition,
  inline `(?i:...)`;
- `%ignore` terminals may follow every terminal and open the text (`root ::= ign start`), bounded
  so a model that favours blanks cannot run to max_tokens: at most four ignored tokens per gap, each
  unbounded repetition inside them capped at `max_ignore_repeat` (default 16) characters or groups.

Bounded expansion: lark writes its rules in plain BNF by distributing every inline group,
optional and repeat into the rule's alternatives, and their number multiplies along a sequence:
`("a"|"b")` written 16 times becomes 65,536 alternatives (a minute of CPU), `("b" ~ 5 | "c" ~ 5 |
"d") ~ 6..12` hundreds of thousands (minutes), all in a compile thread nobody can stop. So before
lark compiles, the rule trees (from lark's own grammar parser, `load_grammar`) are rewritten, same
language, with fresh rules named `__agentrt_N` (a name no grammar text can spell):
- `x ~ n` / `x ~ n..m` in a rule: `x` becomes a rule of its own, written out as the EBNF repeat
  `{n}` / `{n,m}` (xgrammar repeats natively), never expanded; counts above `MAX_REPEAT` or a
  range with m < n are refused;
- a sequence whose groups and optionals would distribute into more than `MAX_ALTERNATIVES`
  alternatives has its widest groups lifted into rules of their own until it would not.
Templates keep their parameters (a lifted part of a template is a template). Terminals are
regular expressions, written out with their repeats by `grammars/regex.py`, and need neither.

Refused with ConstraintError (a ValueError) naming the construct (the result would not be the
same language): lookahead/lookbehind (except lark's own `ESCAPED_STRING`, mapped to its meaning),
backreferences, lazy repetition, `\\W \\S \\D`, Unicode-wide case folding. Lark priorities and the
contextual lexer only choose among parses; they do not change the language of the text, with one
caveat: a CFG admits tokenizations lark's greedy lexers would not choose, so rare outputs may not
parse with lark: a keyword spelled where a NAME is expected (LALR), or an ignored comment ended
early (`key #c = 1` with `%ignore SH_COMMENT`: lark's comment runs to the end of the line; no lark
parser accepts it). xgrammar's lookahead `(= ...)` is not enforced, so maximal munch cannot be
written into the grammar; a sound fix needs first-character sets of the terminals (open).

Why not xgrammar's own conversion: xgrammar 0.2.9 ships `Grammar.from_lark` (and
`GrammarCompiler.compile_lark`) and `Grammar.from_regex`. Checked one by one against this module
(SmolLM2 tokenizer, Spider sample of tests/grammars/test_lark.py):
- `from_lark` refuses both SQL grammars the tests use (syncode_sql_grammar.lark and outlines'
  sql_select.lark: "rule and terminal priorities are not supported" at `select_expr.0:`); this
  module converts them and agrees with lark on all 50 Spider queries (49 and 39 accepted);
- `from_lark` does not bound `%ignore`: `a=` + 100 spaces + `1` is accepted under `%ignore WS`,
  where this module allows at most four ignored tokens of at most 16 repetitions per gap;
- `from_lark` accepts `/a+?b/` and `/\\Wa/` silently; this module refuses both by name (laziness
  is a lexer choice in lark; `\\W` means different sets in Python's `re` and ECMA-262);
- xgrammar's regex is not exact: inside JSON-schema strings (`Regex(..., json_string=true)`) the
  pattern `^1(?:x[0-9]+)?Z$` admits "10Z" and `^a(b[0-9]+)?c$` admits "a0c" (an optional group
  ending in a repetition); `from_regex` ignores anchors inside the pattern (`ab$c` admits "abc",
  which Python's `re` rejects). So `regex` constraints and schema `pattern`s use `grammars/regex.py`.
"""

from __future__ import annotations

import re

from agentrt.errors import ConstraintError
from agentrt.grammars.regex import RegexToEBNF, esc_char

MAX_ALTERNATIVES = 64
"""The most alternatives one sequence of a Lark rule may distribute into before its groups are
lifted into rules of their own (see the module docstring)."""
MAX_REPEAT = 2**31 - 1
"""The largest count of a Lark `~` repeat (the backend's repeat bound)."""
_FRESH = "__agentrt_"

# lark's common.ESCAPED_STRING and the `"\"" _STRING_INNER "\""` spelling of it: a double-quoted
# string with backslash escapes. Their lazy repetition / lookbehind only find the closing quote,
# so the language is that of the greedy rule below.
_ESCAPED_STRING_RES = ('".*?(?<!\\\\)(\\\\\\\\)*?"', '"(?:[^"\\\\]|\\\\.)*?"')
_ESCAPED_STRING_EBNF = '"\\"" ([^"\\\\] | "\\\\" [^])* "\\""'


def _literal(text: str, ignore_case: bool = False) -> str:
    if not text:
        return '""'
    if not ignore_case or not any(c.isalpha() for c in text):
        return '"' + "".join(esc_char(ord(c), False) for c in text) + '"'
    parts = []
    for c in text:
        if c.isascii() and c.isalpha():
            parts.append(f"[{c.lower()}{c.upper()}]")
        elif c.isalpha():
            raise ConstraintError(f"case-insensitive non-ASCII text {text!r} is not supported")
        else:
            parts.append('"' + esc_char(ord(c), False) + '"')
    return "(" + " ".join(parts) + ")"


def _rule_name(name: str) -> str:
    return "r_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def _term_name(name: str) -> str:
    return "t_" + re.sub(r"[^A-Za-z0-9_]", "_", name)


def lark_to_ebnf(text: str, start: str = "start", max_ignore_repeat: int = 16) -> str:
    """EBNF (root rule `root`) with the language of the Lark grammar `text` from rule `start`.
    Raises ConstraintError naming the problem (a Lark syntax error, or a construct above)."""
    import lark
    from lark.load_grammar import load_grammar

    try:
        grammar, _ = load_grammar(text, "<string>", [], True)  # what lark.Lark(text) does first
        repeats = _Bounder(grammar).run()
        parser = lark.Lark(grammar, start=start, parser="earley", lexer="dynamic", keep_all_tokens=True)
    except (lark.exceptions.LarkError, OSError, OverflowError) as e:  # OSError: %import of an unknown module
        raise ConstraintError(f"not a valid Lark grammar: {e}") from None
    ignore = list(parser.ignore_tokens)
    lines = []
    alts: dict[str, list[str]] = {}
    ws = " ign" if ignore else ""
    for rule in parser.rules:
        syms = []
        for sym in rule.expansion:
            if sym.is_term:
                syms.append(_term_name(sym.name) + ws)
            else:
                n_m = repeats.get(sym.name.split("{", 1)[0])  # a template's instances: name{args}
                syms.append(_rule_name(sym.name) + ("" if n_m is None else f"{{{n_m[0]},{n_m[1]}}}"))
        alts.setdefault(rule.origin.name, []).append(" ".join(syms) if syms else '""')
    if start not in alts:
        raise ConstraintError(f"the Lark grammar has no '{start}' rule")
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
            body = RegexToEBNF(t.name).convert(pat.value, "i" in pat.flags)
        lines.append(f"{_term_name(t.name)} ::= {body}")
    if ignore:
        by_name = {t.name: t.pattern for t in parser.terminals}
        for n in ignore:
            pat = by_name[n]
            body = (
                _literal(pat.value, "i" in pat.flags)
                if pat.type == "str"
                else RegexToEBNF(n, max_repeat=max_ignore_repeat).convert(pat.value, "i" in pat.flags)
            )
            lines.append(f"i_{_term_name(n)} ::= {body}")
        one = "(" + " | ".join(f"i_{_term_name(n)}" for n in ignore) + ")"
        lines.append(f"ign ::= ({one} ({one} ({one} {one}?)?)?)?")
    return "\n".join(lines) + "\n"


class _Bounder:
    """Rewrites the rule trees of a loaded (not yet compiled) lark `Grammar` in place so that
    lark's compile stays linear in the grammar's size. `run()` gives {fresh rule name: (n, m)}
    for the rules that stand for a `~ n..m` repeat. Raises ConstraintError for a bad `~` count."""

    def __init__(self, grammar):
        self.rule_defs = grammar.rule_defs
        self.repeats: dict[str, tuple[int, int]] = {}

    def run(self) -> dict[str, tuple[int, int]]:
        for _name, params, tree, _options in list(self.rule_defs):
            self._rewrite(tree, tuple(params))
        return self.repeats

    def _rewrite(self, tree, params: tuple) -> None:
        from lark import Tree

        width: dict[int, int] = {}  # how many alternatives a subtree distributes into, capped
        for node in tree.iter_subtrees():  # iterative, children before their parents
            kids = [c for c in node.children if isinstance(c, Tree)]
            if node.data == "expr" and node.children[1].type == "TILDE":
                counts = _repeat_counts(node.children[2:])
                self.repeats[self._lift(node, node.children[0], params)] = counts
                w = 1
            elif node.data == "expr":  # x? x* x+ (lark: x | empty, a recursion rule | empty, one)
                w = {"?": width[id(kids[0])] + 1, "*": 2, "+": 1}[node.children[1].value]
            elif node.data == "maybe":  # [x]
                w = width[id(kids[0])] + 1
            elif node.data in ("expansions", "alias"):
                w = sum(width[id(k)] for k in kids)
            elif node.data == "expansion":
                w = self._bound_sequence(kids, width, params)
            else:  # value, literal, range, template_usage: one symbol
                w = 1
            width[id(node)] = min(w, MAX_ALTERNATIVES + 1)

    def _bound_sequence(self, kids: list, width: dict[int, int], params: tuple) -> int:
        """Lift the widest parts of a sequence into rules until the product of their widths (the
        alternatives lark would write for it) is at most MAX_ALTERNATIVES; returns that product."""
        while True:
            total = 1
            for k in kids:
                total = min(total * width[id(k)], MAX_ALTERNATIVES + 1)
            if total <= MAX_ALTERNATIVES:
                return total
            widest = max(kids, key=lambda k: width[id(k)])
            self._lift(widest, widest, params)
            width[id(widest)] = 1

    def _lift(self, node, part, params: tuple) -> str:
        """Move `part` (a subtree of `node`, or `node` itself) into a fresh rule and turn `node`
        into a reference to it (a template usage passing the parameters on, inside a template).
        Returns the fresh rule's name."""
        from lark import Tree
        from lark.grammar import NonTerminal, RuleOptions

        name = f"{_FRESH}{len(self.rule_defs)}"
        part = Tree(part.data, part.children)  # `node` may be `part`: it is rewritten below
        body = part if part.data == "expansions" else Tree("expansions", [Tree("expansion", [part])])
        self.rule_defs.append((name, list(params), body, RuleOptions(keep_all_tokens=True)))
        ref = NonTerminal(name)
        if params:
            args = [Tree("value", [NonTerminal(p)]) for p in params]
            ref = Tree("template_usage", [ref, *args])
        node.data, node.children = "value", [ref]
        return name


def _repeat_counts(tokens: list) -> tuple[int, int]:
    """(n, m) of a Lark `~ n` / `~ n..m`. Raises ConstraintError for a negative count, m < n, or a
    count above MAX_REPEAT."""
    n, m = int(tokens[0]), int(tokens[-1])
    if n < 0 or m < n:
        raise ConstraintError(f"not a valid Lark grammar: bad repeat range `~ {n}..{m}`")
    if m > MAX_REPEAT:
        raise ConstraintError(f"Lark repeat `~ {m}` is over the limit of {MAX_REPEAT}")
    return n, m
