"""Tools and a response schema in one request (issue 51 item 5): chat `response_format` + `tools`,
Responses `text.format` + `tools`, Messages `output_config.format` + `tools`. Under tool_choice
"auto" the output is tool calls (each valid against its tool's parameters) or a final answer valid
against the schema, one grammar, after the reasoning of a reasoning model; "required" and a named
tool keep meaning calls; `parallel_tool_calls` is kept; `stop` has no effect (the whole output is
constrained). Through the official `openai` and `anthropic` clients and the OpenAI Agents SDK
(an `output_type` and tools) against a real HTTP server over the scripted fake model, whose
script is picked by what the prompt holds (`Scripts`)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.support.tools_schema import (
    ANSWER,
    CALL,
    REPORT,
    TOOLS,
    WEATHER_PARAMS,
    call_text,
    chat,
    openai_client,
    serve,
    valid_calls,
)

# ---- chat completions ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_calls_a_tool_then_answers_valid_against_the_schema(schema_server, stream):
    url, scripts = schema_server
    question = f"Weather in Oslo, as a report? ({stream})"
    scripts.when(question, CALL + "<|im_end|>")
    scripts.when("RESULT-chat", ANSWER + "<|im_end|>")
    first = chat(url, question, stream)
    assert first["finish"] == "tool_calls" and first["content"] is None, first
    assert first["calls"] == [("get_weather", '{"city": "Oslo"}')]
    messages = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "RESULT-chat: 7 C, rain"},
    ]
    second = chat(url, question, stream, messages=messages)
    assert second["finish"] == "stop" and second["calls"] == [], second
    assert json.loads(second["content"]) == json.loads(ANSWER)


@pytest.mark.parametrize(
    "script",
    [
        '{"city": "Oslo", "temp_c": "seven"}',  # a value of the wrong type
        '{"city": "Oslo", "temp_c": 7, "wind": 3}',  # a property the schema closes out
        "The weather in Oslo is 7 C.",  # prose instead of the schema's JSON
        '{"city": "Oslo"}',  # a required property missing
    ],
    ids=["wrong-type", "extra-key", "prose", "missing-key"],
)
def test_an_answer_that_violates_the_schema_is_masked(schema_server, script):
    """The model writes an answer the schema forbids: the grammar masks it at the first token it
    cannot take (the output is then the schema's JSON or calls, never free text); max_tokens_policy
    "close" ends it valid."""
    url, scripts = schema_server
    question = f"Report for Oslo? ({script})"
    scripts.when(question, script + "<|im_end|>")
    for stream in (False, True):
        out = chat(url, question, stream, max_tokens=60, extra_body={"max_tokens_policy": "close"})
        if out["calls"]:
            valid_calls(out["calls"])
            assert out["content"] is None
        else:
            jsonschema.validate(json.loads(out["content"]), REPORT)
            assert out["content"] != script


@pytest.mark.parametrize(
    "call",
    [
        call_text("get_weather", '{"city": 42}'),  # an argument of the wrong type
        call_text("get_weather", '{"town": "Oslo"}'),  # an unknown argument
        call_text("get_news", '{"city": "Oslo"}'),  # a tool that is not offered
    ],
    ids=["wrong-type", "unknown-argument", "unknown-tool"],
)
def test_a_call_with_bad_arguments_is_masked(schema_server, call):
    url, scripts = schema_server
    question = f"Weather call? ({call})"
    scripts.when(question, call + "<|im_end|>")
    out = chat(url, question, max_tokens=60, extra_body={"max_tokens_policy": "close"})
    assert out["calls"] or out["content"], out
    if out["calls"]:
        valid_calls(out["calls"])
        assert out["finish"] == "tool_calls"
    else:
        jsonschema.validate(json.loads(out["content"]), REPORT)


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_is_kept(schema_server, parallel):
    url, scripts = schema_server
    question = f"Weather and time in Oslo? ({parallel})"
    two = CALL + "\n" + call_text("get_time", '{"city": "Oslo"}')
    scripts.when(question, two + "<|im_end|>")
    out = chat(url, question, max_tokens=80, parallel_tool_calls=parallel)
    assert out["finish"] == "tool_calls"
    assert [n for n, _ in out["calls"]] == (["get_weather", "get_time"] if parallel else ["get_weather"])
    valid_calls(out["calls"])


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_required_and_named_keep_meaning_calls(schema_server, tool_choice):
    """A schema beside tool_choice "required" or a named tool: the output is still calls (the
    schema is for a later turn's answer); the model's attempt at an answer is masked."""
    url, scripts = schema_server
    question = f"Report now? ({tool_choice})"
    scripts.when(question, ANSWER + "<|im_end|>")
    for stream in (False, True):
        out = chat(
            url,
            question,
            stream,
            max_tokens=60,
            tool_choice=tool_choice,
            extra_body={"max_tokens_policy": "close"},
        )
        assert out["finish"] == "tool_calls" and out["content"] is None, out
        valid_calls(out["calls"])
        if isinstance(tool_choice, dict):
            assert [n for n, _ in out["calls"]] == ["get_time"]


def test_tool_choice_none_with_a_schema_is_the_schema_alone(schema_server):
    """Before this change too: tool_choice "none" and a schema is the schema (no call opens)."""
    url, scripts = schema_server
    question = "Report, no tools?"
    scripts.when(question, CALL + "<|im_end|>")
    out = chat(url, question, max_tokens=60, tool_choice="none", extra_body={"max_tokens_policy": "close"})
    assert out["calls"] == [] and out["finish"] == "stop"
    jsonschema.validate(json.loads(out["content"]), REPORT)


def test_stop_has_no_effect_on_calls_or_the_answer(schema_server):
    """The whole output is constrained (calls or the schema's JSON), so `stop` cuts neither."""
    url, scripts = schema_server
    question = "Report with a stop string?"
    scripts.when(question, ANSWER + "<|im_end|>")
    for stream in (False, True):
        out = chat(url, question, stream, stop=["Oslo", "<tool_call>"])
        assert json.loads(out["content"]) == json.loads(ANSWER) and out["finish"] == "stop"
    scripts.when("Call with a stop string?", CALL + "<|im_end|>")
    out = chat(url, "Call with a stop string?", stop=["Oslo", "<tool_call>"])
    assert out["calls"] == [("get_weather", '{"city": "Oslo"}')]


def test_json_object_with_tools(schema_server):
    url, scripts = schema_server
    question = "Any JSON object?"
    scripts.when(question, '{"any": [1, 2]}<|im_end|>')
    out = chat(url, question, response_format={"type": "json_object"})
    assert json.loads(out["content"]) == {"any": [1, 2]}


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "u",
                        "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
                    },
                }
            },
            "response_format.json_schema.schema",
            "the final answer's schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "u",
                        "schema": {"type": "object", "properties": {"a": False}, "required": ["a"]},
                    },
                }
            },
            "response_format.json_schema.schema",
            "the final answer's schema",
        ),
        (
            {"response_format": None, "extra_body": {"regex": "[a-z]+"}},
            "regex",
            "cannot be combined with tools",
        ),
    ],
    ids=["unique-strings", "unsatisfiable", "regex"],
)
def test_an_answer_that_cannot_be_enforced_is_a_400_naming_the_field(schema_server, extra, param, words):
    """Never silently calls only: an answer schema the grammar cannot hold (here uniqueItems over
    strings, whose check would read the calls too, or one no value satisfies) is refused naming
    the schema; other constraints than a JSON answer still cannot be combined with tools."""
    import openai

    url, _ = schema_server
    kw = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "max_tokens": 5}
    if extra.get("response_format"):
        kw["response_format"] = extra["response_format"]
    with pytest.raises(openai.BadRequestError) as e:
        openai_client(url).chat.completions.create(**kw, extra_body=extra.get("extra_body"))
    err = e.value.body
    assert err["param"] == param and words in err["message"], err


# ---- Responses and Messages ------------------------------------------------------------------------


def test_responses_text_format_with_tools(schema_server):
    url, scripts = schema_server
    question = "Responses: weather report for Oslo?"
    scripts.when(question, CALL + "<|im_end|>")
    scripts.when("RESULT-responses", ANSWER + "<|im_end|>")
    tools = [{"type": "function", **{k: v for k, v in t["function"].items()}} for t in TOOLS]
    text = {"format": {"type": "json_schema", "name": "report", "schema": REPORT, "strict": True}}
    client = openai_client(url)
    kw = {"model": "m", "tools": tools, "text": text, "temperature": 0, "max_output_tokens": 120}
    first = client.responses.create(input=question, **kw)
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    follow = [
        {"role": "user", "content": question},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "RESULT-responses: 7 C"},
    ]
    second = client.responses.create(input=follow, **kw)
    assert [i.type for i in second.output] == ["message"]
    assert json.loads(second.output_text) == json.loads(ANSWER)
    with client.responses.stream(input=follow, **kw) as events:
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        final = events.get_final_response()
    assert deltas == final.output_text == second.output_text
    with client.responses.stream(input=question, **kw) as events:
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Oslo"}


def test_messages_output_config_format_with_tools(schema_server):
    import anthropic

    url, scripts = schema_server
    question = "Messages: weather report for Oslo?"
    scripts.when(question, CALL + "<|im_end|>")
    scripts.when("RESULT-messages", ANSWER + "<|im_end|>")
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": WEATHER_PARAMS} for t in TOOLS]
    kw = {
        "model": "m",
        "max_tokens": 120,
        "tools": tools,
        "extra_body": {
            "temperature": 0,
            "output_config": {"format": {"type": "json_schema", "schema": REPORT}},
        },
    }
    first = client.messages.create(messages=[{"role": "user", "content": question}], **kw)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Oslo"})
    follow = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "RESULT-messages: 7 C"}],
        },
    ]
    second = client.messages.create(messages=follow, **kw)
    assert second.stop_reason == "end_turn" and [b.type for b in second.content] == ["text"]
    assert json.loads(second.content[0].text) == json.loads(ANSWER)
    with client.messages.stream(messages=follow, **kw) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == second.content[0].text
    with client.messages.stream(messages=[{"role": "user", "content": question}], **kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.input) for b in streamed.content if b.type == "tool_use"] == [("tool_use", use.input)]


# ---- reasoning first ------------------------------------------------------------------------------


def test_thinking_template_reasons_first_then_calls_or_answers(schema_thinking_server):
    """Qwen3-Thinking (the prompt opens <think>): the reasoning is free text, JSON-like syntax and
    the call trigger included; then a call, or the schema's answer; an answer that violates the
    schema after the reasoning is masked."""
    url, scripts = schema_thinking_server
    thought = 'Maybe {"city": 1} or "x"; check the weather tool'
    question = "Thinking: report for Oslo?"
    scripts.when(question, f"{thought}.\n</think>\n\n{CALL}<|im_end|>")
    for stream in (False, True):
        out = chat(url, question, stream)
        assert out["reasoning"] == f"{thought}." and out["finish"] == "tool_calls", out
        assert out["calls"] == [("get_weather", '{"city": "Oslo"}')] and not out["content"]
    question = "Thinking: report for Oslo, answer now?"
    scripts.when(question, f"{thought}, no: answer.\n</think>\n\n{ANSWER}<|im_end|>")
    for stream in (False, True):
        out = chat(url, question, stream)
        assert out["reasoning"] == f"{thought}, no: answer." and out["calls"] == [], out
        assert json.loads(out["content"]) == json.loads(ANSWER) and out["finish"] == "stop"
    question = "Thinking: report for Oslo, in prose?"
    scripts.when(question, "Prose it is.\n</think>\n\nIt is 7 C in Oslo.<|im_end|>")
    out = chat(url, question, max_tokens=80, extra_body={"max_tokens_policy": "close"})
    assert out["reasoning"] == "Prose it is."
    if out["calls"]:
        valid_calls(out["calls"])
    else:
        jsonschema.validate(json.loads(out["content"]), REPORT)


HARMONY_TOKENS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
]


def test_harmony_answer_on_the_final_channel_or_a_call(default_model_dir):
    """gpt-oss (Harmony): the answer branch opens the final channel, a call the commentary channel;
    the analysis comes first."""
    from agentrt.testing import byte_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    served, scripts, front = serve(tok, "openai-gpt-oss-120b")
    front.engine.runner.stop_ids = tuple(tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>"))
    analysis = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
    try:
        with served as url:
            scripts.when(
                "Harmony report?",
                f"{analysis}<|channel|>final<|message|>{ANSWER}<|return|>",
            )
            scripts.when(
                "Harmony call?",
                f"{analysis}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Oslo"}<|call|>',
            )
            for stream in (False, True):
                out = chat(url, "Harmony report?", stream)
                assert out["reasoning"] == "Think." and json.loads(out["content"]) == json.loads(ANSWER), out
                out = chat(url, "Harmony call?", stream)
                assert out["reasoning"] == "Think." and out["calls"] == [("get_weather", '{"city": "Oslo"}')]
    finally:
        front.shutdown()
