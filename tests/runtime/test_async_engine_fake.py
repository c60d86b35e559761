"""AsyncEngine on the fake model runner: submit validates and compiles before queuing, streams
deliver every output in order, closing a stream early aborts the request and frees its KV."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentrt.errors import ConstraintError, InvalidRequestError
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.async_engine import AsyncEngine
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine

pytestmark = pytest.mark.usefixtures("time_limit")

PROMPT = [ord(c) for c in "stream me a few tokens"]


@pytest.fixture
def front():
    engine = fake_engine()
    front = AsyncEngine(engine=engine)
    yield front
    front.shutdown()


def test_generate_streams_the_same_tokens_as_the_sync_engine(front):
    want = front.engine.runner.greedy_continuation(PROMPT, 12)

    async def run():
        return [out async for out in front.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))]

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert outs[-1].token_ids == want
    assert "".join(o.delta_text for o in outs) == outs[-1].text


def test_submit_raises_typed_errors_before_queuing(front):
    async def run(params, regex=None):
        return await front.submit(PROMPT, params, ConstraintSpec.regex(regex) if regex else None)

    with pytest.raises(InvalidRequestError) as e:
        asyncio.run(run(SamplingParams(top_p=2.0)))
    assert e.value.param == "top_p"
    with pytest.raises(ConstraintError):
        asyncio.run(run(SamplingParams(max_tokens=4), "(("))
    assert not front.engine.has_work()


def test_closing_a_stream_early_aborts_and_frees_kv(front):
    kv, cache = front.engine.runner.kv, front.engine.scheduler.cache

    async def run():
        stream = await front.submit(PROMPT, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        first = await stream.__anext__()
        await stream.aclose()  # the client left
        return first

    first = asyncio.run(run())
    assert not first.finished
    for _ in range(200):  # the engine thread drains the abort within a step
        if not front.engine.has_work():
            break
        time.sleep(0.01)
    assert not front.engine.has_work()
    assert kv.num_free + (cache.evictable_tokens if cache is not None else 0) == kv.num_slots
    assert front.engine.stats.num_finished["abort"] == 1
