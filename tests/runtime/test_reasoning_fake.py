"""Reasoning and constraints on a scripted model (the fake runner, FakeModelRunner.script): the
constraint is off inside the reasoning and on after it, the thinking budget forces the end
marker at 1 and N tokens, and with max_tokens_policy "close" a long-thinking model under a schema
always ends with valid JSON inside a tight max_tokens. Parsing at every chunking: the reasoning
parser and the output parser (reasoning, then tool calls) give the same pieces whatever the split."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from agentrt.api.output_text import OutputParser
from agentrt.api.tools import plan_tools
from agentrt.grammars.reasoning import FORMATS, ReasoningParser
from agentrt.grammars.spec import ConstraintSpec
from agentrt.grammars.tool_calls import FORMATS as TOOL_FORMATS
from agentrt.runtime.request import ReasoningParams, SamplingParams
from agentrt.testing import fake_engine
from tests.support.models import finish_all

THINK = FORMATS["think"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
    "additionalProperties": False,
}
LONG_THOUGHT = (
    "Let me think about this step by step. The user asks for the largest city. I recall that "
    "Paris is large, but I should double-check every other candidate carefully before answering. "
) * 6


@pytest.fixture(scope="module")
def engine():
    return fake_engine(max_model_len=4096, num_kv_slots=16384)


def _prompt(engine, question: str) -> list[int]:
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert THINK.mode(text) == "open"
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _spec(schema=SCHEMA) -> ConstraintSpec:
    plain = ConstraintSpec.json_schema(schema)
    return ConstraintSpec(plain.kind, plain.value, plain.strict, THINK.as_json("open"))


def _params(max_tokens, budget=None, policy="length", close_text=""):
    return SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        max_tokens_policy=policy,
        reasoning=ReasoningParams(THINK.start, THINK.end, "open", budget, close_text),
    )


def _split(text: str) -> ReasoningParser:
    parser = ReasoningParser(THINK, "open")
    parser.feed(text)
    parser.finish()
    return parser


def test_json_inside_the_reasoning_and_prose_after_it(engine):
    """The model writes JSON inside <think> and then tries prose as its answer: the JSON stays
    reasoning (the constraint is off there), the prose is masked and the answer is valid JSON."""
    prompt = _prompt(engine, "Largest city?")
    engine.runner.script(prompt, '{"city": "Lyon", "ok": false}\n</think>\n\nSure! The answer is Paris.')
    (out,) = finish_all(engine, [engine.add_request(prompt, _params(120, policy="close"), _spec())])
    parsed = _split(out.text)
    assert parsed.reasoning == '{"city": "Lyon", "ok": false}'
    assert "Sure" not in parsed.content
    jsonschema.validate(json.loads(parsed.content), SCHEMA)
    assert out.finish_reason == "stop"


def test_the_answer_cannot_be_skipped(engine):
    """A model that ends its reasoning and then stops (EOS) is not allowed to: EOS is masked until
    the answer is complete."""
    prompt = _prompt(engine, "Skip the answer?")
    engine.runner.script(prompt, "no answer needed</think>")
    (out,) = finish_all(engine, [engine.add_request(prompt, _params(100, policy="close"), _spec())])
    jsonschema.validate(json.loads(_split(out.text).content), SCHEMA)


@pytest.mark.parametrize("budget", [1, 7, 40])
def test_budget_forces_the_end_marker(engine, budget):
    prompt = _prompt(engine, f"Think for {budget}?")
    engine.runner.script(prompt, LONG_THOUGHT)
    close_text = " Time is up."
    params = _params(400, budget, "close", close_text)
    (out,) = finish_all(engine, [engine.add_request(prompt, params, _spec())])
    parsed = _split(out.text)
    assert parsed.reasoning == (LONG_THOUGHT[:budget] + close_text).strip()
    close = len(engine.tokenizer.encode(close_text + THINK.end, add_special_tokens=False))
    assert out.num_reasoning_tokens == budget + close
    jsonschema.validate(json.loads(parsed.content), SCHEMA)


def test_close_policy_always_gives_a_valid_answer_at_tight_max_tokens(engine):
    """A long-thinking model (it never closes its reasoning) under a schema, budget 150, max_tokens
    170: with the length policy the answer is cut; with "close" every output is valid JSON within
    max_tokens, greedy and sampled."""
    valid = {"length": 0, "close": 0}
    for i in range(6):
        prompt = _prompt(engine, f"Question {i}?")
        engine.runner.script(prompt, LONG_THOUGHT)
        for policy in valid:
            params = _params(170, 150, policy)
            if i % 2:
                params.temperature, params.seed = 1.0, i
            (out,) = finish_all(engine, [engine.add_request(prompt, params, _spec())])
            assert len(out.token_ids) <= 170
            try:
                jsonschema.validate(json.loads(_split(out.text).content), SCHEMA)
                valid[policy] += 1
            except (ValueError, jsonschema.ValidationError):
                assert policy == "length", out.text
    assert valid["close"] == 6
    assert valid["length"] < 6


def test_unconstrained_budget_closes_the_reasoning(engine):
    prompt = _prompt(engine, "Free text?")
    engine.runner.script(prompt, LONG_THOUGHT)
    (out,) = finish_all(engine, [engine.add_request(prompt, _params(60, 10))])
    assert out.text.startswith(LONG_THOUGHT[:10] + "</think>")


# ---- parsing at every chunking ------------------------------------------------------------------

TEXTS = [
    ("open", "\nI should call it.\n</think>\n\nHere you go."),
    ("open", "thinking <thi </thin </think>answer with </think> inside"),
    ("optional", "  <think>\nreasoning\n\n</think>\n\nanswer"),
    ("optional", "no reasoning <think> here"),
    ("optional", "<thin"),
    ("open", "cut inside the reasoning </thi"),
    ("off", "<think>x</think>y"),
]


def _chunkings(text: str, seed: int = 0):
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("mode,text", TEXTS)
def test_reasoning_parser_is_chunking_invariant(mode, text):
    whole = ReasoningParser(THINK, mode)
    whole.feed(text)
    whole.finish()
    for pieces in _chunkings(text):
        parser = ReasoningParser(THINK, mode)
        reasoning = content = ""
        for p in pieces:
            r, c = parser.feed(p)
            reasoning, content = reasoning + r, content + c
        r, c = parser.finish()
        assert (reasoning + r, content + c) == (whole.reasoning, whole.content), pieces


def test_reasoning_parser_pieces():
    p = _split("\nI think.\n</think>\n\n{}")
    assert (p.reasoning, p.content) == ("I think.", "{}")
    p = ReasoningParser(THINK, "optional")
    p.feed("plain answer")
    p.finish()
    assert (p.reasoning, p.content) == ("", "plain answer")


def test_calls_after_the_reasoning_are_parsed_at_any_chunking():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plan = plan_tools(tools, "auto", None, TOOL_FORMATS["hermes"])
    text = (
        '\nMaybe <tool_call {"name": "get_weather"} here? No.\n</think>\n\nLet me check.'
        '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    whole = OutputParser((THINK, "open"), plan)
    whole.feed(text)
    _, finish = whole.close("stop")
    assert finish == "tool_calls"
    assert whole.reasoning.startswith("Maybe <tool_call {")  # the call syntax short of its marker
    assert [c.name for c in whole.calls] == ["get_weather"]
    assert json.loads(whole.calls[0].arguments) == {"city": "Paris"}
    for pieces in _chunkings(text, seed=3):
        parser = OutputParser((THINK, "open"), plan)
        events = [e for p in pieces for e in parser.feed(p)]
        events += parser.close("stop")[0]
        reasoning = "".join(e.text for e in events if e.kind == "reasoning")
        content = "".join(e.text for e in events if e.kind == "content")
        args = "".join(e.text for e in events if e.kind == "args")
        assert (reasoning, content) == (whole.reasoning, whole.content)
        assert json.loads(args) == {"city": "Paris"}


@pytest.mark.parametrize("fmt_name", sorted(TOOL_FORMATS))
def test_reasoning_then_calls_in_every_format_at_any_chunking(fmt_name):
    """Every tool-call format after a reasoning block: the same reasoning, content and calls
    whole, one character at a time and at random splits."""
    fmt = TOOL_FORMATS[fmt_name]
    props = {"city": {"type": "string"}, "days": {"type": "integer"}}  # XML formats read values by type
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": props}}}
        for n in ("get_weather", "get_time")
    ]
    plan = plan_tools(tools, "auto", None, fmt)
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"city": "Hanoi"})]
    if fmt_name == "harmony":  # a Harmony call ends the turn (<|call|>): one per output
        calls = calls[:1]
    text = "\nWhich tool? The weather one.\n</think>\n\nLet me check." + fmt.render_calls(calls)
    whole = OutputParser((THINK, "open"), plan)
    whole.feed(text)
    _, finish = whole.close("stop")
    assert finish == "tool_calls"
    assert whole.reasoning == "Which tool? The weather one."
    expected = [(c.name, json.loads(c.arguments)) for c in whole.calls]
    assert expected == [(n, a) for n, a in calls]
    for pieces in _chunkings(text, seed=len(fmt_name)):
        parser = OutputParser((THINK, "open"), plan)
        events = [e for p in pieces for e in parser.feed(p)]
        events += parser.close("stop")[0]
        assert "".join(e.text for e in events if e.kind == "reasoning") == whole.reasoning
        assert "".join(e.text for e in events if e.kind == "content") == whole.content
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == expected
