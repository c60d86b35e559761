"""Anthropic's Messages API (POST /v1/messages) through the official `anthropic` client: against a
real `agentrt serve` on the default model (tool use forced and round-tripped, streaming equal to the
non-streamed message, stop sequences, output_config.format, errors in Anthropic's shape), the
request translation on its own, and API keys sent as `x-api-key` (a real uvicorn server over the
fake runner)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from agentrt.api.errors import APIError
from agentrt.api.messages import MessagesRequest, MessagesShape, to_chat

MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0}  # this SDK version has no temperature argument: sent in the body
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "What's the weather in Hanoi?"}]
COUNT = [{"role": "user", "content": "Count from 1 to 10."}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="any", max_retries=0)


def _same(a, b) -> None:
    """Two messages agree but for their ids (and how much of the prompt the cache served)."""

    def strip(m):
        d = m.model_dump(exclude={"id", "usage"})
        for block in d["content"]:
            block.pop("id", None)
        return d, m.usage.output_tokens, m.usage.input_tokens + m.usage.cache_read_input_tokens

    assert strip(a) == strip(b)


def test_forced_tool_use_round_trip_and_stream(client):
    kwargs = {
        "model": MODEL,
        "max_tokens": 60,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": GREEDY,
    }
    resp = client.messages.create(messages=ASK, **kwargs)
    assert resp.type == "message" and resp.role == "assistant" and resp.model == MODEL
    assert resp.id.startswith("msg_") and resp.stop_reason == "tool_use" and resp.stop_sequence is None
    [call] = resp.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert resp.usage.output_tokens > 0 and resp.usage.cache_creation_input_tokens == 0
    # the same request streamed: the SDK's accumulated message is the same message
    with client.messages.stream(messages=ASK, **kwargs) as stream:
        streamed = stream.get_final_message()
    _same(streamed, resp)
    # the tool's result goes back as a tool_result block; the model answers in text
    turns = [
        *ASK,
        {"role": "assistant", "content": resp.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"temp_c": 31}'}],
        },
    ]
    final = client.messages.create(
        model=MODEL, max_tokens=60, messages=turns, tools=[WEATHER], stop_sequences=["zzz"], extra_body=GREEDY
    )
    assert final.stop_reason == "end_turn" and final.stop_sequence is None, final
    assert [b.type for b in final.content] == ["text"] and final.content[0].text.strip()


def test_text_stream_equals_the_message(client):
    kwargs = {
        "model": MODEL,
        "max_tokens": 12,
        "messages": COUNT,
        "system": "You count.",
        "extra_body": GREEDY,
    }
    resp = client.messages.create(**kwargs)
    assert resp.stop_reason == "max_tokens" and resp.usage.output_tokens == 12
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == resp.content[0].text
    _same(streamed, resp)


def test_stop_sequences(client):
    # greedy output is "1. 1\n2. 2\n3. 3\n4. 4\n..." (measured)
    kwargs = {
        "model": MODEL,
        "max_tokens": 40,
        "messages": COUNT,
        "stop_sequences": ["9", "4."],
        "extra_body": GREEDY,
    }
    resp = client.messages.create(**kwargs)
    assert (resp.stop_reason, resp.stop_sequence) == ("stop_sequence", "4.")
    assert resp.content[0].text == "1. 1\n2. 2\n3. 3\n"
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    _same(streamed, resp)


def test_output_config_format_constrains_the_text(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    }
    resp = client.messages.create(
        model=MODEL,
        max_tokens=30,
        messages=[{"role": "user", "content": "Name a city in France."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    jsonschema.validate(json.loads(resp.content[0].text), schema)


def _error(excinfo, kind: str) -> str:
    body = excinfo.value.body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_errors_in_anthropic_shape(client):
    bad_tool = {**WEATHER, "input_schema": {"type": "object", "properties": {"city": {"type": "strin"}}}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=ASK, tools=[bad_tool])
    assert _error(e, "invalid_request_error").startswith("tools[0].input_schema: ")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.post("/v1/messages", body={"model": MODEL, "messages": ASK}, cast_to=object)
    assert _error(e, "invalid_request_error") == "max_tokens: Field required"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=5, messages=ASK)
    assert "no-such-model" in _error(e, "not_found_error")
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [image]}])
    assert _error(e, "invalid_request_error").startswith(
        "messages[0].content[0]: image blocks are not supported"
    )
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL, max_tokens=5, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    assert _error(e, "invalid_request_error").startswith("thinking: extended thinking is not supported")
    with pytest.raises(anthropic.BadRequestError) as e:  # a stop sequence the engine refuses, renamed
        client.messages.create(model=MODEL, max_tokens=5, messages=ASK, stop_sequences=[""])
    assert _error(e, "invalid_request_error").startswith("stop_sequences ")


# ---- the translation on its own (no model) ----------------------------------------------------------
def _translate(**body):
    return to_chat(MessagesRequest.model_validate({"model": MODEL, "max_tokens": 8, **body}))


def test_translation_to_chat():
    chat, where = _translate(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "user",
                "content": [{"type": "text", "text": " In Hue."}],
            },  # combined with the turn above
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Hue"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "down"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Try again."},
                ],
            },
        ],
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        top_k=5,
        metadata={"user_id": "u1"},
    )
    got = [m.as_dict() for m in chat.messages]
    assert got == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather? In Hue."},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Hue"}'},
                }
            ],
        },
        {"role": "tool", "content": "Error: down", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "Try again."},
    ]
    assert where == ["system", "messages[0]", "messages[2]", "messages[3].content[0]", "messages[3]"]
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.stop, chat.top_k) == (
        "required",
        False,
        ["END"],
        5,
    )
    assert chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "Weather in a city.",
            },
        }
    ]
    named, _ = _translate(messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert _translate(messages=ASK, tools=[WEATHER], tool_choice={"type": "none"})[0].tool_choice == "none"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": ASK, "temperature": 1.5}, "temperature"),
        ({"messages": ASK, "container": "c1"}, "container"),
        ({"messages": [*ASK, {"role": "assistant", "content": "It is"}]}, "messages[1]"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}]}
                ]
            },
            "messages[0].content[0].tool_use_id",
        ),
        (
            {"messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools[0].type",
        ),
        ({"messages": ASK, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"messages": ASK, "tool_choice": {"type": "required"}}, "tool_choice.type"),
        ({"messages": ASK, "output_config": {"effort": "high"}}, "output_config.effort"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "foo": 1}]}]},
            "messages[0].content[0].foo",
        ),
    ],
)
def test_translation_refuses_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        _translate(**body)
    assert (e.value.status, e.value.param) == (400, param) and e.value.message


def test_chat_field_names_map_back():
    shape = MessagesShape(MODEL, None, ["system", "messages[0]", "messages[1].content[2]"])
    assert shape.param("tools[3].function.parameters") == "tools[3].input_schema"
    assert shape.param("tools[0].function.name") == "tools[0].name"
    assert shape.param("stop") == "stop_sequences" and shape.param("prompt") == "messages"
    assert shape.param("parallel_tool_calls") == "tool_choice.disable_parallel_tool_use"
    assert shape.param("messages[2].tool_call_id") == "messages[1].content[2]"
    assert shape.param("response_format.json_schema.schema") == "output_config.format.schema"
    assert [shape.param(p) for p in ("messages", "max_tokens", "model", None)] == [
        "messages",
        "max_tokens",
        "model",
        None,
    ]


# ---- API keys as x-api-key (Anthropic's clients), over the fake runner ------------------------------
def test_x_api_key_header_and_401_shape():
    from agentrt.api.app import create_app
    from agentrt.api.middleware import ServerOptions
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.testing import fake_engine, serve_in_thread

    front = AsyncEngine(engine=fake_engine())
    try:
        app = create_app(front, "fake", options=ServerOptions(api_keys=("key-one", "key-two")))
        with serve_in_thread(app) as url:
            body = {"model": "fake", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
            resp = anthropic.Anthropic(base_url=url, api_key="key-two", max_retries=0).messages.create(**body)
            assert resp.type == "message" and resp.usage.output_tokens == 2
            with pytest.raises(anthropic.AuthenticationError) as e:
                anthropic.Anthropic(base_url=url, api_key="key-three", max_retries=0).messages.create(**body)
            assert _error(e, "authentication_error") == "incorrect API key"
            assert "key-three" not in json.dumps(e.value.body)
            # OpenAI routes keep OpenAI's shape and also take the key as x-api-key
            models = httpx.get(f"{url}/v1/models", headers={"x-api-key": "key-one"})
            assert models.status_code == 200
            refused = httpx.get(f"{url}/v1/models")
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    finally:
        front.shutdown()


def test_an_error_after_the_first_output_is_an_error_event(monkeypatch):
    """A request that fails mid-stream (an injected detokenizer fault) ends its 200 stream with one
    `error` event in Anthropic's shape, which the SDK raises."""
    import uuid

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.testing import FaultInjector, fake_engine, serve_in_thread

    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=7))  # the request id to make fail
    engine = fake_engine()
    front = AsyncEngine(engine=engine)
    body = {"model": "fake", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}
    try:
        victim = f"chatcmpl-{uuid.UUID(int=7).hex}"
        with (
            serve_in_thread(create_app(front, "fake")) as url,
            FaultInjector(engine, victim, "detokenizer", after_tokens=2),
        ):
            raw = httpx.post(f"{url}/v1/messages", json={**body, "stream": True})
            client = anthropic.Anthropic(base_url=url, api_key="any", max_retries=0)
            with pytest.raises(anthropic.APIStatusError) as e, client.messages.stream(**body) as stream:
                stream.get_final_message()
    finally:
        front.shutdown()
    assert raw.status_code == 200
    events = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "error" and "message_stop" not in events
    error = json.loads(raw.text.rstrip().splitlines()[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error" and error["error"]["message"]
    assert e.value.body["error"]["type"] == "api_error"
