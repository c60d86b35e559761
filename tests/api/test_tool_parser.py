"""Tool-call parsing (api/tools/parsing.py) for every chunking, and the tool-call grammar (structural tags)
model-free: names, arguments and formats."""

from __future__ import annotations

import json

import pytest

from agentrt.api.protocol import APIError
from agentrt.api.tools import ToolCallParser, plan_tools, render_messages
from agentrt.grammars.conformance import accepts
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.tool_calls import FORMATS
from agentrt.grammars.xgrammar_backend import GrammarBackend
from tests.support.paths import load_case


def _parse(
    fmt: str, chunks: list[str], names=None, cut_off: bool = False
) -> tuple[str, list[tuple[str, str]], list]:
    """(content, [(name, arguments)], OpenAI-style deltas merged per call index)."""
    p = ToolCallParser(FORMATS[fmt], names=names)
    events = []
    for c in chunks:
        events += p.feed(c)
    events += p.finish(cut_off=cut_off)
    content = "".join(e.text for e in events if e.kind == "content")
    calls: dict[int, list] = {}
    for e in events:
        if e.kind == "call":
            assert e.index not in calls and e.index == len(calls)  # indexes 0, 1, ... in order
            calls[e.index] = [e.name, ""]
        elif e.kind == "args":
            calls[e.index][1] += e.text
    assert content == p.content
    assert [tuple(v) for v in calls.values()] == [(c.name, c.arguments) for c in p.calls]
    return content, [tuple(v) for v in calls.values()], events


def _chunkings(text: str):
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for size in (2, 3, 5, 7, 11):
        yield [text[i : i + size] for i in range(0, len(text), size)]


def test_case_stream_tool_call_boundaries():
    case = load_case("stream-tool-call-boundaries")
    want = [(c["name"], c["arguments"]) for c in case["expect_tool_calls"]]
    for chunks in _chunkings(case["model_text"]):
        content, calls, _ = _parse("hermes", chunks)
        assert content.strip() == ""
        assert [(n, json.loads(a)) for n, a in calls] == want, chunks


@pytest.mark.parametrize(
    "fmt,text,want_content,want",
    [
        (
            "hermes",
            'Let me check.<tool_call>\n{"name": "f", "arguments": {"a": "x}<\\"y"}}\n</tool_call> Done.',
            "Let me check.Done.",
            [("f", '{"a": "x}<\\"y"}')],
        ),
        (
            "hermes",
            "no call here, just <tool text and <tool_call",
            "no call here, just <tool text and <tool_call",
            [],
        ),
        (
            "hermes",
            '<tool_call>\n{"arguments": {"n": 1}, "name": "g"}\n</tool_call>',
            "",
            [("g", '{"n": 1}')],
        ),
        ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
        (
            "hermes",
            '<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": 2}]}}',
            "",
            [("f", '{"a": [1, {"b": 2}]}')],
        ),
        (
            "llama3_json",
            '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
            "",
            [("f", '{"a": 1}'), ("g", "{}")],
        ),
        (
            "mistral",
            'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "]"}}]',
            "ok ",
            [("f", '{"a": 1}'), ("g", '{"b": "]"}')],
        ),
    ],
)
def test_formats_parse_the_same_under_any_chunking(fmt, text, want_content, want):
    for chunks in _chunkings(text):
        content, calls, _ = _parse(fmt, chunks)
        assert (content, calls) == (want_content, want), chunks


@pytest.mark.parametrize(
    "text,want",
    [
        ('<tool_call>\n{"name": "get_weather",', ("", [])),  # cut before the arguments: no call, no markup
        (
            'ok<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name":',
            ("ok", [("f", '{"a": 1}')]),
        ),
        ('<tool_call>\n{"name": "f", "arguments": {"a": "x"}}\n</tool_call', ("", [("f", '{"a": "x"}')])),
        (
            '<tool_call>\n{"name": "f", "arguments": {"a": ',
            ("", [("f", '{"a": ')]),
        ),  # started: partial arguments
        # a second call cut inside its marker (found by the adversarial pass: '<tool_' was content)
        ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_', ("", [("f", "{}")])),
        ("done <tool_ca", ("done ", [])),
    ],
)
def test_text_cut_by_max_tokens_never_puts_call_markup_in_content(text, want):
    for chunks in _chunkings(text):
        content, calls, _ = _parse("hermes", chunks, cut_off=True)
        assert (content, calls) == want, chunks


@pytest.mark.parametrize(
    "text,names,want_content,want",
    [
        (  # the form Llama 3.3's template writes for a built-in tool
            '<|python_tag|>brave_search.call(query="rome, \\"old\\" town", count=3)',
            None,
            "",
            [("brave_search", '{"query": "rome, \\"old\\" town", "count": 3}')],
        ),
        ("Hi <|python_tag|>wolfram_alpha.call()", {"wolfram_alpha"}, "Hi ", [("wolfram_alpha", "{}")]),
        (  # a JSON call after the tag, then another after "; "
            '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
            None,
            "",
            [("f", '{"a": 1}'), ("g", "{}")],
        ),
        ("<|python_tag|>print(1)", None, "<|python_tag|>print(1)", []),  # code, not a call
        (  # a name the request does not offer stays content
            '<|python_tag|>brave_search.call(query="x")',
            {"f"},
            '<|python_tag|>brave_search.call(query="x")',
            [],
        ),
    ],
)
def test_llama_builtin_calls_after_the_python_tag(text, names, want_content, want):
    """`<|python_tag|>NAME.call(k=v, ...)` (Llama 3.x's built-in tools, as its template writes them)
    is a call whose keyword arguments stream as a JSON object, at any chunking; before issue 51 it
    was content."""
    for chunks in _chunkings(text):
        content, calls, _ = _parse("llama3_json", chunks, names=names)
        assert (content, calls) == (want_content, want), chunks


def test_a_llama_builtin_call_cut_by_max_tokens_leaves_no_markup():
    text = '<|python_tag|>brave_search.call(query="rome")'
    for n in range(1, len(text)):
        content, calls, _ = _parse("llama3_json", [text[:n]], cut_off=True)
        assert content == "" and len(calls) <= 1, text[:n]


def test_a_partial_marker_at_a_natural_end_stays_content():
    assert _parse("hermes", ["see <tool_"])[0] == "see <tool_"  # finish_reason "stop": it is text


def test_unknown_tool_names_stay_content():
    text = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    content, calls, _ = _parse("hermes", [text], names={"f"})
    assert calls == [] and content == text


def test_first_delta_of_a_call_carries_the_name_then_only_arguments():
    _, _, events = _parse(
        "hermes", list('<tool_call>\n{"name": "f", "arguments": {"a": 12345}}\n</tool_call>')
    )
    kinds = [e.kind for e in events]
    assert kinds[0] == "call" and set(kinds[1:]) == {"args"} and len(kinds) > 3  # streamed piece by piece


def test_plan_validation_errors_name_the_field():
    fmt = FORMATS["hermes"]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for tools, choice, param in [
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
        ([tool, tool], None, "tools[1].function.name"),
        ([tool], {"type": "function", "function": {"name": "g"}}, "tool_choice"),
        ([tool], "sometimes", "tool_choice"),
        ([{"type": "retrieval"}], None, "tools[0]"),
        (None, "required", "tool_choice"),
    ]:
        with pytest.raises(APIError) as e:
            plan_tools(tools, choice, None, fmt)
        assert e.value.param == param, (tools, choice, e.value.message)
    plan = plan_tools(
        [tool, {"type": "function", "function": {"name": "g"}}],
        {"type": "function", "function": {"name": "g"}},
        False,
        fmt,
    )
    assert plan.mode == "required" and [t["name"] for t in plan.tools] == ["g"] and len(plan.all_tools) == 2


def test_generic_rendering_puts_tools_in_the_system_prompt_and_calls_in_text():
    plan = plan_tools(
        [
            {
                "type": "function",
                "function": {"name": "get_time", "description": "Now.", "parameters": {"type": "object"}},
            }
        ],
        "auto",
        None,
        FORMATS["hermes"],
    )
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    out, tools = render_messages(msgs, plan, native=False)
    assert tools is None
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_time"' in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>"}


@pytest.fixture(scope="module")
def backend(tokenizer):
    return GrammarBackend(tokenizer, 49152, (2,), GrammarConfig())


def _spec(tools, mode="required", parallel=True, fmt="hermes"):
    plan = plan_tools([{"type": "function", "function": t} for t in tools], mode, parallel, FORMATS[fmt])
    return ConstraintSpec.tool_calls(plan.constraint_value())


TZ = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["tz"],
        "additionalProperties": False,
    },
}
NOTE = {
    "name": "save_note",
    "parameters": {
        "type": "object",
        "properties": {"text": {"type": "string", "maxLength": 8}},
        "required": ["text"],
    },
}


def _call(name, args, fmt="hermes"):
    f = FORMATS[fmt]
    return f.tag_begin(name) + json.dumps(args) + f.tag_end()  # the compact layout: ", " and ": "


def test_required_grammar_admits_only_offered_tools_with_valid_arguments(backend):
    c = backend.compile(_spec([TZ, NOTE]))
    assert accepts(backend, c, _call("get_time", {"tz": "UTC"}))
    assert accepts(backend, c, _call("get_time", {"tz": "UTC"}) + "\n" + _call("save_note", {"text": "hi"}))
    assert not accepts(backend, c, "Sure!")  # required: a call, not text
    assert not accepts(backend, c, _call("get_weather", {"tz": "UTC"}))  # no invented names
    assert not accepts(backend, c, _call("get_time", {"tz": "PST"}))
    assert not accepts(backend, c, _call("save_note", {"text": "far too long"}))
    single = backend.compile(_spec([TZ, NOTE], parallel=False))
    assert not accepts(
        backend, single, _call("get_time", {"tz": "UTC"}) + "\n" + _call("get_time", {"tz": "CET"})
    )


def test_auto_grammar_admits_text_then_constrained_calls(backend):
    c = backend.compile(_spec([TZ], mode="auto"))
    assert accepts(backend, c, "It is noon.")
    assert accepts(backend, c, "Checking. " + _call("get_time", {"tz": "CET"}))
    assert not accepts(backend, c, "Checking. " + _call("get_time", {"tz": "PST"}))
    assert not accepts(backend, c, _call("other", {}))


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral"])
def test_other_formats_compile_and_parse_back(backend, fmt):
    c = backend.compile(_spec([TZ, NOTE], fmt=fmt))
    text = _call("get_time", {"tz": "UTC"}, fmt)
    assert accepts(backend, c, text)
    _, calls, _ = _parse(fmt, [text])
    assert calls == [("get_time", '{"tz": "UTC"}')]


def test_case_tool_without_parameters(backend):
    case = load_case("tool-without-parameters")
    plan = plan_tools(case["tools"], "required", True, FORMATS["hermes"])
    c = backend.compile(ConstraintSpec.tool_calls(plan.constraint_value()))
    assert accepts(backend, c, _call("get_server_time", {}))
    assert accepts(backend, c, _call("save_note", {"text": "x" * 1000}))
    # a tool with no parameters at all takes exactly {}
    bare = plan_tools(
        [{"type": "function", "function": {"name": "ping"}}], "required", True, FORMATS["hermes"]
    )
    c = backend.compile(ConstraintSpec.tool_calls(bare.constraint_value()))
    assert accepts(backend, c, _call("ping", {})) and not accepts(backend, c, _call("ping", {"x": 1}))


def test_unenforceable_tool_schema_names_the_tool(backend):
    bad = {
        "name": "uniq",
        "parameters": {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}},
    }
    with pytest.raises(ValueError, match="tool 'uniq' parameters: .*uniqueItems"):
        backend.compile(_spec([TZ, bad]))


QWEN_LIKE = (  # a Hermes/Qwen-style template that renders tools itself (shortened)
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    '{% for c in m.tool_calls or [] %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_format_detection_and_native_template_rendering(tokenizer):
    from agentrt.api.tools import detect_format

    assert detect_format(QWEN_LIKE) == ("hermes", True)
    assert detect_format("{{ '[TOOL_CALLS]' }} {% if tools %}{% endif %}") == ("mistral", True)
    assert detect_format("<|python_tag|>{% for t in tools %}{% endfor %}") == ("llama3_json", True)
    assert detect_format(tokenizer.chat_template) == ("hermes", False)  # the default model: generic
    plan = plan_tools(
        [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}],
        "auto",
        None,
        FORMATS["hermes"],
    )
    msgs = [
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    out, tools = render_messages(msgs, plan, native=True)
    assert tools and tools[0]["function"]["name"] == "get_time"
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}  # objects for HF templates
    assert out[2] == {"role": "tool", "content": "12:00", "tool_call_id": "c1"}
    text = tokenizer.apply_chat_template(
        out, tools=tools, chat_template=QWEN_LIKE, tokenize=False, add_generation_prompt=True
    )
    assert (
        '"name": "get_time"' in text
        and '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}' in text
    )


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-Infinity", "1e999", "[1, NaN]", '"\\ud800"'])
def test_argument_values_that_are_not_strict_json_stay_text(raw):
    """A parameter value written as NaN / Infinity / an overflowing number / a lone-surrogate escape
    is not strict JSON (clients JSON.parse the arguments; a lone surrogate cannot be sent as UTF-8):
    the value is kept as the text the model wrote, in DSML's JSON-typed and Qwen3-Coder's formats."""
    dsml = (
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n'
        f'<｜DSML｜parameter name="v" string="false">{raw}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜function_calls>"
    )
    qwen = f"<tool_call>\n<function=f>\n<parameter=v>\n{raw}\n</parameter>\n</function>\n</tool_call>"
    for fmt, text in (("deepseek_v3_2", dsml), ("qwen3_coder", qwen)):
        _, calls, _ = _parse(fmt, [text], names={"f"})
        assert len(calls) == 1, fmt
        args = calls[0][1]
        assert json.loads(args, parse_constant=_no_constant) == {"v": raw}
        args.encode("utf-8")


def _no_constant(name: str):
    pytest.fail(f"{name} in tool arguments")
