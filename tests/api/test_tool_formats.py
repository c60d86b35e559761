"""Every family's tool-call format (issue 36 item 4), model-free: detection from the 26 real chat
templates (../shared/testdata/chat_templates), rendering of tools and earlier tool turns through
each template, the streaming parser at any chunking, and the grammar (build_constraint over the
default model's tokenizer) for required / named / auto / parallel_tool_calls false."""

from __future__ import annotations

import json
import logging
import random

import pytest
import xgrammar as xgr

from agentrt.api.tools import ToolCallParser, ToolPrompt, detect, plan_tools
from agentrt.grammars.pipeline import build_constraint, whitespace_options
from agentrt.grammars.spec import GrammarConfig
from agentrt.grammars.tool_calls import FORMATS
from tests.support.paths import SHARED
from tests.support.tool_formats import (
    CONVERSATION,
    SCHEMAS,
    TOOLS,
    grammar,
    make_compiler,
    parse,
    template_text,
)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return make_compiler(tokenizer)


# template file -> (format, the unparsed call syntax it uses: warned about, generic prompt)
TEMPLATES = {
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("hermes", "command_r"),
    "DeepSeek-V3.2": ("deepseek_v3_2", None),
    "GLM-4.6": ("glm45", None),
    "HuggingFaceTB-SmolLM3-3B": ("hermes", None),  # no tool syntax at all: generic, no warning
    "MiniMax-M2": ("minimax_m2", None),
    "NVIDIA-Nemotron-Nano-v2": ("nemotron_json", None),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", None),
    "Qwen-QwQ-32B": ("hermes", None),
    "Qwen-Qwen3-0.6B": ("hermes", None),
    "Qwen3-4B-Thinking-2507": ("hermes", None),
    "Qwen3-Coder": ("qwen3_coder", None),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("hermes", "deepseek_r1"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("hermes", "deepseek_r1"),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek_v3_1", None),
    "google-gemma-4-31B-it": ("gemma4", None),
    "ibm-granite-granite-3.3-2B-Instruct": ("granite", None),
    "llama-cpp-microsoft-Phi-4-mini-instruct": ("phi4_mini", None),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3_json", None),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama3_json", None),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", None),
    "mistralai-Mistral-Small-3.1-24B-Instruct-2503": ("mistral", None),
    "moonshotai-Kimi-K2-Thinking": ("kimi_k2", None),
    "moonshotai-Kimi-K2": ("kimi_k2", None),
    "openai-gpt-oss-120b": ("harmony", None),
    "vllm-tool_chat_template_gemma3_pythonic": ("pythonic", None),
    "vllm-tool_chat_template_llama4_json": ("llama3_json", None),
}
GENERIC = {name for name, (fmt, _) in TEMPLATES.items() if fmt == "hermes"} - {
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "Qwen-QwQ-32B",
    "Qwen-Qwen3-0.6B",
    "Qwen3-4B-Thinking-2507",
}
NEW = [
    "qwen3_coder",
    "glm45",
    "deepseek_v3_1",
    "deepseek_v3_2",
    "minimax_m2",
    "kimi_k2",
    "mistral_v11",
    "phi4_mini",
    "pythonic",
    "granite",
    "nemotron_json",
    "gemma4",
]

# ---- detection ------------------------------------------------------------------------------


def test_every_template_is_classified():
    files = {p.stem for p in (SHARED / "chat_templates").glob("*.jinja")} if SHARED.exists() else set()
    if not files:
        pytest.skip("the shared chat templates are not present")
    assert files == set(TEMPLATES)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_detection_from_the_real_template(name, caplog):
    fmt, unsupported = TEMPLATES[name]
    text = template_text(name)
    d = detect(text)
    assert d.name == fmt
    assert (d.unsupported or "").split(" ")[0] == (unsupported or "")
    with caplog.at_level(logging.WARNING, logger="agentrt.api.tools.rendering"):
        prompt = ToolPrompt.for_template(text)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if unsupported:  # a start-up warning naming the syntax and the fallback
        assert len(warnings) == 1 and unsupported in warnings[0] and "generic prompt" in warnings[0]
        assert not prompt.native and prompt.fmt.name == "hermes"
    else:
        assert warnings == []
        assert prompt.native == (name not in GENERIC)


def test_detection_of_mistral_args_style_and_forced_formats(caplog):
    assert (
        detect("{{ '[TOOL_CALLS]' + name + '[ARGS]' + args }}{% if tools %}{% endif %}").name == "mistral_v11"
    )
    with caplog.at_level(logging.WARNING):  # a format chosen by the flag: no warning about the template
        p = ToolPrompt.for_template(template_text("openai-gpt-oss-120b"), "qwen3_coder")
    assert p.fmt.name == "qwen3_coder" and not p.native and not caplog.records


# ---- rendering through each template --------------------------------------------------------

# what each format's template must show of the earlier calls
RENDERED_CALL = {
    "hermes": '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}',
    "qwen3_coder": "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>",
    "deepseek_v3_1": 'get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time',
    "deepseek_v3_2": (
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>'
        '\n<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>'
    ),
    "minimax_m2": (
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>'
    ),
    "kimi_k2": 'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>',
    "mistral": '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, "id": "',
    "phi4_mini": '<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}<|/tool_call|>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "pythonic": '[get_weather(city="Paris", days=2), get_time()]',
    # Gemma 4: keys bare and sorted, strings between <|"|>, calls back to back, then the results
    "gemma4": (
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|><|tool_call>call:get_time{}'
        '<tool_call|><|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>'
    ),
    # Granite 3.3's template renders no earlier calls: written in the content as the model writes them
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "get_time"',
    "nemotron_json": (
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
        '{"name": "get_time", "arguments": {}}]</TOOLCALL>'
    ),
    # gpt-oss's template writes the recipient in the role header; the model's own calls put it on
    # the channel (the grammar's form): both are Harmony
    "harmony": 'assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 2}<|call|>',
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tools_and_tool_turns_render_through_the_template(name, tokenizer):
    text = template_text(name)
    prompt = ToolPrompt.for_template(text)
    plan = plan_tools(TOOLS, "auto", None, prompt.fmt)
    messages, tools = prompt.render(CONVERSATION, plan)
    out = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=text, tokenize=False, add_generation_prompt=True
    )
    assert "sunny" in out and "noon" in out and "and tomorrow?" in out
    assert "Weather." in out  # the tool list (its descriptions)
    if prompt.native:
        assert RENDERED_CALL[prompt.fmt.name] in out, out
    else:  # the generic prompt: the calls as hermes blocks in the assistant's text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in out
        assert "<tool_response>\nsunny\n</tool_response>" in out
    if prompt.fmt.name == "kimi_k2" and "Thinking" in name:
        assert "## Return of functions.get_weather:0\nsunny" in out  # results name the template's ids
    if prompt.fmt.name == "mistral":  # 9-character ids, the same on the call and its result
        cid = out.split('"id": "')[1][:9]
        assert cid.isalnum() and f'"call_id": "{cid}"' in out
    if prompt.fmt.name == "deepseek_v3_1":  # the template renders no tool list: DeepSeek's own prompt
        assert "### get_weather" in out and "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name" in out


# ---- parsing at any chunking ----------------------------------------------------------------

W = ("get_weather", {"city": "Paris <b>\nnord", "days": 2, "opts": {"hourly": True}})
T = ("get_time", {})

# scripted model output in each family's own syntax: (text, content, [(name, arguments)])
SCRIPTS = {
    "hermes": [
        (
            (
                'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
            ),
            "Let me check.\n",
            [("get_weather", {"city": "Rome"}), T],
        )
    ],
    "llama3_json": [
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
            "",
            [("get_weather", {"city": "Rome"})],
        ),
        ('{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}', "", [T, T]),
        ('<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    ],
    "mistral": [
        (
            (
                'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "abcDEF123"}, '
                '{"name": "get_time", "arguments": {}, "id": "abcDEF124"}]'
            ),
            "Sure. ",
            [("get_weather", {"city": "Rome"}), T],
        ),
        (
            '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
            "",
            [T, ("get_weather", {"city": "Rome"})],
        ),
    ],
    "mistral_v11": [
        ("ok[TOOL_CALLS]get_time[CALL_ID]abcDEF123[ARGS]{}", "ok", [T]),
        ("[TOOL_CALLS]hello there", "[TOOL_CALLS]hello there", []),
    ],
    "phi4_mini": [
        ('Hm.<|tool_call|>{"name": "get_time", "arguments": {}}<|/tool_call|> Done.', "Hm.Done.", [T]),
        (
            '<|tool_call|>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]<|/tool_call|>',
            "",
            [T, ("get_weather", {"city": "Rome"})],
        ),
    ],
    "granite": [
        (  # Granite 3.x writes the list alone; keys in another order are read whole
            '<|tool_call|>[{"arguments": {"city": "Rome"}, "name": "get_weather"}, {"name": "get_time", "arguments": {}}]',
            "",
            [("get_weather", {"city": "Rome"}), T],
        ),
        (
            '<|tool_call|>[{"name": "rm_rf", "arguments": {}}]',
            '<|tool_call|>[{"name": "rm_rf", "arguments": {}}]',
            [],
        ),
    ],
    "nemotron_json": [
        (
            'Let me check.\n\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</TOOLCALL>\n',
            "Let me check.\n\n",
            [("get_weather", {"city": "Rome"})],
        ),
        ("The <TOOLCALL> tag opens calls.", "The <TOOLCALL> tag opens calls.", []),
    ],
    "qwen3_coder": [
        (
            (
                "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n</parameter>\n"
                "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{'hourly': True}\n</parameter>\n</function>\n"
                "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
            ),
            "I'll look.\n",
            [("get_weather", {"city": "San Jose", "days": 3, "opts": {"hourly": True}}), T],
        ),
        (
            "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
            "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
            [],
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n</function>",
            "",
            [("get_weather", {"city": "42"})],
        ),
    ],
    "glm45": [
        (
            (
                "On it.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>"
            ),
            "On it.\n",
            [("get_weather", {"city": "Rome", "days": 2}), T],
        ),
        ("<tool_call>get_time</tool_call>", "", [T]),  # GLM-4.7's layout: no newline after the name
    ],
    "deepseek_v3_1": [
        (
            (
                'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜>'
                "<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
            ),
            "Sure.",
            [("get_weather", {"city": "Rome"}), T],
        )
    ],
    "kimi_k2": [
        (
            (
                "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Rome"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}'
                "<|tool_call_end|><|tool_calls_section_end|>"
            ),
            "Sure.",
            [("get_weather", {"city": "Rome"}), T],
        )
    ],
    "minimax_m2": [
        (
            (  # as MiniMax M2 writes calls after its reasoning: values typed by the schema
                'Let me look.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">San Jose'
                '</parameter>\n<parameter name="days">3</parameter>\n<parameter name="opts">{"hourly": true}'
                '</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>'
            ),
            "Let me look.\n",
            [("get_weather", {"city": "San Jose", "days": 3, "opts": {"hourly": True}}), T],
        ),
        (
            '<minimax:tool_call>\n<invoke name="rm_rf">\n</invoke>\n</minimax:tool_call>',
            '<minimax:tool_call>\n<invoke name="rm_rf">\n</invoke>\n</minimax:tool_call>',
            [],
        ),
        ("The <invoke> tag is XML.", "The <invoke> tag is XML.", []),
    ],
    "pythonic": [
        (
            "[get_weather(city='Rome', opts={'hourly': False}), get_time()]",
            "",
            [("get_weather", {"city": "Rome", "opts": {"hourly": False}}), T],
        ),
        (
            "See [docs] and [1, 2] and [get_time] and f(x).",
            "See [docs] and [1, 2] and [get_time] and f(x).",
            [],
        ),
    ],
    "gemma4": [
        (
            (  # calls back to back; strings raw (brackets, quotes, the end marker inside); nested values
                'Let me look.<|tool_call>call:get_weather{city:<|"|>San "Jose" {CA}<tool_call|>\n<|"|>,days:3,'
                'opts:{hourly:true,tags:[<|"|>a<|"|>,-1.5e3,null,[]],w:{}}}<tool_call|><|tool_call>call:get_time{}'
                "<tool_call|>"
            ),
            "Let me look.",
            [
                (
                    "get_weather",
                    {
                        "city": 'San "Jose" {CA}<tool_call|>\n',
                        "days": 3,
                        "opts": {"hourly": True, "tags": ["a", -1500.0, None, []], "w": {}},
                    },
                ),
                T,
            ],
        ),
        (  # whitespace between tokens, a quoted key, Python's literals (the template writes None so)
            (
                '<|tool_call>call:get_weather{ <|"|>city<|"|> : <|"|>Rome<|"|> , days:2, opts:{hourly:True,x:None} }'
                "<tool_call|>\n"
            ),
            "",
            [("get_weather", {"city": "Rome", "days": 2, "opts": {"hourly": True, "x": None}})],
        ),
        (
            "<|tool_call>call:rm_rf{}<tool_call|>",
            "<|tool_call>call:rm_rf{}<tool_call|>",
            [],
        ),
        ("The <|tool_call> token opens calls.", "The <|tool_call> token opens calls.", []),
        (  # not the syntax inside a call: the call ends there (brackets closed), the rest is text
            "<|tool_call>call:get_weather{city:Rome days:2}<tool_call|> Done.",
            "days:2}<tool_call|> Done.",
            [("get_weather", {"city": "Rome"})],
        ),
        ("<|tool_call>call:get_time{} Done.", " Done.", [T]),  # no end marker: the call ends with its braces
    ],
}


def _chunkings(text: str, seed: int = 36):
    yield [text]
    yield list(text)  # one character at a time
    rng = random.Random(seed)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _cases():
    for fmt, scripts in SCRIPTS.items():
        for i, s in enumerate(scripts):
            yield pytest.param(fmt, *s, id=f"{fmt}-{i}")
    for fmt in FORMATS:  # each format's own writing of text + several calls reads back
        f = FORMATS[fmt]
        calls = [W] if fmt == "harmony" else [W, T, W]  # a Harmony call ends the turn (<|call|>)
        yield pytest.param(
            fmt, "Let me see. " + f.render_calls(calls), "Let me see. ", calls, id=f"{fmt}-own"
        )


@pytest.mark.parametrize("fmt,text,want_content,want_calls", list(_cases()))
def test_streamed_parse_equals_whole_parse_at_any_chunking(fmt, text, want_content, want_calls):
    content, calls = parse(fmt, [text])
    assert content == want_content
    assert [(n, json.loads(a)) for n, a in calls] == [(n, a) for n, a in want_calls]
    for chunks in _chunkings(text):
        assert parse(fmt, chunks) == (content, calls), chunks


@pytest.mark.parametrize("fmt", NEW)
def test_cut_off_call_markup_never_reaches_content(fmt):
    full = "Hi " + FORMATS[fmt].render_calls([W])
    for n in range(len("Hi "), len(full)):
        for chunks in ([full[:n]], list(full[:n])):
            content, _ = parse(fmt, chunks, cut_off=True)
            assert content == "Hi ", (fmt, full[:n])


def test_xml_values_are_typed_by_the_schema():
    plan = plan_tools(TOOLS, "auto", None, FORMATS["qwen3_coder"])
    p = plan.new_parser()
    p.feed(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n007\n</parameter>\n<parameter=days>\n007\n"
    )
    p.feed("</parameter>\n<parameter=x>\ntrue\n</parameter>\n</function>\n</tool_call>")
    _events, finish = p.close("stop")
    assert finish == "tool_calls"
    assert json.loads(p.calls[0].arguments) == {"city": "007", "days": 7, "x": "true"}  # undeclared: text


# ---- grammars -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_grammar_of_each_format(compiler, fmt):
    f = FORMATS[fmt]
    one = f.render_calls([("get_weather", {"city": "Rome", "days": 2})])
    two = f.render_calls([("get_weather", {"city": "Rome\n<b>", "unit": "C"}), T])
    required = grammar(compiler, fmt)
    assert required(one) and required(f.render_calls([T]))
    if fmt == "harmony":  # a call ends the turn: one per output
        assert not required(two)
    else:  # (mistral: one list, as its templates write it; before issue 51, one block per call)
        assert required(two)
    assert not required("Sure!")  # required: a call, not text
    assert not required(f.render_calls([("rm_rf", {})]))  # no invented tools
    assert not required(f.render_calls([("get_weather", {"days": 2})]))  # city is required
    assert not required(f.render_calls([("get_weather", {"city": "Rome", "days": 9})]))  # maximum 7
    assert not required(f.render_calls([("get_weather", {"city": "Rome", "unit": "K"})]))  # enum
    assert not required(f.render_calls([("get_weather", {"city": "Rome", "zone": "x"})]))  # closed object
    single = grammar(compiler, fmt, parallel=False)
    assert single(one) and not single(f.render_calls([W, T])) and not single(two)
    named = grammar(compiler, fmt, {"type": "function", "function": {"name": "get_time"}})
    assert named(f.render_calls([T])) and not named(one)
    auto = grammar(compiler, fmt, "auto")
    assert auto('It is sunny [probably] {"really": yes}.')
    assert auto("No tools needed.") and auto("")
    assert auto("Let me check. " + one)
    assert not auto("Let me check. " + f.render_calls([("get_weather", {"city": "Rome", "days": 0})]))
    auto_single = grammar(compiler, fmt, "auto", parallel=False)
    assert auto_single("Ok. " + one) and not auto_single("Ok. " + f.render_calls([W, T]))
    for text in (one, two):  # what the grammar takes, the parser reads back
        _, calls = parse(fmt, [text])
        assert calls and all(n in SCHEMAS for n, _ in calls)


def test_every_format_is_a_choice_of_the_flag():
    import argparse

    from agentrt.server_args import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    action = next(a for a in p._actions if "--tool-call-format" in a.option_strings)
    assert set(action.choices) == {"auto", *FORMATS}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_long_call_streamed_in_small_pieces_costs_linear_work(fmt):
    """A 200,000-character argument fed 4 characters at a time: each feed's work is bounded (the
    XML / pythonic value is kept in pieces, not re-copied), so the whole parse takes well under a
    second here (quadratic work would take minutes)."""
    import time

    big = "x<y " * 50_000
    text = "Hi " + FORMATS[fmt].render_calls([("save", {"text": big, "n": 1})])
    schema = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer"}}}
    p = ToolCallParser(FORMATS[fmt], schemas={"save": schema})
    start = time.perf_counter()
    for i in range(0, len(text), 4):
        p.feed(text[i : i + 4])
    p.finish()
    assert time.perf_counter() - start < 20
    assert json.loads(p.calls[0].arguments) == {"text": big, "n": 1}


def test_generic_prompt_of_a_chosen_format_shows_its_own_syntax():
    prompt = ToolPrompt.for_template(None, "qwen3_coder")  # a template without tools, format chosen
    plan = plan_tools(TOOLS, "auto", None, prompt.fmt)
    messages, tools = prompt.render(CONVERSATION, plan)
    assert tools is None and not prompt.native
    system = messages[0]["content"]
    assert system.startswith("Be brief.") and "<function=<function name>>" in system
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in messages[2]["content"]
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_named_templates_are_read_from_their_tool_use_template():
    named = [
        {"name": "default", "template": "{{ messages }}"},
        {"name": "tool_use", "template": template_text("deepseek-ai-DeepSeek-V3.1")},
    ]
    assert ToolPrompt.for_template(named).fmt.name == "deepseek_v3_1"
    assert ToolPrompt.for_template(
        [{"name": "default", "template": template_text("Qwen3-Coder")}]
    ).fmt.name == ("qwen3_coder")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_tool_choice_none_forbids_the_call_syntax(compiler, fmt):
    """tool_choice "none": free text, never a call: the format's call markers are excluded."""
    f = FORMATS[fmt]
    plan = plan_tools(TOOLS, "none", None, f)
    built = build_constraint(plan.constraint(), whitespace_options(GrammarConfig()), compiler)

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(built.grammar)
        return m.accept_string(text) and m.is_completed()

    assert accepts("No tools needed: it is sunny in Rome.") and accepts("")
    assert not accepts("Let me check. " + f.render_calls([("get_weather", {"city": "Rome"})]))
