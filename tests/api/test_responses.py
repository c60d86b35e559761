"""OpenAI's Responses API (`POST /v1/responses`, agentrt/api/responses.py): through the official
`openai` client and the OpenAI Agents SDK's default Responses model against a real `agentrt serve`
on the default model (structured output, a forced tool, a tool round trip, streaming equal to the
non-streamed output, cached-token usage, errors in this API's field names); model-free, the output
items built from model text (the same whatever the chunking) and the chat -> Responses field names;
and over the fake runner, an error after the stream started is an `error` event and a client that
closes the stream stops its request."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from agentrt.runtime.async_engine import AdmissionConfig
from tests.api.test_disconnect import GatedRunner, fake_server, settle, step_until

MODEL = "smollm2-135m-instruct"

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 30},
        "country": {"type": "string", "minLength": 1, "maxLength": 30},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city.",
    "parameters": WEATHER_PARAMS,
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "Current local time in a city.",
    "parameters": WEATHER_PARAMS,
}
QUESTION = "What's the weather in Hanoi?"


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key="none")


def test_json_schema_text_format(oai):
    resp = oai.responses.create(
        model=MODEL,
        instructions="Answer in JSON.",
        input="Name a city in France.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        temperature=0,
        max_output_tokens=60,
        extra_body={"max_tokens_policy": "close"},  # valid JSON even at the token limit
    )
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == MODEL
    assert [item.type for item in resp.output] == ["message"]
    message = resp.output[0]
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    jsonschema.validate(json.loads(resp.output_text), CITY)
    # the settings are echoed as the SDK expects them
    assert resp.instructions == "Answer in JSON." and resp.max_output_tokens == 60
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "city"
    assert resp.temperature == 0 and resp.tools == [] and resp.tool_choice == "auto"
    assert resp.status == message.status == "completed" and resp.incomplete_details is None
    usage = resp.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_forced_function_tool(oai):
    resp = oai.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    )
    assert resp.status == "completed"
    assert [item.type for item in resp.output] == ["function_call"]
    call = resp.output[0]
    assert call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    assert resp.output_text == ""
    assert resp.tool_choice.type == "function" and resp.tool_choice.name == "get_weather"
    assert [t.name for t in resp.tools] == ["get_weather", "get_time"]
    assert resp.tools[0].strict is True  # the Responses API's default


def test_tool_round_trip(oai):
    """function_call -> function_call_output -> the model's answer in text."""
    first = oai.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=60,
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    history = [
        {"role": "user", "content": QUESTION},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 31}'},
    ]
    final = oai.responses.create(
        model=MODEL, input=history, tools=[WEATHER], temperature=0, max_output_tokens=60
    )
    assert final.status == "completed", final
    assert [item.type for item in final.output] == ["message"]
    assert final.output_text.strip()


def _streamed(oai, **kwargs) -> list:
    return list(oai.responses.create(stream=True, **kwargs))


def _check_event_order(events: list) -> None:
    """Sequence numbers count from 0; the stream opens with created / in_progress and ends with the
    terminal event, whose response is the whole output."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.id == events[0].response.id


def test_streamed_text_equals_the_non_streamed_output(oai):
    body = {
        "model": MODEL,
        "input": "Write one sentence about the sea.",
        "temperature": 0,
        "max_output_tokens": 24,
    }
    resp = oai.responses.create(**body)
    events = _streamed(oai, **body)
    _check_event_order(events)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == resp.output_text and resp.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == resp.output_text
    final = events[-1].response
    assert final.output_text == resp.output_text and final.status == resp.status
    assert final.usage.output_tokens == resp.usage.output_tokens
    types = [e.type for e in events[2:-1]]
    assert types[:2] == ["response.output_item.added", "response.content_part.added"]
    assert types[-3:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


def test_streamed_call_equals_the_non_streamed_call(oai):
    body = {
        "model": MODEL,
        "input": QUESTION,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": 60,
    }
    resp = oai.responses.create(**body)
    # the SDK's own stream helper accumulates the events into the final response
    with oai.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _check_event_order(events)
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (call,) = resp.output
    assert args == done.arguments == call.arguments
    (streamed,) = final.output
    assert (streamed.type, streamed.name, streamed.arguments) == (
        "function_call",
        "get_weather",
        call.arguments,
    )


def test_usage_counts_cached_tokens_on_a_repeated_prompt(oai):
    body = {
        "model": MODEL,
        "instructions": "You are a travel agent. Answer in one short sentence.",
        "input": "Which river flows through Hanoi, the capital of Vietnam?",
        "temperature": 0,
        "max_output_tokens": 4,
    }
    oai.responses.create(**body)
    again = oai.responses.create(**body)
    details = again.usage.input_tokens_details
    assert 0 < details.cached_tokens <= again.usage.input_tokens
    # 4 tokens cannot hold the answer: incomplete, as OpenAI reports a max_output_tokens stop
    assert again.usage.output_tokens == 4
    assert again.status == "incomplete" and again.incomplete_details.reason == "max_output_tokens"
    assert again.output[0].status == "incomplete"


def test_errors_name_the_responses_fields(oai):
    from openai import BadRequestError

    cases = [
        (
            {"input": "hi", "previous_response_id": "resp_123"},
            "previous_response_id",
            "send the whole conversation",
        ),
        ({"input": "hi", "conversation": "conv_1"}, "conversation", "server-side state"),
        ({"input": "hi", "background": True}, "background", "server-side state"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "no reasoning mode"),
        ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include[0]", "not supported"),
        ({"input": "hi", "truncation": "auto"}, "truncation", "context_length_exceeded"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "function tools only"),
        (
            {"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]},
            "tools[0].name",
            "tools[0].name must be",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "https://x.invalid/a.png"}],
                    }
                ]
            },
            "input[0].content[0].type",
            "text only",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "function_call_output", "call_id": "c1", "output": "1"},
                ]
            },
            "input[1].call_id",
            "answers no function_call",
        ),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
        (
            {
                "input": "hi",
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "tags",
                        "schema": {"type": "array", "items": {"type": "number"}, "uniqueItems": True},
                    }
                },
            },
            "text.format.schema",
            "uniqueItems",
        ),
        (
            {
                "input": "hi",
                "tools": [
                    {
                        "type": "function",
                        "name": "tag",
                        "parameters": {
                            "type": "object",
                            "properties": {"t": {"type": "array", "uniqueItems": True}},
                        },
                    }
                ],
            },
            "tools[0].parameters",
            "uniqueItems",
        ),
    ]
    for body, param, words in cases:
        with pytest.raises(BadRequestError) as info:
            oai.responses.create(model=MODEL, **body)
        err = info.value.body
        assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
        assert words in err["message"] and err["message"].startswith(param.split("[")[0]), (body, err)


def test_openai_agents_sdk_responses_model_tool_round_trip(server):
    pytest.importorskip("agents", reason="openai-agents is not installed (it is in the test extra)")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        ToolCallItem,
        ToolCallOutputItem,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no exporter: this machine has no internet
    seen = []

    @function_tool
    def get_time(city: str) -> str:
        """Current local time in a city."""
        seen.append(("get_time", city))
        return '{"time": "14:05"}'  # measured: the 135M model echoes a JSON result and stops

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        seen.append(("get_weather", city))
        return '{"sky": "sunny", "temp_c": 31}'

    def agent() -> Agent:
        """A fresh agent (its client's connections belong to the event loop that first uses them)."""
        # the SDK's default model class for OpenAI: the Responses API
        model = OpenAIResponsesModel(
            model=MODEL, openai_client=AsyncOpenAI(base_url=f"{server}/v1", api_key="none")
        )
        # a named tool_choice for the first turn; the SDK resets it to auto after the call
        return Agent(
            name="clock",
            instructions="Answer with the time.",
            tools=[get_weather, get_time],
            model=model,
            model_settings=ModelSettings(
                tool_choice="get_time", parallel_tool_calls=False, temperature=0, max_tokens=60
            ),
        )

    result = Runner.run_sync(agent(), "What time is it in Hanoi?", max_turns=4)
    kinds = [type(i) for i in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    assert seen and seen[0][0] == "get_time"
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert all(r.usage.input_tokens > 0 for r in result.raw_responses)

    # the same run streamed: the SDK's stream handler reads the events into the same result
    async def streamed():
        run = Runner.run_streamed(agent(), "What time is it in Hanoi?", max_turns=4)
        types = [e.data.type async for e in run.stream_events() if e.type == "raw_response_event"]
        return run, types

    run, types = asyncio.run(streamed())
    assert types.count("response.completed") == len(result.raw_responses)
    assert "response.function_call_arguments.delta" in types and "response.output_text.delta" in types
    assert run.final_output == result.final_output
    assert [type(i) for i in run.new_items] == kinds


# ---- model-free -------------------------------------------------------------------------------


def _plan():
    from agentrt.api.tools import plan_tools
    from agentrt.grammars.tool_calls import FORMATS

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
    return plan_tools([tool], "auto", True, FORMATS["hermes"])


def _without_ids(value):
    """`value` with generated ids (msg_, fc_, call_) replaced by their prefix."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    if isinstance(value, str) and value.startswith(("msg_", "fc_", "call_")):
        return value.split("_")[0] + "_"
    return value


CALL_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Hue"}}\n</tool_call>\n'
)


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_output_items_follow_the_text_whatever_the_chunking(finish):
    from agentrt.api.responses.shape import _Output

    whole = _Output(_plan())
    whole.feed(CALL_TEXT)
    whole.finish(finish)
    status = "completed" if finish == "stop" else "incomplete"
    assert _without_ids(whole.items) == [
        {
            "id": "msg_",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Let me check.\n", "annotations": [], "logprobs": []}
            ],
        },
        {
            "id": "fc_",
            "type": "function_call",
            "status": status,  # the last item carries how the output ended
            "arguments": '{"city": "Hue"}',
            "call_id": "call_",
            "name": "get_weather",
        },
    ]
    # one character at a time: the same items, and the events rebuild them exactly
    chunked = _Output(_plan())
    events = [e for ch in CALL_TEXT for e in chunked.feed(ch)] + chunked.finish(finish)
    assert _without_ids(chunked.items) == _without_ids(whole.items)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == chunked.items
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert (text, args) == ("Let me check.\n", '{"city": "Hue"}')
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]


def test_whitespace_alone_opens_no_message_but_an_empty_output_is_one_message():
    from agentrt.api.responses.shape import _Output

    out = _Output(_plan())
    out.feed('\n \n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Hue"}}\n</tool_call>')
    out.finish("stop")
    assert [i["type"] for i in out.items] == ["function_call"]
    empty = _Output(None)
    empty.finish("stop")
    assert [(i["type"], i["content"][0]["text"]) for i in empty.items] == [("message", "")]


def test_chat_field_names_become_responses_names():
    from agentrt.api.responses import ResponsesRequest, to_chat_request

    req = ResponsesRequest.model_validate(
        {
            "model": MODEL,
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "1"}],
                },
            ],
        }
    )
    chat, shape = to_chat_request(req, MODEL)
    # the two calls join one assistant message; the output is a tool message
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert [c.id for c in chat.messages[2].tool_calls] == ["c1", "c2"]
    assert (chat.messages[3].tool_call_id, chat.messages[3].text()) == ("c2", "1")
    names = {
        "messages": "input",
        "messages[0]": "instructions",
        "messages[3].tool_call_id": "input[3].call_id",
        "max_tokens": "max_output_tokens",
        "response_format": "text.format",
        "response_format.json_schema.schema": "text.format.schema",
        "tools[2].function.parameters": "tools[2].parameters",
        "tool_choice": "tool_choice",
        None: None,
    }
    assert {k: shape.param(k) for k in names} == names


# ---- model-free: a real HTTP server over the fake runner -------------------------------------


def _events(lines: list[str]) -> list[dict]:
    """The `data:` JSON of SSE lines, each checked against its `event:` line."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
            assert data["type"] == name, (name, data)
            out.append(data)
    return out


def test_an_error_after_the_stream_started_is_an_error_event():
    runner = GatedRunner()
    with fake_server(runner, AdmissionConfig(request_timeout_s=0.3)) as (url, front):

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:

                async def streamed() -> list[dict]:
                    body = {
                        "model": "fake",
                        "input": "tell me a story",
                        "stream": True,
                        "max_output_tokens": 400,
                    }
                    async with client.stream("POST", "/v1/responses", json=body) as r:
                        assert r.status_code == 200
                        return _events([line async for line in r.aiter_lines()])

                task = asyncio.create_task(streamed())
                await step_until(runner, lambda: len(front.engine.scheduler.running) == 1, "it runs")
                await asyncio.sleep(0.4)  # past the deadline while the engine waits in a forward
                runner.open()
                events = await task
                assert events[0]["type"] == "response.created"
                assert [e["sequence_number"] for e in events] == list(range(len(events)))
                error = events[-1]
                assert set(error) == {"type", "sequence_number", "code", "message", "param"}
                assert (error["type"], error["code"], error["param"]) == ("error", "request_timeout", None)
                assert not any(e["type"] == "response.completed" for e in events)
                await settle(url, front)

        asyncio.run(run())


def test_closing_the_stream_stops_the_request():
    runner = GatedRunner()
    with fake_server(runner) as (url, front):

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = {"model": "fake", "input": "tell me a story", "stream": True, "max_output_tokens": 400}

                async def first_delta() -> None:
                    async with client.stream("POST", "/v1/responses", json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            if line == "event: response.output_text.delta":
                                return  # closes the stream

                task = asyncio.create_task(first_delta())
                await step_until(runner, task.done, "a first text delta")
                await task
                # closed after the first delta: the request ends within one step, its KV freed
                await step_until(runner, lambda: not front.engine.has_work(), "the request stopped")
                assert front.engine.stats.num_finished["abort"] == 1
                assert front.engine.stats.num_generated_tokens < 400
                runner.open()
                await settle(url, front)

        asyncio.run(run())
