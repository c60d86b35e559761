"""A chat template renders within a budget of time and size enforced while it renders
(runtime/chat_template.py, runtime/template_sandbox.py; issue 56 item 2): a looping template is
stopped within its time budget, a huge one before it builds what it would, each a 400 naming the
budget on every route that renders a template; the server keeps serving; a render stops when its
client leaves and when the server shuts down (test_template_budget_server.py: SIGTERM exits within
its usual time); the render is the one transformers' apply_chat_template makes."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc

import httpx
import pytest
from fastapi.testclient import TestClient

from agentrt.api.app import create_app
from agentrt.errors import ChatTemplateError, ServiceUnavailableError, TemplateBudgetError
from agentrt.runtime.async_engine import AsyncEngine
from agentrt.runtime.chat_template import ChatRenderer, TemplateBudget
from agentrt.runtime.config import EngineConfig, ModelConfig
from agentrt.testing import byte_tokenizer, fake_engine, serve_in_thread
from tests.support.paths import SHARED, shared_path

pytestmark = pytest.mark.usefixtures("time_limit")

MODEL = "fake"
BUDGET_S = 0.5
MAX_BYTES = 1 << 20
# ChatML, except when the last message asks for trouble: two nested 100k loops that produce nothing
# (10**10 iterations), a macro building 300 MB, or one multiplication building 300 MB
HOSTILE = (
    "{%- macro big() %}{% for i in range(100000) %}{{ 'x' * 3000 }}{% endfor %}{% endmacro -%}"
    "{%- set last = messages[-1].content -%}"
    "{%- if last == 'loop' %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}{% elif last == 'huge' %}{% set s = big() %}{{ s|length }}"
    "{% elif last == 'mul' %}{{ ('x' * 300000000)|length }}{% endif -%}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}"
)


def _engine(time_s: float = BUDGET_S, max_bytes: int = MAX_BYTES) -> AsyncEngine:
    budget = TemplateBudget(time_s=time_s, max_bytes=max_bytes)
    engine = fake_engine(EngineConfig(model=ModelConfig(chat_template_budget=budget)))
    engine.tokenizer.chat_template = HOSTILE
    return AsyncEngine(engine=engine)


@pytest.fixture(scope="module")
def client():
    front = _engine()
    with TestClient(create_app(front, MODEL)) as c:
        yield c
    front.shutdown()


def _requests(content: str) -> list[tuple[str, dict]]:
    """Every route that renders the chat template, with one user message `content`."""
    message = [{"role": "user", "content": content}]
    return [
        ("/v1/chat/completions", {"model": MODEL, "messages": message, "max_tokens": 2}),
        ("/v1/messages", {"model": MODEL, "messages": message, "max_tokens": 2}),
        ("/v1/responses", {"model": MODEL, "input": content, "max_output_tokens": 2}),
        ("/tokenize", {"model": MODEL, "messages": message}),
    ]


def _budget_message(resp, path: str) -> str:
    assert resp.status_code == 400, resp.text
    if path == "/v1/messages":  # Anthropic's error shape
        return resp.json()["error"]["message"]
    error = resp.json()["error"]
    assert error["code"] == "chat_template_budget_exceeded", error
    assert error["param"] == ("input" if path == "/v1/responses" else "messages")
    return error["message"]


def test_a_looping_template_is_stopped_within_its_time_budget_on_every_route(client):
    for path, body in _requests("loop"):
        start = time.monotonic()
        resp = client.post(path, json=body)
        elapsed = time.monotonic() - start
        message = _budget_message(resp, path)
        assert "time budget of 0.5 s (--chat-template-budget)" in message
        assert elapsed < BUDGET_S + 2.0, (path, elapsed)
    # the server keeps serving
    ok = client.post("/v1/chat/completions", json=_requests("hello")[0][1])
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("content", ["huge", "mul"])
def test_a_huge_template_is_refused_before_it_builds_what_it_would(client, content):
    tracemalloc.start()
    try:
        for path, body in _requests(content):
            start = time.monotonic()
            resp = client.post(path, json=body)
            message = _budget_message(resp, path)
            assert "size budget of 1,048,576 bytes (--chat-template-max-bytes)" in message
            assert time.monotonic() - start < BUDGET_S + 2.0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak:,} bytes at the peak: the 300 MB were built"
    assert client.post("/v1/chat/completions", json=_requests("hello")[0][1]).status_code == 200


# each builds far more than 1 MiB in one C call, which no deadline could interrupt
SIZE_BOMBS = {
    "str times int": "{{ 'x' * 10**9 }}",
    "list times int": "{{ [1] * 10**8 }}",
    "~ doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "+ doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "block set doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s %}{{ ns.s }}{{ ns.s }}"
        "{% endset %}{% endfor %}"
    ),
    "center filter": "{{ 'x'|center(10**9) }}",
    "str.ljust": "{{ 'x'.ljust(10**9) }}",
    "printf width": "{{ '%0999999999d' % 1 }}",
    "str.format width": "{{ '{:>{w}}'.format(1, w=999999999) }}",
    "integer power": "{{ 9 ** 999999999 }}",
    "join filter": "{{ range(100000)|join('x' * 100000) }}",
    "replace filter": "{{ ('x' * 100000)|replace('', 'y' * 1000) }}",
    "indent filter": "{{ ('x\n' * 100000)|indent(100000) }}",
    "int.to_bytes": "{{ (1).to_bytes(10**9, 'big') }}",
    "lipsum": "{{ lipsum(100000) }}",
}


@pytest.mark.parametrize("name", sorted(SIZE_BOMBS))
def test_a_value_over_the_size_budget_is_refused_before_it_is_built(name):
    tok = byte_tokenizer()
    tok.chat_template = SIZE_BOMBS[name]
    renderer = ChatRenderer(tok, TemplateBudget(time_s=10.0, max_bytes=MAX_BYTES))
    start = time.monotonic()
    with pytest.raises(TemplateBudgetError) as e:
        renderer.render([{"role": "user", "content": "hi"}])
    assert e.value.limit == "size" and e.value.param == "messages"
    assert time.monotonic() - start < 2.0


def test_a_template_that_raises_is_refused_naming_messages_with_its_message():
    tok = byte_tokenizer()
    tok.chat_template = "{{ raise_exception('only user turns, please') }}"
    with pytest.raises(ChatTemplateError) as e:
        ChatRenderer(tok).render([{"role": "user", "content": "hi"}])
    assert e.value.param == "messages" and e.value.reason == "only user turns, please"


def test_many_messages_are_stopped_by_the_time_budget():
    """The 100k-message conversation (seconds of rendering before the context check) falls under
    the same budget."""
    tok = byte_tokenizer()
    tok.chat_template = shared_path("chat_templates", "Qwen-Qwen3-0.6B.jinja").read_text()
    renderer = ChatRenderer(tok, TemplateBudget(time_s=0.25))
    messages = [{"role": "user", "content": "hi"}] * 100_000
    start = time.monotonic()
    with pytest.raises(TemplateBudgetError) as e:
        renderer.render(messages)
    assert e.value.limit == "time"  # stopped: the plain render takes 2.8-4.2 s (docs/benchmarks.md)
    assert time.monotonic() - start < 3.0  # the budget, preparing 100k messages and freeing them


def test_a_render_stops_when_its_cancel_event_is_set():
    tok = byte_tokenizer()
    tok.chat_template = HOSTILE
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    start = time.monotonic()
    with pytest.raises(ServiceUnavailableError):
        ChatRenderer(tok, TemplateBudget(time_s=60.0)).render(
            [{"role": "user", "content": "loop"}], cancel=cancel
        )
    assert time.monotonic() - start < 2.0


def _watch_renders(app) -> tuple[threading.Event, threading.Event]:
    """(started, ended): set when the app's next render starts and when it returns or raises."""
    renderer = app.state.serving.renderer
    real = renderer.render
    started, ended = threading.Event(), threading.Event()

    def render(*args, **kwargs):
        started.set()
        try:
            return real(*args, **kwargs)
        finally:
            ended.set()

    renderer.render = render
    return started, ended


def test_a_render_stops_when_its_client_leaves():
    front = _engine(time_s=60.0)
    app = create_app(front, MODEL)
    started, ended = _watch_renders(app)
    body = b'{"model": "fake", "messages": [{"role": "user", "content": "loop"}], "max_tokens": 2}'
    try:
        with serve_in_thread(app) as url:
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                assert started.wait(10)
            left = time.monotonic()
            assert ended.wait(10), "the render went on after its client left"
            assert time.monotonic() - left < 5.0
            ok = httpx.post(f"{url}/v1/chat/completions", json=_requests("hello")[0][1], timeout=30)
            assert ok.status_code == 200, ok.text
    finally:
        front.shutdown()


def test_stop_renders_ends_a_render_in_flight_with_a_503():
    """The server's shutdown (cli.serve's finally and the app's lifespan) stops renders in flight."""
    front = _engine(time_s=60.0)
    app = create_app(front, MODEL)
    started, _ = _watch_renders(app)
    result: dict = {}
    try:
        with serve_in_thread(app) as url:

            def post():
                body = _requests("loop")[0][1]
                result["resp"] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)

            t = threading.Thread(target=post)
            t.start()
            assert started.wait(10)
            stopped = time.monotonic()
            app.state.serving.stop_renders()
            t.join(10)
            assert not t.is_alive() and time.monotonic() - stopped < 5.0
            assert result["resp"].status_code == 503, result["resp"].text
            # renders started after the stop are stopped too
            resp = httpx.post(f"{url}/v1/chat/completions", json=_requests("hello")[0][1], timeout=30)
            assert resp.status_code == 503
    finally:
        front.shutdown()


SAMPLES = {
    "plain": ([{"role": "user", "content": "Hello"}], None, {}),
    "system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], None, {}),
    "tools": (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "sunny"},
        ],
        [
            {
                "type": "function",
                "function": {"name": "weather", "description": "d", "parameters": {"type": "object"}},
            }
        ],
        {},
    ),
    "reasoning": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
            {"role": "user", "content": "3+3?"},
        ],
        None,
        {"enable_thinking": True},
    ),
}


@pytest.mark.parametrize(
    "template",
    sorted(p.name for p in (SHARED / "chat_templates").glob("*.jinja")) or ["(no shared templates)"],
)
def test_the_budgeted_render_equals_apply_chat_template(template):
    tok = byte_tokenizer()
    tok.chat_template = shared_path("chat_templates", template).read_text()
    renderer = ChatRenderer(tok)
    for name, (messages, tools, kwargs) in SAMPLES.items():
        try:
            expected = tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as e:  # noqa: BLE001 - the template refuses: so must the budgeted render
            with pytest.raises(ChatTemplateError) as got:
                renderer.render(messages, tools, True, kwargs)
            assert got.value.reason == str(e), name
            continue
        assert renderer.render(messages, tools, True, kwargs) == expected, name
