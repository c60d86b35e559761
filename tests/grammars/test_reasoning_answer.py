"""The reasoning and the answer in the grammar layer (issue 51 items 1 and 3): the grammar keeps every
format's call markers out of the reasoning (as it keeps the end marker), the unique-strings check
reads the answer only (its AnswerGate), and the parsers read a call written inside an
unconstrained reasoning as a call. Matcher level, on the default model's tokenizer."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import xgrammar as xgr

from agentrt.api.output_text import OutputParser
from agentrt.api.tools import plan_tools
from agentrt.grammars.pipeline import build_constraint, whitespace_options
from agentrt.grammars.reasoning import FORMATS as REASONING
from agentrt.grammars.reasoning import ReasoningParser
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.tool_calls import FORMATS, call_markers

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
UNIQUE = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}


@pytest.fixture(scope="module")
def compiler(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _reasoning_of(fmt: str):
    return REASONING["harmony"] if fmt == "harmony" else REASONING["think"]


def _around(fmt: str, mode: str, reasoning: str, answer: str) -> str:
    """The output text of `reasoning` then `answer` in the tool format's reasoning format."""
    r = _reasoning_of(fmt)
    start = "" if mode == "open" else r.start
    return f"{start}{reasoning}{r.end}{r.separator or chr(10) * 2}{answer}"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_no_call_marker_inside_a_constrained_reasoning(compiler, fmt):
    """Every format, tool_choice auto / required / named, reasoning open or optional: a call after
    the reasoning is accepted, and so is a reasoning holding the call syntax short of its marker;
    a call written inside the reasoning is refused (before the fix it was reasoning text). In
    optional mode the auto answer's free text cannot open with the start marker either (else the
    grammar read the reasoning and its call as an answer the parser reads as reasoning)."""
    f = FORMATS[fmt]
    call = f.render_calls([("get_weather", {"city": "Rome"})])
    talk = 'Calls look like {"name": "x", "arguments": {}} or [x(a=1)]; "quoted" [brackets].'
    for tool_choice in ("auto", "required", NAMED):
        plan = plan_tools([WEATHER], tool_choice, None, f)
        for mode in ("open", "optional"):
            spec = replace(plan.constraint(), reasoning=_reasoning_of(fmt).as_json(mode))
            grammar = build_constraint(spec, whitespace_options(GrammarConfig()), compiler).grammar

            def accepts(text: str, grammar=grammar) -> bool:
                m = xgr.GrammarMatcher(grammar)
                return m.accept_string(text) and m.is_completed()

            where = (tool_choice, mode)
            assert accepts(_around(fmt, mode, "I will call it.", call)), where
            if fmt not in ("llama3_json", "pythonic"):  # their markers are the call itself
                assert accepts(_around(fmt, mode, talk, call)), where
            assert not accepts(_around(fmt, mode, f"I will call {call} now.", call)), where
            assert not accepts(_around(fmt, mode, f"I will call {call}", "")), where


def test_tool_choice_none_keeps_the_reasoning_free(compiler):
    """tool_choice "none": no call to lose, the reasoning may name the syntax (the answer cannot)."""
    plan = plan_tools([WEATHER], "none", None, FORMATS["hermes"])
    spec = replace(plan.constraint(), reasoning=REASONING["think"].as_json("open"))
    m = xgr.GrammarMatcher(build_constraint(spec, whitespace_options(GrammarConfig()), compiler).grammar)
    call = FORMATS["hermes"].render_calls([("get_weather", {"city": "Rome"})])
    assert m.accept_string(f"Not {call} today.</think>\n\nIt is sunny.") and m.is_completed()


@pytest.fixture(scope="module")
def backend(tokenizer):
    from agentrt.grammars.xgrammar_backend import GrammarBackend

    b = GrammarBackend(tokenizer, 49152, (2,), GrammarConfig())
    yield b
    b.shutdown()


@pytest.mark.parametrize(
    "fmt,mode", [("think", "open"), ("think", "optional"), ("harmony", "optional"), ("gemma4", "optional")]
)
def test_unique_strings_are_checked_in_the_answer_only(backend, tokenizer, fmt, mode):
    """A reasoning with a lone quote does not hide the answer's duplicate, and a reasoning quoting
    duplicates is free text, token by token and as whole strings. Both fail before the fix."""
    r = REASONING[fmt]
    spec = replace(ConstraintSpec.json_schema(UNIQUE), reasoning=r.as_json(mode))
    compiled = backend.compile(spec)
    header = r.header

    def text(reasoning: str, answer: str) -> str:
        return (
            f"{'' if mode == 'open' else r.start}{reasoning}{r.end}{r.separator or chr(10)}{header}{answer}"
        )

    dup = text('He said "hi.', '["a", "a"]')
    m = backend.new_matcher(compiled)
    assert not m.accept_string(dup)
    m = backend.new_matcher(compiled)
    ids = tokenizer.encode(dup, add_special_tokens=False)
    assert not all(m.accept_token(t) for t in ids)  # the duplicate's closing quote is refused
    for reasoning in ('He said "hi.', 'They said ["x", "x"] and "y'):
        good = text(reasoning, '["a", "b"]')
        m = backend.new_matcher(compiled)
        assert all(m.accept_token(t) for t in tokenizer.encode(good, add_special_tokens=False)), reasoning
        assert m.is_completed()
        m.rollback(3)  # the check's state follows the matcher back
        m = backend.new_matcher(compiled)
        assert m.accept_string(good) and m.is_completed()
        m.reset()
        assert not m.accept_string(dup)


def test_the_mask_inside_the_reasoning_keeps_every_quote(backend, tokenizer):
    """Inside the reasoning the check clears no bit: the quote that closes a quoted duplicate is
    allowed there (before the fix it was masked)."""
    spec = replace(ConstraintSpec.json_schema(UNIQUE), reasoning=REASONING["think"].as_json("open"))
    m = backend.new_matcher(backend.compile(spec))
    for t in tokenizer.encode('They said ["x", "x', add_special_tokens=False):
        assert m.accept_token(t)
    bitmask = backend.allocate_bitmask(1)
    m.inner.fill_next_token_bitmask(bitmask, 0)
    assert m.restrict(bitmask, 0) == 0


def test_answer_gate():
    """Where the answer begins, token by token: markers split across tokens, leading whitespace
    before an optional start marker, special tokens' text, a call marker (kept in the answer)."""
    from agentrt.grammars.reasoning import AnswerGate

    gate = AnswerGate(b"<think>", b"</think>", "open")
    assert [gate.feed(b) for b in (b'x "', b"</th", b"ink>\n", b'["a"')] == [b"", b"", b"\n", b'["a"']
    assert gate.state == "answer" and gate.ended_by == b"</think>"
    gate = AnswerGate(b"<think>", b"</think>", "optional")
    assert [gate.feed(b) for b in (b"\n", b"<th", b"ink>a", b"</think>b")] == [b"", b"", b"", b"b"]
    gate = AnswerGate(b"<think>", b"</think>", "optional")
    assert [gate.feed(b) for b in (b" ", b"<t", b"x")] == [b"", b"", b"<tx"]
    assert gate.state == "answer" and gate.ended_by is None
    gate = AnswerGate(b"<think>", b"</think>", "open", (b"<tool_call>",))
    assert [gate.feed(b) for b in (b"a <tool", b"_call>{")] == [b"", b"<tool_call>{"]
    assert gate.ended_by == b"<tool_call>"
    copy = AnswerGate(b"<think>", b"</think>", "open").copy()
    copy.feed(b"</think>")
    assert copy.state == "answer"
    assert AnswerGate.for_spec("") is None
    assert AnswerGate(b"<think>", b"</think>", "off").feed(b"x") == b"x"


def _chunkings(text: str, seed: int):
    rng = random.Random(seed)
    yield [text]
    yield list(text)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 6)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_unconstrained_call_inside_the_reasoning_is_a_call(fmt):
    """Without a grammar a call marker ends the reasoning: the call is parsed as a call, at any
    chunking (before the fix it stayed reasoning); under tool_choice "none" it stays reasoning."""
    f = FORMATS[fmt]
    r = _reasoning_of(fmt)
    call = f.render_calls([("get_weather", {"city": "Paris"})])
    text = f"{r.start}I need the weather. {call}"
    plan = plan_tools([WEATHER], "auto", None, f, constrained=False)
    for pieces in _chunkings(text, seed=51):
        parser = OutputParser((r, "optional"), plan)
        events = [e for p in pieces for e in parser.feed(p)]
        events += parser.close("stop")[0]
        assert "".join(e.text for e in events if e.kind == "reasoning") == "I need the weather.", pieces
        assert [c.name for c in parser.calls] == ["get_weather"], pieces
        assert json.loads(parser.calls[0].arguments) == {"city": "Paris"}
    none = plan_tools([WEATHER], "none", None, f, constrained=False)
    parser = OutputParser((r, "optional"), none)
    parser.feed(text)
    parser.close("stop")
    assert call_markers(f, none.tools)[0] in parser.reasoning and not parser.calls


def test_reasoning_parser_holds_back_a_partial_call_marker():
    p = ReasoningParser(REASONING["think"], "open", ("<tool_call>",))
    assert p.feed("thinking <tool_") == ("thinking", "")
    assert p.feed("cal") == ("", "")
    assert p.feed("l>{") == ("", "<tool_call>{")
    p = ReasoningParser(REASONING["think"], "open", ("<tool_call>",))
    assert p.feed("a <tool_") == ("a", "")
    assert p.feed("box") == (" <tool_box", "")
