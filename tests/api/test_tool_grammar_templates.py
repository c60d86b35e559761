"""The tool-call grammars against what the real chat templates write (issue 51 item 4): Mistral's
parallel calls as the template's one list, Llama 3's `<|python_tag|>` calls (JSON and the built-in
tools' `.call(...)` form) under required / named / auto, keyword values closed by the call's own
token, and the XML formats' parameters."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from agentrt.api.tools import ToolCallParser, ToolPrompt, plan_tools
from agentrt.grammars.pipeline import build_constraint, whitespace_options
from agentrt.grammars.spec import GrammarConfig
from agentrt.grammars.tool_calls import FORMATS
from tests.support.tool_formats import (
    CONVERSATION,
    SCHEMAS,
    TOOLS,
    grammar,
    make_compiler,
    parse,
    template_text,
)

T = ("get_time", {})  # the call of the tool without parameters, parsed


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return make_compiler(tokenizer)


BRAVE = {
    "type": "function",
    "function": {
        "name": "brave_search",
        "description": "Web search.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "count": {"type": "integer", "maximum": 20}},
            "required": ["query"],
        },
    },
}
LLAMA_TOOLS = [*TOOLS, BRAVE]
LLAMA_CONVERSATION = [
    {"role": "user", "content": "search?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "brave_search", "arguments": '{"query": "rome"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


def _written_calls(tokenizer, template: str, messages: list[dict], begin: str, end: str, **kwargs):
    """The calls of `messages` as the real `template` writes them: each text from `begin` to just
    before `end`, in order (the template's own bytes, compared against the grammar and the parser)."""
    text = template_text(template)
    prompt = ToolPrompt.for_template(text)
    plan = plan_tools(LLAMA_TOOLS, "auto", None, prompt.fmt)
    msgs, tools = prompt.render(messages, plan)
    out = tokenizer.apply_chat_template(msgs, tools=tools, chat_template=text, tokenize=False, **kwargs)
    found, at = [], 0
    while (i := out.find(begin, at)) >= 0:
        j = out.index(end, i)
        found.append(out[i:j])
        at = j
    return found


def test_mistral_parallel_calls_are_the_templates_one_list(compiler, tokenizer):
    """Both Mistral templates write a turn's calls as one list, `[TOOL_CALLS][{...}, {...}]` (Small
    3.1 with a space before it, each call with its 9-character id): the grammar takes exactly that,
    under required, named and auto, and the parser reads the calls back. Before issue 51 the
    grammar wrote parallel calls as repeated `[TOOL_CALLS][...]` blocks and refused the list."""
    eos = tokenizer.eos_token
    required, auto = grammar(compiler, "mistral"), grammar(compiler, "mistral", "auto")
    single = grammar(compiler, "mistral", parallel=False)
    for template in ("mistralai-Mistral-Nemo-Instruct-2407", "mistralai-Mistral-Small-3.1-24B-Instruct-2503"):
        [written] = _written_calls(tokenizer, template, CONVERSATION, "[TOOL_CALLS]", eos)
        assert written.count("[TOOL_CALLS]") == 1 and written.count('"id": "') == 2, written
        assert required(written) and auto("Checking. " + written), written
        assert not single(written)  # parallel_tool_calls false: one call
        _, calls = parse("mistral", [written])
        assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris", "days": 2}), T]
    call = '{"name": "get_time", "arguments": {}'  # open: the id may follow
    one = f"[TOOL_CALLS][{call}}}]"
    assert required(one) and single(one) and single(f'[TOOL_CALLS] [{call}, "id": "abcDEF123"}}]')
    assert not required(one + one)  # repeated blocks
    assert not required(f'[TOOL_CALLS][{call}, "id": "abc"}}]')  # an id is 9 letters and digits
    assert not auto(f"Ok. {one} and more text")  # the list ends the turn
    named = grammar(compiler, "mistral", {"type": "function", "function": {"name": "get_time"}})
    assert named(one) and not named(f"[TOOL_CALLS][{call}}}, {call}}}]")  # a named tool: one call
    assert not named('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]')


def test_llama3_python_tag_calls_in_the_grammar(compiler, tokenizer):
    """Llama 3.x under required / named: a JSON call optionally after `<|python_tag|>`, and a
    built-in tool (brave_search, wolfram_alpha, code_interpreter) also as the template writes it
    when the request names it in `builtin_tools`: `<|python_tag|>brave_search.call(query="...")`,
    alone, its keyword arguments checked against the tool's parameters; under auto the tag opens
    a call (no free text after it). Before issue 51 required refused the tag (parsed only) and
    the built-in form was neither constrained nor parsed."""
    [written] = _written_calls(
        tokenizer,
        "meta-llama-Llama-3.3-70B-Instruct",
        LLAMA_CONVERSATION,
        "<|python_tag|>",
        "<|eom_id|>",
        builtin_tools=["brave_search"],
    )
    assert written == '<|python_tag|>brave_search.call(query="rome")', written
    json_call = '{"name": "get_time", "parameters": {}}'
    weather = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    required = grammar(compiler, "llama3_json", tools=LLAMA_TOOLS)
    single = grammar(compiler, "llama3_json", parallel=False, tools=LLAMA_TOOLS)
    for ok in (written, f"<|python_tag|>{json_call}", f"<|python_tag|>{json_call}; {weather}", json_call):
        assert required(ok), ok
    assert single(written) and single(f"<|python_tag|>{json_call}")
    assert not single(f"<|python_tag|>{json_call}; {weather}")
    assert required('<|python_tag|>brave_search.call(query="x", count=3)')
    for bad in (
        "<|python_tag|>brave_search.call(count=3)",  # query is required
        '<|python_tag|>brave_search.call(query="x", count=30)',  # maximum 20
        '<|python_tag|>brave_search.call(query="x", lang="en")',  # an undeclared keyword
        '<|python_tag|>get_weather.call(city="Rome")',  # not a built-in tool: JSON only
        f'<|python_tag|>brave_search.call(query="x"); {json_call}',  # a built-in call stands alone
        "<|python_tag|>print(1)",
        f"<|python_tag|><|python_tag|>{json_call}",
    ):
        assert not required(bad), bad
    named = grammar(
        compiler, "llama3_json", {"type": "function", "function": {"name": "brave_search"}}, tools=LLAMA_TOOLS
    )
    assert named(written) and named('{"name": "brave_search", "parameters": {"query": "x"}}')
    assert not named(f"<|python_tag|>{json_call}")
    named_time = grammar(
        compiler, "llama3_json", {"type": "function", "function": {"name": "get_time"}}, tools=LLAMA_TOOLS
    )
    assert named_time(f"<|python_tag|>{json_call}") and not named_time(written)
    auto = grammar(compiler, "llama3_json", "auto", tools=LLAMA_TOOLS)
    assert auto("Let me search. " + written) and auto(f"Ok <|python_tag|>{json_call}") and auto("No call.")
    assert not auto("Ok <|python_tag|>print(1)")  # the tag opens a call
    assert not auto('Ok <|python_tag|>brave_search.call(q="x")')
    for text, want in ((written, ("brave_search", {"query": "rome"})), (f"<|python_tag|>{json_call}", T)):
        p = ToolCallParser(FORMATS["llama3_json"], names={"brave_search", *SCHEMAS})
        p.feed(text)
        p.finish()
        assert p.content == "" and [(c.name, json.loads(c.arguments)) for c in p.calls] == [want]


def test_a_builtin_tool_whose_arguments_are_not_keywords_is_called_as_json(compiler):
    """A built-in tool whose parameters a keyword list cannot hold (a property name that is not an
    identifier) is offered as a JSON call only: never a weaker `.call(...)` form."""
    odd = {
        "type": "function",
        "function": {
            "name": "wolfram_alpha",
            "parameters": {
                "type": "object",
                "properties": {"the-query": {"type": "string"}},
                "required": ["the-query"],
            },
        },
    }
    required = grammar(compiler, "llama3_json", tools=[odd])
    assert required('{"name": "wolfram_alpha", "parameters": {"the-query": "x"}}')
    assert not required('<|python_tag|>wolfram_alpha.call(the-query="x")')


@pytest.mark.parametrize(
    "fmt,text",
    [
        ("pythonic", '[get_weather(city="Rome")]'),
        ("llama3_json", '<|python_tag|>brave_search.call(query="rome weather")'),
    ],
)
def test_a_keyword_value_may_end_in_the_token_that_closes_the_call(compiler, tokenizer, fmt, text):
    """Token by token, each of the call's own tokens is in the mask: `")` (or `")]`) closes the last
    string value and the call in one token. Before issue 51 xgrammar's JSON lookahead after a string
    (`,` `}` `]` `:` only) masked that token, so the model had to split it (the scripted model lost
    its way)."""
    plan = plan_tools(LLAMA_TOOLS, "required", True, FORMATS[fmt])
    built = build_constraint(plan.constraint(), whitespace_options(GrammarConfig()), compiler)
    matcher = xgr.GrammarMatcher(built.grammar)
    mask = xgr.allocate_token_bitmask(1, 49152)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(tokenizer.decode([t]).startswith('")') for t in ids)
    for t in ids:
        matcher.fill_next_token_bitmask(mask)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, (tokenizer.decode([t]), text)
        assert matcher.accept_token(t)
    assert matcher.is_completed()


def test_xml_raw_strings_cannot_close_their_parameter_early(compiler):
    f = FORMATS["qwen3_coder"]
    required = grammar(compiler, "qwen3_coder")
    assert required(f.render_calls([("get_weather", {"city": "a </param b\n\nc"})]))
    assert not required(f.render_calls([("get_weather", {"city": "a </parameter> b"})]))
    glm = grammar(compiler, "glm45")
    assert not glm(FORMATS["glm45"].render_calls([("get_weather", {"city": "a </arg_value> b"})]))


def test_xml_refuses_what_a_parameter_list_cannot_enforce(compiler):
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "minProperties": 1}},
    }
    with pytest.raises(ValueError, match="minProperties"):
        grammar(compiler, "qwen3_coder", tools=[tool])
    lax = {**tool, "function": {**tool["function"], "strict": False}}
    assert grammar(compiler, "qwen3_coder", tools=[lax])(
        FORMATS["qwen3_coder"].render_calls([("f", {"a": "x"})])
    )
