"""Agent frameworks against a real `agentrt serve` on the default model: the official `openai`
client, LangChain, pydantic-ai and the OpenAI Agents SDK (each installed by the test extra; a
missing package skips its test and says which)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct"

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}},
    "required": ["city"],
    "additionalProperties": False,
}


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


def test_openai_client_tool_round_trip_streaming(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="none")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city.",
                "parameters": WEATHER_PARAMS,
            },
        }
    ]
    messages = [{"role": "user", "content": "What's the weather in Hanoi?"}]
    # parallel_tool_calls false: a 135M model given the choice keeps calling until max_tokens
    resp = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    call = resp.choices[0].message.tool_calls[0]
    assert resp.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    # the same request streamed: the client's own accumulation gives the same call
    args, name = "", None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
        stream=True,
    ):
        for tc in chunk.choices[0].delta.tool_calls or []:
            name = name or tc.function.name
            args += tc.function.arguments or ""
    assert (name, args) == ("get_weather", call.function.arguments)
    messages += [
        resp.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 31}'},
    ]
    # the model answers the tool result in text (measured: 22 tokens, an echo of the result)
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=60
    )
    assert final.choices[0].finish_reason == "stop", final
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_langchain_bind_tools_and_structured_output(server):
    pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (it is in the test extra)"
    )
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="none", model=MODEL, temperature=0, max_tokens=60)
    msg = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke(
        "What's the weather in Hanoi?"
    )
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str)
    city = llm.with_structured_output(City).invoke("Name a city in France.")  # default method: json_schema
    assert isinstance(city, City)


def test_pydantic_ai_tool_output_and_native_output(server):
    pytest.importorskip("pydantic_ai", reason="pydantic-ai-slim is not installed (it is in the test extra)")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{server}/v1", api_key="none"))
    settings = {"temperature": 0, "max_tokens": 80, "parallel_tool_calls": False}
    # tool output (pydantic-ai's default): the answer comes as a call to its final_result tool
    result = Agent(model, output_type=City, model_settings=settings).run_sync("Name a city in Vietnam.")
    assert isinstance(result.output, City)
    calls = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
    assert calls and calls[0].tool_name.startswith("final_result")
    # native structured output: response_format json_schema
    result = Agent(model, output_type=NativeOutput(City), model_settings=settings).run_sync(
        "Name a city in Japan."
    )
    assert isinstance(result.output, City)


def test_openai_agents_sdk_tool_round_trip(server):
    pytest.importorskip("agents", reason="openai-agents is not installed (it is in the test extra)")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
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
        seen.append(city)
        return "14:05"

    model = OpenAIChatCompletionsModel(
        model=MODEL, openai_client=AsyncOpenAI(base_url=f"{server}/v1", api_key="none")
    )
    # tool_choice required for the first turn; the SDK resets it to auto after the call
    agent = Agent(
        name="clock",
        instructions="Answer with the time.",
        tools=[get_time],
        model=model,
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60
        ),
    )
    result = Runner.run_sync(agent, "What time is it in Hanoi?", max_turns=4)
    kinds = [type(i) for i in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds and seen
    assert isinstance(result.final_output, str)


@pytest.mark.slow  # a real server under a thinking template, ~18 s; the SDK's other tests stay in the suite
def test_openai_agents_sdk_with_a_thinking_model(tmp_path):
    """`agentrt serve --chat-template` with Qwen3-Thinking's real template and a budget message:
    the Agents SDK sees the model's reasoning as a ReasoningItem, then its tool call (constrained
    after the reasoning) and the tool's result."""
    pytest.importorskip("agents", reason="openai-agents is not installed (it is in the test extra)")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        ReasoningItem,
        Runner,
        ToolCallItem,
        ToolCallOutputItem,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    from agentrt.testing import agentrt_server
    from tests.support.paths import shared_path

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_time(city: str) -> str:
        """Current local time in a city."""
        seen.append(city)
        return "14:05"

    template = shared_path("chat_templates", "Qwen3-4B-Thinking-2507.jinja")
    args = ["--chat-template", str(template), "--reasoning-budget-message", " Time to answer."]
    with agentrt_server(MODEL, *args, log_path=tmp_path / "server.log") as srv:
        model = OpenAIChatCompletionsModel(
            model=MODEL, openai_client=AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none")
        )
        settings = ModelSettings(
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=120,
            extra_body={"thinking_token_budget": 16},
        )
        agent = Agent(
            name="clock",
            instructions="Answer with the time.",
            tools=[get_time],
            model=model,
            model_settings=settings,
        )
        result = Runner.run_sync(agent, "What time is it in Hanoi?", max_turns=2)
    kinds = [type(i) for i in result.new_items]
    assert ReasoningItem in kinds and ToolCallItem in kinds and ToolCallOutputItem in kinds, kinds
    assert kinds.index(ReasoningItem) < kinds.index(ToolCallItem)
    assert seen
