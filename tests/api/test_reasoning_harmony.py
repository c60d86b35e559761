"""gpt-oss's Harmony format through the chat API: the real gpt-oss chat template on a byte-level
tokenizer with Harmony's special tokens (<|start|>, <|channel|>, <|message|>, <|end|>,
<|constrain|>, <|return|>, <|call|>: the last two stop the output), and a scripted fake model. The
analysis channel is the reasoning, the final channel the answer, and a call is a commentary
message to functions.NAME; constraints apply after the analysis."""

from __future__ import annotations

import json

import jsonschema
import pytest

from agentrt.api.reasoning import ReasoningSetup
from agentrt.grammars.reasoning import FORMATS, ReasoningParser
from tests.support.api import sse_chunks
from tests.support.paths import shared_path

HARMONY_TOKENS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def harmony():
    """(client, runner): the API over a fake engine whose tokenizer has Harmony's special tokens
    and gpt-oss's chat template, <|return|> and <|call|> its stop tokens."""
    from fastapi.testclient import TestClient

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.runtime.engine import Engine
    from agentrt.testing import FakeModelRunner, byte_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = shared_path("chat_templates", "openai-gpt-oss-120b.jinja").read_text()
    runner = FakeModelRunner(tok, max_model_len=8192, num_kv_slots=32768)
    runner.stop_ids = tuple(tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>"))
    front = AsyncEngine(engine=Engine(runner=runner))
    with TestClient(create_app(front, "gpt-oss", reasoning_budget_message=" Enough.")) as client:
        yield client, runner
    front.shutdown()


def _script(client, runner, messages, text, tools=None) -> None:
    """Make the model write `text` after the prompt a chat request with `messages` renders to."""
    body = {"model": "gpt-oss", "messages": messages}
    if tools:
        body["tools"] = tools
    ids = client.post("/tokenize", json=body).json()["tokens"]
    runner.script(ids, text)


def _chat(client, messages, **extra):
    r = client.post(
        "/v1/chat/completions", json={"model": "gpt-oss", "messages": messages, "temperature": 0, **extra}
    )
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(client, messages, **extra):
    reasoning = content = ""
    calls: dict[int, list[str]] = {}
    finish = None
    body = {"model": "gpt-oss", "messages": messages, "temperature": 0, "stream": True, **extra}
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


def test_harmony_is_detected_with_its_special_tokens():
    from agentrt.testing import byte_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    template = shared_path("chat_templates", "openai-gpt-oss-120b.jinja").read_text()
    setup = ReasoningSetup.for_template(template, tokenizer=tok)
    assert setup.fmt == FORMATS["harmony"] and setup.keep_special
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}],
        chat_template=template,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered.endswith("<|start|>assistant") and FORMATS["harmony"].mode(rendered) == "optional"


def test_analysis_is_reasoning_and_the_final_channel_is_the_schema_answer(harmony):
    client, runner = harmony
    messages = [{"role": "user", "content": "Largest city, as JSON?"}]
    _script(
        client,
        runner,
        messages,
        '<|channel|>analysis<|message|>Maybe {"city": 1}. Paris.<|end|><|start|>assistant'
        '<|channel|>final<|message|>{"city": "Paris", "ok": true}<|return|>',
    )
    body = _chat(client, messages, max_tokens=200, response_format=JSON_FORMAT)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"] == 'Maybe {"city": 1}. Paris.'
    assert json.loads(choice["message"]["content"]) == {"city": "Paris", "ok": True}
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    reasoning, content, calls, finish = _streamed(
        client, messages, max_tokens=200, response_format=JSON_FORMAT
    )
    assert (reasoning, content, calls, finish) == (
        choice["message"]["reasoning_content"],
        choice["message"]["content"],
        [],
        "stop",
    )


def test_prose_on_the_final_channel_is_masked_by_the_schema(harmony):
    """The model tries prose as its final answer: the grammar allows only the schema there, and
    max_tokens_policy "close" ends it valid."""
    client, runner = harmony
    messages = [{"role": "user", "content": "Answer in prose?"}]
    _script(
        client,
        runner,
        messages,
        "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>Sure, Paris!<|return|>",
    )
    body = _chat(client, messages, max_tokens=120, max_tokens_policy="close", response_format=JSON_FORMAT)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "ok"
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


def test_a_call_on_the_commentary_channel_after_the_analysis(harmony):
    client, runner = harmony
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    call = (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    )
    _script(
        client,
        runner,
        messages,
        f"<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant{call}",
        tools=TOOLS,
    )
    for choice_mode in ("auto", "required"):
        body = _chat(client, messages, max_tokens=200, tools=TOOLS, tool_choice=choice_mode)
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls", body
        message = choice["message"]
        assert message["reasoning_content"] == "Need the weather tool."
        assert not message["content"]
        (tc,) = message["tool_calls"]
        assert tc["function"]["name"] == "get_weather"
        assert json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
        streamed = _streamed(client, messages, max_tokens=200, tools=TOOLS, tool_choice=choice_mode)
        assert streamed == (
            "Need the weather tool.",
            "",
            [("get_weather", tc["function"]["arguments"])],
            "tool_calls",
        )


def test_budget_closes_the_analysis_and_the_answer_follows(harmony):
    client, runner = harmony
    messages = [{"role": "user", "content": "Think long?"}]
    _script(client, runner, messages, "<|channel|>analysis<|message|>" + "I keep thinking. " * 40)
    body = _chat(
        client,
        messages,
        max_tokens=200,
        max_tokens_policy="close",
        thinking_token_budget=12,
        response_format=JSON_FORMAT,
    )
    message = body["choices"][0]["message"]
    assert message["reasoning_content"].endswith("Enough.")
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


@pytest.mark.parametrize(
    "text,reasoning,content",
    [
        (
            "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>hi",
            "think",
            "hi",
        ),
        ("<|channel|>final<|message|>direct", "", "direct"),
        ("<|channel|>analysis<|message|>cut off", "cut off", ""),
    ],
)
def test_harmony_parser_at_any_chunking(text, reasoning, content):
    fmt = FORMATS["harmony"]
    for size in (1, 2, 3, 5, len(text)):
        parser = ReasoningParser(fmt, "optional")
        got = ["", ""]
        for i in range(0, len(text), size):
            r, c = parser.feed(text[i : i + size])
            got = [got[0] + r, got[1] + c]
        r, c = parser.finish()
        assert (got[0] + r, got[1] + c) == (reasoning, content), size
