"""Nothing that checks the answer reads the reasoning, and a call is never lost in it (issue 51 items
1 and 3), on the scripted fake model under real Qwen3 chat templates.

Item 1: the model reasons with the answer's own syntax (quotes, brackets, duplicate items, the
answer itself) before it answers, for every constraint kind (json_schema, regex, grammar, choice,
uniqueItems, repetition_repair, max_tokens_policy "close"): the reasoning comes back as written,
its tokens' logprobs are those of the unconstrained request (no mask touched them), and the answer
is valid. Before the fix the unique-strings check lexed the reasoning: a lone quote there let
`["a", "a"]` through, and a reasoning quoting `["x", "x"]` had its closing quote masked; runaway
repair lexed it too and missed the answer's loop.

Item 3: the model writes a tool call inside its reasoning (vLLM #39056), in every tool format.
Under the tool-call grammar ("auto", "required", named) the call marker cannot be written there:
the model must end its reasoning to call. Without a grammar (tool_call_constraint false) the marker
ends the reasoning and the call comes back as a call. Harmony (gpt-oss): a commentary-channel call
inside the analysis channel, likewise."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from agentrt.grammars.tool_calls import FORMATS as TOOL_FORMATS
from agentrt.grammars.tool_calls import call_markers
from tests.support.api import sse_chunks
from tests.support.paths import shared_path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PLAN_TOOLS = [{"name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
UNIQUE = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


def _json_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}


def _app(tokenizer, template: str, stop_tokens: tuple[str, ...] = (), **kwargs):
    """(TestClient, runner, front) over a fake engine with `tokenizer` and the shared chat template
    `template` (`stop_tokens`: the model's stop tokens, else the tokenizer's EOS)."""
    from fastapi.testclient import TestClient

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.runtime.engine import Engine
    from agentrt.testing import FakeModelRunner

    tokenizer.chat_template = shared_path("chat_templates", f"{template}.jinja").read_text()
    runner = FakeModelRunner(tokenizer, max_model_len=8192, num_kv_slots=32768)
    if stop_tokens:
        runner.stop_ids = tuple(tokenizer.convert_tokens_to_ids(t) for t in stop_tokens)
    front = AsyncEngine(engine=Engine(runner=runner))
    client = TestClient(create_app(front, "m", reasoning_budget_message=" ok", **kwargs))
    return client, runner, front


@pytest.fixture(scope="module")
def thinking(default_model_dir):
    """The default model's tokenizer under Qwen3-4B-Thinking-2507's template (the prompt opens
    <think>)."""
    from transformers import AutoTokenizer

    client, runner, front = _app(
        AutoTokenizer.from_pretrained(str(default_model_dir)), "Qwen3-4B-Thinking-2507"
    )
    with client:
        yield client, runner
    front.shutdown()


def _script(client, runner, messages, text, tools=None) -> None:
    body = {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}
    runner.script(client.post("/tokenize", json=body).json()["tokens"], text)


def _chat(client, messages, **extra) -> dict:
    body = {"model": "m", "messages": messages, "temperature": 0, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(client, messages, **extra) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """(reasoning, content, [(name, arguments)], finish_reason) of a streamed chat completion."""
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    finish = None
    body = {"model": "m", "messages": messages, "temperature": 0, "stream": True, **extra}
    for chunk in sse_chunks(client, body):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], ["", ""])
                entry[0] += tc.get("function", {}).get("name") or ""
                entry[1] += tc.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return reasoning, content, [tuple(c) for c in calls.values()], finish


def _reasoning_logprobs(body: dict) -> list[tuple[str, float]]:
    """(token, logprob) of the output's tokens up to the one that completes </think>."""
    out, text = [], ""
    for entry in body["choices"][0]["logprobs"]["content"]:
        out.append((entry["token"], entry["logprob"]))
        text += entry["token"]
        if "</think>" in text:
            return out
    raise AssertionError(f"no </think> in the output: {text!r}")


# ---- item 1: every constraint kind, with the answer's syntax in the reasoning ---------------------

KINDS = [
    # (id, request fields, reasoning, answer, check of the content)
    (
        "json_schema",
        _json_format(CITY),
        'Maybe {"city": "Rome"} or {"city": "Par',
        '{"city": "Paris"}',
        lambda c: jsonschema.validate(json.loads(c), CITY),
    ),
    (
        "regex",
        {"regex": '(yes|no) "[0-9]+"'},
        'Not no "12" but yes "4',
        'yes "42"',
        lambda c: re.fullmatch('(yes|no) "[0-9]+"', c) or pytest.fail(c),
    ),
    (
        "grammar",
        {"grammar": 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+'},
        "A list like [a,b or [c,[d,e]",
        "[c,d]",
        lambda c: re.fullmatch(r"\[[a-z]+(,[a-z]+)*\]", c) or pytest.fail(c),
    ),
    (
        "choice",
        {"choice": ["red", "green"]},
        'Not "red", so "green',
        "green",
        lambda c: c in ("red", "green") or pytest.fail(c),
    ),
    (
        "unique_items",
        _json_format(UNIQUE),
        'They said ["x", "x"] and ["y", "y", "',
        '["a", "b"]',
        lambda c: jsonschema.validate(json.loads(c), UNIQUE),
    ),
]


@pytest.mark.parametrize("name,fields,reasoning,answer,check", KINDS, ids=[k[0] for k in KINDS])
def test_a_reasoning_in_the_answers_syntax_is_free_text(thinking, name, fields, reasoning, answer, check):
    """The scripted reasoning holds the answer's syntax (and, for uniqueItems, duplicate items and
    an open string): it is written as scripted, its tokens' logprobs equal the unconstrained
    request's (no mask touched the reasoning), and the answer is the scripted one, valid.
    unique_items fails before the fix (the closing quote of the second "x" was masked)."""
    client, runner = thinking
    messages = [{"role": "user", "content": f"answer syntax: {name}"}]
    _script(client, runner, messages, f"{reasoning}\n</think>\n\n{answer}<|im_end|>")
    body = _chat(client, messages, max_tokens=80, logprobs=True, **fields)
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == reasoning, choice
    assert choice["message"]["content"] == answer and choice["finish_reason"] == "stop", choice
    check(choice["message"]["content"])
    free = _chat(client, messages, max_tokens=80, logprobs=True)
    ours, theirs = _reasoning_logprobs(body), _reasoning_logprobs(free)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(ours, theirs)), (ours, theirs)
    assert _streamed(client, messages, max_tokens=80, **fields) == (reasoning, answer, [], "stop")


def test_a_lone_quote_in_the_reasoning_does_not_hide_a_duplicate(thinking):
    """The issue's case: a reasoning with one `"`, then the answer ["a", "a"]: the duplicate's
    closing quote is masked (the answer is closed valid under max_tokens_policy "close"). Before
    the fix the check read the reasoning's quote as the answer's and let ["a", "a"] through."""
    client, runner = thinking
    messages = [{"role": "user", "content": "lone quote"}]
    _script(client, runner, messages, 'He said "hi.\n</think>\n\n["a", "a"]<|im_end|>')
    for stream in (False, True):
        if stream:
            reasoning, content, _, finish = _streamed(
                client, messages, max_tokens=40, max_tokens_policy="close", **_json_format(UNIQUE)
            )
        else:
            choice = _chat(client, messages, max_tokens=40, max_tokens_policy="close", **_json_format(UNIQUE))
            choice = choice["choices"][0]
            reasoning, content = choice["message"]["reasoning_content"], choice["message"]["content"]
            finish = choice["finish_reason"]
        assert reasoning == 'He said "hi.' and finish == "stop"
        items = json.loads(content)
        jsonschema.validate(items, UNIQUE)
        assert items[0] == "a" and len(items) == len(set(items)), content


def test_the_closing_path_keeps_the_items_distinct_after_a_quoted_reasoning(thinking):
    """max_tokens_policy "close" with the budget spent inside a reasoning that holds a lone quote:
    the closing path goes through </think> and writes two distinct strings (minItems 2). Before
    the fix the check read the reasoning's quote and the path closed with ["", ""]."""
    client, runner = thinking
    schema = {**UNIQUE, "minItems": 2}
    messages = [{"role": "user", "content": "close me"}]
    _script(client, runner, messages, 'He said "hi and then he said nothing more for a long while')
    body = _chat(client, messages, max_tokens=24, max_tokens_policy="close", **_json_format(schema))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["reasoning_content"].startswith(
        'He said "hi'
    )
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_runaway_repair_reads_the_answer_only(thinking):
    """repetition_repair: a reasoning with a lone quote, then an answer whose string value loops:
    the loop is closed and reported at /name. Before the fix the repair's lexer read the
    reasoning's quote, took the answer's strings for structure and let the loop run to max_tokens."""
    client, runner = thinking
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    messages = [{"role": "user", "content": "loop"}]
    _script(client, runner, messages, 'He said "hi.\n</think>\n\n{"name": "' + "ab" * 150)
    body = _chat(
        client,
        messages,
        max_tokens=120,
        max_tokens_policy="close",
        repetition_repair=True,
        **_json_format(schema),
    )
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == 'He said "hi.'
    assert choice.get("agentrt_repaired") == ["/name"], choice
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


# ---- item 3: a call written inside the reasoning, every tool format -------------------------------


@pytest.fixture(scope="module")
def format_apps():
    """format name -> (client, runner): a byte-level fake model under Qwen3-4B-Thinking-2507's
    template with that tool-call format forced, <|im_end|> its stop token (built on first use)."""
    from agentrt.testing import byte_tokenizer

    apps, fronts = {}, []

    def get(fmt: str):
        if fmt not in apps:
            stops = ("<|endoftext|>", "<|im_end|>")
            client, runner, front = _app(
                byte_tokenizer(), "Qwen3-4B-Thinking-2507", stops, tool_call_format=fmt
            )
            client.__enter__()
            apps[fmt] = (client, runner)
            fronts.append((client, front))
        return apps[fmt]

    yield get
    for client, front in fronts:
        client.__exit__(None, None, None)
        front.shutdown()


def _no_marker(fmt: str, text: str | None) -> bool:
    return not any(m in (text or "") for m in call_markers(TOOL_FORMATS[fmt], PLAN_TOOLS))


@pytest.mark.parametrize("fmt", sorted(set(TOOL_FORMATS) - {"harmony"}))
def test_a_call_inside_the_reasoning_is_never_lost(format_apps, fmt):
    """The model writes a call inside its reasoning and never closes it (vLLM #39056). Without a
    grammar the call marker ends the reasoning: the call comes back as a call, streamed or not
    (before the fix it stayed reasoning). Under the grammar the marker cannot be written there, on
    "auto", "required" and a named tool_choice: the scripted marker's last character is masked
    and the reasoning never holds the marker (before the fix it did)."""
    client, runner = format_apps(fmt)
    call = TOOL_FORMATS[fmt].render_calls([("get_weather", {"city": "Paris"})])
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    _script(client, runner, messages, f"I need the weather.\n{call}<|im_end|>", [WEATHER])
    free = {"tools": [WEATHER], "tool_call_constraint": False, "max_tokens": 400}
    body = _chat(client, messages, **free)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["reasoning_content"] == "I need the weather."
    (tc,) = choice["message"]["tool_calls"]
    assert (tc["function"]["name"], json.loads(tc["function"]["arguments"])) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert _streamed(client, messages, **free) == (
        "I need the weather.",
        "",
        [("get_weather", tc["function"]["arguments"])],
        "tool_calls",
    )
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("auto", "required", named):
        body = _chat(client, messages, tools=[WEATHER], tool_choice=tool_choice, max_tokens=60)
        reasoning = body["choices"][0]["message"]["reasoning_content"]
        assert reasoning.startswith("I need the weather.") and _no_marker(fmt, reasoning), body


def test_stop_strings_never_cut_a_call_that_ended_the_reasoning(format_apps):
    """Without a grammar, a call marker that ends the reasoning is where the answer starts for stop
    strings too: they apply to the text before the first call (none here), so "Paris" in the call's
    arguments is not a match, streamed or not."""
    client, runner = format_apps("hermes")
    messages = [{"role": "user", "content": "Weather in Paris, with a stop string?"}]
    call = TOOL_FORMATS["hermes"].render_calls([("get_weather", {"city": "Paris"})])
    _script(client, runner, messages, f"Paris, I think.\n{call}<|im_end|>", [WEATHER])
    free = {"tools": [WEATHER], "tool_call_constraint": False, "max_tokens": 200, "stop": ["Paris"]}
    choice = _chat(client, messages, **free)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["reasoning_content"] == "Paris, I think."
    arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"city": "Paris"}
    assert _streamed(client, messages, **free) == (
        "Paris, I think.",
        "",
        [("get_weather", arguments)],
        "tool_calls",
    )


def test_a_call_after_the_reasoning_is_unchanged(format_apps):
    """The contract's other half: a call written after </think> is a call, with or without the
    grammar, and a reasoning that only talks about the call syntax (no marker) stays reasoning."""
    client, runner = format_apps("hermes")
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    call = TOOL_FORMATS["hermes"].render_calls([("get_weather", {"city": "Rome"})])
    thought = 'A call is written as {"name": ..., "arguments": {...}} in a tool_call tag.'
    _script(client, runner, messages, f"{thought}\n</think>\n\n{call}<|im_end|>", [WEATHER])
    for constrained in (True, False):
        body = _chat(client, messages, tools=[WEATHER], tool_call_constraint=constrained, max_tokens=200)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == thought
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}


HARMONY_TOKENS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]


@pytest.fixture(scope="module")
def harmony():
    """(client, runner): gpt-oss's template on a byte-level tokenizer with Harmony's special
    tokens, <|return|> and <|call|> its stop tokens."""
    from agentrt.testing import byte_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    client, runner, front = _app(tok, "openai-gpt-oss-120b", ("<|return|>", "<|call|>"))
    with client:
        yield client, runner
    front.shutdown()


def test_harmony_a_commentary_call_inside_the_analysis(harmony):
    """gpt-oss writes its call on the commentary channel without ending the analysis message.
    Without a grammar the call opens the answer (a call, not reasoning); under the grammar the
    call's channel header cannot be written inside the analysis, and the thinking budget's close
    is followed by a valid call under "required". Both fail before the fix."""
    client, runner = harmony
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    call = (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    )
    _script(client, runner, messages, f"<|channel|>analysis<|message|>I need the weather.{call}", [WEATHER])
    free = {"tools": [WEATHER], "tool_call_constraint": False, "max_tokens": 400}
    for reasoning, content, calls, finish in (
        _streamed(client, messages, **free),
        _streamed(client, messages, **free, stream_options={"include_usage": True}),
    ):
        assert (reasoning, content, finish) == ("I need the weather.", "", "tool_calls")
        assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})]
    body = _chat(client, messages, **free)
    choice = body["choices"][0]
    assert (
        choice["finish_reason"] == "tool_calls"
        and choice["message"]["reasoning_content"] == "I need the weather."
    )
    for tool_choice in ("auto", "required"):
        body = _chat(
            client,
            messages,
            tools=[WEATHER],
            tool_choice=tool_choice,
            max_tokens=160,
            thinking_token_budget=40,
            max_tokens_policy="close",
        )
        choice = body["choices"][0]
        assert _no_marker("harmony", choice["message"]["reasoning_content"]), choice
        if tool_choice == "required":
            assert choice["finish_reason"] == "tool_calls", choice
            (tc,) = choice["message"]["tool_calls"]
            jsonschema.validate(json.loads(tc["function"]["arguments"]), WEATHER["function"]["parameters"])
