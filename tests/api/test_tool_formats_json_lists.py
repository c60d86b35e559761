"""The JSON-list tool-call formats of the 2026 hybrid families (issue 53 item 5), through the chat
API on a scripted fake model with the real chat templates: Nemotron Nano v2 (Nemotron-H) writes
`<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>` after its `<think>` reasoning
(nemotron_json), Granite 3.x `<|tool_call|>[...]` (granite; Granite 4.0's template writes hermes
blocks). Each: the template is detected, the calls are parsed streamed and not, constrained under
`required` / a named tool, and a multi-turn conversation with the tool results renders through the
template with the earlier calls written exactly as the grammar lets the model write them."""

from __future__ import annotations

import json

import pytest

from agentrt.grammars.tool_calls import FORMATS
from tests.support.paths import shared_path
from tests.support.tool_formats import grammar, make_compiler

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]

_LIST = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
# format -> (template, the text before the calls the model writes, the reasoning it holds, CALLS
# as the family writes them)
FAMILIES = {
    "nemotron_json": (
        "NVIDIA-Nemotron-Nano-v2",
        "I need both tools.\n</think>\n\n",
        "I need both tools.",
        f"<TOOLCALL>{_LIST}</TOOLCALL>",
    ),
    "granite": ("ibm-granite-granite-3.3-2B-Instruct", "", None, f"<|tool_call|>{_LIST}"),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, default_model_dir):
    """(format name, TestClient, FakeModelRunner, tokenizer) over the fake engine with the
    family's chat template and the default model's tokenizer."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.runtime.engine import Engine
    from agentrt.testing import FakeModelRunner

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    tok.chat_template = shared_path("chat_templates", f"{FAMILIES[request.param][0]}.jinja").read_text()
    runner = FakeModelRunner(tok, max_model_len=8192, num_kv_slots=32768)
    front = AsyncEngine(engine=Engine(runner=runner))
    client = TestClient(create_app(front, "m"))
    with client:
        yield request.param, client, runner, tok
    front.shutdown()


def _prompt_ids(client, messages, tools):
    r = client.post("/tokenize", json={"model": "m", "messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _chat(client, messages, **extra):
    body = {"model": "m", "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 200}
    r = client.post("/v1/chat/completions", json={**body, **extra})
    assert r.status_code == 200, r.text
    return r


def _streamed(r) -> tuple[str, str, dict[int, list[str]], str]:
    """(reasoning, content, {index: [name, arguments]}, finish_reason) of a streamed response."""
    reasoning, content, calls, finish = "", "", {}, ""
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[len("data: ") :])["choices"]
        if not choice:
            continue
        delta = choice[0]["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
        for c in delta.get("tool_calls") or []:
            entry = calls.setdefault(c["index"], ["", ""])
            entry[0] += c["function"].get("name") or ""
            entry[1] += c["function"].get("arguments") or ""
        finish = choice[0].get("finish_reason") or finish
    return reasoning, content, calls, finish


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_calls_are_parsed_streamed_and_not(family, tool_choice):
    fmt, client, runner, _ = family
    _, before, reasoning, written = FAMILIES[fmt]
    messages = [{"role": "user", "content": f"weather and time, {tool_choice}?"}]
    runner.script(_prompt_ids(client, messages, TOOLS), before + written)
    body = _chat(client, messages, tool_choice=tool_choice).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", body
    message = choice["message"]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert got == CALLS
    assert not message.get("content")
    assert message.get("reasoning_content") == reasoning
    r = _chat(client, messages, tool_choice=tool_choice, stream=True)
    s_reasoning, s_content, s_calls, s_finish = _streamed(r)
    assert (s_reasoning or None, s_content, s_finish) == (reasoning, "", "tool_calls")
    assert [(n, json.loads(a)) for n, a in s_calls.values()] == CALLS


def test_a_named_tool_is_one_call_to_it(family):
    """The script calls get_weather then get_time; naming get_time, the grammar forces that one
    call (the model's first token off the script is masked), and the list ends the output."""
    fmt, client, runner, _ = family
    _, before, _, written = FAMILIES[fmt]
    messages = [{"role": "user", "content": "time only?"}]
    runner.script(_prompt_ids(client, messages, TOOLS), before + written)
    named = {"type": "function", "function": {"name": "get_time"}}
    message = _chat(client, messages, tool_choice=named).json()["choices"][0]["message"]
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
    ] == [("get_time", {})]


def test_a_conversation_with_tool_results_renders_the_calls_as_the_grammar_writes_them(family, tokenizer):
    """Turn 2 of a tool loop: the earlier calls go back into the prompt in the family's syntax
    (Nemotron's template writes them itself; Granite 3.3's renders none, so they are written into
    the assistant's text), the results in the template's own way, and the model's answer after
    them is content. What the prompt shows of the calls is exactly what the `required` grammar
    accepts and the parser reads back."""
    fmt, client, runner, tok = family
    _, before, _, written = FAMILIES[fmt]
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(CALLS)
    ]
    messages = [
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]
    ids = _prompt_ids(client, messages, TOOLS)
    prompt = tok.decode(ids)
    assert prompt.count(written) == 1, prompt
    after = prompt[prompt.index(written) + len(written) :]
    if fmt == "nemotron_json":
        assert after.startswith(
            "\n<SPECIAL_12>\n\n<SPECIAL_11>User\n<TOOL_RESPONSE>[sunny, noon]</TOOL_RESPONSE>"
        )
    else:
        assert after.startswith(
            "<|end_of_text|>\n<|start_of_role|>tool<|end_of_role|>sunny<|end_of_text|>\n"
            "<|start_of_role|>tool<|end_of_role|>noon<|end_of_text|>"
        )
    assert '"name": "get_weather"' in prompt.split(written)[0]  # the tool list, before the calls
    assert FORMATS[fmt].render_calls(CALLS) == written
    assert grammar(make_compiler(tokenizer), fmt, tools=TOOLS)(written)
    runner.script(ids, before + "Sunny at noon.<|im_end|>")
    message = _chat(client, messages).json()["choices"][0]["message"]
    assert message["content"] == "Sunny at noon." and not message.get("tool_calls")
