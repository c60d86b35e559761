"""Tools and a response schema in one request through the client libraries of docs/compatibility.md
that send both (issue 51 item 5; the requests themselves: test_tools_with_schema.py): chat `response_format` + `tools`,
Responses `text.format` + `tools`, Messages `output_config.format` + `tools`. Under tool_choice
"auto" the output is tool calls (each valid against its tool's parameters) or a final answer valid
against the schema, one grammar, after the reasoning of a reasoning model; "required" and a named
tool keep meaning calls; `parallel_tool_calls` is kept; `stop` has no effect (the whole output is
constrained). Through the official `openai` and `anthropic` clients and the OpenAI Agents SDK
(an `output_type` and tools) against a real HTTP server over the scripted fake model, whose
script is picked by what the prompt holds (`Scripts`)."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.tools_schema import (
    ANSWER,
    CALL,
    FORMAT,
    TOOLS,
)

# ---- the OpenAI Agents SDK: an output_type and tools -----------------------------------------------


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk_output_type_with_tools(schema_server, api):
    """An agent with an `output_type` and a tool, on the SDK's default Responses model and on its
    chat completions model: the model calls the tool, the SDK runs it, and the final answer is
    parsed into the output type (run and streamed run)."""
    pytest.importorskip("agents", reason="openai-agents is not installed (it is in the test extra)")
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        ToolCallItem,
        ToolCallOutputItem,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    set_tracing_disabled(True)  # no exporter: this machine has no internet
    url, scripts = schema_server

    class Report(BaseModel):
        city: str
        temp_c: int

    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        seen.append(city)
        return f"RESULT-agents-{api}: 7 C"

    question = f"Agents ({api}): the weather report for Oslo?"
    # the SDK's own function schema ({"city"} required, closed): the script's call satisfies it
    scripts.when(question, CALL + "<|im_end|>")
    scripts.when(f"RESULT-agents-{api}", ANSWER + "<|im_end|>")

    def agent() -> Agent:
        model_class = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        return Agent(
            name="weather",
            instructions="Report the weather.",
            tools=[get_weather],
            output_type=Report,
            model=model_class(model="m", openai_client=client),
            model_settings=ModelSettings(temperature=0, max_tokens=120),
        )

    result = Runner.run_sync(agent(), question, max_turns=3)
    kinds = [type(i) for i in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds and seen == ["Oslo"], kinds
    assert result.final_output == Report(city="Oslo", temp_c=7)

    async def streamed():
        run = Runner.run_streamed(agent(), question, max_turns=3)
        async for _ in run.stream_events():
            pass
        return run

    run = asyncio.run(streamed())
    assert run.final_output == result.final_output and [type(i) for i in run.new_items] == kinds


# ---- the other client libraries of docs/compatibility.md that send both -----------------------------


def test_pydantic_ai_native_output_with_a_tool(schema_server):
    """pydantic-ai's `NativeOutput` (response_format json_schema) beside a function tool."""
    pytest.importorskip("pydantic_ai", reason="pydantic-ai-slim is not installed (it is in the test extra)")
    from pydantic import BaseModel
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.messages import ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    url, scripts = schema_server

    class Report(BaseModel):
        city: str
        temp_c: int

    question = "pydantic-ai: the weather report for Oslo?"
    scripts.when(question, CALL + "<|im_end|>")
    scripts.when("RESULT-pydantic", ANSWER + "<|im_end|>")
    model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=f"{url}/v1", api_key="none"))
    agent = Agent(
        model, output_type=NativeOutput(Report), model_settings={"temperature": 0, "max_tokens": 120}
    )

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return f"RESULT-pydantic: 7 C in {city}"

    result = agent.run_sync(question)
    assert result.output == Report(city="Oslo", temp_c=7)
    calls = [p for m in result.all_messages() for p in m.parts if isinstance(p, ToolCallPart)]
    assert [(c.tool_name, c.args_as_dict()) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_langchain_bind_tools_with_response_format(schema_server):
    pytest.importorskip(
        "langchain_openai", reason="langchain-openai is not installed (it is in the test extra)"
    )
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    url, scripts = schema_server

    class Report(BaseModel):
        city: str
        temp_c: int

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "RESULT-langchain: 7 C"

    question = "LangChain: the weather report for Oslo?"
    scripts.when(question, CALL + "<|im_end|>")
    scripts.when("RESULT-langchain", ANSWER + "<|im_end|>")
    llm = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model="m", temperature=0, max_tokens=120)
    bound = llm.bind_tools([get_weather], response_format=Report, strict=True)
    messages = [HumanMessage(question)]
    first = bound.invoke(messages)
    assert [(c["name"], c["args"]) for c in first.tool_calls] == [("get_weather", {"city": "Oslo"})]
    messages += [
        first,
        ToolMessage(get_weather.invoke(first.tool_calls[0]["args"]), tool_call_id=first.tool_calls[0]["id"]),
    ]
    second = bound.invoke(messages)
    assert not second.tool_calls and second.additional_kwargs["parsed"] == Report(city="Oslo", temp_c=7)


def test_litellm_tools_with_response_format(schema_server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network
    monkeypatch.setenv("LITELLM_OFFLINE_MODE", "true")
    litellm = pytest.importorskip("litellm", reason="litellm is not installed (it is in the test extra)")
    url, scripts = schema_server
    question = "LiteLLM: the weather report for Oslo?"
    scripts.when(question, CALL + "<|im_end|>")
    kw = {
        "model": "openai/m",
        "api_base": f"{url}/v1",
        "api_key": "none",
        "temperature": 0,
        "max_tokens": 120,
    }
    resp = litellm.completion(
        messages=[{"role": "user", "content": question}], tools=TOOLS, response_format=FORMAT, **kw
    )
    (call,) = resp.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    scripts.when("LiteLLM: answer now?", ANSWER + "<|im_end|>")
    resp = litellm.completion(
        messages=[{"role": "user", "content": "LiteLLM: answer now?"}],
        tools=TOOLS,
        response_format=FORMAT,
        **kw,
    )
    assert json.loads(resp.choices[0].message.content) == json.loads(ANSWER)
