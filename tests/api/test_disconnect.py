"""Disconnects, admission and time limits against a real HTTP server (uvicorn, in this process) over
the fake model runner: a client that leaves stops its request within one engine step (streamed or
not, queued, running or waiting for its constraint to compile) and frees its KV, radix-tree locks and
grammar state; requests over --max-queued-requests get 429 with Retry-After; --request-timeout ends
a request with a 504 / error event and frees its KV. Steps are counted with the fake runner's
records; a gated runner holds the engine still where a test needs it to (no timed asserts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from concurrent.futures import Future

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentrt.api.app import create_app
from agentrt.runtime.async_engine import AdmissionConfig, AsyncEngine
from agentrt.runtime.config import EngineConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.testing import FakeModelRunner, serve_in_thread

pytestmark = pytest.mark.usefixtures("time_limit")

MODEL = "fake"
PROMPT = "tell me a long story about"


class GatedRunner(FakeModelRunner):
    """A fake runner whose forwards each wait for a permit (`allow`) until `open()` lets them all run."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        self.num_entered = self.num_allowed = 0

    def allow(self, n: int = 1) -> None:
        self.num_allowed += n
        self._permits.release(n)

    def open(self) -> None:
        self._open.set()

    def execute(self, chunks, return_hidden=False):
        self.num_entered += 1
        while not self._open.is_set() and not self._permits.acquire(timeout=0.01):
            pass
        return super().execute(chunks, return_hidden)


async def step_until(runner: GatedRunner, cond, what: str) -> None:
    """Let the engine take one step at a time (a permit only when a forward waits for one) until
    cond() holds."""
    deadline = time.monotonic() + 20
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        if runner.num_entered > runner.num_allowed:
            runner.allow(1)
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def fake_server(runner: FakeModelRunner, admission: AdmissionConfig | None = None, max_num_seqs: int = 8):
    """(base URL, AsyncEngine) of a server over `runner`; the runner is let go before shutdown."""
    engine = Engine(EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs)), runner=runner)
    front = AsyncEngine(engine=engine, admission=admission)
    try:
        with serve_in_thread(create_app(front, MODEL)) as url:
            yield url, front
    finally:
        if isinstance(runner, GatedRunner):
            runner.open()
        front.shutdown()


async def until(cond, what: str, timeout_s: float = 20.0) -> None:
    """Wait (polling) until cond() holds; fail naming `what` if it never does."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.005)


def gauges(url: str) -> dict[str, float]:
    """GET /metrics: sample name (with its labels as {k=v,...}) -> value."""
    text = httpx.get(f"{url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def completion(max_tokens: int, stream: bool = False, **extra) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return body | extra


async def settle(url: str, front: AsyncEngine) -> None:
    """Wait until the engine holds no request, then check the idle baseline: nothing running or
    waiting (engine and /metrics), no KV held for requests, no radix-tree lock, no open stream."""
    engine = front.engine
    await until(
        lambda: not engine.has_work() and front.num_inbox_messages == 0 and front.num_waiting == 0,
        "the engine went idle",
    )
    kv, cache = engine.runner.kv, engine.scheduler.cache
    assert cache.locked_tokens == 0
    assert kv.num_free + cache.evictable_tokens == kv.num_slots
    assert not front._streams
    g = await asyncio.to_thread(gauges, url)
    assert g["agentrt_num_requests_running"] == 0
    assert g["agentrt_num_requests_waiting"] == 0
    assert g["agentrt_kv_usage_ratio"] == 0.0
    assert g["agentrt_kv_cache_usage_ratio"] == cache.evictable_tokens / kv.num_slots


async def expect_normal_service(client: httpx.AsyncClient, runner: FakeModelRunner) -> None:
    """A following request gets exactly the greedy continuation."""
    r = await client.post("/v1/completions", json=completion(12))
    assert r.status_code == 200, r.text
    ids = runner.tokenizer.encode(PROMPT, add_special_tokens=False)
    want = runner.tokenizer.decode(runner.greedy_continuation(ids, 12))
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (want, "length")


def test_non_streamed_disconnect_aborts_within_one_step():
    runner = GatedRunner()
    with fake_server(runner) as (url, front):

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                request = asyncio.create_task(client.post("/v1/completions", json=completion(400)))
                runner.allow(3)
                await until(lambda: runner.num_forwards == 3, "3 forwards")
                request.cancel()  # the client leaves; the engine waits in forward 4 for a permit
                stats = front.engine.stats
                await until(  # (taken already when it came before forward 4 started)
                    lambda: front.num_inbox_messages == 1 or stats.num_finished["abort"] == 1,
                    "the abort reached the engine",
                )
                runner.open()
                await settle(url, front)
                assert runner.num_forwards <= 4  # the step in flight, then none
                assert stats.num_finished["abort"] == 1
                assert stats.num_generated_tokens <= 4
                await expect_normal_service(client, runner)

        asyncio.run(run())


def test_disconnect_while_the_constraint_compiles_never_starts_the_request(monkeypatch):
    runner = FakeModelRunner()
    with fake_server(runner) as (url, front):
        grammar = front.engine.grammar
        pending: Future = Future()  # this caller's future of a compile that has not finished
        compiles = []

        def slow_submit(spec):
            compiles.append(spec)
            return pending

        monkeypatch.setattr(grammar, "submit", slow_submit)

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = completion(50, stream=True, regex="[a-z]{3,40}")
                request = asyncio.create_task(client.post("/v1/completions", json=body))
                await until(lambda: compiles and front.num_waiting == 1, "the request waits for its compile")
                request.cancel()
                await until(lambda: front.num_waiting == 0, "the request left the admission count")
                assert pending.cancelled()  # its interest in the compile released
                await settle(url, front)
                assert runner.num_forwards == 0 and front.engine.stats.num_prompt_tokens == 0
                await expect_normal_service(client, runner)

        asyncio.run(run())


def test_random_disconnects_leave_the_engine_at_its_idle_baseline():
    """32 concurrent requests (half streamed, some constrained, some chat) whose clients drop at
    seeded random points: before the response, after k stream events, or never."""
    runner = FakeModelRunner()
    rng = random.Random(17)
    with fake_server(runner, max_num_seqs=8) as (url, front):

        async def one(client: httpx.AsyncClient, i: int) -> str:
            stream = i % 2 == 0
            body = completion(rng.randint(20, 200), stream=stream)
            if i % 4 == 1:
                body["regex"] = "[a-z ]{1,300}"
            if i % 8 == 3:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {}}}},
                }
            path = "/v1/completions"
            if i % 4 == 2:
                path = "/v1/chat/completions"
                body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
            drop_after_events = rng.choice([0, 1, 3, 10, 30, 1000])
            drop_after_s = rng.choice([0, 0.001, 0.02, 0.1, 0.3, None])
            if not stream:
                try:
                    r = await asyncio.wait_for(client.post(path, json=body), drop_after_s)
                except TimeoutError:
                    return "dropped"
                assert r.status_code == 200, r.text
                return "done"
            async with client.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                n = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        assert "error" not in json.loads(line[6:]) if line != "data: [DONE]" else True
                        n += 1
                        if n >= drop_after_events:
                            return "dropped"
            return "done"

        async def run():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
                results = await asyncio.gather(*(one(client, i) for i in range(32)))
                assert "dropped" in results
                await settle(url, front)
                stats = front.engine.stats
                assert stats.num_finished["abort"] >= 1 and stats.num_finished["error"] == 0
                await expect_normal_service(client, runner)

        asyncio.run(run())


def test_a_burst_over_the_queue_limit_gets_429_and_the_rest_complete():
    runner = GatedRunner()
    admission = AdmissionConfig(max_queued_requests=3, retry_after_s=2)
    with fake_server(runner, admission, max_num_seqs=2) as (url, front):
        running = front.engine.scheduler.running

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                first = [
                    asyncio.create_task(client.post("/v1/completions", json=completion(6))) for _ in range(2)
                ]
                await step_until(runner, lambda: len(running) == 2, "both run")  # then a forward waits
                burst = [
                    asyncio.create_task(client.post("/v1/completions", json=completion(6))) for _ in range(8)
                ]
                await until(lambda: sum(t.done() for t in burst) == 5, "5 requests refused")
                refused = [t for t in burst if t.done()]
                for r in (t.result() for t in refused):
                    assert r.status_code == 429
                    assert r.headers["retry-after"] == "2"
                    err = r.json()["error"]
                    assert (err["type"], err["code"], err["param"]) == ("requests", "queue_full", None)
                    assert "3 requests are already waiting" in err["message"]
                g = await asyncio.to_thread(gauges, url)
                assert (g["agentrt_num_requests_running"], g["agentrt_num_requests_waiting"]) == (2, 3)
                assert g["agentrt_requests_rejected_total{reason=queue_full}"] == 5
                runner.open()
                for r in await asyncio.gather(*first, *(t for t in burst if t not in refused)):
                    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
                await settle(url, front)

        asyncio.run(run())


def test_request_timeout_ends_requests_with_504_or_an_error_event_and_frees_kv():
    runner = GatedRunner()
    admission = AdmissionConfig(request_timeout_s=0.3)
    with fake_server(runner, admission) as (url, front):

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                plain = asyncio.create_task(client.post("/v1/completions", json=completion(400)))

                async def streamed() -> list[dict]:
                    async with client.stream("POST", "/v1/completions", json=completion(400, True)) as r:
                        assert r.status_code == 200
                        return [
                            json.loads(x[6:])
                            for x in [line async for line in r.aiter_lines()]
                            if x.startswith("data: {")
                        ]

                events = asyncio.create_task(streamed())
                await step_until(runner, lambda: len(front.engine.scheduler.running) == 2, "both run")
                await asyncio.sleep(0.4)  # past both deadlines while the engine waits in a forward
                runner.open()
                r = await plain
                assert r.status_code == 504
                err = r.json()["error"]
                assert (err["type"], err["code"]) == ("server_error", "request_timeout")
                assert "0.3 s" in err["message"]
                events = await events
                assert events[-1]["error"]["code"] == "request_timeout"
                assert front.engine.stats.num_finished["error"] == 2
                assert front.engine.stats.num_generated_tokens < 40
                await settle(url, front)
                await expect_normal_service(client, runner)

        asyncio.run(run())


def test_request_timeout_while_the_constraint_compiles(monkeypatch):
    runner = FakeModelRunner()
    with fake_server(runner, AdmissionConfig(request_timeout_s=0.2)) as (url, front):
        pending: Future = Future()  # a compile that never ends
        monkeypatch.setattr(front.engine.grammar, "submit", lambda spec: pending)

        async def run():
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                r = await client.post("/v1/completions", json=completion(10, regex="[a-z]+"))
                assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
                assert "while its constraint compiled" in r.json()["error"]["message"]
                await settle(url, front)
                assert runner.num_forwards == 0

        asyncio.run(run())
