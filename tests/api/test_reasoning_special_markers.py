"""Reasoning markers that are special tokens (as in Qwen3's, DeepSeek's and GLM's tokenizers) stay in
the decoded text whatever else the request carries, so the reasoning parser still finds them: with
tools on the request the tool format's own wish to drop special tokens (hermes) must not strip
them, or the answer and the calls end up in the reasoning (issue 51 item 2). On the scripted fake
model with the default tokenizer given <think> and </think> as special tokens, under Qwen3's
Thinking and hybrid templates."""

from __future__ import annotations

import json

import pytest

from tests.support.paths import shared_path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _served(default_model_dir, template: str):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.runtime.engine import Engine
    from agentrt.testing import FakeModelRunner

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert "</think>" in tok.all_special_tokens and len(tok.encode("</think>", add_special_tokens=False)) == 1
    tok.chat_template = shared_path("chat_templates", f"{template}.jinja").read_text()
    runner = FakeModelRunner(tok, max_model_len=4096, num_kv_slots=16384)
    front = AsyncEngine(engine=Engine(runner=runner))
    return TestClient(create_app(front, "m")), runner, front


@pytest.fixture(scope="module", params=["Qwen3-4B-Thinking-2507", "Qwen-Qwen3-0.6B"])
def served(request, default_model_dir):
    client, runner, front = _served(default_model_dir, request.param)
    with client:
        yield client, runner, request.param
    front.shutdown()


def _script(client, runner, messages, text, tools):
    body = {"model": "m", "messages": messages, "tools": tools}
    runner.script(client.post("/tokenize", json=body).json()["tokens"], text)


def _reasoning(template: str) -> str:
    """What the model writes to reason: the Thinking template opened the block in the prompt."""
    return "" if template.startswith("Qwen3-4B") else "<think>\n"


@pytest.mark.parametrize("tool_choice", ["auto", "required", None])
def test_special_markers_survive_tools(served, tool_choice):
    client, runner, template = served
    messages = [{"role": "user", "content": f"weather in Paris? {tool_choice}"}]
    tools = [WEATHER] if tool_choice else None
    answer = CALL if tool_choice else "It is sunny."
    _script(
        client,
        runner,
        messages,
        f"{_reasoning(template)}I should look.\n</think>\n\n{answer}<|im_end|>",
        tools,
    )
    body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 80}
    if tools:
        body |= {"tools": tools, "tool_choice": tool_choice}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "I should look.", message
    if tools:
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"], message
        assert not message.get("content")
    else:
        assert message["content"] == "It is sunny."
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [
        c["delta"]
        for line in r.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
        for c in json.loads(line[6:])["choices"]
    ]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "I should look."
    assert "".join(d.get("content") or "" for d in deltas) == (message.get("content") or "")
    names = [
        c["function"].get("name") for d in deltas for c in d.get("tool_calls") or [] if c.get("function")
    ]
    assert [n for n in names if n] == (["get_weather"] if tools else [])
