"""Argument grammars of the tool-call formats whose arguments are not one JSON object: XML
parameters (Qwen3-Coder ``<parameter=k>\\nv\\n</parameter>``, GLM ``<arg_key>k</arg_key>
<arg_value>v</arg_value>``, DeepSeek V3.2's DSML ``<｜DSML｜parameter name="k" string="true">v
</｜DSML｜parameter>``, whose `string` attribute says how the value is written: "true" raw text,
"false" JSON) and Python keyword arguments (pythonic ``f(k=v, ...)``).

Each is EBNF (root rule ``root``) built from the tool's parameter schema after the same faithful
normalization as ``response_format`` (json_schema/): the properties in their declared order, the
required ones required; a value of a non-string type is the JSON grammar of its subschema
(pipeline.schema_ebnf, passed in as ``schema_ebnf``: this module cannot import the pipeline, which
imports it); in XML a string value is raw text (as the templates write it): free text that never
contains the closing tag, or, for a string with a pattern / length / format, the inside of its JSON
string grammar (a subset of raw text: no quote, backslash or control character). Keywords on the
arguments object itself that a sequence of parameters cannot enforce (minProperties,
patternProperties, ...) are refused (or dropped when the tool is `strict: false`). Properties the
schema leaves open (``additionalProperties``) are offered only when the schema declares none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from agentrt.grammars.json_schema import normalize_schema

_ROOT_KEYS = {"type", "properties", "required", "additionalProperties", "$defs"}
_NAME_CHARS = re.compile(r"[A-Za-z_][\w.\-]*")
_STRING_ROOT = re.compile(r'^root ::= \(\("\\"" (.*) "\\""\)\)$', re.MULTILINE)
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][\w.\-]*|.', re.DOTALL)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_JSON_FOLLOW = "[,}\\]:]))"  # the end of the lookahead xgrammar prints after a JSON string
_KWARG_FOLLOW = "[,}\\]:)]))"


def lit(text: str) -> str:
    """`text` as an EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


def rename(ebnf: str, prefix: str) -> tuple[str, str]:
    """(rules, root name): every rule of `ebnf` (xgrammar's printed EBNF, root rule `root`) renamed
    with `prefix`, so several grammars can live in one text."""
    names = set(re.findall(r"^([A-Za-z_][\w.\-]*) ::=", ebnf, re.MULTILINE))
    out = []
    for tok in _TOKEN.findall(ebnf):
        out.append(prefix + tok if tok in names else tok)
    return "".join(out), prefix + "root"


def excluding(name: str, close: str) -> str:
    """Rules `name`: any text that does not contain `close` (whose first character occurs in it only
    once, as in a closing tag `</...>`). Built as `[^<]* ("<" N1)*` where N1 is any `<`-free text
    that does not start with the rest of `close`."""
    head, rest = close[0], close[1:]
    assert head not in rest
    not_head = f"[^{_cls(head)}]"
    rules = [f"{name} ::= {not_head}* ({lit(head)} {name}_1)*"]
    for i, c in enumerate(rest):
        other = f"[^{_cls(head)}{_cls(c)}] {not_head}*"
        nxt = f" | {lit(c)} {name}_{i + 2}" if i + 1 < len(rest) else ""
        rules.append(f'{name}_{i + 1} ::= "" | {other}{nxt}')
    return "\n".join(rules) + "\n"


def _cls(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c


@dataclass(frozen=True)
class XmlLayout:
    """How a format writes one parameter: `open` + key + `mid` + value + `close`, then `after`, with
    `sep` between two parameters; the value text of a string is raw, ended by `close` (stripped of
    `strip_newlines` newlines at each end when parsed). `string_attr` (DSML): `mid` is followed by
    `true">` and the raw text of a string, or `false">` and the JSON text of another value."""

    open: str
    mid: str
    close: str
    after: str = "\n"
    strip_newlines: bool = False
    sep: str = ""
    string_attr: bool = False

    def ebnf_param(self, key_lit: str, value_root: str) -> str:
        return f"{lit(self.open)} {key_lit} {lit(self.mid)} {value_root} {lit(self.close + self.after)}"

    def render(self, key: str, value) -> str:
        """One parameter as the model writes it (strings raw, other values as JSON)."""
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        attr = ('true">' if isinstance(value, str) else 'false">') if self.string_attr else ""
        return self.open + key + self.mid + attr + text + self.close + self.after


QWEN_XML = XmlLayout("<parameter=", ">\n", "\n</parameter>", strip_newlines=True)
GLM_XML = XmlLayout("<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>")
DSML = "｜DSML｜"
DSML_XML = XmlLayout(
    f'<{DSML}parameter name="', '" string="', f"</{DSML}parameter>", after="", sep="\n", string_attr=True
)
MINIMAX_XML = XmlLayout('<parameter name="', '">', "</parameter>")
"""MiniMax M2: DSML's parameters without the prefix nor the string attribute, each on its own line."""


class _Builder:
    """One tool's argument grammar: rules collected in `rules`, each sub-grammar renamed apart."""

    def __init__(self, schema_ebnf: Callable, ws: dict, defs: dict | None, fmt: str):
        self.schema_ebnf, self.ws, self.defs, self.fmt = schema_ebnf, ws, defs, fmt
        self.rules: list[str] = []
        self.n = 0

    def fresh(self) -> str:
        self.n += 1
        return f"a{self.n}_"

    def add(self, ebnf: str) -> str:
        """Add a whole grammar (root `root`); returns the name of its root."""
        text, root = rename(ebnf, self.fresh())
        self.rules.append(text.strip())
        return root

    def rule(self, body: str) -> str:
        name = self.fresh() + "r"
        self.rules.append(f"{name} ::= {body}")
        return name

    def json_value(self, schema: dict) -> str:
        s = {**schema, "$defs": self.defs} if self.defs else schema
        return self.add(self.schema_ebnf(s, None, [], self.ws))

    def resolve(self, schema: dict) -> dict:
        seen = 0
        while isinstance(schema, dict) and set(schema) == {"$ref"} and self.defs and seen < 64:
            schema = self.defs.get(schema["$ref"].rsplit("/", 1)[-1], schema)
            seen += 1
        return schema

    def xml_value(self, schema: dict, layout: XmlLayout) -> str:
        """The root rule of a value of `schema` written raw (strings) or as JSON (others); with
        `layout.string_attr`, each preceded by its attribute's end (`true">` / `false">`)."""
        raw, js = (lit('true">') + " ", lit('false">') + " ") if layout.string_attr else ("", "")
        s = self.resolve(schema)
        if not isinstance(s, dict) or s == {}:
            if layout.string_attr:  # any value: raw text, or a JSON value
                return self.rule(f"{raw}{self.raw_text(layout)} | {js}{self.json_value({})}")
            return self.raw_text(layout)
        if set(s) == {"anyOf"}:
            return self.rule(" | ".join(self.xml_value(b, layout) for b in s["anyOf"]))
        if "enum" in s or "const" in s:
            values = s["enum"] if "enum" in s else [s["const"]]
            alts = [
                raw + lit(v) if isinstance(v, str) else js + lit(json.dumps(v, ensure_ascii=False))
                for v in values
            ]
            return self.rule(" | ".join(alts) or "[^\\0-\\U0010ffff]")
        if s.get("type") == "string":
            if set(s) == {"type"}:
                return self.rule(raw + self.raw_text(layout)) if raw else self.raw_text(layout)
            ebnf = self.schema_ebnf(s, None, [], self.ws)
            m = _STRING_ROOT.search(ebnf)
            if m is None:
                raise ValueError(
                    f"a string parameter of this kind cannot be written raw in the {self.fmt} format"
                )
            root = self.add(ebnf[: m.start()] + f"root ::= (({m.group(1)}))" + ebnf[m.end() :])
            return self.rule(raw + root) if raw else root
        return self.rule(js + self.json_value(s)) if js else self.json_value(s)

    def raw_text(self, layout: XmlLayout) -> str:
        name = self.fresh() + "raw"
        self.rules.append(excluding(name, layout.close.strip()).strip())
        return name


def _object_parts(
    schema: dict, strict: bool | None, dropped: list[str], fmt: str
) -> tuple[dict, list[str], set[str], dict | None, dict | None]:
    """(properties, names in order, required, extra-values schema or None, $defs) of a normalized
    parameters schema; keywords of the object itself a parameter sequence cannot enforce are
    refused, or dropped into `dropped` when `strict` is False."""
    norm = normalize_schema(schema, best_effort=strict is False, close_objects=strict is True)
    dropped.extend(norm.not_enforced)
    s = norm.schema
    for key in sorted(set(s) - _ROOT_KEYS):
        if strict is False:
            dropped.append(f"{key} at /")
            continue
        raise ValueError(
            f"'{key}' on the arguments object cannot be enforced in the {fmt} call format "
            "(its arguments are a sequence of parameters)"
        )
    props = s.get("properties") or {}
    extra = s.get("additionalProperties", {})
    extra = extra if isinstance(extra, dict) and not props else None
    return props, list(props), set(s.get("required") or []), extra, s.get("$defs")


def _sequence(b: _Builder, parts: list[tuple[str, bool]], sep: str) -> str:
    """The root rule of `parts` ([(rule, required)]) in order, optional ones optional, `sep`
    between two present ones: F_i (nothing written yet) and R_i (something written) per position."""
    n = len(parts)
    pre = b.fresh()
    sep_lit = f"{lit(sep)} " if sep else ""
    for i in range(n, -1, -1):
        if i == n:
            b.rules.append(f'{pre}F{i} ::= ""')
            b.rules.append(f'{pre}R{i} ::= ""')
            continue
        rule, required = parts[i]
        f = f"{rule} {pre}R{i + 1}" + ("" if required else f" | {pre}F{i + 1}")
        r = f"{sep_lit}{rule} {pre}R{i + 1}" + ("" if required else f" | {pre}R{i + 1}")
        b.rules.append(f"{pre}F{i} ::= {f}")
        b.rules.append(f"{pre}R{i} ::= {r}")
    return f"{pre}F0"


def xml_arguments_ebnf(
    schema: dict,
    strict: bool | None,
    dropped: list[str],
    ws: dict,
    schema_ebnf: Callable,
    layout: XmlLayout,
    fmt: str,
) -> str:
    """EBNF (root `root`) of a tool's arguments as XML parameters in `layout`."""
    props, names, required, extra, defs = _object_parts(schema, strict, dropped, fmt)
    b = _Builder(schema_ebnf, ws, defs, fmt)
    parts = []
    for k in names:
        value = b.xml_value(props[k], layout)
        parts.append((b.rule(layout.ebnf_param(lit(k), value)), k in required))
    body = _sequence(b, parts, layout.sep)
    if extra is not None:
        value = b.xml_value(extra, layout)
        key = "[A-Za-z_] [A-Za-z0-9_.\\-]*"
        one = layout.ebnf_param(f"({key})", value)
        body = f"({one} ({lit(layout.sep)} {one})*)?" if layout.sep else f"({one})*"
    return "\n".join([f"root ::= {body}", *b.rules]) + "\n"


def pythonic_arguments_ebnf(
    schema: dict, strict: bool | None, dropped: list[str], ws: dict, schema_ebnf: Callable, fmt: str
) -> str:
    """EBNF (root `root`) of a tool's arguments as Python keyword arguments `k=<JSON value>`,
    separated by ", " (JSON literals; the parser also reads Python's)."""
    props, names, required, extra, defs = _object_parts(schema, strict, dropped, fmt)
    b = _Builder(schema_ebnf, ws, defs, fmt)
    parts = []
    for k in names:
        if not _IDENT.fullmatch(k):
            raise ValueError(
                f"property name {k!r} is not a Python identifier, as the {fmt} call format needs"
            )
        parts.append((b.rule(f"{lit(k + '=')} {b.json_value(props[k])}"), k in required))
    body = _sequence(b, parts, ", ")
    if extra is not None:
        value = b.json_value(extra)
        one = f'[A-Za-z_] [A-Za-z0-9_]* "=" {value}'
        body = f'({one} (", " {one})*)?'
    # xgrammar's JSON strings assert what follows them in JSON (`(=([ \n\r\t]* [,}\]:]))`), a hint its
    # token masks enforce within a token: here a value may end the call, so `)` follows too (else
    # the one token `")` of `f(a="x")` is masked and the model must split it)
    rules = [r.replace(_JSON_FOLLOW, _KWARG_FOLLOW) for r in b.rules]
    return "\n".join([f"root ::= {body}", *rules]) + "\n"


def calls_list_ebnf(calls: list[tuple[str, str]], tail: str = '")"', separator: str = ", ") -> str:
    """EBNF (root `root`): `(separator head args tail)*`, one alternative per tool (head: the
    literal text before its arguments, args: its arguments EBNF; tail: an EBNF expression): the
    further calls of a call list (pythonic: heads `name(`, tail `")"`)."""
    rules, alts = [], []
    for i, (head, args) in enumerate(calls):
        text, root = rename(args, f"t{i}_")
        rules.append(text.strip())
        alts.append(f"({lit(head)} {root} {tail})")
    return "\n".join([f"root ::= ({lit(separator)} call)*", f"call ::= {' | '.join(alts)}", *rules]) + "\n"
