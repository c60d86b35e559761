"""Helpers of the tools-with-a-response-schema tests (tests/api/test_tools_with_schema*.py): the
schema, the tools and scripted calls, a real HTTP server over the scripted fake model (`serve`,
`Scripts`), and one chat request through the openai client (`chat`)."""

from __future__ import annotations

import json

import jsonschema

from tests.support.paths import shared_path

REPORT = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "temp_c": {"type": "integer"}},
    "required": ["city", "temp_c"],
    "additionalProperties": False,
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time in a city.", "parameters": WEATHER_PARAMS},
    },
]
FORMAT = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
ANSWER = '{"city": "Oslo", "temp_c": 7}'


def call_text(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


CALL = call_text("get_weather", '{"city": "Oslo"}')


class Scripts:
    """The fake model's scripts, picked per request by what its prompt holds: `when(needle, text)`
    makes the model write `text` after a prompt holding `needle`; of several, the needle found
    latest in the prompt wins (a tool result after the question). Wraps the AsyncEngine's submit."""

    def __init__(self, front, runner):
        self.rules: dict[str, str] = {}
        submit, tokenizer = front.submit, runner.tokenizer

        async def scripted_submit(prompt_ids, *args, **kwargs):
            prompt = tokenizer.decode(prompt_ids)
            found = [(prompt.rfind(n), text) for n, text in self.rules.items() if n in prompt]
            if found:
                runner.script(prompt_ids, max(found)[1])
            return await submit(prompt_ids, *args, **kwargs)

        front.submit = scripted_submit

    def when(self, needle: str, text: str) -> None:
        self.rules[needle] = text


def serve(tokenizer, template: str | None):
    """(context manager yielding the base URL, Scripts, AsyncEngine) of a real HTTP server over the
    fake model with `tokenizer` and `template` (a shared chat template; None: the tokenizer's)."""
    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.runtime.engine import Engine
    from agentrt.testing import FakeModelRunner
    from agentrt.testing.server import serve_in_thread

    if template is not None:
        tokenizer.chat_template = shared_path("chat_templates", f"{template}.jinja").read_text()
    runner = FakeModelRunner(tokenizer, max_model_len=8192, num_kv_slots=32768)
    front = AsyncEngine(engine=Engine(runner=runner))
    return serve_in_thread(create_app(front, "m")), Scripts(front, runner), front


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def chat(url: str, question: str, stream: bool = False, **extra) -> dict:
    """One chat request through the openai client: {"content", "reasoning", "calls" [(name, args
    text)], "finish"}, the streamed chunks joined when `stream`."""
    kw = {
        "model": "m",
        "messages": extra.pop("messages", [{"role": "user", "content": question}]),
        "temperature": 0,
        "max_tokens": extra.pop("max_tokens", 120),
        "tools": extra.pop("tools", TOOLS),
        "response_format": extra.pop("response_format", FORMAT),
        **extra,
    }
    client = openai_client(url)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        m = choice.message
        calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        reasoning = (m.model_extra or {}).get("reasoning_content")
        return {"content": m.content, "reasoning": reasoning, "calls": calls, "finish": choice.finish_reason}
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for c in d.tool_calls or []:
                name, args = calls.get(c.index, ("", ""))
                calls[c.index] = (name + (c.function.name or ""), args + (c.function.arguments or ""))
            finish = choice.finish_reason or finish
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
    }


def valid_calls(calls) -> None:
    names = {t["function"]["name"] for t in TOOLS}
    for name, args in calls:
        assert name in names
        jsonschema.validate(json.loads(args), WEATHER_PARAMS)
