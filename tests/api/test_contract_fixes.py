"""Contract fixes across chat completions, Responses and Messages (issue 36, item 7), over the fake
model runner with the default model's tokenizer: tool arguments keep the declared property order;
tool_choice "auto" without tools is plain text; text that max_tokens_policy "close" cut under
tools on auto reports "length" / "incomplete"; an empty cache_salt, a temperature outside 0-2,
Anthropic tool ids that repeat or answer an older turn, and Responses function_call items with
arguments that are not JSON or a repeated call_id are 400s naming the field."""

from __future__ import annotations

import json

import pytest

from agentrt.api.errors import APIError
from agentrt.api.messages import MessagesRequest, to_chat
from agentrt.api.tools import plan_tools
from agentrt.grammars.tool_calls import FORMATS
from tests.support.api import sse_chunks

pytestmark = pytest.mark.usefixtures("time_limit")

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "hi"}]


def _params(*names: str) -> dict:
    return {
        "type": "object",
        "properties": {n: {"type": "integer", "minimum": 0, "maximum": 9} for n in names},
        "required": list(names),
        "additionalProperties": False,
    }


def _tool(*names: str) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": _params(*names)}}


@pytest.fixture(scope="module")
def client(fake_client):
    return fake_client


def _error(resp, status: int = 400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


# ---- (a) tool arguments keep the declared property order ---------------------------------------


def test_tool_constraint_keeps_the_declared_property_order():
    zeta_first = plan_tools([_tool("zeta", "alpha")], "required", None, FORMATS["hermes"])
    alpha_first = plan_tools([_tool("alpha", "zeta")], "required", None, FORMATS["hermes"])
    value = json.loads(zeta_first.constraint_value())
    assert list(value["tools"][0]["parameters"]["properties"]) == ["zeta", "alpha"]
    assert value["tools"][0]["parameters"]["required"] == ["zeta", "alpha"]
    # tools that differ only in property order never share a (cached) grammar
    assert zeta_first.constraint().key != alpha_first.constraint().key
    # the same tools give the same key
    again = plan_tools([_tool("zeta", "alpha")], "required", None, FORMATS["hermes"])
    assert again.constraint().key == zeta_first.constraint().key


def test_tool_arguments_follow_the_declared_order(client):
    for names in (("zeta", "alpha"), ("alpha", "zeta")):  # the second must not reuse the first's grammar
        body = {
            "model": MODEL,
            "messages": ASK,
            "tools": [_tool(*names)],
            "tool_choice": "required",
            "temperature": 0,
            "max_tokens": 40,
        }
        resp = client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        (call,) = resp.json()["choices"][0]["message"]["tool_calls"]
        assert list(json.loads(call["function"]["arguments"])) == list(names), call


# ---- (b) tool_choice "auto" without tools is plain text -----------------------------------------


def test_auto_without_tools_is_plain_text(client):
    for tools in ([], None):
        extra = {} if tools is None else {"tools": tools}
        resp = client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": ASK, "tool_choice": "auto", "max_tokens": 4, **extra},
        )
        assert resp.status_code == 200, resp.text
        assert "tool_calls" not in resp.json()["choices"][0]["message"]
        resp = client.post(
            "/v1/messages",
            json={"model": MODEL, "messages": ASK, "tool_choice": {"type": "auto"}, "max_tokens": 4, **extra},
        )
        assert resp.status_code == 200, resp.text
        assert [b["type"] for b in resp.json()["content"]] == ["text"]
    # a Responses object echoes tools: [] and tool_choice: "auto": replaying them is plain text
    first = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4})
    assert first.status_code == 200, first.text
    echo = first.json()
    assert (echo["tools"], echo["tool_choice"]) == ([], "auto")
    replay = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    resp = client.post(
        "/v1/responses", json={**replay, "tools": echo["tools"], "tool_choice": echo["tool_choice"]}
    )
    assert resp.status_code == 200, resp.text
    assert [i["type"] for i in resp.json()["output"]] == ["message"]


def test_required_or_named_tool_choice_without_tools_is_a_400(client):
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("required", named):
        for tools in ([], None):
            extra = {} if tools is None else {"tools": tools}
            body = {"model": MODEL, "messages": ASK, "tool_choice": choice, **extra}
            assert _error(client.post("/v1/chat/completions", json=body))["param"] == "tool_choice"
    for choice in ("required", {"type": "function", "name": "f"}):
        body = {"model": MODEL, "input": "hi", "tools": [], "tool_choice": choice}
        assert _error(client.post("/v1/responses", json=body))["param"] == "tool_choice"
    for choice in ({"type": "any"}, {"type": "tool", "name": "f"}):
        body = {"model": MODEL, "max_tokens": 4, "messages": ASK, "tool_choice": choice}
        resp = client.post("/v1/messages", json=body)
        assert resp.status_code == 400 and resp.json()["type"] == "error", resp.text
        assert "tool_choice needs tools" in resp.json()["error"]["message"]


# ---- (c) text cut by max_tokens_policy "close" under tools on auto is "length" ------------------


def _cut_body(tools: bool, **extra) -> dict:
    body = {"model": MODEL, "temperature": 0, "max_tokens_policy": "close", **extra}
    if tools:
        body |= {"tools": [_tool("zeta", "alpha")], "tool_choice": "auto"}
    return body


@pytest.mark.parametrize("tools", [True, False])
def test_text_cut_by_the_close_policy_is_length_on_chat(client, tools):
    body = _cut_body(tools, messages=ASK, max_tokens=8)
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert (choice["finish_reason"], choice["agentrt_closed_by_budget"]) == ("length", False), choice
    assert "tool_calls" not in choice["message"]
    finishes = [
        (c["choices"][0]["finish_reason"], c["choices"][0].get("agentrt_closed_by_budget"))
        for c in sse_chunks(client, {**body, "stream": True})
        if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert finishes == [("length", False)]


@pytest.mark.parametrize("tools", [True, False])
def test_text_cut_by_the_close_policy_is_incomplete_on_responses(client, tools):
    body = _cut_body(tools, input="hi", max_output_tokens=8)
    if tools:
        body["tools"] = [{"type": "function", "name": "f", "parameters": _params("zeta", "alpha")}]
    resp = client.post("/v1/responses", json=body).json()
    assert (resp["status"], resp["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert [(i["type"], i["status"]) for i in resp["output"]] == [("message", "incomplete")]
    events = list(sse_chunks(client, {**body, "stream": True}, url="/v1/responses"))
    final = events[-1]
    assert final["type"] == "response.incomplete", final
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_call_closed_by_the_budget_is_still_a_tool_call(client):
    # unbounded integers: the fake model writes digits until the budget closes the call
    tool = {"type": "function", "function": {"name": "f", "parameters": _params("zeta", "alpha")}}
    for prop in tool["function"]["parameters"]["properties"].values():
        prop.pop("minimum"), prop.pop("maximum")
    body = _cut_body(True, messages=ASK, max_tokens=40) | {"tools": [tool], "tool_choice": "required"}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert (choice["finish_reason"], choice["agentrt_closed_by_budget"]) == ("tool_calls", True), choice
    (call,) = choice["message"]["tool_calls"]
    assert list(json.loads(call["function"]["arguments"])) == ["zeta", "alpha"]


@pytest.mark.parametrize(
    "text, finish",
    [
        ("Sure, let me", "length"),  # free text only
        ('<tool_call>\n{"name": "f", "arguments": {"zeta": 1, "alpha": 2}}\n</tool_call>', "tool_calls"),
        ('<tool_call>\n{"name": "f", "arguments": {"zeta": 1, "alpha": 2}}\n</tool_call>\n ', "tool_calls"),
        ('<tool_call>\n{"name": "f", "arguments": {"zeta": 1, "alpha": 2}}\n</tool_call>\nNow I', "length"),
        ("Let me check <tool_", "length"),  # a marker cut short is dropped, as under "length"
    ],
)
def test_parser_reports_text_the_budget_cut_as_length(text, finish):
    plan = plan_tools([_tool("zeta", "alpha")], "auto", None, FORMATS["hermes"])
    parser = plan.new_parser()
    parser.feed(text)
    assert parser.close("stop", closed_by_budget=True)[1] == finish
    assert "<tool_" not in parser.content
    closed = plan.new_parser()
    closed.feed(text)
    assert closed.close("stop")[1] == ("tool_calls" if closed.calls else "stop")  # the model's own stop


# ---- (d) an empty cache_salt is refused --------------------------------------------------------


def test_empty_cache_salt_is_a_400(client):
    for url, body in (
        ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ):
        err = _error(client.post(url, json={"model": MODEL, "cache_salt": "", **body}))
        assert err["param"] == "cache_salt" and "cache_salt" in err["message"], err
        # a lone surrogate (valid JSON, not UTF-8 text): a 400 for this request, nothing else fails
        raw = json.dumps({"model": MODEL, "cache_salt": "SALT", **body}).replace('"SALT"', '"\\ud800"')
        err = _error(client.post(url, content=raw, headers={"content-type": "application/json"}))
        assert err["param"] == "cache_salt" and "surrogate" in err["message"], err
        ok = client.post(url, json={"model": MODEL, "cache_salt": "tenant-a", **body})
        assert ok.status_code == 200, ok.text


# ---- (e) leniencies closed -----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [2.5, -0.5])
def test_temperature_outside_openai_range_is_a_400(client, temperature):
    for url, body in (
        ("/v1/chat/completions", {"messages": ASK}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ):
        err = _error(client.post(url, json={"model": MODEL, "temperature": temperature, **body}))
        assert err["param"] == "temperature" and "between 0 and 2" in err["message"], err


def test_temperature_two_is_accepted(client):
    body = {"model": MODEL, "messages": ASK, "temperature": 2, "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def _use(tid: str) -> dict:
    return {"type": "tool_use", "id": tid, "name": "f", "input": {}}


def _result(tid: str) -> dict:
    return {"type": "tool_result", "tool_use_id": tid, "content": "1"}


TURNS_OK = [
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": [_use("t1"), _use("t2")]},
    {"role": "user", "content": [_result("t1"), _result("t2")]},
    {"role": "assistant", "content": [_use("t3")]},
    {"role": "user", "content": [_result("t3"), {"type": "text", "text": "thanks"}]},
]


def test_messages_tool_results_answer_the_turn_before(client):
    chat, _ = to_chat(MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": TURNS_OK}))
    assert [m.tool_call_id for m in chat.messages if m.role == "tool"] == ["t1", "t2", "t3"]


@pytest.mark.parametrize(
    "turns, param",
    [
        (  # a tool_use id given twice in one turn
            [
                ASK[0],
                {"role": "assistant", "content": [_use("t1"), _use("t1")]},
                {"role": "user", "content": "x"},
            ],
            "messages[1].content[1].id",
        ),
        (  # ... or in a later turn
            [*TURNS_OK[:3], {"role": "assistant", "content": [_use("t2")]}, {"role": "user", "content": "x"}],
            "messages[3].content[0].id",
        ),
        (  # a tool_result answering a tool_use two turns back
            [*TURNS_OK[:4], {"role": "user", "content": [_result("t1")]}],
            "messages[4].content[0].tool_use_id",
        ),
        (  # the same tool_use answered twice
            [*TURNS_OK[:2], {"role": "user", "content": [_result("t1"), _result("t1")]}],
            "messages[2].content[1].tool_use_id",
        ),
        (  # an id no tool_use gave
            [*TURNS_OK[:2], {"role": "user", "content": [_result("t9")]}],
            "messages[2].content[0].tool_use_id",
        ),
    ],
)
def test_messages_refuse_repeated_or_stale_tool_ids(client, turns, param):
    with pytest.raises(APIError) as e:
        to_chat(MessagesRequest.model_validate({"model": MODEL, "max_tokens": 4, "messages": turns}))
    assert (e.value.status, e.value.param) == (400, param) and param in e.value.message
    resp = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": turns})
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert param in body["error"]["message"]


def _call(call_id: str, arguments: str = "{}") -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": arguments}


@pytest.mark.parametrize(
    "items, param",
    [
        ([_call("c1", "{not json")], "input[1].arguments"),
        ([_call("c1", "[1, 2]")], "input[1].arguments"),  # arguments are an object
        ([_call("c1", '{"a": NaN}')], "input[1].arguments"),  # NaN / Infinity are not JSON
        ([_call("c1", '{"a": -Infinity}')], "input[1].arguments"),
        ([_call("c1"), _call("c1")], "input[2].call_id"),
        (
            [_call("c1"), {"type": "function_call_output", "call_id": "c1", "output": "1"}, _call("c1")],
            "input[3].call_id",
        ),
    ],
)
def test_responses_refuse_bad_arguments_and_repeated_call_ids(client, items, param):
    body = {
        "model": MODEL,
        "input": [{"role": "user", "content": "hi"}, *items],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "max_output_tokens": 4,
    }
    err = _error(client.post("/v1/responses", json=body))
    assert err["param"] == param and err["message"].startswith(param), err


def test_responses_accept_json_arguments_and_empty_ones(client):
    items = [
        {"role": "user", "content": "hi"},
        _call("c1", '{"a": 1}'),
        _call("c2", ""),
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "function_call_output", "call_id": "c2", "output": "2"},
    ]
    body = {
        "model": MODEL,
        "input": items,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "max_output_tokens": 4,
    }
    resp = client.post("/v1/responses", json=body)
    assert resp.status_code == 200, resp.text
