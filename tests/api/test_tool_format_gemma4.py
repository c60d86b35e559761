"""Gemma 4's tool calls (issue 53 item 5), model-free: `<|tool_call>call:NAME{k:v,...}<tool_call|>`.

- the argument grammar's contract: random walks through the required-call grammar (a character
  vocabulary, so every path of the grammar is reachable) parse back to arguments valid for their
  schema, for the shared tool schemas and a schema using every keyword the format enforces;
- the grammar takes the calls exactly as the real google-gemma-4-31B-it template writes them
  (keys sorted at every depth, a key with a space quoted, None), and refuses what it cannot enforce;
- the parser streams a call's arguments as JSON while they come;
- the conversation's tool results rendered through the real template as `tool_responses` in the
  model's turn, and end to end on the scripted fake model: a call parsed from the real template's
  syntax, and the next turn's prompt with its result.
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from agentrt.api.tools import ToolCallParser, ToolPrompt, detect, plan_tools
from agentrt.grammars.pipeline import build_constraint, whitespace_options
from agentrt.grammars.spec import GrammarConfig
from agentrt.grammars.tool_calls import FORMATS
from tests.support.paths import shared_path
from tests.support.tool_formats import CONVERSATION, SCHEMAS, TOOLS, template_text

GEMMA4 = FORMATS["gemma4"]
TEMPLATE = "google-gemma-4-31B-it"

RICH = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -5, "maximum": 500, "multipleOf": 5},
        "ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "pair": {
            "type": "array",
            "prefixItems": [{"type": "string", "pattern": "^[a-z]{2}$"}, {"type": "boolean"}],
            "items": False,
        },
        "when": {"type": "string", "format": "date"},
        "note": {"type": ["string", "null"]},
        "kind": {"enum": ["a b", 3, None, True]},
        "Zed": {"const": "z"},
        "meta": {"type": "object", "additionalProperties": {"type": "integer"}},
        "any": {},
        "tree": {"$ref": "#/$defs/node"},
        "choice": {"oneOf": [{"type": "string", "minLength": 2}, {"type": "integer"}]},
        "odd key": {"type": "boolean"},
    },
    "required": ["id", "tags", "Zed", "odd key"],
    "additionalProperties": False,
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["v"],
        }
    },
}
RICH_TOOL = {
    "type": "function",
    "function": {"name": "rich", "description": "Every keyword.", "parameters": RICH},
}
ALL_SCHEMAS = {**SCHEMAS, "rich": RICH}

# a character vocabulary: every grammar path is one character (or one marker) at a time
VOCAB = [chr(c) for c in range(32, 127)] + ["\n", "é", "日", '<|"|>', "<|tool_call>", "<tool_call|>", "</s>"]
EOS = len(VOCAB) - 1


@pytest.fixture(scope="module")
def char_compiler():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _grammar(compiler, tools, mode="required", parallel=True):
    plan = plan_tools(tools, mode, parallel, GEMMA4)
    return build_constraint(plan.constraint(), whitespace_options(GrammarConfig()), compiler).grammar


def _accepts(grammar, text: str) -> bool:
    m = xgr.GrammarMatcher(grammar)
    return m.accept_string(text) and m.is_completed()


def _walk(grammar, rng: random.Random, max_steps: int = 4000) -> str | None:
    """A random path through `grammar` (uniform over the allowed tokens, the end taken with
    probability 1/2 once allowed): its text, or None when it did not end within `max_steps`."""
    m = xgr.GrammarMatcher(grammar)
    mask = xgr.allocate_token_bitmask(1, len(VOCAB))
    out: list[str] = []
    for _ in range(max_steps):
        m.fill_next_token_bitmask(mask)
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[: len(VOCAB)]
        allowed = [int(i) for i in np.flatnonzero(bits)]
        if EOS in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return "".join(out)
        t = rng.choice([i for i in allowed if i != EOS])
        assert m.accept_token(t)
        out.append(VOCAB[t])
    return None


def _parsed(text: str) -> tuple[str, list[tuple[str, dict]]]:
    p = ToolCallParser(GEMMA4, names=set(ALL_SCHEMAS), schemas=ALL_SCHEMAS)
    p.feed(text)
    _, finish = p.close("stop")
    assert finish == "tool_calls", text
    return p.content, [(c.name, json.loads(c.arguments)) for c in p.calls]


@pytest.mark.parametrize("tools", [TOOLS, [RICH_TOOL]], ids=["shared", "rich"])
def test_every_call_the_grammar_takes_parses_back_to_valid_arguments(char_compiler, tools):
    """The always-valid contract: 150 random paths through the required-call grammar (parallel
    calls allowed), each read back by the parser: no content, and every call's arguments valid for
    its tool's schema (formats checked). The walks reach strings that hold quotes, brackets and
    partial markers, nested and recursive values and the optional members."""
    grammar = _grammar(char_compiler, tools)
    rng = random.Random(53)
    checker = jsonschema.FormatChecker()
    done, seen = 0, set()
    for _ in range(150):
        text = _walk(grammar, rng)
        if text is None:
            continue
        done += 1
        content, calls = _parsed(text)
        assert content == "" and calls, text
        for name, args in calls:
            jsonschema.validate(args, ALL_SCHEMAS[name], format_checker=checker)
            seen.update(args)
    assert done >= 100
    want = set(RICH["properties"]) if tools == [RICH_TOOL] else {"city", "days", "unit", "opts"}
    assert want <= seen  # every declared property was written by some walk (get_time's keys are free)


def _template_calls(messages: list[dict], tools: list[dict]) -> str:
    """The calls of `messages` as the real template writes them (its own bytes)."""
    text = template_text(TEMPLATE)
    prompt = ToolPrompt.for_template(text)
    plan = plan_tools(tools, "auto", None, prompt.fmt)
    msgs, tool_defs = prompt.render(messages, plan)
    from transformers.utils.chat_template_utils import render_jinja_template

    (out,), _ = render_jinja_template(conversations=[msgs], tools=tool_defs, chat_template=text)
    start = out.index("<|tool_call>")
    return out[start : out.rindex("<tool_call|>") + len("<tool_call|>")]


def test_the_grammar_takes_the_calls_as_the_template_writes_them(char_compiler):
    """The real template writes the arguments' keys sorted case-insensitively at every depth, a
    key holding a space as is, None as `None`: the grammar takes those bytes, the parser reads the
    arguments back, and the format's own writing is the same text (but `null`)."""
    args = {
        "tags": ["x", "yz"],
        "odd key": False,
        "Zed": "z",
        "id": 45,
        "tree": {"v": 1, "kids": [{"v": 2}, {"kids": [], "v": 3}]},
        "note": None,
        "meta": {"b": 1, "A": 2},
        "pair": ["ab", True],
        "when": "2026-02-28",
        "ratio": 0.25,
        "choice": "hi",
        "kind": "a b",
        "any": {"q": [1, "s", None, {"r": False}]},
    }
    call = {"id": "c1", "type": "function", "function": {"name": "rich", "arguments": json.dumps(args)}}
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    written = _template_calls(messages, [RICH_TOOL])
    assert written.startswith('<|tool_call>call:rich{any:{q:[1,<|"|>s<|"|>,None,{r:false}]},choice:')
    assert ",note:None,odd key:false,pair:[" in written and "meta:{A:2,b:1}" in written
    grammar = _grammar(char_compiler, [RICH_TOOL])
    assert _accepts(grammar, written), written
    assert _parsed(written) == ("", [("rich", args)])
    assert GEMMA4.render_calls([("rich", args)]).replace("null", "None") == written
    assert not _accepts(grammar, written.replace("id:45", "id:46"))  # multipleOf 5
    assert not _accepts(grammar, written.replace("odd key:false", 'odd key:<|"|>no<|"|>'))
    assert not _accepts(grammar, written.replace('when:<|"|>2026-02-28', 'when:<|"|>2026-02-30'))
    assert not _accepts(grammar, written.replace("{v:2}", "{v:2,x:1}"))  # a declared object is closed


def test_what_the_syntax_cannot_enforce_is_refused_or_dropped(char_compiler):
    """uniqueItems (and the other keywords of module tool_args_gemma4's list) is a 400 naming the
    keyword and the tool; with strict: false it is dropped and the call still compiles."""
    schema = {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(Exception, match="uniqueItems") as e:
        _grammar(char_compiler, [tool])
    assert "f" in str(e.value)
    lax = {"type": "function", "function": {"name": "f", "parameters": schema, "strict": False}}
    assert _accepts(_grammar(char_compiler, [lax]), "<|tool_call>call:f{xs:[1,1]}<tool_call|>")
    string = {"type": "object", "properties": {"s": {"type": "string"}}}
    g = _grammar(char_compiler, [{"type": "function", "function": {"name": "f", "parameters": string}}])
    assert _accepts(g, '<|tool_call>call:f{s:<|"|>a "<|" <tool_call|>}<|"|>}<tool_call|>')
    assert not _accepts(g, '<|tool_call>call:f{s:<|"|>a<|"|>b<|"|>}<tool_call|>')  # a string ends at <|"|>


def test_arguments_stream_while_the_call_is_written():
    """A call fed in pieces: its name at once, then the arguments JSON as it comes (a string's text
    before the string ends, a bare value once it ends), the pieces concatenating to the whole."""
    p = ToolCallParser(GEMMA4, names=set(SCHEMAS), schemas=SCHEMAS)
    pieces = [
        "Ok<|tool_",
        "call>call:get_wea",
        'ther{city:<|"|>Par',
        "is, <|",
        '"|>,days:1',
        "2}<tool_call|>",
    ]
    events = [[(e.kind, e.name or e.text) for e in p.feed(piece)] for piece in pieces]
    assert events[0] == [("content", "Ok")]
    assert events[1] == []
    assert events[2] == [("call", "get_weather"), ("args", '{"city": "Par')]
    assert events[3] == [("args", "is, ")]  # "<|" may begin the delimiter: held back
    assert events[4] == [("args", '"')]  # days's value 1 may go on
    assert events[5] == [("args", ', "days": 12}')]
    _, finish = p.close("stop")
    assert finish == "tool_calls" and json.loads(p.calls[0].arguments) == {"city": "Paris, ", "days": 12}


def _render(messages: list[dict], **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    text = template_text(TEMPLATE)
    prompt = ToolPrompt.for_template(text)
    msgs, tools = prompt.render(messages, plan_tools(TOOLS, "auto", None, prompt.fmt))
    (out,), _ = render_jinja_template(
        conversations=[msgs], tools=tools, chat_template=text, add_generation_prompt=True, **kwargs
    )
    return out


def test_tool_results_render_in_the_model_turn():
    """The real template reads no tool message: the results go onto the calling turn as
    tool_responses (a JSON object's text as the object), the answer after them in the same model
    turn; a conversation ending in results ends the prompt inside the model's turn, where the
    model goes on (no `<|turn>model`); a later call round opens its own turn."""
    d = detect(template_text(TEMPLATE))
    assert d.name == "gemma4" and d.native and d.tool_responses
    conversation = [dict(m) for m in CONVERSATION]
    conversation[2] = {**conversation[2], "content": ""}
    conversation[3] = {**conversation[3], "content": '{"sky": "sunny", "temp": 21.5}'}
    out = _render(conversation)
    assert (
        "<|turn>model\n"
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|><|tool_call>call:get_time{}<tool_call|>'
        '<|tool_response>response:get_weather{sky:<|"|>sunny<|"|>,temp:21.5}<tool_response|>'
        '<|tool_response>response:get_time{value:<|"|>noon<|"|>}<tool_response|>'
        "Sunny at noon.<turn|>\n<|turn>user\nand tomorrow?<turn|>\n<|turn>model\n"
    ) in out, out
    assert "<|turn>tool" not in out
    pending = _render(conversation[:5])
    assert pending.endswith('{value:<|"|>noon<|"|>}<tool_response|><|channel>thought\n<channel|>'), pending
    more = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
    }
    chained = _render([*conversation[:5], more, {"role": "tool", "tool_call_id": "c9", "content": "one"}])
    assert chained.endswith(
        "<tool_response|><|turn>model\n<|tool_call>call:get_time{}<tool_call|><|tool_response>response:get_time"
        '{value:<|"|>one<|"|>}<tool_response|><|channel>thought\n<channel|>'
    ), chained


def test_a_template_that_reads_tool_messages_gets_them():
    """A later Gemma 4 template (one that tests a message's role against 'tool') is handed the tool
    messages as they are."""
    later = "{{ '<|tool_call>call:' }}{% if message['role'] == 'tool' %}{% endif %}tool_responses"
    d = detect(later)
    assert d.name == "gemma4" and not d.tool_responses
    prompt = ToolPrompt.for_template(later)
    msgs, _ = prompt.render(CONVERSATION, plan_tools(TOOLS, "auto", None, prompt.fmt))
    assert [m["role"] for m in msgs].count("tool") == 2


def _app():
    """(client, runner, front): the scripted byte-level fake model under the real Gemma 4 template."""
    from fastapi.testclient import TestClient

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.runtime.engine import Engine
    from agentrt.testing import FakeModelRunner, byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = shared_path("chat_templates", f"{TEMPLATE}.jinja").read_text()
    runner = FakeModelRunner(tokenizer, max_model_len=8192, num_kv_slots=32768)
    front = AsyncEngine(engine=Engine(runner=runner))
    return TestClient(create_app(front, "m")), runner, front


def test_a_call_and_its_result_through_the_api():
    """Chat completions on the real template: the model's `<|tool_call>` call (constrained by the
    gemma4 grammar) comes back as an OpenAI tool call, streamed or not; the next request, with the
    call and its result, renders the result as a tool_response in the model's turn."""
    client, runner, front = _app()
    weather = TOOLS[:1]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    call = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'
    with client:
        body = {"model": "m", "messages": messages, "tools": weather}
        prompt = client.post("/tokenize", json=body).json()["tokens"]
        runner.script(prompt, call + "<|endoftext|>")
        r = client.post("/v1/chat/completions", json={**body, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"], choice
        (tc,) = choice["message"]["tool_calls"]
        assert tc["function"]["name"] == "get_weather"
        assert json.loads(tc["function"]["arguments"]) == {"city": "Paris", "days": 2}
        turn = [*messages, {"role": "assistant", "content": None, "tool_calls": [tc]}]
        turn.append({"role": "tool", "tool_call_id": tc["id"], "content": '{"sky": "clear"}'})
        ids = client.post("/tokenize", json={**body, "messages": turn}).json()["tokens"]
        text = runner.tokenizer.decode(ids)
        assert text.endswith(
            call + '<|tool_response>response:get_weather{sky:<|"|>clear<|"|>}<tool_response|>'
            "<|channel>thought\n<channel|>"
        ), text
    front.shutdown()
