"""The HTTP perimeter on the fake runner: API keys on every route (both key sources, constant-time
compare), the body limit on bytes received (chunked bodies against a real uvicorn server),
disconnects visible to routes through the middleware, prompts refused before tokenizing, CORS,
what is logged, HEAD /health, bad logprobs values refused, the `model` field never touching the file system."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import socket
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import Request
from fastapi.testclient import TestClient

from agentrt.api.app import create_app
from agentrt.api.middleware import DEFAULT_MAX_BODY_BYTES, ServerOptions
from agentrt.runtime.async_engine import AsyncEngine
from agentrt.server_args import add_server_args, exposure_warning, is_loopback, server_options
from agentrt.testing import fake_engine, free_port

pytestmark = pytest.mark.usefixtures("time_limit")

MODEL = "fake"
KEYS = ("key-one", "key-two", "key-three")
ERROR_KEYS = {"message", "type", "param", "code"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def front():
    front = AsyncEngine(engine=fake_engine())
    yield front
    front.shutdown()


@contextlib.contextmanager
def client_for(front, **options):
    with TestClient(create_app(front, MODEL, options=ServerOptions(**options))) as c:
        yield c


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert set(resp.json()) == {"error"} and set(resp.json()["error"]) == ERROR_KEYS
    return resp.json()["error"]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ---- API keys ------------------------------------------------------------------------------------
def _app_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves: its OpenAPI operations and the plain routes
    beside them (docs, HEAD /health); a route added later is covered without editing this test."""
    found = {(m.upper(), path) for path, ops in app.openapi()["paths"].items() for m in ops}
    for route in app.routes:
        for method in getattr(route, "methods", None) or ():
            found.add((method, route.path))
    found.add(("HEAD", "/health"))
    return sorted(found)


def _call(client, method: str, path: str, headers=None):
    if method == "POST":
        return client.post(path, json={}, headers=headers)
    return client.request(method, path, headers=headers)


def test_every_route_but_health_and_metrics_needs_a_key(front):
    with client_for(front, api_keys=KEYS) as c:
        routes = _app_routes(c.app)
        assert ("POST", "/v1/chat/completions") in routes and ("GET", "/docs") in routes
        wrong = {}
        for method, path in [*routes, ("GET", "/v1/no-such-route")]:
            open_ = path in ("/health", "/metrics")
            missing = _call(c, method, path)
            bad = _call(c, method, path, _bearer("key-four"))
            good = _call(c, method, path, _bearer("key-two"))
            got = (missing.status_code, bad.status_code, good.status_code)
            if open_ and 401 in got or not open_ and (got[:2] != (401, 401) or got[2] == 401):
                wrong[f"{method} {path}"] = got
            if not open_ and method != "HEAD":
                for resp in (missing, bad):
                    assert resp.headers["www-authenticate"] == "Bearer"
                    if path.startswith("/v1/messages"):  # Anthropic's error shape there
                        body = resp.json()
                        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
                        assert "key-four" not in body["error"]["message"]
                        continue
                    err = _error(resp, 401)
                    assert (err["type"], err["param"], err["code"]) == (
                        "invalid_request_error",
                        None,
                        "invalid_api_key",
                    )
                    assert "key-four" not in err["message"]
        assert wrong == {}, "routes with the wrong auth behaviour (no key, wrong key, right key)"


@pytest.mark.parametrize(
    "header", ["key-one", "Basic key-one", "Bearer", "Bearer key-one-and-more", "bearer  key-on"]
)
def test_malformed_authorization_is_refused(front, header):
    with client_for(front, api_keys=KEYS) as c:
        assert (
            _error(c.get("/v1/models", headers={"Authorization": header}), 401)["code"] == "invalid_api_key"
        )
        assert c.get("/v1/models", headers={"Authorization": "bearer  key-one"}).status_code == 200


def test_a_request_with_a_key_is_served(front):
    with client_for(front, api_keys=KEYS) as c:
        for key in KEYS:
            resp = c.post("/v1/chat/completions", json=CHAT, headers=_bearer(key))
            assert resp.status_code == 200, resp.text
        assert c.post("/v1/completions", json=COMPLETION, headers=_bearer("key-one")).status_code == 200


def test_metrics_needs_a_key_with_the_flag(front):
    with client_for(front, api_keys=KEYS, metrics_require_key=True) as c:
        assert _error(c.get("/metrics"), 401)["code"] == "invalid_api_key"
        assert c.get("/metrics", headers=_bearer("key-one")).status_code == 200
        assert c.get("/health").status_code == 200


def test_without_keys_everything_is_open(front):
    with client_for(front) as c:
        assert c.get("/v1/models").status_code == 200
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200


def test_keys_are_compared_with_compare_digest_against_every_key(front, monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    with client_for(front, api_keys=KEYS) as c:
        for key, status in (("key-one", 200), ("nope", 401), ("key-three", 200)):
            calls.clear()
            assert c.get("/v1/models", headers=_bearer(key)).status_code == status
            # no early exit: the first key matching still compares against all three
            assert len(calls) == len(KEYS)
            assert all(len(a) == len(b) == 32 for a, b in calls)  # digests: lengths never leak


def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_args(p)
    return p.parse_args(list(argv))


def test_keys_from_flags_and_environment(front):
    assert server_options(_serve_args("--api-key", "a", "--api-key", "b"), {}).api_keys == ("a", "b")
    assert server_options(_serve_args(), {"AGENTRT_API_KEY": "env-key"}).api_keys == ("env-key",)
    both = server_options(_serve_args("--api-key", "a"), {"AGENTRT_API_KEY": "env-key"})
    assert both.api_keys == ("a", "env-key")
    assert server_options(_serve_args(), {}).api_keys == ()
    with pytest.raises(ValueError, match="empty"):
        server_options(_serve_args("--api-key", ""), {})
    with client_for(front, api_keys=both.api_keys) as c:
        assert c.get("/v1/models", headers=_bearer("env-key")).status_code == 200
        assert c.get("/v1/models", headers=_bearer("a")).status_code == 200
        assert c.get("/v1/models").status_code == 401


def test_warning_when_listening_beyond_loopback_without_a_key():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert is_loopback(host) and exposure_warning(host, 8000, ()) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        assert not is_loopback(host)
        assert "without an API key" in exposure_warning(host, 8000, ())
        assert exposure_warning(host, 8000, ("k",)) is None


def test_serve_flags_defaults():
    options = server_options(_serve_args(), {})
    assert options == ServerOptions()
    assert options.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 16 << 20
    custom = server_options(
        _serve_args(
            "--max-body-bytes",
            "100",
            "--allowed-origins",
            "https://a.example, https://b.example",
            "--metrics-require-key",
            "--log-requests",
        ),
        {},
    )
    assert custom.max_body_bytes == 100 and custom.metrics_require_key and custom.log_requests
    assert custom.allowed_origins == ("https://a.example", "https://b.example")


# ---- body limit, against a real uvicorn server -------------------------------------------------------
@contextlib.contextmanager
def uvicorn_server(app):
    """`app` served by uvicorn on 127.0.0.1 (a thread of this process); yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _chunks(data: bytes, size: int = 1024):
    for i in range(0, len(data), size):
        yield data[i : i + size]


def test_body_limit_counts_bytes_received_in_chunks(front):
    limit = 4096
    app = create_app(front, MODEL, options=ServerOptions(max_body_bytes=limit))
    small = httpx.Request("POST", "http://x", json=COMPLETION).content
    big = httpx.Request("POST", "http://x", json={**COMPLETION, "prompt": "a" * 20_000}).content
    headers = {"Content-Type": "application/json"}
    with uvicorn_server(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        req = client.build_request("POST", "/v1/completions", content=_chunks(big), headers=headers)
        assert req.headers.get("transfer-encoding") == "chunked" and "content-length" not in req.headers
        err = _error(client.send(req), 413)
        assert err["type"] == "invalid_request_error"
        assert err["message"] == f"request body exceeds the limit of {limit} bytes"
        # a chunked body within the limit is served
        ok = client.post("/v1/completions", content=_chunks(small, 16), headers=headers)
        assert ok.status_code == 200, ok.text
        # a declared Content-Length over the limit is refused before reading
        err = _error(client.post("/v1/completions", content=big, headers=headers), 413)
        assert err["message"] == f"request body of {len(big)} bytes exceeds the limit of {limit} bytes"
        assert client.get("/health").status_code == 200


def test_default_body_limit_by_content_length(front):
    with client_for(front) as c:
        resp = c.post(
            "/v1/completions",
            content=b"{}",
            headers={"content-type": "application/json", "content-length": str(DEFAULT_MAX_BODY_BYTES + 1)},
        )
        assert "exceeds the limit of 16777216 bytes" in _error(resp, 413)["message"]


def test_a_route_sees_its_client_disconnect_through_the_middleware(front):
    """Pure ASGI middleware pass the client's disconnect through: `request.is_disconnected()`
    turns true in a route (BaseHTTPMiddleware hid it)."""
    app = create_app(
        front, MODEL, options=ServerOptions(api_keys=KEYS, allowed_origins=("https://a.example",))
    )
    entered, left = threading.Event(), threading.Event()

    @app.post("/v1/test-wait")
    async def wait(request: Request):
        assert await request.json() == {"a": 1}  # the body is read first, as the API routes do
        entered.set()
        for _ in range(2000):
            if await request.is_disconnected():
                left.set()
                return {}
            await asyncio.sleep(0.01)
        return {}

    with uvicorn_server(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                b"POST /v1/test-wait HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-one\r\n"
                b"Origin: https://a.example\r\nContent-Type: application/json\r\n"
                b'Content-Length: 8\r\n\r\n{"a": 1}'
            )
            assert entered.wait(10)
        assert left.wait(10), "the route never saw the client leave"


# ---- prompts that cannot fit ---------------------------------------------------------------------
def test_a_huge_prompt_is_refused_without_tokenizing(front, monkeypatch):
    tokenizer = front.engine.tokenizer
    encoded: list[int] = []
    real = tokenizer.encode

    def spy(text, *args, **kwargs):
        encoded.append(len(text))
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", spy)
    huge = "x" * 5_000_000
    with client_for(front) as c:
        for path, body, param in (
            ("/v1/completions", {**COMPLETION, "prompt": huge}, "prompt"),
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": huge}]}, "messages"),
        ):
            err = _error(c.post(path, json=body), 400)
            assert (err["code"], err["param"]) == ("context_length_exceeded", param)
            assert err["message"].startswith("prompt has at least ")
            assert err["message"].endswith("leaves no room in the context limit of 512 tokens")
        assert encoded == []
        # a prompt the bound cannot rule out is tokenized and gets the engine's own answer
        err = _error(c.post("/v1/completions", json={**COMPLETION, "prompt": "y" * 600}), 400)
        assert err["code"] == "context_length_exceeded" and err["message"].startswith("prompt has 600 tokens")
        assert encoded == [600]


# ---- CORS ----------------------------------------------------------------------------------------
def _preflight(c, origin: str):
    return c.options(
        "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def test_cors_is_off_by_default(front):
    with client_for(front) as c:
        assert "access-control-allow-origin" not in _preflight(c, "https://a.example").headers
        resp = c.get("/v1/models", headers={"Origin": "https://a.example"})
        assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers


def test_cors_for_allowed_origins_only(front):
    with client_for(front, api_keys=KEYS, allowed_origins=("https://a.example",)) as c:
        pre = _preflight(c, "https://a.example")  # no key on a preflight: CORS answers it first
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == "https://a.example"
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        resp = c.get("/v1/models", headers={"Origin": "https://a.example", **_bearer("key-one")})
        assert resp.headers["access-control-allow-origin"] == "https://a.example"
        denied = c.get("/v1/models", headers={"Origin": "https://a.example"})  # the 401 is readable
        assert (
            denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "https://a.example"
        )
        other = c.get("/v1/models", headers={"Origin": "https://evil.example", **_bearer("key-one")})
        assert "access-control-allow-origin" not in other.headers
        assert "access-control-allow-origin" not in _preflight(c, "https://evil.example").headers


# ---- logging -------------------------------------------------------------------------------------
@pytest.mark.parametrize("log_requests", [False, True])
def test_prompts_are_logged_only_with_log_requests(front, caplog, log_requests):
    caplog.set_level(logging.DEBUG)
    secret = "SECRET-PROMPT-7f3a"
    with client_for(front, log_requests=log_requests) as c:
        chat = {**CHAT, "messages": [{"role": "user", "content": secret}]}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        assert c.post("/v1/completions", json={**COMPLETION, "prompt": secret + "-2"}).status_code == 200
        assert (
            c.post("/v1/completions", json={**COMPLETION, "prompt": secret + "-3", "n": 0}).status_code == 400
        )
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert (secret in logged) is log_requests
    assert (f"{secret}-2" in logged) is log_requests


# ---- small API holes -----------------------------------------------------------------------------
def test_head_health(front):
    with client_for(front) as c:
        resp = c.head("/health")
        assert resp.status_code == 200 and resp.content == b""
        assert set(c.app.openapi()["paths"]["/health"]) == {"get"}


@pytest.mark.parametrize(
    "path,extra,param",
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),
        ("/v1/completions", {"top_logprobs": 0}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ],
)
def test_bad_logprobs_are_refused_naming_the_field(front, path, extra, param):
    body = {**(CHAT if "chat" in path else COMPLETION), **extra}
    with client_for(front) as c:
        err = _error(c.post(path, json=body), 400)
    assert err["param"] == param and param in err["message"]
    assert err["type"] == "invalid_request_error"


def test_chat_logprobs_false_asks_for_nothing(front):
    with client_for(front) as c:
        resp = c.post("/v1/chat/completions", json={**CHAT, "logprobs": False})
        assert resp.status_code == 200 and resp.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    "path,extra", [("/v1/completions", {"logprobs": 0}), ("/v1/chat/completions", {"logprobs": True})]
)
def test_logprobs_are_served(front, path, extra):
    with client_for(front) as c:
        resp = c.post(path, json={**(CHAT if "chat" in path else COMPLETION), **extra})
        assert resp.status_code == 200, resp.text
        body = resp.json()
    logprobs = body["choices"][0]["logprobs"]
    num = len(logprobs["content"] if "chat" in path else logprobs["tokens"])
    assert num == body["usage"]["completion_tokens"] > 0


_AUDIT: dict = {"installed": False, "events": None}
"""The audit hook below is process-wide and permanent; it records only while `events` is a list."""


def _audit(event: str, args: tuple) -> None:
    events = _AUDIT["events"]
    if events is not None and any("passwd" in str(a) for a in args if isinstance(a, str | bytes)):
        events.append((event, args))


@contextlib.contextmanager
def _file_events():
    """The audited events (open, listdir, stat-like calls...) naming "passwd" while in the block."""
    if not _AUDIT["installed"]:
        sys.addaudithook(_audit)
        _AUDIT["installed"] = True
    events: list = []
    _AUDIT["events"] = events
    try:
        yield events
    finally:
        _AUDIT["events"] = None


@pytest.mark.parametrize("model", ["../../etc/passwd", "/etc/passwd", "fake/../../../etc/passwd"])
def test_the_model_field_never_reaches_the_file_system(front, model):
    with client_for(front) as c, _file_events() as events:
        resp = c.post("/v1/chat/completions", json={**CHAT, "model": model})
    err = _error(resp, 404)
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert events == [], f"file system events naming the model: {events}"
    # the hook does see file access naming passwd, so an empty list means something
    with _file_events() as events, contextlib.suppress(OSError):
        open("/nonexistent/passwd")  # noqa: SIM115
    assert events and events[0][0] == "open"


# ---- schemas over the constraint limit -----------------------------------------------------------
def test_a_schema_over_the_limit_is_refused_before_its_meta_schema_check(monkeypatch):
    """The meta-schema check costs ~0.4 ms per property in the server process: a schema over
    max_constraint_bytes is refused by its size first, for response_format and for tools."""
    import jsonschema

    from agentrt.grammars.spec import GrammarConfig
    from agentrt.runtime.config import EngineConfig

    checked: list[int] = []
    real = jsonschema.Draft202012Validator.check_schema

    def spy(schema):
        checked.append(len(schema.get("properties", {})) if isinstance(schema, dict) else 0)
        return real(schema)

    monkeypatch.setattr(jsonschema.Draft202012Validator, "check_schema", spy)
    limit = 20_000
    front = AsyncEngine(engine=fake_engine(EngineConfig(grammar=GrammarConfig(max_constraint_bytes=limit))))
    props = {f"p{i}": {"type": "string"} for i in range(limit // 20)}
    big = {"type": "object", "properties": props}
    small = {"type": "object", "properties": {"q": {"type": "string"}}}
    tool = lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}}
    try:
        with client_for(front) as c:
            rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": big}}
            err = _error(c.post("/v1/chat/completions", json={**CHAT, "response_format": rf}), 400)
            assert err["param"] == "response_format.json_schema.schema", err
            assert f"over the {limit}-byte limit" in err["message"], err
            tools = [tool("a", small), tool("b", big)]
            err = _error(c.post("/v1/chat/completions", json={**CHAT, "tools": tools}), 400)
            assert err["param"] == "tools[1].function.parameters", err
            assert f"over the {limit}-byte limit" in err["message"], err
    finally:
        front.shutdown()
    assert checked and all(n < len(props) for n in checked), checked  # the big schema never reached it
