"""Edges of reasoning and tool-call constraints found by an adversarial run, each on a scripted
fake model with a real chat template: whitespace before <think>, stop strings inside the
reasoning, a thinking budget near max_tokens, tool_choice "none" (free text, llama3_json's bare
JSON answers) under max_tokens_policy "close", earlier reasoning on every API, and reasoning fields
sent to a model that does not reason."""

from __future__ import annotations

import pytest

from tests.support.paths import shared_path

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _client(default_model_dir, template: str | None):
    """(TestClient context, runner) over a fake engine with the default model's tokenizer and
    `template` (a file in the shared chat templates; None: the tokenizer's own)."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.runtime.engine import Engine
    from agentrt.testing import FakeModelRunner

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    if template is not None:
        tok.chat_template = shared_path("chat_templates", f"{template}.jinja").read_text()
    runner = FakeModelRunner(tok, max_model_len=8192, num_kv_slots=32768)
    front = AsyncEngine(engine=Engine(runner=runner))
    return TestClient(create_app(front, "m", reasoning_budget_message=" ok")), runner, front


@pytest.fixture(scope="module")
def hybrid(default_model_dir):
    """Qwen3's hybrid template (the model may open <think>)."""
    client, runner, front = _client(default_model_dir, "Qwen-Qwen3-0.6B")
    with client:
        yield client, runner
    front.shutdown()


@pytest.fixture(scope="module")
def thinking(default_model_dir):
    """Qwen3-Thinking's template (the prompt opens <think>)."""
    client, runner, front = _client(default_model_dir, "Qwen3-4B-Thinking-2507")
    with client:
        yield client, runner
    front.shutdown()


def _script(client, runner, messages, text, tools=None):
    body = {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}
    runner.script(client.post("/tokenize", json=body).json()["tokens"], text)


def _chat(client, messages, **extra):
    r = client.post(
        "/v1/chat/completions", json={"model": "m", "messages": messages, "temperature": 0, **extra}
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_whitespace_before_think_still_opens_the_reasoning(hybrid):
    """A newline before <think> still opens the reasoning, and the grammar and the parser agree
    where it is: a call after it is a call; a call written inside it is never lost there (issue 51
    item 3). Under the tool-call grammar its marker cannot be written inside the reasoning (nor
    can the answer's free text open with <think>, which the parser reads as reasoning); without
    the grammar the marker ends the reasoning and the call is a call."""
    client, runner = hybrid
    messages = [{"role": "user", "content": "weather?"}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _script(client, runner, messages, f"\n<think>\nI could call\n</think>\n\n{call}<|im_end|>", [WEATHER])
    body = _chat(client, messages, max_tokens=200, tools=[WEATHER])
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls", body
    assert message["reasoning_content"] == "I could call"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    inside = [{"role": "user", "content": "weather, inside?"}]
    _script(client, runner, inside, f"\n<think>\nI could {call} but\n</think>\n\n{call}<|im_end|>", [WEATHER])
    message = _chat(client, inside, max_tokens=60, tools=[WEATHER])["choices"][0]["message"]
    assert message["reasoning_content"].startswith("I could <tool_call")
    assert "<tool_call>" not in message["reasoning_content"] and not message.get("tool_calls")
    body = _chat(client, inside, max_tokens=200, tools=[WEATHER], tool_call_constraint=False)
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "tool_calls", body
    assert message["reasoning_content"] == "I could"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_weather"]


def test_stop_strings_apply_to_the_answer_only(thinking):
    client, runner = thinking
    messages = [{"role": "user", "content": "stop?"}]
    for tools in (None, [WEATHER]):
        text = "I might STOP here <tool_call maybe.\n</think>\n\nAnswer one. STOP more"
        _script(client, runner, messages, text, tools)
        body = _chat(client, messages, max_tokens=60, stop=["STOP"], **({"tools": tools} if tools else {}))
        message = body["choices"][0]["message"]
        assert message["reasoning_content"] == "I might STOP here <tool_call maybe."
        assert message["content"] == "Answer one. "
        assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "constraint", [{"regex": "[a-z]{1,3}"}, {"response_format": {"type": "json_object"}}, {}]
)
def test_a_thinking_budget_never_passes_max_tokens(thinking, constraint):
    client, runner = thinking
    messages = [{"role": "user", "content": f"long {sorted(constraint)}"}]
    _script(client, runner, messages, "thinking " * 40)
    body = _chat(client, messages, max_tokens=30, thinking_token_budget=29, **constraint)
    assert body["usage"]["completion_tokens"] <= 30
    assert body["choices"][0]["finish_reason"] == "length"


def test_tool_choice_none_under_close_is_cut_free_text(thinking):
    client, runner = thinking
    messages = [{"role": "user", "content": "no tools"}]
    _script(client, runner, messages, "short\n</think>\n\n" + "words and more words " * 10, [WEATHER])
    body = _chat(
        client, messages, max_tokens=20, tools=[WEATHER], tool_choice="none", max_tokens_policy="close"
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and not choice.get("agentrt_closed_by_budget")
    assert choice["message"]["content"].startswith("words and")


def test_llama3_json_tool_choice_none_allows_json_answers(default_model_dir):
    """llama3_json writes calls as bare JSON: "none" forbids an object naming an offered tool,
    not every {"name": ...} answer."""
    client, runner, front = _client(default_model_dir, "meta-llama-Llama-3.2-3B-Instruct")
    with client:
        messages = [{"role": "user", "content": "who?"}]
        _script(client, runner, messages, '{"name": "Bob"}<|im_end|>', [WEATHER])
        body = _chat(
            client, messages, max_tokens=30, tools=[WEATHER], tool_choice="none", stop=["<|im_end|>"]
        )
        assert body["choices"][0]["message"]["content"].startswith('{"name": "Bob"}')
    front.shutdown()


def test_earlier_reasoning_reaches_the_template_on_every_api(hybrid):
    """Inside a tool loop Qwen3's template keeps the last turn's reasoning: chat's
    reasoning_content, a Responses reasoning item and a Messages thinking block give the same
    prompt."""
    client, _ = hybrid
    thought = "I need the weather tool for this."
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    chat = {
        "model": "m",
        "max_tokens": 1,
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": thought},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    }
    responses = {
        "model": "m",
        "max_output_tokens": 1,
        "tools": [
            {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
        ],
        "input": [
            {"role": "user", "content": "weather?"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": thought}]},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    }
    messages = {
        "model": "m",
        "max_tokens": 1,
        "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": thought, "signature": ""},
                    {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]},
        ],
    }
    prompt_tokens = {
        "chat": client.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"],
        "responses": client.post("/v1/responses", json=responses).json()["usage"]["input_tokens"],
        "messages": sum(  # Anthropic's input_tokens leave out the tokens read from the cache
            client.post("/v1/messages", json=messages).json()["usage"][k]
            for k in ("input_tokens", "cache_read_input_tokens")
        ),
    }
    without = dict(
        chat, messages=[{k: v for k, v in m.items() if k != "reasoning_content"} for m in chat["messages"]]
    )
    assert len(set(prompt_tokens.values())) == 1, prompt_tokens
    assert (
        prompt_tokens["chat"]
        > client.post("/v1/chat/completions", json=without).json()["usage"]["prompt_tokens"]
    )


def test_responses_input_of_reasoning_items_alone_is_a_400(hybrid):
    client, _ = hybrid
    r = client.post("/v1/responses", json={"model": "m", "input": [{"type": "reasoning", "summary": []}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


@pytest.mark.parametrize("field,value", [("reasoning_effort", "high"), ("thinking_token_budget", 10)])
def test_reasoning_fields_on_a_model_that_does_not_reason_are_400s(fake_client, field, value):
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], field: value}
    r = fake_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    ok = dict(body, **{field: "none" if field == "reasoning_effort" else 0}, max_tokens=2)
    assert fake_client.post("/v1/chat/completions", json=ok).status_code == 200
