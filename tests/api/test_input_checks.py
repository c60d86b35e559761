"""Every input checked the same way on every API (issue 51 item 6), through HTTP on the fake model
runner: each finding of an adversarial run against chat completions, Responses and Messages, on
each API where the field exists. Errors name fields in one style (`messages[1].role`), quote a
client's value cut short, and a body that is not JSON says why (not UTF-8 at an offset, nested
past the limit, an integer past Python's digit limit)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrt.api.errors import ECHO_MAX_CHARS
from agentrt.api.json_body import MAX_JSON_DEPTH, json_depth

pytestmark = pytest.mark.usefixtures("time_limit")

MODEL = "smollm2-135m-instruct"
CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
HI = [{"role": "user", "content": "hi"}]
CHAT_BODY = {"model": MODEL, "messages": HI, "max_tokens": 2}
RESPONSES_BODY = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
MESSAGES_BODY = {"model": MODEL, "messages": HI, "max_tokens": 2}
BASE = {CHAT: CHAT_BODY, RESPONSES: RESPONSES_BODY, MESSAGES: MESSAGES_BODY}
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.fixture(scope="module")
def client(fake_client):
    return fake_client


def _error(resp, status: int = 400) -> tuple[str, str | None]:
    """(message, param) of an error answer: OpenAI's shape, or Anthropic's (no param) on Messages."""
    assert resp.status_code == status, resp.text[:500]
    body = resp.json()
    if body.get("type") == "error":
        assert body["error"]["type"] == "invalid_request_error" or status != 400, body
        return body["error"]["message"], None
    return body["error"]["message"], body["error"]["param"]


def _post_raw(client, path: str, text: str | bytes):
    data = text.encode() if isinstance(text, str) else text
    return client.post(path, content=data, headers={"content-type": "application/json"})


def _names(resp, param: str, status: int = 400) -> str:
    """The error's message, once it names `param` (as its param, or in its text on Messages)."""
    message, got = _error(resp, status)
    assert (got == param) if got is not None else (param in message), (param, got, message)
    return message


# ---- Responses checks the sampling extensions chat checks ----------------------------------------

EXTENSIONS = [
    ("logit_bias", {"x": 1}, "logit_bias", "token ids"),
    ("logit_bias", {"99999999": 1}, "logit_bias", "outside the vocabulary"),
    ("stop_token_ids", ["a"], "stop_token_ids[0]", "integer"),
    ("stop_token_ids", [99999999], "stop_token_ids", "outside the vocabulary"),
    ("ignore_eos", "yes", "ignore_eos", "boolean"),
]


@pytest.mark.parametrize("field, value, param, why", EXTENSIONS, ids=lambda v: str(v)[:20])
def test_responses_checks_sampling_extensions_as_chat_does(client, field, value, param, why):
    for path in (CHAT, RESPONSES):
        assert why in _names(client.post(path, json={**BASE[path], field: value}), param)
    # not a Messages field: refused by name there
    _names(client.post(MESSAGES, json={**MESSAGES_BODY, field: value}), field)


def test_responses_passes_valid_extensions_through_and_refuses_n(client):
    for field, value in (("ignore_eos", True), ("stop_token_ids", [5]), ("logit_bias", {"5": 1.0})):
        for path in (CHAT, RESPONSES):
            assert client.post(path, json={**BASE[path], field: value}).status_code == 200
    chat = client.post(CHAT, json={**CHAT_BODY, "n": 2})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 2
    assert "one output" in _names(client.post(RESPONSES, json={**RESPONSES_BODY, "n": 2}), "n")
    assert client.post(RESPONSES, json={**RESPONSES_BODY, "n": 1}).status_code == 200
    _names(client.post(MESSAGES, json={**MESSAGES_BODY, "n": 2}), "n")
    # chat's names for what Responses names otherwise are refused with the name to use
    message = _names(client.post(RESPONSES, json={**RESPONSES_BODY, "max_tokens": 5}), "max_tokens")
    assert "max_output_tokens" in message


# ---- a call is answered at most once, on every API -----------------------------------------------


def _chat_call(cid: str, arguments: str = "{}") -> dict:
    return {"id": cid, "type": "function", "function": {"name": "f", "arguments": arguments}}


def _chat_turns(*extra: dict) -> list[dict]:
    return [*HI, {"role": "assistant", "content": None, "tool_calls": [_chat_call("c1")]}, *extra]


def _fc(cid: str, arguments: str = "{}") -> dict:
    return {"type": "function_call", "call_id": cid, "name": "f", "arguments": arguments}


def _fco(cid: str) -> dict:
    return {"type": "function_call_output", "call_id": cid, "output": "1"}


def _use(tid: str, **extra) -> dict:
    return {"type": "tool_use", "id": tid, "name": "f", "input": {}, **extra}


def _result(tid: str) -> dict:
    return {"type": "tool_result", "tool_use_id": tid, "content": "1"}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOLS = {
    CHAT: [TOOL],
    RESPONSES: [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    MESSAGES: [{"name": "f", "input_schema": {"type": "object"}}],
}
ANSWERED = {
    "twice": {
        CHAT: (
            _chat_turns(
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
            ),
            "messages[3].tool_call_id",
        ),
        RESPONSES: ([*HI, _fc("c1"), _fco("c1"), _fco("c1")], "input[3].call_id"),
        MESSAGES: (
            [
                *HI,
                {"role": "assistant", "content": [_use("t1")]},
                {"role": "user", "content": [_result("t1"), _result("t1")]},
            ],
            "messages[2].content[1].tool_use_id",
        ),
    },
    "turns later": {
        CHAT: (
            _chat_turns(
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "more"},
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
            ),
            "messages[5].tool_call_id",
        ),
        RESPONSES: (
            [
                *HI,
                _fc("c1"),
                _fco("c1"),
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "more"},
                _fco("c1"),
            ],
            "input[5].call_id",
        ),
        MESSAGES: (
            [
                *HI,
                {"role": "assistant", "content": [_use("t1")]},
                {"role": "user", "content": [_result("t1")]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [_result("t1")]},
            ],
            "messages[4].content[0].tool_use_id",
        ),
    },
}


def _with_turns(path: str, turns: list) -> dict:
    key = "input" if path == RESPONSES else "messages"
    return {**BASE[path], key: turns, "tools": TOOLS[path]}


@pytest.mark.parametrize("case", ANSWERED)
def test_a_call_answered_twice_or_again_later_is_refused(client, case):
    for path, (turns, param) in ANSWERED[case].items():
        _names(client.post(path, json=_with_turns(path, turns)), param)
    # one answer each is fine
    ok = {
        CHAT: _chat_turns({"role": "tool", "tool_call_id": "c1", "content": "1"}),
        RESPONSES: [*HI, _fc("c1"), _fco("c1")],
        MESSAGES: [
            *HI,
            {"role": "assistant", "content": [_use("t1")]},
            {"role": "user", "content": [_result("t1")]},
        ],
    }
    for path, turns in ok.items():
        assert client.post(path, json=_with_turns(path, turns)).status_code == 200, path


# ---- assistant calls are checked on every API (chat's tool_calls were not) -----------------------

CALLS = {
    "duplicate ids": {
        CHAT: (
            [
                *HI,
                {"role": "assistant", "tool_calls": [_chat_call("a"), _chat_call("a")]},
                {"role": "tool", "tool_call_id": "a", "content": "1"},
            ],
            "messages[1].tool_calls[1].id",
        ),
        RESPONSES: ([*HI, _fc("a"), _fc("a"), _fco("a")], "input[2].call_id"),
        MESSAGES: (
            [
                *HI,
                {"role": "assistant", "content": [_use("a"), _use("a")]},
                {"role": "user", "content": [_result("a")]},
            ],
            "messages[1].content[1].id",
        ),
    },
    "arguments not JSON": {
        CHAT: (
            [
                *HI,
                {"role": "assistant", "tool_calls": [_chat_call("a", "{not json")]},
                {"role": "tool", "tool_call_id": "a", "content": "1"},
            ],
            "messages[1].tool_calls[0].function.arguments",
        ),
        RESPONSES: ([*HI, _fc("a", "{not json"), _fco("a")], "input[1].arguments"),
        MESSAGES: (
            [
                *HI,
                {"role": "assistant", "content": [_use("a") | {"input": "{not json"}]},
                {"role": "user", "content": [_result("a")]},
            ],
            "messages[1].content[0].input",
        ),
    },
    "arguments not an object": {
        CHAT: (
            [
                *HI,
                {"role": "assistant", "tool_calls": [_chat_call("a", "[1, 2]")]},
                {"role": "tool", "tool_call_id": "a", "content": "1"},
            ],
            "messages[1].tool_calls[0].function.arguments",
        ),
        RESPONSES: ([*HI, _fc("a", "[1, 2]"), _fco("a")], "input[1].arguments"),
        MESSAGES: (
            [
                *HI,
                {"role": "assistant", "content": [_use("a") | {"input": [1, 2]}]},
                {"role": "user", "content": [_result("a")]},
            ],
            "messages[1].content[0].input",
        ),
    },
}


@pytest.mark.parametrize("case", CALLS)
def test_assistant_calls_are_checked_on_every_api(client, case):
    for path, (turns, param) in CALLS[case].items():
        _names(client.post(path, json=_with_turns(path, turns)), param)


# ---- Messages: Anthropic's rules for tool turns and empty content --------------------------------

USE_T1 = {"role": "assistant", "content": [_use("t1"), _use("t2")]}


@pytest.mark.parametrize(
    "turns, param",
    [
        ([*HI, USE_T1, {"role": "user", "content": "no results"}], "messages[2]"),  # no tool_result
        ([*HI, USE_T1, {"role": "user", "content": [_result("t1")]}], "messages[2]"),  # t2 unanswered
        (  # text before the tool_result blocks
            [
                *HI,
                USE_T1,
                {"role": "user", "content": [{"type": "text", "text": "x"}, _result("t1"), _result("t2")]},
            ],
            "messages[2].content[1]",
        ),
        ([{"role": "user", "content": []}], "messages[0].content"),
        ([*HI, {"role": "assistant", "content": []}, *HI], "messages[1].content"),
    ],
    ids=["no-result", "one-unanswered", "text-first", "empty-user", "empty-assistant"],
)
def test_messages_tool_turn_rules_and_empty_content(client, turns, param):
    _names(client.post(MESSAGES, json=_with_turns(MESSAGES, turns)), param)
    # the results first, then text, answering every tool_use: accepted
    good = [
        *HI,
        USE_T1,
        {"role": "user", "content": [_result("t1"), _result("t2"), {"type": "text", "text": "x"}]},
    ]
    assert client.post(MESSAGES, json=_with_turns(MESSAGES, good)).status_code == 200


# ---- parallel_tool_calls is checked with or without tools ----------------------------------------


def test_parallel_tool_calls_is_checked_with_or_without_tools(client):
    for tools in (False, True):
        for path in (CHAT, RESPONSES):
            body = {**BASE[path], "parallel_tool_calls": "x", **({"tools": TOOLS[path]} if tools else {})}
            assert "boolean" in _names(client.post(path, json=body), "parallel_tool_calls")
        choice = {"type": "auto", "disable_parallel_tool_use": "x"}
        body = {**MESSAGES_BODY, "tool_choice": choice, **({"tools": TOOLS[MESSAGES]} if tools else {})}
        assert "boolean" in _names(client.post(MESSAGES, json=body), "tool_choice.disable_parallel_tool_use")


# ---- a body that is not JSON says why ------------------------------------------------------------


def _no_param(resp) -> str:
    message, param = _error(resp)
    assert param is None, param
    return message


@pytest.mark.parametrize("path", [CHAT, RESPONSES, MESSAGES, "/v1/completions"])
def test_a_body_that_is_not_json_says_why(client, path):
    text = json.dumps({**BASE.get(path, {"model": MODEL, "prompt": "hi"}), "user": "XX"})
    offset = text.encode().index(b"XX")
    bad = text.encode().replace(b"XX", b"\xff\xfe")
    assert f"not valid UTF-8: byte 0xff at offset {offset}" in _no_param(_post_raw(client, path, bad))

    very_deep = "[" * 100_000 + "]" * 100_000
    message = _no_param(_post_raw(client, path, f'{{"model": "{MODEL}", "x": {very_deep}}}'))
    assert f"limit of {MAX_JSON_DEPTH} levels" in message
    over = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH  # parses, one level over the limit with the body
    message = _no_param(_post_raw(client, path, f'{{"model": "{MODEL}", "x": {over}}}'))
    assert f"{MAX_JSON_DEPTH + 1} levels deep, over the limit of {MAX_JSON_DEPTH} levels" in message

    message = _no_param(_post_raw(client, path, f'{{"model": "{MODEL}", "seed": {"9" * 5000}}}'))
    assert "integer of more than 4300 digits" in message

    message = _no_param(_post_raw(client, path, '{"model": '))
    assert message.startswith("request body is not valid JSON: Expecting value at character 10")

    if path == CHAT:  # nesting within the limit is served
        within = "[" * (MAX_JSON_DEPTH - 10) + "]" * (MAX_JSON_DEPTH - 10)
        body = json.dumps({**CHAT_BODY, "chat_template_kwargs": {"x": "X"}}).replace('"X"', within)
        assert _post_raw(client, CHAT, body).status_code == 200


# ---- a lone surrogate in a schema key --------------------------------------------------------------

SCHEMA_FIELDS = {
    CHAT: (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": "S"}}},
        "response_format.json_schema.schema",
    ),
    RESPONSES: ({"text": {"format": {"type": "json_schema", "name": "s", "schema": "S"}}}, "text.format"),
    MESSAGES: (
        {"output_config": {"format": {"type": "json_schema", "schema": "S"}}},
        "output_config.format.schema",
    ),
}
TOOL_FIELDS = {
    CHAT: (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "S"}}]},
        "tools[0].function.parameters",
    ),
    RESPONSES: ({"tools": [{"type": "function", "name": "f", "parameters": "S"}]}, "tools[0]"),
    MESSAGES: ({"tools": [{"name": "f", "input_schema": "S"}]}, "tools[0].input_schema"),
}


@pytest.mark.parametrize("fields", [SCHEMA_FIELDS, TOOL_FIELDS], ids=["response-schema", "tool-parameters"])
def test_a_lone_surrogate_in_a_schema_key_is_a_clear_400(client, fields):
    schema = json.dumps({"type": "object", "properties": {"KEY": {"type": "string"}}})
    schema = schema.replace("KEY", "\\ud800")  # JSON's escape: a lone surrogate once parsed
    for path, (extra, param) in fields.items():
        text = json.dumps({**BASE[path], **extra}).replace('"S"', schema)
        message = _names(_post_raw(client, path, text), param)
        assert "codec" not in message and "surrogate" in message, message


# ---- one style of error path ------------------------------------------------------------------------


def test_error_paths_are_written_one_way(client):
    body = {**CHAT_BODY, "messages": [*HI, {"role": "bogus", "content": "x"}]}
    _names(client.post(CHAT, json=body), "messages[1].role")
    body = {**MESSAGES_BODY, "messages": [*HI, {"role": "bogus", "content": "x"}]}
    message = _names(client.post(MESSAGES, json=body), "messages[1].role")
    assert "messages.1" not in message
    call = {"id": "a", "type": "function", "function": {"name": "f"}}  # no arguments
    body = {**CHAT_BODY, "messages": [*HI, {"role": "assistant", "tool_calls": [call]}]}
    _names(client.post(CHAT, json=body), "messages[1].tool_calls[0].function.arguments")
    for path in (CHAT, RESPONSES):
        _names(client.post(path, json={**BASE[path], "stop_token_ids": [1, "x"]}), "stop_token_ids[1]")
    _names(client.post(RESPONSES, json={**RESPONSES_BODY, "include": [5]}), "include[0]")


# ---- a long value is never echoed whole ---------------------------------------------------------

BIG = "x" * (1 << 20)
ECHOES = [
    (CHAT, {"model": BIG}, "model", 404),
    (
        CHAT,
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": BIG}}},
        "tool_choice",
        400,
    ),
    (
        CHAT,
        {"messages": [*HI, {"role": "tool", "tool_call_id": BIG, "content": "1"}]},
        "messages[1].tool_call_id",
        400,
    ),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": BIG}]}]}, "messages[0].content[0]", 400),
    (CHAT, {"reasoning_effort": BIG}, "reasoning_effort", 400),
    (CHAT, {"logit_bias": {BIG: "a"}}, "logit_bias." + "x" * ECHO_MAX_CHARS + "...", 400),
    (RESPONSES, {"model": BIG}, "model", 404),
    (RESPONSES, {"reasoning": {"effort": BIG}}, "reasoning.effort", 400),
    (RESPONSES, {"include": [BIG]}, "include[0]", 400),
    (RESPONSES, {"tools": [{"type": BIG}]}, "tools[0].type", 400),
    (RESPONSES, {"input": [*HI, _fco(BIG)]}, "input[1].call_id", 400),
    (RESPONSES, {"input": [*HI, {"type": BIG}]}, "input[1].type", 400),
    (MESSAGES, {"model": BIG}, "model", 404),
    (MESSAGES, {"tools": [{"type": BIG, "name": "f", "input_schema": {}}]}, "tools[0]", 400),
    (MESSAGES, {"messages": [{"role": "user", "content": [{"type": BIG}]}]}, "messages[0].content[0]", 400),
    (MESSAGES, {BIG: 1}, "x" * ECHO_MAX_CHARS, 400),
]


@pytest.mark.parametrize("path, extra, param, status", ECHOES, ids=lambda v: str(v)[:40])
def test_a_long_value_is_never_echoed_whole(client, path, extra, param, status):
    resp = client.post(path, json={**BASE[path], **extra})
    message = _names(resp, param, status)
    assert len(resp.content) < 2 * ECHO_MAX_CHARS + 600, message[:300]


# ---- the depth scan agrees with the parsed value ------------------------------------------------

_TEXT = st.text(alphabet=st.sampled_from(['"', "\\", "[", "]", "{", "}", "a", "é", "\n", " "]), max_size=6)
_VALUES = st.recursive(
    st.one_of(_TEXT, st.integers(), st.floats(allow_nan=False), st.none(), st.booleans()),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)),
    max_leaves=40,
)


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(value=_VALUES, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_json_depth_matches_the_parsed_value(value, ascii_only, indent):
    """Brackets and quotes inside strings (escaped or not) never count: the byte scan that bounds
    a body's nesting gives the depth of the value json.loads reads."""
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent).encode()
    assert json_depth(text) == _depth(value), text


# ---- a call left unanswered, and a call without a name (the adversary's) --------------------------


def test_a_call_left_unanswered_is_refused_on_every_api(client):
    """OpenAI refuses a conversation that goes on after calls without answering them; Messages
    always did (tool_use ids without tool_result blocks). A conversation may end with the calls."""
    later = {"role": "user", "content": "and?"}
    cases = {
        CHAT: (_chat_turns(later), "messages[2]"),
        RESPONSES: ([*HI, _fc("c1"), later], "input[2]"),
        MESSAGES: ([*HI, {"role": "assistant", "content": [_use("t1")]}, later], "tool_result"),
    }
    for path, (turns, param) in cases.items():
        message = _names(client.post(path, json=_with_turns(path, turns)), param)
        assert "c1" in message or "t1" in message, message
    # answered, or the conversation ends with them: fine
    assert client.post(CHAT, json=_with_turns(CHAT, _chat_turns())).status_code == 200
    assert client.post(RESPONSES, json=_with_turns(RESPONSES, [*HI, _fc("c1")])).status_code == 200
    answered = _chat_turns({"role": "tool", "tool_call_id": "c1", "content": "1"}, later)
    assert client.post(CHAT, json=_with_turns(CHAT, answered)).status_code == 200


def test_an_assistant_call_without_a_name_is_refused(client):
    call = {"id": "c1", "type": "function", "function": {"name": "", "arguments": "{}"}}
    turns = [*HI, {"role": "assistant", "content": None, "tool_calls": [call]}]
    _names(client.post(CHAT, json=_with_turns(CHAT, turns)), "messages[1].tool_calls[0].function.name")
