"""Lark grammars -> EBNF (grammars/lark_grammar.py): same language as lark on real SQL grammars,
clear errors for what cannot be converted, and generated text that lark parses."""

from __future__ import annotations

import json

import pytest

from agentrt.grammars.conformance import accepts
from agentrt.grammars.lark_grammar import lark_to_ebnf
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.xgrammar_backend import GrammarBackend
from tests.support.paths import shared_path


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, 49152, (2,), GrammarConfig())


def _lark_accepts(parser, text: str) -> bool:
    import lark

    try:
        parser.parse(text)
        return True
    except lark.exceptions.LarkError:
        return False


@pytest.mark.parametrize("grammar", ["syncode_sql_grammar.lark", "outlines_pr587/sql_select.lark"])
def test_sql_grammar_agrees_with_lark_on_spider(backend, grammar):
    import lark

    text = shared_path("sql", grammar).read_text()
    parser = lark.Lark(text, parser="earley", lexer="dynamic")
    compiled = backend.compile(ConstraintSpec.lark(text))
    queries = [
        json.loads(line)["query"]
        for line in shared_path("sql", "spider_dev_sample50.jsonl").read_text().splitlines()
    ]
    verdicts = [(accepts(backend, compiled, q), _lark_accepts(parser, q)) for q in queries]
    assert all(ours == theirs for ours, theirs in verdicts), [
        q for q, v in zip(queries, verdicts) if v[0] != v[1]
    ]
    assert sum(ours for ours, _ in verdicts) >= 39  # most Spider queries are in these grammars


@pytest.mark.slow  # minutes on 2 CPU cores: `make test-slow`
def test_generated_sql_parses_with_lark(engine, tokenizer):
    """SQL generation on the default model under the converted Spider grammar: every finished
    output parses with lark."""
    import lark

    from agentrt.runtime.request import SamplingParams
    from tests.support.models import chat_ids

    text = shared_path("sql", "syncode_sql_grammar.lark").read_text()
    parser = lark.Lark(text, parser="earley", lexer="dynamic")
    ddl = json.loads(shared_path("sql", "spider_dev_schemas_ddl.json").read_text())
    rows = [
        json.loads(line) for line in shared_path("sql", "spider_dev_sample50.jsonl").read_text().splitlines()
    ]
    reqs = []
    for row in rows[:4]:
        prompt = f"{ddl[row['db_id']]}\n\nWrite one SQLite query for: {row['question']}"
        reqs.append(
            (
                chat_ids(tokenizer, [{"role": "user", "content": prompt}]),
                SamplingParams(temperature=0, max_tokens=60),
                ConstraintSpec.lark(text),
            )
        )
    outs = engine.generate(reqs)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished, [o.text for o in outs]
    for o in finished:
        assert _lark_accepts(parser, o.text), o.text


@pytest.mark.parametrize(
    "grammar,match",
    [
        ("start: A\nA: /(?<=x)a/", "lookahead/lookbehind"),
        ("start: A\nA: /(a)\\1/", "backreference"),
        ("start: A\nA: /a+?b/", "lazy repetition"),
        ("start: A\nA: /\\Wa/", "\\\\W"),
        ('start: a\na: "x" b', "not a valid Lark grammar"),
        ('begin: "x"', "not a valid Lark grammar"),
    ],
)
def test_unconvertible_lark_is_a_clear_error(backend, grammar, match):
    with pytest.raises(ValueError, match=match):
        backend.compile(ConstraintSpec.lark(grammar))


def test_lark_features_convert(backend):
    grammar = r"""
    start: pair ("," pair)*
    pair: KEY "=" value
    ?value: NUMBER | WORD | "[" [value ("," value)*] "]"
    KEY: /[a-z_]+/i
    WORD: "yes"i | "no"i
    %import common.NUMBER
    %import common.WS
    %ignore WS
    """
    ebnf = lark_to_ebnf(grammar)
    assert "root ::=" in ebnf
    compiled = backend.compile(ConstraintSpec.lark(grammar))
    for ok in ["a=1", "A_b = YES , c=[1, no,[2]]", "x=1.5e3"]:
        assert accepts(backend, compiled, ok), ok
    for bad in ["a=", "a=maybe", "=1", "a=1,", "a=[1"]:
        assert not accepts(backend, compiled, bad), bad


def test_ignored_whitespace_is_bounded(backend):
    """%ignore terminals cannot run forever: at most four ignored tokens per gap, unbounded
    repetitions inside them capped at 16; whitespace plus a comment and a newline still fit."""
    text = 'start: "a" "b"\n%import common.WS\n%ignore WS\nCOMMENT: /#[^\\n]*/\n%ignore COMMENT\n'
    compiled = backend.compile(ConstraintSpec.lark(text))
    assert accepts(backend, compiled, "a b") and accepts(backend, compiled, "a  # why\n  b")
    assert not accepts(backend, compiled, "a" + " " * 100 + "b")
    m = backend.new_matcher(compiled)
    assert m.accept_string("a") and not m.accept_string(" " * 100)


@pytest.mark.parametrize(
    "grammar,good,bad",
    [
        (
            'start: ("b" ~ 5 | "c" ~ 5 | "d") ~ 6..12',  # lark alone: every combination, minutes of CPU
            ["d" * 6, "bbbbb" + "d" * 5, "ccccc" * 12],
            ["d" * 5, "d" * 13, "bbbb" + "d" * 6],
        ),
        (
            'start: "a" () ~ 3 "b" ~ 0 "c" ~ 0..2 [D] ~ 2\nD: "d"',
            ["a", "acc", "ad", "acdd", "add"],
            ["ab", "accc", "addd"],
        ),
        (
            'start: y ~ 3 _sep{"a", ","} _sep{y, "."}\ny: "q" | "r"\n_sep{x, sep}: x (sep ("z"|x) ~ 2..3) ~ 0..4',
            ["qqraq", "qqra,zaq.rz", "rrra,aa,zzzq"],
            ["qqa q", "qqraq.z", "qqra,a,a,a,a,aq"],
        ),
        ('start: "a" ~ 2000000000 | "b"', ["b"], ["", "ab", "aa"]),
        ("start: " + '("a" | "b") ' * 12, ["a" * 12, "ab" * 6], ["a" * 11, "a" * 13, "c" * 12]),
        ("start: " + '"a"? ' * 30, ["", "a" * 30], ["a" * 31]),
    ],
    ids=["repeat-of-alternation", "repeat-edges", "repeat-in-template", "repeat-2e9", "groups", "optionals"],
)
def test_repeats_and_groups_keep_their_language_without_expansion(backend, grammar, good, bad):
    """`~ n..m` becomes an EBNF repeat and inline groups/optionals that would multiply into many
    alternatives become rules of their own (lark would write 2^12 alternatives for the 12 groups):
    the EBNF stays small and the language is the same."""
    assert len(lark_to_ebnf(grammar)) < 20_000
    compiled = backend.compile(ConstraintSpec.lark(grammar))
    for ok in good:
        assert accepts(backend, compiled, ok), ok
    for no in bad:
        assert not accepts(backend, compiled, no), no


@pytest.mark.parametrize(
    "grammar,match",
    [('start: "a" ~ 5..3', "bad repeat range"), ('start: "a" ~ 99999999999', "over the limit")],
)
def test_bad_repeat_counts_are_a_clear_error(grammar, match):
    with pytest.raises(ValueError, match=match):
        lark_to_ebnf(grammar)
