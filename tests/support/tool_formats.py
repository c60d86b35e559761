"""Shared pieces of the tool-format tests (tests/api/test_tool_formats.py, test_tool_grammar_templates.py):
two tools and their schemas, a conversation with earlier calls, a real chat template's text, the
streaming parser's result (`parse`) and the tool-call grammar as an acceptor (`grammar`)."""

from __future__ import annotations

import xgrammar as xgr

from agentrt.api.tools import ToolCallParser, plan_tools
from agentrt.grammars.pipeline import build_constraint, whitespace_options
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.tool_calls import FORMATS
from tests.support.paths import shared_path

WEATHER = {
    "name": "get_weather",
    "description": "Weather.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "unit": {"type": "string", "enum": ["C", "F"]},
            "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}
TIME = {"name": "get_time", "description": "Time.", "parameters": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": t} for t in (WEATHER, TIME)]
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}


def template_text(name: str) -> str:
    return shared_path("chat_templates", f"{name}.jinja").read_text()


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "weather and time?"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "call_aaa",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {"id": "call_bbb", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_aaa", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_bbb", "content": "noon"},
    {"role": "assistant", "content": "Sunny at noon."},
    {"role": "user", "content": "and tomorrow?"},
]


def parse(fmt: str, chunks: list[str], cut_off: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments JSON)]) from the events, checked against the parser's own totals."""
    p = ToolCallParser(FORMATS[fmt], names=set(SCHEMAS), schemas=SCHEMAS)
    events = [e for c in chunks for e in p.feed(c)] + p.finish(cut_off=cut_off)
    content = "".join(e.text for e in events if e.kind == "content")
    calls: dict[int, list[str]] = {}
    for e in events:
        if e.kind == "call":
            assert e.index == len(calls)
            calls[e.index] = [e.name, ""]
        elif e.kind == "args":
            calls[e.index][1] += e.text
    assert content == p.content
    got = [tuple(v) for v in calls.values()]
    assert got == [(c.name, c.arguments) for c in p.calls]
    return content, got


def make_compiler(tokenizer):
    """An xgrammar compiler over the default model's tokenizer (one thread, no cache)."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152, stop_token_ids=[2])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def grammar(compiler, fmt, mode="required", parallel=True, tools=TOOLS):
    """A function telling whether the tool-call grammar of `fmt` accepts a whole text."""
    plan = plan_tools(tools, mode, parallel, FORMATS[fmt])
    spec = ConstraintSpec.tool_calls(plan.constraint_value())
    built = build_constraint(spec, whitespace_options(GrammarConfig()), compiler)

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(built.grammar)
        return m.accept_string(text) and m.is_completed()

    return accepts
