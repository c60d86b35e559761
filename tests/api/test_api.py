"""HTTP API in-process (FastAPI TestClient) on the default model: contract and bad input."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.paths import load_case

MODEL = "smollm2-135m-instruct"


def _chat(client, **kw):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a city in France."}],
        "temperature": 0,
        "max_tokens": 24,
    }
    body.update(kw)
    return client.post("/v1/chat/completions", json=body)


def _assert_error(resp, status: int, param: str | None, pattern: str):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert re.search(pattern, err["message"]), err["message"]


def test_health_and_models(client):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_invalid_json_body(client):
    resp = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    _assert_error(resp, 400, None, "not valid JSON")


def test_unknown_model(client):
    resp = _chat(client, model="gpt-17")
    _assert_error(resp, 404, "model", "gpt-17")
    assert resp.json()["error"]["code"] == "model_not_found"


def test_empty_messages(client):
    _assert_error(_chat(client, messages=[]), 400, "messages", "at least 1")


def test_prompt_longer_than_context(client):
    _assert_error(
        _chat(client, messages=[{"role": "user", "content": "hello " * 9000}]),
        400,
        "messages",
        "context limit",
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("top_p", 5),
        ("max_tokens", 0),
        ("max_tokens", 10**9),
        ("presence_penalty", 7),
        ("top_k", -3),
        ("n", 0),
        ("n", 17),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": 1000}),
        ("seed", -4),
    ],
)
def test_bad_sampling_values_name_the_field(client, field, value):
    resp = _chat(client, **{field: value})
    _assert_error(resp, 400, field, field if field != "n" else "n must be between 1 and 16")


def test_broken_constraints_are_400_and_server_keeps_serving(client):
    case = load_case("broken-constraint-is-an-error")
    for extra in case["requests"]:
        _assert_error(
            _chat(client, **extra),
            case["expect_status"],
            "response_format.json_schema.schema",
            "not a valid JSON Schema",
        )
    _assert_error(_chat(client, regex="(ab"), 400, "regex", "cannot be compiled")
    _assert_error(_chat(client, regex="a{1,4294967295}"), 400, "regex", "too large")
    _assert_error(
        _chat(client, lark="%import nosuchmodule.FOO\nstart: FOO"), 400, "lark", "not a valid Lark grammar"
    )
    _assert_error(_chat(client, grammar="root ::= nothing_here"), 400, "grammar", "cannot be compiled")
    _assert_error(_chat(client, choice=[]), 400, "choice", "non-empty")
    _assert_error(_chat(client, regex="a+", choice=["x"]), 400, "choice", "at most one constraint")
    _assert_error(
        _chat(client, response_format={"type": "json_schema"}), 400, "response_format.json_schema", "required"
    )
    _assert_error(
        _chat(
            client,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "yes"},
            },
        ),
        400,
        "response_format.json_schema.strict",
        "boolean",
    )
    _assert_error(
        _chat(client, tools=[{"type": "function", "function": {"name": "no spaces allowed"}}]),
        400,
        "tools[0].function.name",
        "letters, digits",
    )
    ok = _chat(client)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_constraint_kinds(client):
    out = _chat(client, choice=["Paris", "Lyon", "Berlin"]).json()
    assert out["choices"][0]["message"]["content"] in {"Paris", "Lyon", "Berlin"}
    out = _chat(client, regex=r"[A-Z][a-z]+, France").json()
    assert re.fullmatch(r"[A-Z][a-z]+, France", out["choices"][0]["message"]["content"])
    out = _chat(client, grammar='root ::= "City: " [A-Za-z]+').json()
    assert re.fullmatch(r"City: [A-Za-z]+", out["choices"][0]["message"]["content"])
    out = _chat(client, response_format={"type": "json_object"}, max_tokens=200).json()
    assert out["choices"][0]["finish_reason"] == "stop", out  # the object closed well within the budget
    assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)


def _stream_text(client, url, body) -> tuple[str, list[dict]]:
    chunks = []
    with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_chat_stream_equals_non_stream(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a city and its country."}],
        "temperature": 0,
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }
    plain = client.post("/v1/chat/completions", json=body).json()
    chunks = _stream_text(
        client, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert finals == [plain["choices"][0]["finish_reason"]]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == plain["usage"]["completion_tokens"]
    # the second run found the prompt in the prefix cache
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_completions_stream_equals_non_stream(client):
    body = {"model": MODEL, "prompt": "The three primary colors are", "temperature": 0, "max_tokens": 20}
    plain = client.post("/v1/completions", json=body).json()
    assert plain["object"] == "text_completion" and plain["usage"]["completion_tokens"] == 20
    chunks = _stream_text(client, "/v1/completions", {**body, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]


def test_hostile_input_is_a_clear_400(client):
    def raw(url: str, body: str):  # JSON text with a \ud800 escape: a lone surrogate once parsed
        return client.post(url, content=body.encode(), headers={"content-type": "application/json"})

    m = f'"model": "{MODEL}"'
    _assert_error(
        raw("/v1/chat/completions", f'{{{m}, "messages": [{{"role": "user", "content": "\\ud800"}}]}}'),
        400,
        "messages",
        "Unicode",
    )
    _assert_error(raw("/v1/completions", f'{{{m}, "prompt": "a\\ud800b"}}'), 400, "prompt", "Unicode")
    _assert_error(
        raw("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}'),
        404,
        "model",
        "does not exist",
    )
    deep: dict = {"type": "string"}
    for _ in range(200):  # deeper than the meta-schema check reads, within the body's nesting limit
        deep = {"type": "array", "items": deep}
    _assert_error(
        _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}),
        400,
        "response_format.json_schema.schema",
        "nested too deeply",
    )
    _assert_error(_chat(client, regex=r"[^\s\S]"), 400, "regex", "cannot be converted")
    _assert_error(
        _chat(
            client,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "a{1,4294967295}"}},
            },
        ),
        400,
        "response_format.json_schema.schema",
        "too large",
    )
    _assert_error(_chat(client, grammar='root ::= "a" root'), 400, "grammar", "no finite output")
    _assert_error(_chat(client, stream=True, grammar='root ::= "a" []'), 400, "grammar", "no finite output")
    _assert_error(_chat(client, max_tokens="5"), 400, "max_tokens", "integer")
    _assert_error(_chat(client, max_completion_tokens=10**9), 400, "max_completion_tokens", "context limit")
    _assert_error(_chat(client, functions=[{"name": "f"}]), 400, "functions", "not supported")
    _assert_error(_chat(client, tool_choice="required"), 400, "tool_choice", "needs tools")
    _assert_error(_chat(client, tools="f"), 400, "tools", "list")
    _assert_error(
        client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True}),
        400,
        "echo",
        "not supported",
    )
    _assert_error(client.get("/v1/nothing"), 404, None, "Not Found")
    big = client.post(
        "/v1/completions", content=b" " * (17 << 20), headers={"content-type": "application/json"}
    )
    _assert_error(big, 413, None, "exceeds the limit")
    assert _chat(client).status_code == 200


def test_usage_reports_cached_tokens_and_metrics(client):
    body = {
        "messages": [
            {"role": "system", "content": "You are terse. " * 40},
            {"role": "user", "content": "Name a colour."},
        ],
        "max_tokens": 4,
    }
    first = _chat(client, **body).json()["usage"]
    second = _chat(client, **body).json()["usage"]
    assert second["prompt_tokens"] == first["prompt_tokens"]
    assert second["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 1
    salted = _chat(client, cache_salt="tenant-b", **body).json()["usage"]
    assert salted["prompt_tokens_details"]["cached_tokens"] == 0
    text = client.get("/metrics").text
    for name in (
        "agentrt_prompt_tokens_total",
        "agentrt_cached_prompt_tokens_total",
        "agentrt_prefix_cache_hit_rate",
        "agentrt_kv_usage_ratio",
        "agentrt_num_requests_running",
        "agentrt_num_requests_waiting",
        "agentrt_time_to_first_token_seconds_bucket",
        "agentrt_inter_token_latency_seconds_bucket",
        "agentrt_e2e_request_latency_seconds_bucket",
        "agentrt_preemptions_total",
    ):
        assert name in text, name
