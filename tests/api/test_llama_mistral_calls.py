"""Llama 3.x's `<|python_tag|>` calls and Mistral's parallel calls end to end (issue 51 item 4): a
scripted fake model (the default model's tokenizer) served with the real Llama 3.3 and Mistral
templates writes each form its template writes; the tool-call grammar lets it through under
required / named / auto and the response carries the calls, streamed and not. Before issue 51 the
grammar refused `<|python_tag|>` under required (the model was pushed into another call), never
constrained nor parsed `<|python_tag|>brave_search.call(...)`, and wrote Mistral's parallel calls
as repeated `[TOOL_CALLS]` blocks (the template's one list was cut after its first call)."""

from __future__ import annotations

import json

import pytest

from tests.support.paths import shared_path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
BRAVE = {
    "type": "function",
    "function": {
        "name": "brave_search",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}
END = "<|im_end|>"  # the default model's end of turn


def _served(default_model_dir, template: str):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.runtime.engine import Engine
    from agentrt.testing import FakeModelRunner

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    tok.chat_template = shared_path("chat_templates", f"{template}.jinja").read_text()
    runner = FakeModelRunner(tok, max_model_len=8192, num_kv_slots=32768)
    front = AsyncEngine(engine=Engine(runner=runner))
    return TestClient(create_app(front, "m")), runner, front, tok


@pytest.fixture(scope="module")
def llama(default_model_dir):
    client, runner, front, tok = _served(default_model_dir, "meta-llama-Llama-3.3-70B-Instruct")
    with client:
        yield client, runner, tok
    front.shutdown()


@pytest.fixture(scope="module", params=["Nemo-Instruct-2407", "Small-3.1-24B-Instruct-2503"])
def mistral(default_model_dir, request):
    client, runner, front, _ = _served(default_model_dir, f"mistralai-Mistral-{request.param}")
    with client:
        yield client, runner
    front.shutdown()


def _prompt(client, tok, messages, tools, template_kwargs=None) -> list[int]:
    """The prompt's token ids as the server renders it: /tokenize, or (with chat_template_kwargs,
    which /tokenize does not take) the same rendering done here, checked against /tokenize without."""
    ids = client.post("/tokenize", json={"model": "m", "messages": messages, "tools": tools}).json()["tokens"]
    if not template_kwargs:
        return ids
    from agentrt.api.tools import ToolPrompt, plan_tools

    prompt = ToolPrompt.for_template(tok.chat_template)
    rendered, defs = prompt.render(messages, plan_tools(tools, "auto", None, prompt.fmt))
    mine = tok.apply_chat_template(rendered, tools=defs, tokenize=False, add_generation_prompt=True)
    assert tok.encode(mine, add_special_tokens=False) == ids  # the same rendering as the server's
    text = tok.apply_chat_template(
        rendered, tools=defs, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    return tok.encode(text, add_special_tokens=False)


def _chat(client, messages, tools, **extra) -> tuple[dict, dict]:
    """(the non-streamed choice, the streamed one merged: content and each call's name and arguments)."""
    body = {"model": "m", "messages": messages, "tools": tools, "temperature": 0, "max_tokens": 120, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    content, calls, finish = "", {}, None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in json.loads(line[6:])["choices"]:
            content += c["delta"].get("content") or ""
            finish = c.get("finish_reason") or finish
            for call in c["delta"].get("tool_calls") or []:
                entry = calls.setdefault(call["index"], ["", ""])
                entry[0] += call["function"].get("name") or ""
                entry[1] += call["function"].get("arguments") or ""
    streamed = {"content": content, "calls": [tuple(v) for _, v in sorted(calls.items())], "finish": finish}
    return choice, streamed


def _calls(choice) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"]["tool_calls"] or []
    ]


def _same_stream(choice, streamed) -> None:
    assert streamed["finish"] == choice["finish_reason"]
    assert streamed["content"] == (choice["message"]["content"] or "")
    assert [(n, json.loads(a)) for n, a in streamed["calls"]] == _calls(choice)


@pytest.mark.parametrize("choice_", ["required", "auto"])
def test_llama_json_call_after_the_python_tag(llama, choice_):
    client, runner, tok = llama
    messages = [{"role": "user", "content": f"weather in Paris? {choice_}"}]
    call = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    runner.script(_prompt(client, tok, messages, [WEATHER]), call + END)
    choice, streamed = _chat(client, messages, [WEATHER], tool_choice=choice_)
    assert choice["finish_reason"] == "tool_calls", choice
    assert _calls(choice) == [("get_weather", {"city": "Paris"})] and not choice["message"]["content"]
    _same_stream(choice, streamed)


@pytest.mark.parametrize(
    "tool_choice", ["required", "auto", {"type": "function", "function": {"name": "brave_search"}}]
)
def test_llama_builtin_call_as_the_template_writes_it(llama, tool_choice):
    """The request names brave_search as a built-in tool (the template's `builtin_tools`): the model
    writes `<|python_tag|>brave_search.call(query="...")` and the response is that call."""
    client, runner, tok = llama
    messages = [{"role": "user", "content": f"search the web for rome {json.dumps(tool_choice)}"}]
    kwargs = {"builtin_tools": ["brave_search"]}
    prose = "Searching. " if tool_choice == "auto" else ""
    text = f'{prose}<|python_tag|>brave_search.call(query="rome weather"){END}'
    runner.script(_prompt(client, tok, messages, [WEATHER, BRAVE], kwargs), text)
    choice, streamed = _chat(
        client, messages, [WEATHER, BRAVE], tool_choice=tool_choice, chat_template_kwargs=kwargs
    )
    assert choice["finish_reason"] == "tool_calls", choice
    assert _calls(choice) == [("brave_search", {"query": "rome weather"})]
    assert (choice["message"]["content"] or "") == prose
    _same_stream(choice, streamed)


def test_a_stop_string_never_cuts_a_python_tag_call(llama):
    """Under auto, stop strings apply to the text before a call: a call opened by <|python_tag|>
    (not only by a tool's JSON) ends their scan, so "rome" inside the call's arguments cuts
    nothing, while the prose before it is still scanned."""
    client, runner, tok = llama
    messages = [{"role": "user", "content": "search the web for rome, stopping"}]
    kwargs = {"builtin_tools": ["brave_search"]}
    text = f'Searching. <|python_tag|>brave_search.call(query="rome weather"){END}'
    runner.script(_prompt(client, tok, messages, [WEATHER, BRAVE], kwargs), text)
    extra = {"tool_choice": "auto", "chat_template_kwargs": kwargs}
    choice, streamed = _chat(client, messages, [WEATHER, BRAVE], stop=["rome"], **extra)
    assert choice["finish_reason"] == "tool_calls", choice
    assert _calls(choice) == [("brave_search", {"query": "rome weather"})]
    _same_stream(choice, streamed)
    choice, _ = _chat(client, messages, [WEATHER, BRAVE], stop=["arch"], **extra)
    assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", "Se")


def test_llama_tag_never_opens_anything_but_a_call(llama):
    """Under required the model that would write code (or a non-built-in tool's `.call`) after the
    tag is held to a call of an offered tool with valid arguments (closed within max_tokens: the
    noise it writes off the script has no end of its own)."""
    client, runner, tok = llama
    for i, text in enumerate(["<|python_tag|>print(42)", '<|python_tag|>get_weather.call(city="Paris")']):
        messages = [{"role": "user", "content": f"code {i}"}]
        runner.script(_prompt(client, tok, messages, [WEATHER, BRAVE]), text + END)
        choice, _ = _chat(
            client,
            messages,
            [WEATHER, BRAVE],
            tool_choice="required",
            max_tokens=60,
            max_tokens_policy="close",
        )
        calls = _calls(choice)
        assert calls and all(n in ("get_weather", "brave_search") for n, _ in calls), choice
        for name, args in calls:
            assert isinstance(args.get("city" if name == "get_weather" else "query"), str)


@pytest.mark.parametrize("choice_", ["required", "auto"])
def test_mistral_parallel_calls_in_one_list(mistral, choice_):
    client, runner = mistral
    messages = [{"role": "user", "content": f"weather in Paris and Rome? {choice_}"}]
    prose = "Sure. " if choice_ == "auto" else ""
    calls = ", ".join(
        f'{{"name": "get_weather", "arguments": {{"city": "{c}"}}, "id": "abcDEF12{i}"}}'
        for i, c in enumerate(["Paris", "Rome"])
    )
    ids = client.post("/tokenize", json={"model": "m", "messages": messages, "tools": [WEATHER]}).json()[
        "tokens"
    ]
    runner.script(ids, f"{prose}[TOOL_CALLS][{calls}]{END}")
    choice, streamed = _chat(client, messages, [WEATHER], tool_choice=choice_)
    assert choice["finish_reason"] == "tool_calls", choice
    assert _calls(choice) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert (choice["message"]["content"] or "") == prose
    _same_stream(choice, streamed)
    single, _ = _chat(client, messages, [WEATHER], tool_choice=choice_, parallel_tool_calls=False)
    assert _calls(single) == [("get_weather", {"city": "Paris"})]  # one call: the list closes after it
