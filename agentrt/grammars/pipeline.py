"""The constraint pipeline: a ConstraintSpec's text -> xgrammar Grammar -> finite-output check
-> compiled grammar (`build_constraint`, its result `Built`). JSON Schema goes through the
faithful-schema pass (json_schema/) and xgrammar's converter, whose EBNF is then corrected here
(length-bounded strings, `pattern`s through grammars/regex.py, json_schema/nodes.py's grammars of
our own); regex / Lark become EBNF; tool calls a structural tag. It runs in a killable compile
child (grammars/compile_child.py) or on a compile thread (xgrammar_backend.GrammarBackend).
Errors: ConstraintError (keyword, JSON pointer and tool index kept from a schema error).
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

import xgrammar as xgr

from agentrt.errors import ConstraintError
from agentrt.grammars.finite import ForcedBound, check_finite
from agentrt.grammars.json_schema import normalize_schema
from agentrt.grammars.json_schema.nodes import put_nodes, take_nodes
from agentrt.grammars.regex import regex_to_ebnf, regex_to_json_string_ebnf
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig


class Built(NamedTuple):
    """What one constraint compiles to (`build_constraint`), in process or in a compile child:
    the compiled grammar (None when it comes from a child: compile `ebnf` again), the grammar's
    EBNF text (xgrammar's printing, root rule "root"), the keywords dropped under best effort
    ("keyword at /pointer"), and the bound on text the grammar can force (grammars/finite.py;
    None: unknown)."""

    grammar: xgr.CompiledGrammar | None
    ebnf: str
    not_enforced: list[str]
    forced_bound: ForcedBound | None
    unique_plan: list | None = None  # the unique-strings check's plan (grammars/unique_items.py)


_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


# xgrammar's length-bounded strings (minLength/maxLength) are `name{lo, hi}` over a rule
# `name ::= (([^\"\\\r\n]))`: it admits raw control characters (invalid JSON, seen in a random walk)
# and no escapes. Measured on xgrammar 0.2.9: a counted repetition is fast only when its unit is one
# character class; with an escape alternative in the unit a mask costs 20 ms per token at maxLength
# 32 and 235 ms at 1000 (the plain class: 10 us). So the unit becomes the class of characters JSON
# takes raw (no control characters, quote or backslash); a maxLength string has no escapes, and a
# minLength-only string has its first `lo` - 1 characters raw and escapes after them (`x+` is fast).
# Stricter than the schema (never admits an invalid string), documented in the README.
_BOUNDED_RULE = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_RAW_CHAR = '[^\\0-\\x1f\\"\\\\]'
_JSON_CHAR = f'(({_JSON_RAW_CHAR}) | ("\\\\" [\\"\\\\/bfnrt]))'


def _take_patterns(schema):
    """Swap every `pattern` / `patternProperties` regex for a placeholder xgrammar keeps verbatim.
    xgrammar's own regex conversion inside JSON strings is wrong for an optional group that ends in
    a repetition: measured (0.2.9), `1(?:x[0-9]+)?Z` admits "10Z". The placeholders get EBNF from
    grammars/regex.py (see lark_grammar.py's docstring for the measurements)."""
    patterns: list[str] = []

    def walk(s):
        if isinstance(s, list):
            return [walk(x) for x in s]
        if not isinstance(s, dict):
            return s
        out = {}
        for k, v in s.items():
            if k == "pattern" and isinstance(v, str):
                patterns.append(v)
                out[k] = f"AGENTRTPAT{len(patterns) - 1}X"
            elif k == "patternProperties" and isinstance(v, dict):
                pp = {}
                for pat, sub in v.items():
                    patterns.append(pat)
                    pp[f"AGENTRTPAT{len(patterns) - 1}X"] = walk(sub)
                out[k] = pp
            elif k in ("properties", "$defs") and isinstance(v, dict):
                out[k] = {name: walk(sub) for name, sub in v.items()}
            else:
                out[k] = walk(v)
        return out

    return walk(schema), patterns


def _put_patterns(ebnf: str, patterns: list[str]) -> str:
    for i, pat in enumerate(patterns):
        placeholder = f'Regex("AGENTRTPAT{i}X", json_string=true)'
        if placeholder not in ebnf:
            raise ConstraintError(f"pattern {pat!r} could not be placed in the grammar")
        ebnf = ebnf.replace(placeholder, "(" + regex_to_json_string_ebnf(pat) + ")")
    return ebnf


def _fix_bounded_strings(ebnf: str) -> str:
    names = _BOUNDED_RULE.findall(ebnf)
    if not names:
        return ebnf
    ebnf = _BOUNDED_RULE.sub(lambda m: f"{m.group(1)} ::= {_JSON_RAW_CHAR}", ebnf)
    for name in names:
        # minLength only
        ebnf, n = re.subn(
            rf"\b{name}\{{(\d+), -1\}}", lambda m, name=name: _at_least(name, int(m.group(1))), ebnf
        )
        if n:
            ebnf += f"\n{name}_any ::= {_JSON_CHAR}\n"
    return ebnf


def _at_least(name: str, lo: int) -> str:
    """`lo`+ string characters: the first lo - 1 raw, then one or more of any (escapes included).
    `x+` keeps masks fast; `x{1, 1} x*` measured 26 ms per token in an object."""
    return f"{name}{{{lo - 1}, {lo - 1}}} {name}_any+" if lo > 1 else f"{name}_any+"


def schema_ebnf(
    schema, strict: bool | None, not_enforced: list[str], ws: dict, plans: list | None = None
) -> str:
    """EBNF (root rule `root`) of a JSON Schema through the faithful pipeline: normalize (refuse or,
    with strict False, drop what cannot be enforced, appending "keyword at pointer" to
    `not_enforced`), xgrammar's converter, then our bounded strings and patterns. With `plans` (a
    list), `uniqueItems` over free strings is kept and its matcher check's plan appended there
    (grammars/unique_items.py; None appended when the schema has none); without, it is refused.
    Raises ConstraintError (UnsupportedSchemaError / UnsatisfiableSchemaError from the normalizer)
    or xgrammar's RuntimeError."""
    best_effort = strict is False
    norm = normalize_schema(
        schema, best_effort=best_effort, close_objects=strict is True, unique_strings=plans is not None
    )
    not_enforced.extend(norm.not_enforced)
    schema = norm.schema
    if plans is not None:
        from agentrt.grammars.unique_items import has_marks, strip_marks, unique_plan

        plan = None
        if has_marks(schema):
            plan = unique_plan(schema, best_effort, not_enforced)
            schema = strip_marks(schema)
        plans.append(plan)
    schema, nodes = take_nodes(schema, ws)  # subschemas with grammars of our own (json_schema/nodes.py)
    schema, patterns = _take_patterns(schema)
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema, ensure_ascii=False), strict_mode=False, **ws)
    return put_nodes(_put_patterns(_fix_bounded_strings(str(grammar)), patterns), nodes, ws)


def clean_error(e: Exception) -> str:
    """The reason to show for `e`: xgrammar's text without its prefix; never empty or Python's
    own wording for a recursion limit."""
    if isinstance(e, RecursionError):
        return "it is nested too deeply (the converter's recursion limit was reached)"
    text = _XGR_PREFIX.sub("", str(e)).strip()
    return (
        text or f"xgrammar refused it with {type(e).__name__} and no message (e.g. a number beyond 64 bits)"
    )


def _refusal(message: str, cause: Exception) -> ConstraintError:
    """A ConstraintError with `message` that keeps the keyword, pointer and tool index of `cause`
    when it is a ConstraintError (a schema error deep in the constraint)."""
    if isinstance(cause, ConstraintError):
        return ConstraintError(
            message, cause.param, keyword=cause.keyword, pointer=cause.pointer, tool_index=cause.tool_index
        )
    return ConstraintError(message)


def whitespace_options(config: GrammarConfig) -> dict:
    """xgrammar's JSON layout options from `config` (the `ws` argument of `schema_ebnf`)."""
    ws = {"any_whitespace": config.any_whitespace, "indent": config.indent}
    if config.any_whitespace:
        ws["max_whitespace_cnt"] = config.max_whitespace_cnt
    return ws


def spec_grammar(
    spec: ConstraintSpec, not_enforced: list[str], ws: dict, plans: list | None = None
) -> xgr.Grammar | None:
    """`answer_grammar`, after the model's free reasoning when the spec has a reasoning format
    (grammars/reasoning.py: `reasoning` then the answer, one grammar). Tool calls' markers are
    excluded from the reasoning (a call comes after it, never inside it)."""
    answer = answer_grammar(spec, not_enforced, ws, plans)
    if answer is None or not spec.reasoning:
        return answer
    from agentrt.grammars.reasoning import ReasoningFormat

    fmt, mode = ReasoningFormat.from_json(spec.reasoning)
    markers: list[str] = []
    if spec.kind == "tool_calls" and (plan := json.loads(spec.value)).get("mode") != "none":
        from agentrt.grammars.tool_calls import FORMATS, call_markers

        markers = call_markers(FORMATS[plan["format"]], plan["tools"])
    tag = fmt.structural_tag(mode, str(answer), spec.kind == "tool_calls", markers)
    return xgr.Grammar.from_structural_tag(json.dumps(tag, ensure_ascii=False))


def answer_grammar(
    spec: ConstraintSpec, not_enforced: list[str], ws: dict, plans: list | None = None
) -> xgr.Grammar | None:
    """The spec as an xgrammar Grammar whose root rule is `root` (None for an unknown kind).
    Dropped keywords (best effort) are appended to `not_enforced`; a json_schema spec's
    unique-strings plan to `plans` when given (see `schema_ebnf`; tool arguments never get one).
    Raises ConstraintError, or xgrammar's RuntimeError / ValueError (build_constraint turns them
    into ConstraintError)."""
    if spec.kind == "json_schema":
        ebnf = schema_ebnf(json.loads(spec.value), spec.strict, not_enforced, ws, plans)
        return xgr.Grammar.from_ebnf(ebnf)
    if spec.kind == "tool_calls":
        from agentrt.grammars.reasoning import free_answer
        from agentrt.grammars.tool_calls import arguments_ebnf, structural_tag

        plan = json.loads(spec.value)
        args = []
        for i, t in enumerate(plan["tools"] if plan.get("mode") != "none" else []):
            dropped: list[str] = []
            try:  # the format's arguments grammar: the JSON one (schema_ebnf) or built from it
                ebnf = arguments_ebnf(plan["format"], t, dropped, ws, schema_ebnf)
                check_finite(ebnf, "root")
            except (RuntimeError, ValueError) as e:
                raise _refusal(clean_error(e), e).in_tool(i, t["name"]) from None
            not_enforced.extend(f"{d} (tool '{t['name']}')" for d in dropped)
            args.append(ebnf)
        if plan.get("answer") is not None:
            tag = _calls_or_answer(plan, args, spec.reasoning, not_enforced, ws)
        else:
            tag = structural_tag(plan, args)
        tag = free_answer(spec.reasoning, tag)  # a reasoning's start: no answer
        return xgr.Grammar.from_structural_tag(json.dumps(tag, ensure_ascii=False))
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **ws)
    if spec.kind == "lark":
        from agentrt.grammars.lark_grammar import lark_to_ebnf

        return xgr.Grammar.from_ebnf(lark_to_ebnf(spec.value), root_rule_name="root")
    if spec.kind == "regex":
        # our converter, not xgrammar's from_regex (which ignores anchors inside a pattern:
        # `ab$c` admits "abc"); a whole-match regex, ^ and $ at its ends optional
        return xgr.Grammar.from_ebnf(f"root ::= {regex_to_ebnf(spec.value)}\n", root_rule_name="root")
    if spec.kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.value, root_rule_name="root")
    if spec.kind == "choice":
        alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec.value))
        return xgr.Grammar.from_ebnf(f"root ::= {alts}")
    return None


def _calls_or_answer(plan: dict, args: list[str], reasoning: str, not_enforced: list[str], ws: dict) -> dict:
    """The structural tag of tool calls or a final answer (tool_choice "auto" with a response
    schema, `plan["answer"]`: {"schema", "strict"}): `(calls) | (answer)`, the calls exactly as
    under tool_choice "required" (each call's arguments valid, `parallel` kept), the answer the
    schema's JSON through the faithful pipeline (no free text, so the first token picks the branch).
    `reasoning`: the spec's reasoning value; a format whose plain answer opens with a header
    (Harmony's final channel) gets it before the answer, not before the calls. Raises
    ConstraintError "the final answer's schema: ..." (keyword and pointer kept) when the schema
    cannot be enforced; its uniqueItems over strings is refused (that check reads the whole output)."""
    from agentrt.grammars.tool_calls import structural_tag

    calls = structural_tag({**plan, "mode": "required"}, args)["format"]
    answer = plan["answer"]
    try:
        ebnf = schema_ebnf(answer["schema"], answer["strict"], not_enforced, ws)
        check_finite(ebnf, "root")
    except (RuntimeError, ValueError) as e:
        raise _refusal(f"the final answer's schema: {clean_error(e)}", e) from None
    element: dict = {"type": "grammar", "grammar": ebnf}
    if reasoning:
        from agentrt.grammars.reasoning import ReasoningFormat

        header = ReasoningFormat.from_json(reasoning)[0].header
        if header:
            element = {"type": "sequence", "elements": [{"type": "const_string", "value": header}, element]}
    return {"type": "structural_tag", "format": {"type": "or", "elements": [calls, element]}}


def build_constraint(spec: ConstraintSpec, ws: dict, compiler: xgr.GrammarCompiler) -> Built:
    """All the work of one constraint: the spec's text parsed and converted to an xgrammar Grammar
    (`spec_grammar`: the faithful-schema normalizer and xgrammar's JSON Schema converter, regex /
    Lark -> EBNF, tool-call structural tags), the finite-output check and forced-text bound
    (grammars/finite.py), then `compiler.compile_grammar`. `ws`: `whitespace_options(config)`.
    GrammarBackend runs it in a compile child that is killed at the deadline
    (grammars/compile_child.py), or on the compile thread without one. Raises ConstraintError
    "<kind> constraint cannot be compiled: <reason>", keeping the keyword, JSON pointer and tool
    index of a schema error."""
    not_enforced: list[str] = []
    plans: list = []
    try:
        grammar = spec_grammar(spec, not_enforced, ws, plans)
        if grammar is None:
            raise ConstraintError(f"unknown constraint kind '{spec.kind}'")
        ebnf = str(grammar)
        bound = check_finite(ebnf, "root")
        plan = plans[0] if plans else None
        return Built(compiler.compile_grammar(grammar), ebnf, not_enforced, bound, plan)
    except (RuntimeError, ValueError, TypeError) as e:
        raise _refusal(f"{spec.kind} constraint cannot be compiled: {clean_error(e)}", e) from None
