"""EBNF of our own for the subschemas xgrammar's converter does not enforce exactly, spliced into
its grammar: objects with `patternProperties`, `propertyNames`, forbidden properties (`"k": false`)
or property counts on an open object, and strings whose `pattern` comes with a length range or
that carry a `not` of patterns, and numbers with `multipleOf` (decimals.py's residue automaton).

Measured (xgrammar 0.2.9): its converter gives every additional key the `additionalProperties`
schema even when the key matches a `patternProperties` pattern, ignores `propertyNames`, and drops
`maxLength` beside `pattern`. These subschemas get exact grammars here (automata.py):

- object: named properties in schema order (each at most once, required ones present), then any
  number of other members whose key is read by one DFA over the name languages (named keys
  excluded, `propertyNames` intersected, each pattern region mapped to its schema, the rest to
  `additionalProperties`); a member counter enforces `maxProperties` (duplicated keys count twice:
  stricter, never wider) and `minProperties` of at most 1 (any member makes the parsed object
  non-empty; the normalizer refuses more on an open object, since a repeated key counts once);
- string: the product DFA of the whole-string pattern, the length range and the patterns of a
  `not` (negation.py; a string matching one of them is left out).

Splicing: `take_nodes` swaps each such subschema for `{"anyOf": [{"const": MARKER}, *values]}`
(its property and pattern values stay schemas xgrammar converts); `put_nodes` finds the rule whose
first case is the marker and replaces its body with ours, naming the value rules by their cases.
Keys and pattern strings use raw characters only (no escapes; see automata.py's alphabet).
Errors: ConstraintError naming the keyword (e.g. with `indent` set, whose layout depends on depth).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from agentrt.errors import ConstraintError
from agentrt.grammars.json_schema.automata import DFA, alphabet, build, dfa_ebnf, minimize
from agentrt.grammars.json_schema.decimals import number_dfa
from agentrt.grammars.json_schema.values import number_dfa_bounds, unique_values
from agentrt.grammars.regex import _merge, ebnf_chars, esc_char

_MARKER = "AGENTRTNODE{}X"
_CASE0 = re.compile(r'^(\w+)_case_0 ::= \(\("\\"AGENTRTNODE(\d+)X\\""\)\)$', re.MULTILINE)
_DUMMY = {"type": "null"}


def needs_node(s: dict) -> bool:
    """Does normalized subschema `s` need a grammar of ours?"""
    t = s.get("type")
    if t == "object":
        open_ = s.get("additionalProperties", {}) is not False or bool(s.get("patternProperties"))
        return (
            bool(s.get("patternProperties"))
            or "propertyNames" in s
            or any(v is False for v in s.get("properties", {}).values())
            or (open_ and ("minProperties" in s or "maxProperties" in s))
        )
    if t in ("number", "integer"):
        return "multipleOf" in s
    if t == "array":
        return s.get("uniqueItems") is True or "contains" in s
    return t == "string" and (
        s.get("format") == "regex"
        or "not" in s
        or "allOf" in s
        or ("pattern" in s and ("minLength" in s or "maxLength" in s))
    )


def string_automaton(s: dict) -> tuple[DFA, object]:
    """The DFA of a normalized string schema with `pattern` (whole-string), a length range, an
    `allOf` of `{"pattern": p}` (searches, all must match: a format beside a pattern, strings.py)
    and `not` patterns (searches, none may match: negation.not_patterns), and the test on a state's
    label that says it accepts. Raises AutomatonError past the automaton bounds."""
    from agentrt.grammars.json_schema.negation import not_patterns

    comps: list = []
    if "pattern" in s:
        comps.append(("regex", s["pattern"]))
    if "minLength" in s or "maxLength" in s:
        comps.append(("length", (s.get("minLength", 0), s.get("maxLength"))))
    comps += [("search", x["pattern"]) for x in s.get("allOf", [])]
    must = frozenset(range(len(comps)))
    nots = not_patterns(s.get("not"))
    banned = frozenset(range(len(comps), len(comps) + len(nots)))
    comps += [("search", p) for p in nots]
    dfa = build(comps, alphabet(tuple(r for _kind, r in comps if _kind in ("regex", "search"))))
    return dfa, lambda lab: must <= lab and not (banned & lab)


def key_components(pn) -> list[tuple[str, object]]:
    """The automaton components (automata.build) of a normalized `propertyNames` schema: all of
    them must accept a name. Raises ValueError for a form with no automaton here."""
    if pn is None or pn == {}:
        return []
    if "enum" in pn and len(pn) == 1:
        return [("words", [v for v in pn["enum"] if isinstance(v, str)])]
    if pn.get("type") == "string" and set(pn) <= {"type", "pattern", "minLength", "maxLength"}:
        comps: list = []
        if "pattern" in pn:
            comps.append(("regex", pn["pattern"]))
        if "minLength" in pn or "maxLength" in pn:
            comps.append(("length", (pn.get("minLength", 0), pn.get("maxLength"))))
        return comps
    raise ValueError("propertyNames other than a string pattern, length range or enum")


@dataclass
class _Node:
    kind: str  # "object" | "array" | "string" | "number" | "integer"
    schema: dict  # the normalized subschema (values replaced by their indices)
    num_values: int


def take_nodes(schema, ws: dict):
    """`schema` (a normalize_schema output) with every subschema `needs_node` swapped for a marker
    anyOf, and the list of nodes for `put_nodes`."""
    nodes: list[_Node] = []

    def walk(s):
        if isinstance(s, list):
            return [walk(x) for x in s]
        if not isinstance(s, dict):
            return s
        out = {}
        for k, v in s.items():
            if k in ("properties", "patternProperties", "$defs"):
                out[k] = {name: walk(sub) for name, sub in v.items()}
            elif k in ("additionalProperties", "items", "prefixItems", "anyOf", "propertyNames", "contains"):
                out[k] = walk(v)
            else:
                out[k] = v
        if not needs_node(out):
            return out
        if ws.get("indent") is not None:
            kw = {"object": "patternProperties", "array": "uniqueItems"}.get(out["type"], "pattern")
            kw = "multipleOf" if "multipleOf" in out else "format" if out.get("format") else kw
            raise ConstraintError(
                f"JSON Schema keyword '{kw}' with an object layout of its own cannot be enforced "
                "with an indented layout (indent)",
                keyword=kw,
            )
        values = []
        if out["type"] == "object":
            props = {}
            for name, sub in out.get("properties", {}).items():
                if sub is not False:
                    props[name] = len(values)
                    values.append(sub)
                else:
                    props[name] = None
            pps, seen = {}, {}
            for pat, sub in out.get("patternProperties", {}).items():
                if sub is False:  # names it matches are forbidden
                    pps[pat] = None
                    continue
                key = json.dumps(sub, sort_keys=True)  # equal schemas share one value rule
                if key not in seen:
                    seen[key] = len(values)
                    values.append(sub)
                pps[pat] = seen[key]
            trivial = [i for i, v in enumerate(values) if v == {}]
            ap = out.get("additionalProperties", {})
            ap_i = None
            if ap is not False:
                ap_i = len(values)
                values.append(ap)
            layout = {
                **out,
                "properties": props,
                "patternProperties": pps,
                "additionalProperties": ap_i,
                "trivial": trivial,
            }
        elif out["type"] == "array" and "contains" in out:
            values = [out.get("items", {}), out["contains"]]
            layout = out
        else:
            layout = out
        nodes.append(_Node(out["type"], layout, len(values)))
        return {"anyOf": [{"const": _MARKER.format(len(nodes) - 1)}, *(values or [_DUMMY])]}

    return walk(schema), nodes


_ADDL_KEY_RULE = re.compile(r"^(\w*_addl_key\w*) ::= (.*)$", re.MULTILINE)
_ESCAPE_ALT = '| ("\\\\" basic_escape basic_string_sub)'
_RAW_KEY_SUB = 'agentrt_raw_key_sub ::= (("\\"") | ([^\\0-\\x1f\\"\\\\\\r\\n] agentrt_raw_key_sub))'


def raw_additional_keys(ebnf: str) -> str:
    """xgrammar's additional-property keys without escapes. Its key rules exclude the named keys by
    their raw spelling only: measured (0.2.9), `{"\\u0061": "x"}` passed as an additional key where
    property "a" must be an integer. Without escapes every key has one spelling (stricter: an
    additional key cannot hold a quote, backslash or control character)."""
    found = False

    def fix(m: re.Match) -> str:
        nonlocal found
        found = True
        body = m.group(2).replace(" " + _ESCAPE_ALT, "").replace("basic_string_sub", "agentrt_raw_key_sub")
        return f"{m.group(1)} ::= {body}"

    ebnf = _ADDL_KEY_RULE.sub(fix, ebnf)
    return ebnf + "\n" + _RAW_KEY_SUB + "\n" if found else ebnf


def put_nodes(ebnf: str, nodes: list[_Node], ws: dict) -> str:
    """Replace each node's marker rule in xgrammar's `ebnf` with its grammar (and make additional
    keys escape-free: `raw_additional_keys`)."""
    ebnf = raw_additional_keys(ebnf)
    if not nodes:
        return ebnf
    found = {}
    for m in _CASE0.finditer(ebnf):
        found.setdefault(int(m.group(2)), []).append(m.group(1))
    extra = []
    for i, node in enumerate(nodes):
        for prefix in found.get(i) or [None]:
            line = re.search(rf"^{prefix} ::= \((.*)\)$", ebnf, flags=re.MULTILINE) if prefix else None
            alts = _alternatives(line.group(1)) if line else []
            if len(alts) != max(node.num_values, 1) + 1 or alts[0] != f"({prefix}_case_0)":
                raise ConstraintError("an object or string constraint could not be placed in the grammar")
            body, rules = _node_ebnf(node, alts[1:], f"{prefix}_n", ws)
            ebnf = ebnf[: line.start()] + f"{prefix} ::= {body}" + ebnf[line.end() :]
            extra += rules
    return ebnf + "\n" + "\n".join(extra) + "\n"


def _alternatives(body: str) -> list[str]:
    """Top-level `|` alternatives of a printed EBNF body (quotes and classes skipped)."""
    cuts = [i for i, c, depth in ebnf_chars(body) if c == "|" and depth == 0]
    return [body[a + 1 : b].strip() for a, b in zip([-1, *cuts], [*cuts, len(body)], strict=True)]


def _lit(text: str) -> str:
    return '"' + "".join(esc_char(ord(c), False) for c in text) + '"'


def _node_ebnf(node: _Node, values: list[str], name: str, ws: dict) -> tuple[str, list[str]]:
    if node.kind == "string":
        return _string_ebnf(node.schema, name)
    if node.kind in ("number", "integer"):
        return _number_ebnf(node.schema, name)
    if node.kind == "array" and "contains" in node.schema:
        return _contains_ebnf(node.schema, values, name, ws)
    if node.kind == "array":
        return _unique_ebnf(node.schema, name, ws)
    return _object_ebnf(node.schema, values, name, ws)


def _string_ebnf(s: dict, name: str) -> tuple[str, list[str]]:
    if s.get("format") == "regex":
        return _regex_format_ebnf(name)
    dfa, ok = string_automaton(s)
    dfa, outs = minimize(dfa, lambda lab: '"\\""' if ok(lab) else None)
    lines, live = dfa_ebnf(dfa, outs, name)
    if not live:
        raise ConstraintError("no string satisfies the pattern, length range and negated patterns")
    return f'("\\"" {name}_0)', lines


REGEX_FORMAT_DEPTH = 8


def regex_format_text(depth: int = REGEX_FORMAT_DEPTH) -> str:
    r"""A regex (Python syntax) for the JSON text, between the quotes, of the `format: regex`
    strings we produce: a subset of the regexes both ECMA-262 (the spec's dialect) and Python's
    `re` (what `jsonschema` checks) compile. Literals other than the syntax characters, `.`, the
    escapes \d \w \s (and negations), \n \t \r \f \v and escaped syntax characters, classes of such
    characters and the ranges a-z, A-Z, 0-9, groups `(...)` and `(?:...)` nested at most `depth`
    deep, `|`, the anchors ^ and $ (never quantified), and the quantifiers * + ? {n} {n,} (n of
    at most 3 digits), each optionally lazy. In the text a regex backslash is an escaped one (two
    backslashes). Narrower than the format (no lookaround, backreferences, flags, other ranges,
    deeper nesting ...), and regular, so it is a DFA (fast masks)."""
    bs = r"\\\\"
    esc = bs + r"(?:[dDwWsSntrfv.*+?()\[\]{}|^$/]|" + bs + ")"
    lit = r'[^\x00-\x1f"\\^$.|?*+()\[\]{}]'
    cls = r'\[\^?(?:[^\x00-\x1f"\\^\[\]\-&~|]|' + esc + r"|a-z|A-Z|0-9)+\]"
    quant = r"(?:[*+?]|\{[0-9]{1,3},?\})\??"
    body = ""
    for _ in range(depth + 1):
        group = r"|\((?:\?:)?" + body + r"\)" if body else ""
        atom = f"(?:{lit}|\\.|{esc}|{cls}{group})"
        body = f"(?:{atom}(?:{quant})?|\\^|\\$|\\|)*"
    return body


def _regex_format_ebnf(name: str) -> tuple[str, list[str]]:
    """`format: regex`: the DFA of `regex_format_text` over the JSON text (backslash included)."""
    sigma = tuple(_merge([*alphabet(()), (0x5C, 0x5C)]))
    dfa = build([("regex", regex_format_text())], sigma)
    dfa, outs = minimize(dfa, lambda lab: '"\\""' if lab else None)
    lines, _live = dfa_ebnf(dfa, outs, name)
    return f'("\\"" {name}_0)', lines


def _array_layout(ws: dict) -> tuple[str, str, str]:
    if ws.get("any_whitespace"):
        gap = f"[ \\n\\t]{{0,{int(ws.get('max_whitespace_cnt', 2))}}}"
        return f'"[" {gap}', f'{gap} "]"', f'{gap} "," {gap}'
    return '"["', '"]"', '", "'


def _contains_ebnf(s: dict, values: list[str], name: str, ws: dict) -> tuple[str, list[str]]:
    """An array whose items match values[0] (the items schema) with at least `minContains` (1)
    of them matching values[1] (items and `contains` merged): rule `{name}_{t}_{c}` continues after
    t items (capped where the bounds stop telling counts apart) of which c (capped at k) matched.
    An item matching both may count or not: the grammar is ambiguous, its language exact."""
    item, hit = values
    k = s.get("minContains", 1)
    lo, hi = s.get("minItems", 0), s.get("maxItems")
    cap = hi if hi is not None else max(lo, k)
    open_, close, sep = _array_layout(ws)

    def productive(t: int, c: int) -> bool:  # enough room left for the matches still missing
        return hi is None or k - c <= hi - t

    rules = []
    for t in range(cap + 1):
        for c in range(min(t, k) + 1):
            if not productive(t, c):
                continue
            alts = ['""'] if t >= lo and c >= k else []
            if hi is None or t < hi:
                lead = "" if t == 0 else f"{sep} "
                t2 = min(t + 1, cap)
                if productive(t2, c):
                    alts.append(f"({lead}{item} {name}_{t2}_{c})")
                alts.append(f"({lead}{hit} {name}_{t2}_{min(c + 1, k)})")
            rules.append(f"{name}_{t}_{c} ::= " + " | ".join(alts))
    return f"({open_} {name}_0_0 {close})", rules


def _unique_ebnf(s: dict, name: str, ws: dict) -> tuple[str, list[str]]:
    """An array of distinct items drawn from a few scalars (values.unique_values): rule
    `{name}_{mask}` continues an array whose values so far are the bits of `mask`, so no value
    repeats; `minItems`/`maxItems` are the set sizes that may close or grow."""
    values = [_lit(json.dumps(v, ensure_ascii=False)) for v in unique_values(s)]
    lo, hi = s.get("minItems", 0), min(s.get("maxItems", len(values)), len(values))
    open_, close, sep = _array_layout(ws)
    rules, todo, seen = [], [0], {0}
    while todo:
        mask = todo.pop()
        size = mask.bit_count()
        alts = ['""'] if size >= lo else []
        if size < hi:
            lead = "" if mask == 0 else f"{sep} "
            for i, v in enumerate(values):
                if not mask >> i & 1:
                    nxt = mask | 1 << i
                    alts.append(f"({lead}{v} {name}_{nxt})")
                    if nxt not in seen:
                        seen.add(nxt)
                        todo.append(nxt)
        rules.append(f"{name}_{mask} ::= " + " | ".join(alts))
    return f"({open_} {name}_0 {close})", rules


def _number_ebnf(s: dict, name: str) -> tuple[str, list[str]]:
    """A number with `multipleOf` and bounds: decimals.py's residue automaton, minimized."""
    dfa = number_dfa(s["multipleOf"], **number_dfa_bounds(s), integer=s["type"] == "integer")
    dfa, outs = minimize(dfa, lambda lab: '""' if lab else None)
    lines, live = dfa_ebnf(dfa, outs, name)
    if not live:
        raise ConstraintError("no number satisfies multipleOf and the bounds", keyword="multipleOf")
    return f"{name}_0", lines


def _object_ebnf(s: dict, values: list[str], name: str, ws: dict) -> tuple[str, list[str]]:
    if ws.get("any_whitespace"):
        gap = f"[ \\n\\t]{{0,{int(ws.get('max_whitespace_cnt', 2))}}}"
        open_, close, sep, ksep = f'"{{" {gap}', f'{gap} "}}"', f'{gap} "," {gap}', f'{gap} ":" {gap}'
    else:
        open_, close, sep, ksep = '"{"', '"}"', '", "', '": "'
    rules: list[str] = []
    member = _member_rule(s, values, f"{name}_k", ksep, rules)
    props = [(k, i) for k, i in s["properties"].items() if i is not None]
    required = set(s.get("required", []))
    lo = 1 if s.get("minProperties", 0) >= 1 else 0
    hi = s.get("maxProperties")
    top = hi if hi is not None else 1  # counter states: members so far (saturating without a max)

    def nxt(c):
        return c + 1 if hi is not None else min(c + 1, 1)

    productive: dict[tuple[int, int], bool] = {}
    # additional members after the named ones: A_c
    for c in range(top + 1):
        alts = []
        if c >= lo:
            alts.append('""')
        room = None if hi is None else hi - c
        if member is not None and (room is None or room > 0):
            rest = f"({sep} {member})"
            if c == 0:
                tail = f"{rest}*" if room is None else (f"{rest}{{0,{room - 1}}}" if room > 1 else '""')
                alts.append(f"({member} {tail})")
            else:
                alts.append(f"{rest}*" if room is None else f"{rest}{{0,{room}}}")
        productive[(len(props), c)] = bool(alts)
        if alts:
            rules.append(f"{name}_{len(props)}_{c} ::= " + " | ".join(alts))
    for i in range(len(props) - 1, -1, -1):
        key, vi = props[i]
        for c in range(top + 1):
            alts = []
            if (hi is None or c < hi) and productive[(i + 1, nxt(c))]:
                lead = "" if c == 0 else f"{sep} "
                alts.append(f"({lead}{_lit(json.dumps(key))} {ksep} {values[vi]} {name}_{i + 1}_{nxt(c)})")
            if key not in required and productive[(i + 1, c)]:
                alts.append(f"{name}_{i + 1}_{c}")
            productive[(i, c)] = bool(alts)
            if alts:
                rules.append(f"{name}_{i}_{c} ::= " + " | ".join(alts))
    if not productive[(0, 0)]:
        raise ConstraintError("no object satisfies this schema's property rules")
    return f"({open_} {name}_0_0 {close})", rules


def _member_rule(s: dict, values: list[str], name: str, ksep: str, rules: list[str]) -> str | None:
    """The rule of one non-named member (key, separator, value), or None when no key can appear."""
    pats = list(s["patternProperties"].items())
    pn = key_components(s.get("propertyNames"))
    comps = [("search", p) for p, _ in pats]
    comps.append(("words", list(s["properties"])))
    named = len(pats)
    pn_ids = frozenset(range(named + 1, named + 1 + len(pn)))
    comps += pn
    ap = s["additionalProperties"]
    if not pats and ap is None:
        return None
    sigma = alphabet(tuple(r for kind, r in comps if kind in ("regex", "search")))

    def output(label):
        if named in label or not pn_ids <= label:
            return None
        if any(pats[i][1] is None for i in label if i < named):
            return None  # a pattern whose schema is false matches: the name is forbidden
        hit = sorted({pats[i][1] for i in label if i < named})
        if not hit:
            return None if ap is None else f'"\\"" {ksep} {values[ap]}'
        strict = [i for i in hit if i not in s["trivial"]] or hit[:1]
        if len(strict) > 1:  # the normalizer refuses overlapping patterns with different schemas
            raise ConstraintError(
                "overlapping patternProperties with different schemas", keyword="patternProperties"
            )
        return f'"\\"" {ksep} {values[strict[0]]}'

    dfa: DFA = build(comps, sigma)
    dfa, outs = minimize(dfa, output)
    lines, live = dfa_ebnf(dfa, outs, name)
    if not live:
        return None
    rules += lines
    rules.append(f'{name} ::= "\\"" {name}_0')
    return name
