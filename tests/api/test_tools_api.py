"""Tool calling through the HTTP API: every tool_choice mode, streaming and not, 1 and 3 tools,
parallel_tool_calls on and off. Runs on the fake model runner with the default model's tokenizer and
chat template (what is asserted, the tool grammar, the call parser and the streamed deltas, does not
depend on the weights); tool round trips on the real model are in test_frameworks.py."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.support.api import sse_chunks

MODEL = "smollm2-135m-instruct"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": 40},
                "limit": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["query"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD, SEARCH)}


@pytest.fixture(scope="module")
def client(fake_client):
    return fake_client


def _body(tools, choice, parallel, stream):
    # free text (auto, none) gets a short budget: the 135M model rarely calls under auto
    body = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 96 if choice not in ("auto", "none") else 48,
        "max_tokens_policy": "close",
        "messages": [
            {"role": "user", "content": "What is the weather in Paris, in celsius? Also add 2 and 3."}
        ],
        "tools": tools,
        "parallel_tool_calls": parallel,
        "stream": stream,
    }
    if choice is not None:
        body["tool_choice"] = choice
    return body


def _non_stream(client, body) -> tuple[str | None, list[tuple[str, str]], str]:
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
    return (
        msg["content"],
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
        choice["finish_reason"],
    )


def _stream(client, body) -> tuple[str | None, list[tuple[str, str]], str]:
    content, calls, finish = "", {}, None
    for chunk in sse_chunks(client, body):
        choice = chunk["choices"][0]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or []:
            i = tc["index"]
            if i not in calls:  # the first chunk of a call: id, type, name, empty arguments
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                assert tc["function"]["arguments"] == "" and tc["function"]["name"]
                assert i == len(calls)
                calls[i] = [tc["function"]["name"], ""]
            else:  # later chunks: argument fragments only
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[i][1] += tc["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content or None, [tuple(v) for v in calls.values()], finish


@pytest.mark.parametrize("n_tools", [1, 3])
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", ["auto", "required", "named", "none"])
def test_tool_choice_modes(client, choice, parallel, n_tools):
    tools = [WEATHER, ADD, SEARCH][:n_tools]
    names = {t["function"]["name"] for t in tools}
    tc = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    results = {}
    for stream in (False, True):
        body = _body(tools, tc, parallel, stream)
        results[stream] = (_stream if stream else _non_stream)(client, body)
    assert results[True] == results[False]  # streamed deltas concatenate to the non-streamed result
    content, calls, finish = results[False]
    for name, args in calls:
        assert name in names
        jsonschema.validate(json.loads(args), SCHEMAS[name])
    if choice == "none":  # the call syntax is excluded by the grammar (test_tool_formats.py)
        assert calls == [] and finish in ("stop", "length") and "<tool_call>" not in (content or "")
    if choice in ("required", "named"):
        assert calls and finish == "tool_calls" and not content
        if choice == "named":
            assert {n for n, _ in calls} == {"get_weather"}
    if calls:
        assert finish == "tool_calls"
    if not parallel:
        assert len(calls) <= 1


def test_tool_round_trip_and_errors(client):
    first = _non_stream(client, _body([WEATHER], "required", False, False))
    ((name, args),) = first[1]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]
    resp = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "tools": [WEATHER], "temperature": 0, "max_tokens": 20},
    )
    assert resp.status_code == 200, resp.text
    bad = client.post(
        "/v1/chat/completions",
        json={**_body([WEATHER], "required", True, False), "regex": "[a-z]+"},
    )  # a JSON response schema can sit beside tools (test_tools_with_schema.py), a regex cannot
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "regex"
    bad_schema = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}},
        },
    }
    bad = client.post("/v1/chat/completions", json=_body([WEATHER, bad_schema], "required", True, False))
    assert bad.status_code == 400 and "tool 'f' parameters" in bad.json()["error"]["message"], bad.text
    assert bad.json()["error"]["param"] == "tools[1].function.parameters"
    scalar = {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}
    bad = client.post("/v1/chat/completions", json=_body([scalar], "required", True, False))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function.parameters", bad.text
    for msgs, param in [
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}], "messages[1].tool_call_id"),
        (
            [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "nope", "content": "1"}],
            "messages[1].tool_call_id",
        ),
        (
            [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                }
            ],
            "messages[0].tool_calls",
        ),
    ]:
        bad = client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "tools": [WEATHER]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    # a prompt over the context is refused before the tools' grammar is compiled
    huge = {
        "type": "function",
        "function": {"name": "big", "description": "word " * 9000, "parameters": {"type": "object"}},
    }
    bad = client.post("/v1/chat/completions", json=_body([huge], "required", True, False))
    assert bad.status_code == 400 and "context limit" in bad.json()["error"]["message"], bad.text
    not_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": 12}}}
    bad = client.post("/v1/chat/completions", json=_body([not_schema], "auto", True, False))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function.parameters", bad.text
