"""Aborts, admission and time limits in the AsyncEngine on the fake runner (no HTTP): an aborted
request frees its KV and radix-tree locks and the gauges say so at once; a submit cancelled while
queued or compiling never runs; the queue limit counts compiling and queued requests; a timed-out
request ends with a RequestTimeoutError."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentrt.errors import QueueFullError, RequestTimeoutError, ServiceUnavailableError
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.async_engine import AdmissionConfig, AsyncEngine
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine

pytestmark = pytest.mark.usefixtures("time_limit")

PROMPT = [ord(c) for c in "a prompt long enough to fill some KV slots"]
LONG = SamplingParams(temperature=0, max_tokens=400)


def gauges(front: AsyncEngine) -> dict[str, float]:
    text = front.metrics_text().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def wait_idle(front: AsyncEngine) -> None:
    deadline = time.monotonic() + 10
    while front.engine.has_work() or front.num_inbox_messages:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.005)


def test_gauges_reflect_an_abort_at_once():
    front = AsyncEngine(engine=fake_engine())
    kv, cache = front.engine.runner.kv, front.engine.scheduler.cache
    try:

        async def run():
            stream = await front.submit(PROMPT, LONG)
            await anext(stream)
            busy = gauges(front)
            await stream.aclose()
            return busy

        busy = asyncio.run(run())
        assert busy["agentrt_num_requests_running"] == 1 and busy["agentrt_kv_usage_ratio"] > 0
        wait_idle(front)
        steps = front.engine.stats.num_steps
        idle = gauges(front)  # no step has run since the abort
        assert front.engine.stats.num_steps == steps
        assert (idle["agentrt_num_requests_running"], idle["agentrt_num_requests_waiting"]) == (0, 0)
        assert idle["agentrt_kv_usage_ratio"] == 0.0
        assert idle["agentrt_kv_cache_usage_ratio"] == cache.evictable_tokens / kv.num_slots > 0
        assert cache.locked_tokens == 0 and kv.num_free + cache.evictable_tokens == kv.num_slots
    finally:
        front.shutdown()


def test_abort_with_an_error_finishes_the_request_with_it():
    engine = fake_engine()
    r = engine.add_request(PROMPT, LONG, request_id="r")
    engine.step()
    out = engine.abort("r", error=RequestTimeoutError("too slow", timeout_s=1.0))
    assert out.finished and out.finish_reason == "error" and isinstance(out.error, RequestTimeoutError)
    assert r.slots == [] and engine.stats.num_finished["error"] == 1
    assert engine.abort("r") is None  # already finished


def test_a_submit_cancelled_while_queued_never_runs():
    front = AsyncEngine(engine=fake_engine(), start_thread=False)  # nothing takes the inbox yet

    async def run():
        task = asyncio.create_task(front.submit(PROMPT, LONG))
        while front.num_inbox_messages == 0:
            await asyncio.sleep(0.001)
        task.cancel()  # waiting for the engine to take it: an abort follows it into the inbox
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert front.num_inbox_messages == 2
    front.run_forever(should_stop=lambda: front.num_inbox_messages == 0 and not front.engine.has_work())
    assert front.engine.runner.num_forwards == 0 and front.engine.stats.num_finished["abort"] == 1
    assert front.num_waiting == 0


def test_queue_limit_counts_compiling_and_queued_requests(monkeypatch):
    front = AsyncEngine(engine=fake_engine(), admission=AdmissionConfig(max_queued_requests=2))
    pending: list[Future] = []  # one future per caller, as the grammar backend gives
    real_submit = front.engine.grammar.submit
    monkeypatch.setattr(front.engine.grammar, "submit", lambda spec: pending.append(Future()) or pending[-1])
    spec = ConstraintSpec.regex("[a-z]{1,20}")
    try:

        async def run():
            compiling = [asyncio.create_task(front.submit(PROMPT, LONG, spec)) for _ in range(2)]
            while front.num_waiting < 2:
                await asyncio.sleep(0.001)
            assert gauges(front)["agentrt_num_requests_waiting"] == 2
            with pytest.raises(QueueFullError) as e:
                await front.submit(PROMPT, LONG)
            assert isinstance(e.value, ServiceUnavailableError)
            assert (e.value.num_waiting, e.value.max_queued_requests, e.value.retry_after_s) == (2, 2, 1)
            compiling[0].cancel()  # a client left while its constraint compiled: room for one
            while front.num_waiting > 1:
                await asyncio.sleep(0.001)
            third = await front.submit(PROMPT, SamplingParams(temperature=0, max_tokens=4))
            assert pending[0].cancelled()  # its interest in the compile was released
            pending[1].set_result(real_submit(spec).result())
            outs = [out async for out in await compiling[1]] + [out async for out in third]
            return [o for o in outs if o.finished]

        finished = asyncio.run(run())
        assert [o.finish_reason for o in finished] == ["stop", "length"]  # the regex ends by itself
        assert front.engine.stats.num_rejected["queue_full"] == 1
        wait_idle(front)
        assert front.num_waiting == 0
    finally:
        front.shutdown()


def test_request_timeout_ends_a_running_request(monkeypatch):
    engine = fake_engine()
    front = AsyncEngine(engine=engine, admission=AdmissionConfig(request_timeout_s=0.05))
    go = threading.Event()
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda *a, **k: go.wait() and execute(*a, **k))
    try:

        async def run():
            stream = await front.submit(PROMPT, LONG)
            await asyncio.sleep(0.1)  # past the deadline while the first forward waits
            go.set()
            return [out async for out in stream]

        outs = asyncio.run(run())
        last = outs[-1]
        assert last.finish_reason == "error" and isinstance(last.error, RequestTimeoutError)
        assert last.error.timeout_s == 0.05 and "while it ran" in last.error.message
        assert engine.runner.num_forwards == 1  # stopped after the step in flight
        wait_idle(front)
        kv, cache = engine.runner.kv, engine.scheduler.cache
        assert cache.locked_tokens == 0 and kv.num_free + cache.evictable_tokens == kv.num_slots
    finally:
        go.set()
        front.shutdown()


def test_finished_requests_do_not_keep_their_deadlines():
    # a long --request-timeout: each finished request's deadline entry must not stay until it is due
    front = AsyncEngine(engine=fake_engine(), admission=AdmissionConfig(request_timeout_s=3600))
    try:

        async def run():
            for _ in range(300):
                stream = await front.submit(PROMPT, SamplingParams(temperature=0, max_tokens=2))
                assert [out async for out in stream][-1].finish_reason == "length"

        asyncio.run(run())
        assert len(front._deadlines) <= 64 + 2
    finally:
        front.shutdown()
