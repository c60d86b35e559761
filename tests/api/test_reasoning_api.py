"""A reasoning model through the chat API: the default model served with Qwen3's real chat
templates. The reasoning goes to `reasoning_content` (and `reasoning`), a json_schema / tool
constraint applies to the answer after it, the thinking budget and `reasoning_effort` bound it,
streamed deltas equal the non-streamed message, and `usage` counts reasoning tokens. The
`thinking_client` fixture is in tests/api/conftest.py."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from agentrt.api.reasoning import ReasoningSetup
from agentrt.grammars.reasoning import FORMATS, detect_reasoning
from tests.support.api import sse_chunks
from tests.support.paths import shared_path

MODEL = "smollm2-135m-instruct"
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the largest city of France? Answer in JSON."}]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}


def _chat(client, **body):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "temperature": 0, **body})
    return r


def test_schema_applies_to_the_answer_after_the_reasoning(thinking_client):
    r = _chat(thinking_client, max_tokens=200, thinking_token_budget=24, response_format=JSON_FORMAT)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "stop"
    assert message["reasoning_content"] and message["reasoning"] == message["reasoning_content"]
    assert "Time to answer." in message["reasoning_content"]
    assert "</think>" not in message["reasoning_content"] + message["content"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    details = body["usage"]["completion_tokens_details"]
    assert 24 <= details["reasoning_tokens"] < body["usage"]["completion_tokens"]


def test_streamed_deltas_equal_the_message(thinking_client):
    body = {"max_tokens": 200, "thinking_token_budget": 16, "response_format": JSON_FORMAT}
    message = _chat(thinking_client, **body).json()["choices"][0]["message"]
    reasoning, content, usage = "", "", None
    for chunk in sse_chunks(
        thinking_client,
        {"model": MODEL, "messages": ASK, "temperature": 0, "stream": True, **body}
        | {"stream_options": {"include_usage": True}},
    ):
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            assert delta.get("reasoning", delta.get("reasoning_content")) == delta.get("reasoning_content")
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert reasoning == message["reasoning_content"]
    assert content == message["content"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] >= 16


def test_budget_zero_answers_at_once(thinking_client):
    r = _chat(
        thinking_client,
        max_tokens=60,
        max_tokens_policy="close",
        thinking_token_budget=0,
        response_format=JSON_FORMAT,
    )
    body = r.json()
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] is None
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_close_policy_keeps_room_for_the_answer(thinking_client):
    """No budget: the model reasons until max_tokens_policy "close" needs the rest of max_tokens
    for "</think>" and the shortest valid answer."""
    r = _chat(thinking_client, max_tokens=48, max_tokens_policy="close", response_format=JSON_FORMAT)
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["agentrt_closed_by_budget"]
    assert body["usage"]["completion_tokens"] <= 48
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_tool_call_after_the_reasoning(thinking_client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    r = _chat(
        thinking_client,
        max_tokens=160,
        thinking_token_budget=12,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", r.text
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert "city" in json.loads(call["function"]["arguments"])
    assert choice["message"]["reasoning_content"]


def test_openai_client_reads_reasoning(thinking_client):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=thinking_client)
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_tokens=120,
        reasoning_effort="low",
        response_format=JSON_FORMAT,
        extra_body={"thinking_token_budget": None},
    )
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"]
    assert out.usage.completion_tokens_details.reasoning_tokens > 0


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_effort": "low", "thinking_token_budget": 8}, "reasoning_effort"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ],
)
def test_bad_reasoning_fields_are_400s(thinking_client, extra, param):
    r = _chat(thinking_client, max_tokens=8, **extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- formats and modes from the real templates (no model) -------------------------------------

THINKING = [
    "Qwen-Qwen3-0.6B",
    "Qwen3-4B-Thinking-2507",
    "Qwen-QwQ-32B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-V3.1",
    "GLM-4.6",
    "HuggingFaceTB-SmolLM3-3B",
    "MiniMax-M2",
    "moonshotai-Kimi-K2-Thinking",
]
NOT_THINKING = ["meta-llama-Llama-3.3-70B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407", "Qwen3-Coder"]


def _render(name: str, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    (text,), _ = render_jinja_template(
        [[{"role": "user", "content": "hi"}]],
        chat_template=shared_path("chat_templates", f"{name}.jinja").read_text(),
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
        **kwargs,
    )
    return text


@pytest.mark.parametrize("name", THINKING)
def test_thinking_templates_are_detected(name):
    assert detect_reasoning(shared_path("chat_templates", f"{name}.jinja").read_text()) == FORMATS["think"]


@pytest.mark.parametrize("name", NOT_THINKING)
def test_other_templates_have_no_reasoning(name):
    assert detect_reasoning(shared_path("chat_templates", f"{name}.jinja").read_text()) is None


@pytest.mark.parametrize(
    "name,kwargs,mode",
    [
        ("Qwen-Qwen3-0.6B", {}, "optional"),
        ("Qwen-Qwen3-0.6B", {"enable_thinking": False}, "off"),
        ("Qwen3-4B-Thinking-2507", {}, "open"),
        ("Qwen-QwQ-32B", {}, "open"),
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", {}, "open"),
        ("deepseek-ai-DeepSeek-V3.1", {}, "off"),
        ("deepseek-ai-DeepSeek-V3.1", {"thinking": True}, "open"),
        ("GLM-4.6", {}, "optional"),
        ("GLM-4.6", {"enable_thinking": False}, "off"),
        ("HuggingFaceTB-SmolLM3-3B", {"enable_thinking": False}, "off"),
        ("MiniMax-M2", {}, "open"),
    ],
)
def test_mode_from_the_rendered_prompt(name, kwargs, mode):
    assert FORMATS["think"].mode(_render(name, **kwargs)) == mode


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "Qwen3-4B-Thinking-2507"])
def test_budget_zero_closes_the_block_in_the_prompt(name):
    setup = ReasoningSetup(FORMATS["think"], close_text="")
    prompt, reasoning = setup.for_request(_render(name), 0)
    assert reasoning.mode == "off" and reasoning.params() is None and FORMATS["think"].mode(prompt) == "off"
    assert prompt.endswith("</think>\n\n")


def test_gemma4_thought_channel():
    """Gemma 4's real template: thinking off by default (its generation prompt closes the thought
    channel empty), optional with `enable_thinking` (the model may open the channel); a budget of 0
    closes it as the template does, and the parser splits the channel from the answer."""
    from agentrt.grammars.reasoning import ReasoningParser

    name = "google-gemma-4-31B-it"
    fmt = detect_reasoning(shared_path("chat_templates", f"{name}.jinja").read_text())
    assert fmt is FORMATS["gemma4"]
    assert _render(name).endswith("<|turn>model\n<|channel>thought\n<channel|>")
    assert fmt.mode(_render(name)) == "off"
    thinking = _render(name, enable_thinking=True)
    assert fmt.mode(thinking) == "optional"
    prompt, reasoning = ReasoningSetup(fmt).for_request(thinking, 0)
    assert reasoning.mode == "off" and prompt == thinking + "<|channel>thought\n<channel|>"
    parser = ReasoningParser(fmt, "optional")
    pieces = [parser.feed(t) for t in ("<|channel>th", "ought\nThe user greets.<chan", "nel|>Hello!")]
    pieces.append(parser.finish())
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == ("The user greets.", "Hello!")


def test_earlier_reasoning_goes_to_the_template(tokenizer):
    """Interleaved thinking: an assistant turn's reasoning_content (or `reasoning`) reaches the chat
    template, which keeps it inside the current tool loop and drops it before the last user turn
    (Qwen3's real template)."""
    from agentrt.api.protocol import ChatMessage
    from agentrt.api.tools import ToolPrompt, plan_tools

    template = shared_path("chat_templates", "Qwen-Qwen3-0.6B.jinja").read_text()
    prompt = ToolPrompt.for_template(template)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    plan = plan_tools(tools, "auto", None, prompt.fmt)
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    raw = [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer", "reasoning": "OLD-THOUGHT"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call], "reasoning_content": "CALL-THOUGHT"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    messages = [ChatMessage.model_validate(m).as_dict() for m in raw]
    rendered, template_tools = prompt.render(messages, plan)
    text = tokenizer.apply_chat_template(
        rendered, tools=template_tools, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    assert "<think>\nCALL-THOUGHT\n</think>" in text
    assert "OLD-THOUGHT" not in text
