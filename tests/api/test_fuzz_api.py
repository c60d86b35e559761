"""API fuzzing, model-free: schemathesis generates requests from the server's own OpenAPI document
(every route; bodies that fit the schema and bodies that break it) and sends them to the app
in-process over the fake runner. Whatever arrives, the server must not answer 5xx, and every error
must be OpenAI's shape {"error": {"message": str, "type": str, "param": str|null, "code": str|null}}.

The default suite runs a fixed budget with a fixed seed (derandomized); the slow-marked test runs a
larger one. The fake engine's context is short (`MAX_MODEL_LEN` tokens), so a generated request with
a huge `max_tokens` is refused or finishes within a few hundred fake steps: each case is bounded.
"""

from __future__ import annotations

import json
import threading

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.support.fuzz import (
    choices,
    ebnf_grammars,
    json_schemas,
    lark_grammars,
    memory_cap,
    odd_text,
    regexes,
)

MAX_MODEL_LEN = 160
"""Context of the fake engine (tokens): bounds the work of any generated request."""

SERVED_MODEL = "fake-model"
ERROR_KEYS = {"message", "type", "param", "code"}


def openai_error_shape(ctx, response, case) -> bool | None:
    """A 4xx/5xx body is exactly {"error": {message: str, type: str, param: str|null, code:
    str|null}}; an error inside an SSE stream (a 200 whose events carry "error") has the same
    shape and is not a server_error. Anthropic's Messages API (/v1/messages) answers in its own
    shape instead (_check_anthropic_error)."""
    check = _check_anthropic_error if case.path.startswith("/v1/messages") else _check_error
    if response.status_code >= 400:
        try:
            body = json.loads(response.content)
        except ValueError as e:
            raise AssertionError(
                f"{response.status_code} body is not JSON: {response.content[:200]!r}"
            ) from e
        check(body, response.status_code)
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        for line in response.content.decode("utf-8", "replace").splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: ") :])
                if "error" in event:  # a failure after the 200 went out: never the server's fault
                    check(event, 400)
    return None


def _check_error(body, status: int) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, f"{status}: not OpenAI's error shape: {body}"
    err = body["error"]
    assert isinstance(err, dict) and set(err) == ERROR_KEYS, f"{status}: error keys {sorted(err)}"
    assert isinstance(err["message"], str) and err["message"], f"{status}: empty message: {err}"
    assert isinstance(err["type"], str) and err["type"], f"{status}: no type: {err}"
    assert err["param"] is None or isinstance(err["param"], str), f"{status}: param {err['param']!r}"
    assert err["code"] is None or isinstance(err["code"], str), f"{status}: code {err['code']!r}"
    # a server error never blames the request; a client error never says server_error
    assert (err["type"] == "server_error") == (status >= 500), f"{status} with type {err['type']!r}"


ANTHROPIC_SERVER_ERRORS = {"api_error", "overloaded_error", "timeout_error"}


def _check_anthropic_error(body, status: int) -> None:
    """Anthropic's error shape: {"type": "error", "error": {"type": str, "message": str}}; the
    error type says server fault exactly for a 5xx."""
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", (
        f"{status}: not Anthropic's error shape: {body}"
    )
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"type", "message"}, f"{status}: error keys {sorted(err)}"
    assert isinstance(err["message"], str) and err["message"], f"{status}: empty message: {err}"
    assert (err["type"] in ANTHROPIC_SERVER_ERRORS) == (status >= 500), f"{status} with type {err['type']!r}"


CHECKS = [not_a_server_error, openai_error_shape]


def _fake_front_and_app():
    """The real FastAPI app (middleware, handlers, routes, serving) around an AsyncEngine over the
    fake runner (byte tokenizer, MAX_MODEL_LEN context). The engine loop is not started here (the
    `engine_loop` fixture runs it): the schema is read at import, so collection stays cheap."""
    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.testing import fake_engine

    front = AsyncEngine(engine=fake_engine(max_model_len=MAX_MODEL_LEN), start_thread=False)
    return front, create_app(front, SERVED_MODEL)


# schemathesis' lazy loader (schemathesis.pytest.from_fixture) fails on pytest 9 (it reads the
# removed `Function._nodeid`), so the schema is loaded from the app at import
_FRONT, _APP = _fake_front_and_app()


def _schema(max_examples: int):
    schema = schemathesis.openapi.from_asgi("/openapi.json", _APP)
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        max_examples=max_examples,
        deterministic=True,
    )
    schema.hook(flatmap_body)
    return schema


def flatmap_body(context, body):
    """Most generated bodies name the served model (a random `model` is a 404 before the engine
    is reached); the rest keep what was generated."""
    if not isinstance(body, dict) or "model" not in body:
        return st.just(body)
    return st.integers(0, 4).map(lambda i: body if i == 0 else {**body, "model": SERVED_MODEL})


INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "top_logprobs", "logprobs")


def _serve(case):
    """Aim a case at the engine: the coverage phase's placeholder model "" becomes the served
    name (hooks do not reach that phase), and an integral float in an integer field (valid JSON
    Schema, refused by the strict request models) becomes an int."""
    body = case.body
    if isinstance(body, dict):
        if body.get("model") == "":
            body["model"] = SERVED_MODEL
        for k in INT_FIELDS:
            if isinstance(body.get(k), float) and body[k].is_integer():
                body[k] = int(body[k])
    return case


schema = _schema(max_examples=20)
schema_large = _schema(max_examples=400)


@pytest.fixture(scope="module", autouse=True)
def engine_loop():
    """Run the engine loop in a thread for this module's tests; stop it after them."""
    thread = threading.Thread(target=_FRONT.run_forever, name="fuzz-engine", daemon=True)
    thread.start()
    yield
    _FRONT.shutdown()
    thread.join(timeout=10)


_SETTINGS = {
    "derandomize": True,
    "deadline": None,
    "database": None,
    "suppress_health_check": list(HealthCheck),
}


@schema.parametrize()
@settings(max_examples=20, **_SETTINGS)
def test_fuzz_api_no_server_error_and_openai_error_shape(case):
    _serve(case).call_and_validate(checks=CHECKS)


@pytest.mark.slow
@schema_large.parametrize()
@settings(max_examples=400, **_SETTINGS)
def test_fuzz_api_large_budget(case):
    _serve(case).call_and_validate(checks=CHECKS)


# ---- bodies that reach the engine ------------------------------------------------------------------------
# schemathesis explores the schema's surface; most of its bodies stop at validation. These are
# well-formed requests with fuzzed values (sampling fields at and past their limits, odd text, every
# kind of constraint, tools), so the engine, the constraint compiler and the stream writer see them.
def _mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy, weight: int = 9) -> st.SearchStrategy:
    """`valid` about `weight` times as often as `invalid` (so that a body with many fields is
    often valid as a whole and reaches the engine)."""
    return st.one_of(*[valid] * weight, invalid)


def _sampling() -> st.SearchStrategy[dict]:
    def num(lo: float, hi: float) -> st.SearchStrategy[float]:
        return _mostly(st.floats(lo, hi), st.floats(allow_nan=False))

    return st.fixed_dictionaries(
        {"stream": st.booleans()},
        optional={
            "max_tokens": _mostly(st.integers(1, 40), st.sampled_from([0, -1, 10**9, 2**63])),
            "temperature": num(0, 2),
            "top_p": _mostly(st.floats(0.01, 1), st.sampled_from([0, -0.5, 1.5])),
            "top_k": _mostly(st.integers(-1, 400), st.sampled_from([-(2**63), 2**63])),
            "min_p": num(0, 1),
            "seed": _mostly(st.integers(0, 2**63 - 1), st.sampled_from([-1, 2**64])),
            "stop": _mostly(  # stop strings with a constraint are a 400: mostly none
                st.just([]), st.one_of(odd_text(0, 4, surrogates=True), st.lists(odd_text(0, 4), max_size=3))
            ),
            "logit_bias": st.dictionaries(
                _mostly(
                    st.sampled_from(["0", "65", "256", "259"]), st.sampled_from(["999999", "-1", "x", ""])
                ),
                num(-100, 100),
                max_size=3,
            ),
            "presence_penalty": num(-2, 2),
            "frequency_penalty": num(-2, 2),
            "repetition_penalty": num(0.01, 10),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "ignore_eos": st.booleans(),
            "stop_token_ids": st.lists(_mostly(st.integers(0, 259), st.integers(-5, 10**6)), max_size=3),
            "max_tokens_policy": st.sampled_from(["length", "close"]),
            "n": _mostly(st.just(1), st.integers(0, 2)),
            "cache_salt": odd_text(),
            "speculative": st.booleans(),
        },
    )


def _tools() -> st.SearchStrategy[dict]:
    name = st.sampled_from(["get_weather", "f", "a.b", "", "x" * 70])
    tool = st.builds(
        lambda n, p: {"type": "function", "function": {"name": n, "parameters": p}},
        name,
        json_schemas(bounded=True, max_leaves=4),
    )
    choice = st.one_of(
        st.sampled_from(["auto", "required", "none", "bogus"]),
        name.map(lambda n: {"type": "function", "function": {"name": n}}),
    )
    return st.fixed_dictionaries(
        {"tools": st.lists(tool, min_size=1, max_size=2)},
        optional={"tool_choice": choice, "parallel_tool_calls": st.booleans()},
    )


def _constraint() -> st.SearchStrategy[dict]:
    # lone surrogates in constraint text: test_lone_surrogate_in_a_constraint_field_is_a_400
    schema = json_schemas(bounded=True, max_leaves=5).map(
        lambda sc: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": sc}}}
    )
    return st.one_of(
        st.just({}),
        regexes(bounded=True).map(lambda r: {"regex": r}),
        choices().map(lambda c: {"choice": c}),
        ebnf_grammars(bounded=True).map(lambda g: {"grammar": g}),
        lark_grammars(bounded=True).map(lambda g: {"lark": g}),
        schema,
        st.just({"response_format": {"type": "json_object"}}),
        _tools(),
        st.builds(lambda t, f: {**t, **f}, _tools(), schema),  # calls or a schema's answer
    )


def _messages() -> st.SearchStrategy[list]:
    msg = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "system", "assistant"]),
            "content": odd_text(0, 30, surrogates=True),
        }
    )
    return st.lists(msg, min_size=1, max_size=3)


chat_bodies = st.builds(
    lambda m, s, c: {"model": SERVED_MODEL, "messages": m, **s, **c}, _messages(), _sampling(), _constraint()
)
completion_bodies = st.builds(
    lambda p, s, c: {"model": SERVED_MODEL, "prompt": p, **s, **{k: v for k, v in c.items() if k != "tools"}},
    st.one_of(odd_text(0, 30, surrogates=True), st.lists(st.integers(-1, 300), max_size=8)),
    _sampling(),
    _constraint(),
)


def check_response(r) -> None:
    """No 5xx; errors in OpenAI's shape; a 200 is a whole completion, or a stream that ends with
    [DONE] and carries no server error."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        _check_error(r.json(), r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-3:]}"
        for e in events[:-1]:
            event = json.loads(e)
            if "error" in event:
                _check_error(event, 400)
    else:
        body = r.json()
        assert body["choices"] and body["choices"][0]["finish_reason"] in {"stop", "length", "tool_calls"}, (
            body
        )


@pytest.fixture(scope="module")
def http():
    """The app started (its lifespan: renders run again after schemathesis' runs shut it down)."""
    from fastapi.testclient import TestClient

    with TestClient(_APP, raise_server_exceptions=False) as client:
        yield client


def _post(http, path: str, body: dict):
    # ensure_ascii: a lone surrogate travels as a \ud800 escape, as a JSON client sends it
    return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


@settings(max_examples=80, **_SETTINGS)
@given(body=chat_bodies)
def test_fuzz_chat_bodies_reach_the_engine(http, body):
    with memory_cap(3 << 30):
        check_response(_post(http, "/v1/chat/completions", body))


@settings(max_examples=30, **_SETTINGS)
@given(body=completion_bodies)
def test_fuzz_completion_bodies_reach_the_engine(http, body):
    with memory_cap(3 << 30):
        check_response(_post(http, "/v1/completions", body))


@pytest.mark.slow
@settings(max_examples=600, **_SETTINGS)
@given(body=st.one_of(chat_bodies, completion_bodies))
def test_fuzz_bodies_large_budget(http, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with memory_cap(3 << 30):
        check_response(_post(http, path, body))


SURROGATE_FIELDS = {
    "regex": {"regex": "\ud800"},
    "choice": {"choice": ["\udfff"]},
    "grammar": {"grammar": 'root ::= "\ud800"'},
    "lark": {"lark": 'start: "\ud800"'},
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"enum": ["\ud800"]}},
        }
    },
}


@pytest.mark.parametrize("field", SURROGATE_FIELDS)
def test_lone_surrogate_in_a_constraint_field_is_a_400(http, field):
    body = {"model": SERVED_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = _post(http, "/v1/chat/completions", {**body, **SURROGATE_FIELDS[field]})
    assert r.status_code == 400, f"{r.status_code}: {r.text[:300]}"
    _check_error(r.json(), 400)
