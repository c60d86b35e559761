"""A reasoning model through the Responses and Messages APIs: the default model served with
Qwen3-4B-Thinking-2507's real chat template (`thinking_client`, tests/api/conftest.py), through the
official `openai` and `anthropic` clients. Responses: `reasoning.effort` / `thinking_token_budget`
bound the reasoning, which comes back as a `reasoning` item (reasoning_text content) before the
answer's items, streamed as reasoning_text events; reasoning items of earlier turns are accepted.
Messages: `thinking` maps onto the budget, the reasoning comes back as `thinking` blocks, streamed
as thinking_delta + signature_delta. Both: streamed equals non-streamed, budget 0 / disabled
gives no reasoning, bad values are 400s naming the field, a model that does not reason is
unchanged. Anthropic's least budget (1024 tokens) is too slow for the real model on a CPU, so
enabled thinking with a budget runs on the scripted fake model (FakeModelRunner.script) under the
same template."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from anthropic.types import TextBlock, ThinkingBlock
from openai.types.responses import ResponseReasoningItem

from tests.support.paths import shared_path

MODEL = "smollm2-135m-instruct"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "country": {"type": "string", "minLength": 1, "maxLength": 20},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
QUESTION = "What is the largest city of France? Answer in JSON."
TEXT_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
OUTPUT_FORMAT = {"format": {"type": "json_schema", "schema": CITY}}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def _oai(http) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)


def _claude(http) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="none", http_client=http, max_retries=0)


def _blocks(message) -> list[dict]:
    """A Message's content blocks as dicts (the stream helper's parsed blocks and the plain ones
    alike)."""
    return [b.model_dump(exclude={"parsed_output", "citations"}) for b in message.content]


def _without_ids(value):
    """`value` without its generated ids (and the stream helper's `parsed`)."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in ("id", "parsed")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


# ---- Responses ------------------------------------------------------------------------------------
BUDGETED = {
    "model": MODEL,
    "input": QUESTION,
    "text": TEXT_FORMAT,
    "temperature": 0,
    "max_output_tokens": 200,
    "extra_body": {"thinking_token_budget": 24},
}


@pytest.fixture(scope="module")
def budgeted(thinking_client):
    """The non-streamed response to BUDGETED (reasoning of 24 tokens, then a json_schema answer)."""
    return _oai(thinking_client).responses.create(**BUDGETED)


def test_responses_reasoning_item_before_the_answer(budgeted):
    resp = budgeted
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    item = resp.output[0]
    assert isinstance(item, ResponseReasoningItem) and item.id.startswith("rs_")
    assert item.summary == [] and item.status == "completed"
    (part,) = item.content
    assert part.type == "reasoning_text" and "Time to answer." in part.text
    assert "</think>" not in part.text + resp.output_text
    jsonschema.validate(json.loads(resp.output_text), CITY)
    assert resp.status == "completed" and resp.reasoning.effort is None
    details = resp.usage.output_tokens_details
    assert 24 <= details.reasoning_tokens < resp.usage.output_tokens


def test_responses_stream_equals_the_response(thinking_client, budgeted):
    with _oai(thinking_client).responses.stream(**BUDGETED) as stream:
        events = list(stream)
        final = stream.get_final_response()
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == budgeted.output[0].content[0].text
    assert text == budgeted.output_text == final.output_text
    assert _without_ids(final.model_dump()["output"]) == _without_ids(budgeted.model_dump()["output"])
    assert (
        final.usage.output_tokens_details.reasoning_tokens
        == budgeted.usage.output_tokens_details.reasoning_tokens
    )
    # the reasoning item's events, as OpenAI streams a reasoning_text part
    kinds = [e.type for e in events if getattr(e, "output_index", None) == 0]
    deltas = kinds.count("response.reasoning_text.delta")
    assert deltas > 1
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning_text.delta"] * deltas,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    added, done = events[2], next(e for e in events if e.type == "response.reasoning_text.done")
    assert added.item.type == "reasoning" and added.item.status == "in_progress"
    assert done.text == reasoning and done.item_id == added.item.id and done.content_index == 0


def test_responses_effort_without_a_budget_and_the_close_policy(thinking_client):
    """effort "high" sets no budget: the model reasons until max_tokens_policy "close" needs the
    rest of max_output_tokens for the answer; summary is accepted (no summary is written)."""
    resp = _oai(thinking_client).responses.create(
        model=MODEL,
        input=QUESTION,
        text=TEXT_FORMAT,
        temperature=0,
        max_output_tokens=48,
        reasoning={"effort": "high", "summary": "auto"},
        extra_body={"max_tokens_policy": "close"},
    )
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].summary == [] and resp.output[0].content[0].text
    jsonschema.validate(json.loads(resp.output_text), CITY)
    assert resp.reasoning.effort == "high" and resp.reasoning.summary == "auto"
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens < resp.usage.output_tokens <= 48


@pytest.mark.parametrize(
    "extra",
    [
        {"reasoning": {"effort": "none"}},
        {"reasoning": {"effort": "minimal"}},
        {"extra_body": {"thinking_token_budget": 0}},
    ],
)
def test_responses_no_reasoning_at_budget_zero(thinking_client, extra):
    resp = _oai(thinking_client).responses.create(
        model=MODEL, input=QUESTION, text=TEXT_FORMAT, temperature=0, max_output_tokens=60, **extra
    )
    assert [item.type for item in resp.output] == ["message"]
    jsonschema.validate(json.loads(resp.output_text), CITY)
    assert resp.usage.output_tokens_details.reasoning_tokens == 0


def test_responses_tool_call_after_reasoning_and_its_items_sent_back(thinking_client):
    """A forced call after the reasoning; the whole output (reasoning item included) sent back as
    input with the call's output is accepted, and the reasoning item is not rendered."""
    client = _oai(thinking_client)
    common = {
        "model": MODEL,
        "temperature": 0,
        "tools": [WEATHER],
        "extra_body": {"thinking_token_budget": 12},
    }
    first = client.responses.create(input="What's the weather in Hanoi?", tool_choice="required", **common)
    assert [item.type for item in first.output] == ["reasoning", "function_call"], first.output
    call = first.output[1]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    history = [{"role": "user", "content": "What's the weather in Hanoi?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 31 C"})
    second = client.responses.create(input=history, tool_choice="none", max_output_tokens=40, **common)
    assert second.output[0].type == "reasoning" and second.output[-1].type == "message"
    assert second.usage.output_tokens_details.reasoning_tokens > 0


def test_reasoning_items_in_input_go_to_the_next_assistant_turn():
    from agentrt.api.responses import ResponsesRequest, to_chat_request

    previous = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "SECRET THOUGHT"}],
        "status": "completed",
    }
    items = [
        {"role": "user", "content": "hi"},
        previous,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "user", "content": "again"},
    ]
    body = {"model": MODEL, "input": items, "reasoning": {"effort": "low"}}
    chat, _ = to_chat_request(ResponsesRequest.model_validate(body), MODEL, reasons=True)
    assert [m.role for m in chat.messages] == ["user", "assistant", "user"]
    # the template keeps or drops it (Qwen3 drops it before the last user turn: test_reasoning_edges.py)
    assert chat.messages[1].as_dict()["reasoning_content"] == "SECRET THOUGHT"
    assert chat.reasoning_effort == "low"
    high, _ = to_chat_request(
        ResponsesRequest.model_validate({**body, "reasoning": {"effort": "xhigh"}}), MODEL, True
    )
    assert high.reasoning_effort == "high"


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
        ({"reasoning": {"effort": "low", "budget": 5}}, "reasoning.budget"),
        ({"reasoning": "high"}, "reasoning"),
        ({"reasoning": {"effort": "low"}, "thinking_token_budget": 8}, "reasoning.effort"),
        ({"thinking_token_budget": -1}, "thinking_token_budget"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"input": [{"type": "reasoning", "summary": "x"}]}, "input[0].summary"),
        (
            {"input": [{"type": "reasoning", "content": [{"type": "text", "text": "x"}]}]},
            "input[0].content[0]",
        ),
    ],
)
def test_responses_bad_reasoning_values_are_400s(thinking_client, extra, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    r = thinking_client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert param.split("[")[0] in error["message"]


def test_responses_on_a_model_that_does_not_reason(client):
    """The plain default model (no reasoning format): no reasoning item, reasoning_tokens 0;
    reasoning asked of it is a 400, effort "none" and a summary are accepted."""
    oai = _oai(client)
    resp = oai.responses.create(
        model=MODEL,
        input=QUESTION,
        text=TEXT_FORMAT,
        temperature=0,
        max_output_tokens=60,
        reasoning={"effort": "none", "summary": "concise"},
    )
    assert [item.type for item in resp.output] == ["message"]
    jsonschema.validate(json.loads(resp.output_text), CITY)
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    # passed through as on chat, where a model that does not reason refuses a budget above 0
    short = oai.responses.create(
        model=MODEL, input="hi", max_output_tokens=2, extra_body={"thinking_token_budget": 0}
    )
    assert [item.type for item in short.output] == ["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", extra_body={"thinking_token_budget": 8})
    assert e.value.body["param"] == "thinking_token_budget"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="hi", reasoning={"effort": "low"})
    assert e.value.body["param"] == "reasoning" and "no reasoning mode" in e.value.body["message"]


# ---- Messages -------------------------------------------------------------------------------------
ASK = [{"role": "user", "content": QUESTION}]


def test_messages_thinking_block_cut_by_max_tokens_and_its_stream(thinking_client):
    """Adaptive thinking (no budget) cut by max_tokens: one thinking block (signature ""),
    stop_reason max_tokens; the stream (thinking_delta, then an empty signature_delta before
    content_block_stop) gives the same message."""
    claude = _claude(thinking_client)
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    kwargs = {"model": MODEL, "max_tokens": 24, "messages": story, "thinking": {"type": "adaptive"}}
    resp = claude.messages.create(**kwargs, extra_body={"temperature": 0})
    (block,) = resp.content
    assert isinstance(block, ThinkingBlock) and block.thinking and block.signature == ""
    assert resp.stop_reason == "max_tokens" and resp.usage.output_tokens == 24
    with claude.messages.stream(**kwargs, extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(resp) and final.stop_reason == resp.stop_reason
    assert final.usage.output_tokens == resp.usage.output_tokens
    raw = [e for e in events if e.type.startswith("content_block")]
    assert raw[0].type == "content_block_start" and raw[0].content_block.type == "thinking"
    deltas = [e.delta for e in raw if e.type == "content_block_delta"]
    assert [d.type for d in deltas] == ["thinking_delta"] * (len(deltas) - 1) + ["signature_delta"]
    assert deltas[-1].signature == "" and raw[-1].type == "content_block_stop"
    assert "".join(d.thinking for d in deltas[:-1]) == block.thinking


def test_messages_disabled_thinking_answers_at_once(thinking_client):
    resp = _claude(thinking_client).messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0, "output_config": OUTPUT_FORMAT},
    )
    assert [b.type for b in resp.content] == ["text"] and resp.stop_reason == "end_turn"
    jsonschema.validate(json.loads(resp.content[0].text), CITY)


def test_messages_display_omitted_keeps_the_block_without_its_text(thinking_client):
    resp = _claude(thinking_client).messages.create(
        model=MODEL,
        max_tokens=8,
        messages=ASK,
        thinking={"type": "adaptive", "display": "omitted"},
        extra_body={"temperature": 0},
    )
    assert [(b.type, b.thinking, b.signature) for b in resp.content] == [("thinking", "", "")]


@pytest.mark.parametrize(
    "thinking,max_tokens,param",
    [
        ({"type": "enabled", "budget_tokens": 1023}, 2000, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": 1024}, 1024, "thinking.budget_tokens"),
        ({"type": "enabled"}, 2000, "thinking.budget_tokens"),
        ({"type": "enabled", "budget_tokens": "1024"}, 2000, "thinking.budget_tokens"),
        ({"type": "sometimes"}, 2000, "thinking.type"),
        ({"type": "adaptive", "display": "full"}, 2000, "thinking.display"),
        ({"type": "disabled", "budget_tokens": 1024}, 2000, "thinking.budget_tokens"),
    ],
)
def test_messages_bad_thinking_is_a_400_naming_the_field(thinking_client, thinking, max_tokens, param):
    with pytest.raises(anthropic.BadRequestError) as e:
        _claude(thinking_client).messages.create(
            model=MODEL, max_tokens=max_tokens, messages=ASK, thinking=thinking
        )
    assert e.value.body["error"]["message"].startswith(param), e.value.body


def test_messages_thinking_blocks_of_earlier_turns_go_to_the_template():
    from agentrt.api.messages import MessagesRequest, to_chat

    turns = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "SECRET THOUGHT", "signature": ""},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "hello"},
            ],
        },
        {"role": "user", "content": "again"},
    ]
    body = {
        "model": MODEL,
        "max_tokens": 2048,
        "messages": turns,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    chat, _ = to_chat(MessagesRequest.model_validate(body), reasons=True)
    assert [m.role for m in chat.messages] == ["user", "assistant", "user"]
    assert chat.messages[1].as_dict()["reasoning_content"] == "SECRET THOUGHT"  # not the redacted data
    assert "opaque" not in json.dumps([m.as_dict() for m in chat.messages])
    assert chat.thinking_token_budget == 1024
    disabled, _ = to_chat(MessagesRequest.model_validate({**body, "thinking": {"type": "disabled"}}))
    assert disabled.thinking_token_budget == 0
    misplaced = [{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}]
    with pytest.raises(
        Exception, match=r"messages\[0\]\.content\[0\]: thinking blocks belong in assistant turns"
    ):
        to_chat(MessagesRequest.model_validate({**body, "messages": misplaced}), reasons=True)


def test_messages_on_a_model_that_does_not_reason(client):
    """The plain default model: no thinking block; disabled thinking and earlier thinking blocks are
    accepted; enabled thinking is refused (test_messages.py)."""
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "hello"},
            ],
        },
        {"role": "user", "content": QUESTION},
    ]
    resp = _claude(client).messages.create(
        model=MODEL,
        max_tokens=60,
        messages=history,
        thinking={"type": "disabled"},
        extra_body={"temperature": 0, "output_config": OUTPUT_FORMAT},
    )
    assert [type(b) for b in resp.content] == [TextBlock]
    jsonschema.validate(json.loads(resp.content[0].text), CITY)


# ---- enabled thinking with Anthropic's budgets, on the scripted fake model ------------------------
THOUGHT = "The user asks for the largest city of France. That is Paris."
ANSWER = '{"city": "Paris", "country": "France"}'


@pytest.fixture(scope="module")
def scripted():
    """(TestClient, runner) of the fake model under Qwen3-4B-Thinking-2507's template."""
    from fastapi.testclient import TestClient

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.testing import fake_engine

    engine = fake_engine(max_model_len=4096, num_kv_slots=16384)
    engine.tokenizer.chat_template = shared_path("chat_templates", "Qwen3-4B-Thinking-2507.jinja").read_text()
    front = AsyncEngine(engine=engine)
    with TestClient(create_app(front, "fake")) as c:
        yield c, engine.runner
    front.shutdown()


def _script(scripted, messages: list[dict], text: str, tools: list[dict] | None = None) -> None:
    """Make the fake model write `text` after the prompt of `messages` (and chat `tools`)."""
    c, runner = scripted
    body = {"model": "fake", "messages": messages, "tools": tools}
    runner.script(c.post("/tokenize", json=body).json()["tokens"], text)


def test_messages_enabled_thinking_then_a_valid_answer(scripted):
    c, _ = scripted
    question = [{"role": "user", "content": "Largest city of France, in JSON?"}]
    _script(scripted, question, f"{THOUGHT}\n</think>\n\n{ANSWER}<|im_end|>")
    kwargs = {
        "model": "fake",
        "max_tokens": 2048,
        "messages": question,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    claude = _claude(c)
    resp = claude.messages.create(**kwargs, extra_body={"temperature": 0, "output_config": OUTPUT_FORMAT})
    assert [type(b) for b in resp.content] == [ThinkingBlock, TextBlock], resp.content
    assert resp.content[0].thinking == THOUGHT and resp.content[0].signature == ""
    assert json.loads(resp.content[1].text) == json.loads(ANSWER) and resp.stop_reason == "end_turn"
    with claude.messages.stream(
        **kwargs, extra_body={"temperature": 0, "output_config": OUTPUT_FORMAT}
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(resp)
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = "".join(
        e.delta.thinking
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    text = "".join(
        e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert (thinking, text) == (resp.content[0].thinking, resp.content[1].text)


def test_messages_thinking_then_a_tool_use(scripted):
    c, _ = scripted
    question = [{"role": "user", "content": "Weather in Hanoi?"}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Hanoi"}}\n</tool_call><|im_end|>'
    tool = {"name": "get_weather", "input_schema": WEATHER["parameters"]}
    chat_tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}
    _script(scripted, question, f"I should call the tool.\n</think>\n\n{call}", tools=[chat_tool])
    resp = _claude(c).messages.create(
        model="fake",
        max_tokens=2048,
        messages=question,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    )
    assert [b.type for b in resp.content] == ["thinking", "tool_use"], resp.content
    assert resp.content[0].thinking == "I should call the tool."
    assert resp.content[1].input == {"city": "Hanoi"} and resp.stop_reason == "tool_use"


# ---- the items and blocks built from model text, at every chunking (no model) ---------------------
MODEL_TEXT = (
    "Let me see: a <tool_call without its > stays reasoning here.\n</think>\n\nChecking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Hue"}}\n</tool_call>'
)


def _parser():
    from agentrt.api.output_text import OutputParser
    from agentrt.api.tools import plan_tools
    from agentrt.grammars.reasoning import FORMATS
    from agentrt.grammars.tool_calls import FORMATS as TOOL_FORMATS

    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}
    return OutputParser((FORMATS["think"], "open"), plan_tools([tool], "auto", True, TOOL_FORMATS["hermes"]))


@pytest.mark.parametrize("size", [1, 3, 7, len(MODEL_TEXT)])
def test_responses_items_from_reasoning_text_whatever_the_chunking(size):
    from agentrt.api.responses.shape import _Output

    out = _Output(_parser())
    chunks = [MODEL_TEXT[i : i + size] for i in range(0, len(MODEL_TEXT), size)]
    events = [e for c in chunks for e in out.feed(c)] + out.finish("stop")
    assert [(i["type"], i["status"]) for i in out.items] == [
        ("reasoning", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
    ]
    reasoning = out.items[0]
    assert reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert reasoning["content"] == [
        {"type": "reasoning_text", "text": "Let me see: a <tool_call without its > stays reasoning here."}
    ]
    assert out.items[1]["content"][0]["text"] == "Checking.\n"
    delta = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert delta == reasoning["content"][0]["text"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == out.items


def test_responses_output_cut_inside_the_reasoning_is_one_incomplete_item():
    from agentrt.api.responses.shape import _Output

    out = _Output(_parser())
    out.feed("Still thinking about")
    out.finish("length")
    assert [(i["type"], i["status"]) for i in out.items] == [("reasoning", "incomplete")]
    ended = _Output(_parser())  # ended (end of sequence) inside the reasoning: an empty answer follows
    ended.feed("Done thinking.")
    ended.finish("stop")
    assert [(i["type"], i["status"]) for i in ended.items] == [
        ("reasoning", "completed"),
        ("message", "completed"),
    ]


@pytest.mark.parametrize("size", [1, 5, len(MODEL_TEXT)])
def test_messages_blocks_from_reasoning_text_whatever_the_chunking(size):
    from agentrt.api.messages.shape import _Content

    content = _Content(_parser())
    chunks = [MODEL_TEXT[i : i + size] for i in range(0, len(MODEL_TEXT), size)]
    events = [e for c in chunks for e in content.feed(c)]
    closing, finish = content.close("stop")
    events += closing
    blocks = content.final_blocks()
    assert finish == "tool_calls"
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0] == {
        "type": "thinking",
        "thinking": "Let me see: a <tool_call without its > stays reasoning here.",
        "signature": "",
    }
    assert blocks[2]["input"] == {"city": "Hue"}
    data = [json.loads(e.split("data: ", 1)[1]) for e in events]
    thinking = [d["delta"] for d in data if d["type"] == "content_block_delta" and d["index"] == 0]
    assert "".join(d["thinking"] for d in thinking[:-1]) == blocks[0]["thinking"]
    assert thinking[-1] == {"type": "signature_delta", "signature": ""}
    stops = [d["index"] for d in data if d["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]
