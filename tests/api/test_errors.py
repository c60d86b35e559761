"""The API's error mapping, model-free: each typed error -> HTTP status and OpenAI's error shape, the
FastAPI handlers (validation, unknown routes, unhandled exceptions), and how a request renames the
engine's fields. The body limit and API keys: tests/api/test_security.py."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from agentrt.api.errors import APIError, error_body, install_error_handlers, to_api_error
from agentrt.api.generation import Generation
from agentrt.api.tools import plan_tools
from agentrt.errors import (
    AgentrtError,
    ConstraintError,
    ContextLengthError,
    IncompleteOutputError,
    InternalError,
    InvalidRequestError,
    ServiceUnavailableError,
)
from agentrt.grammars.spec import ConstraintSpec
from agentrt.grammars.tool_calls import FORMATS
from agentrt.runtime.request import SamplingParams

ERROR_KEYS = {"message", "type", "param", "code"}

CASES = [
    (
        InvalidRequestError("top_p must be in (0, 1]", param="top_p"),
        400,
        "invalid_request_error",
        "top_p",
        None,
    ),
    (InvalidRequestError("no field"), 400, "invalid_request_error", None, None),
    (
        ConstraintError("keyword 'not' at /not", param="response_format", keyword="not", pointer="/not"),
        400,
        "invalid_request_error",
        "response_format",
        None,
    ),
    (
        ContextLengthError("prompt has 9000 tokens", param="prompt", num_prompt_tokens=9000, limit=8192),
        400,
        "invalid_request_error",
        "prompt",
        "context_length_exceeded",
    ),
    (
        IncompleteOutputError("ran out", finish_reason="length", text="{"),
        400,
        "invalid_request_error",
        "max_tokens",
        None,
    ),
    (ServiceUnavailableError("the server is shutting down"), 503, "server_error", None, None),
    (InternalError("internal engine error: boom"), 500, "server_error", None, None),
    (AgentrtError("something else"), 500, "server_error", None, None),
]


@pytest.mark.parametrize("error,status,type_,param,code", CASES, ids=lambda x: type(x).__name__)
def test_each_error_type_maps_to_status_type_param_code(error, status, type_, param, code):
    e = to_api_error(error)
    assert (e.status, e.type, e.param, e.code, e.message) == (status, type_, param, code, error.message)
    assert e.body() == {"error": {"message": error.message, "type": type_, "param": param, "code": code}}


def test_param_and_message_given_by_the_api_layer():
    e = to_api_error(
        ConstraintError("bad", param="x", tool_index=1),
        "tools[1].function.parameters",
        message="tools[1].function.parameters: bad",
    )
    assert (e.status, e.param, e.message) == (
        400,
        "tools[1].function.parameters",
        "tools[1].function.parameters: bad",
    )
    # a server error never names a request field
    assert to_api_error(ServiceUnavailableError("busy"), "messages").param is None


def test_error_body_is_utf8_safe():
    body = error_body("bad \ud800 text", "invalid_request_error", "p\udfff", None)
    assert body["error"]["message"] == "bad \\ud800 text" and body["error"]["param"] == "p\\udfff"
    assert set(body["error"]) == ERROR_KEYS


def test_generation_names_fields_as_the_request_does():
    gen = Generation(
        request_id="chatcmpl-1",
        chat=True,
        prompt_ids=[1],
        params=SamplingParams(),
        constraint=None,
        constraint_param="",
        tools=None,
        param_names={"prompt": "messages", "max_tokens": "max_completion_tokens"},
        cache_salt="",
        stream=False,
        include_usage=False,
    )
    assert (
        gen.api_error(ContextLengthError("long", param="prompt", num_prompt_tokens=9, limit=8)).param
        == "messages"
    )
    assert gen.api_error(InvalidRequestError("small", param="max_tokens")).param == "max_completion_tokens"
    assert gen.api_error(InvalidRequestError("x", param="seed")).param == "seed"
    assert gen.api_error(InvalidRequestError("x"), default_param="messages").param == "messages"
    failed = gen.api_error(None)
    assert (failed.status, failed.type, failed.message) == (500, "server_error", "generation failed")


def test_a_constraint_error_during_generation_names_the_constraint_field():
    gen = Generation(
        request_id="cmpl-1",
        chat=False,
        prompt_ids=[1],
        params=SamplingParams(),
        constraint=ConstraintSpec.regex("[a-z]+"),
        constraint_param="regex",
        tools=None,
        param_names={},
        cache_salt="",
        stream=False,
        include_usage=False,
    )
    err = gen.api_error(ConstraintError("the constraint admits no continuation here (every token is masked)"))
    assert (err.status, err.param) == (400, "regex")
    assert gen.api_error(InvalidRequestError("small", param="max_tokens")).param == "max_tokens"


def test_a_tool_index_names_the_tool_as_the_request_lists_it():
    # ConstraintError.tool_index counts the offered tools; a named tool_choice offers only that one
    tools = [{"type": "function", "function": {"name": n}} for n in ("a", "b", "c")]
    plan = plan_tools(tools, {"type": "function", "function": {"name": "c"}}, None, FORMATS["hermes"])
    assert [t["name"] for t in plan.tools] == ["c"] and plan.request_index(0) == 2
    plan = plan_tools(tools, "required", None, FORMATS["hermes"])
    assert [plan.request_index(i) for i in range(3)] == [0, 1, 2]


class _Body(BaseModel):
    n: int


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/raise/{kind}")
    async def raise_(kind: str):
        errors = {
            "api": APIError("gone", status=404, param="model", code="model_not_found"),
            "constraint": ConstraintError("cannot", param="regex"),
            "unavailable": ServiceUnavailableError("shutting down"),
            "bug": KeyError("x"),
        }
        raise errors[kind]

    @app.post("/body")
    async def body(b: _Body):
        return {"n": b.n}

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert set(resp.json()) == {"error"} and set(resp.json()["error"]) == ERROR_KEYS
    return resp.json()["error"]


def test_handlers_answer_every_failure_in_openai_shape(client):
    assert _error(client.post("/raise/api"), 404) == {
        "message": "gone",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert _error(client.post("/raise/constraint"), 400)["param"] == "regex"
    assert _error(client.post("/raise/unavailable"), 503)["type"] == "server_error"
    assert _error(client.post("/raise/bug"), 500) == {
        "message": "internal error: KeyError",
        "type": "server_error",
        "param": None,
        "code": None,
    }
    assert _error(client.get("/nowhere"), 404)["type"] == "invalid_request_error"
    err = _error(client.post("/body", json={"n": "x"}), 400)
    assert err["param"] == "n" and err["message"].startswith("n: ")
    err = _error(client.post("/body", content=b"{no", headers={"content-type": "application/json"}), 400)
    assert err["param"] is None and "not valid JSON" in err["message"]
