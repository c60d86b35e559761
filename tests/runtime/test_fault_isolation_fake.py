"""Fault isolation, each batch-wide stage in turn (agentrt.testing FaultInjector on the fake
runner): one request's matcher, grammar accept, jump-forward, forward, NaN logits, penalties or
detokenizer raising fails that request alone with an InternalError; the engine keeps stepping, the
others finish token-identical to running alone, and every KV slot is free or cached and unlocked."""

from __future__ import annotations

import asyncio

import pytest

from agentrt.api.streaming import ChunkWriter, stream_events
from agentrt.errors import InternalError
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.async_engine import AsyncEngine
from agentrt.runtime.request import RequestOutput, SamplingParams
from agentrt.testing import FAULT_KINDS, FaultInjector, fake_engine
from tests.support.models import finish_all

pytestmark = pytest.mark.usefixtures("time_limit")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
REQUESTS = [  # the victim first: constrained, so every stage applies to it
    ("victim prompt", ConstraintSpec.json_schema(SCHEMA)),
    ("constrained neighbour", ConstraintSpec.json_schema(SCHEMA)),
    ("regex neighbour", ConstraintSpec.regex("[a-z]{3}-[0-9]{4}")),
    ("plain neighbour", None),
]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24)


def _assert_kv_idle(engine):
    kv, cache = engine.runner.kv, engine.scheduler.cache
    assert not engine.has_work()
    assert kv.num_free + cache.evictable_tokens == kv.num_slots  # nothing held, nothing locked


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_one_requests_fault_fails_it_alone(kind):
    engine = fake_engine()
    alone = [
        engine.generate([([ord(c) for c in text], _params(), spec)])[0].token_ids
        for text, spec in REQUESTS[1:]
    ]
    reqs = [engine.add_request([ord(c) for c in text], _params(), spec) for text, spec in REQUESTS]
    with FaultInjector(engine, reqs[0].request_id, kind, after_tokens=2) as fault:
        outs = finish_all(engine, reqs)
    assert fault.num_raised >= 1
    victim = outs[0]
    assert victim.finish_reason == "error" and isinstance(victim.error, InternalError), victim
    assert [o.token_ids for o in outs[1:]] == alone
    assert all(o.error is None and o.finish_reason in ("stop", "length") for o in outs[1:])
    _assert_kv_idle(engine)
    # the engine keeps serving
    again = engine.generate([([ord(c) for c in REQUESTS[0][0]], _params(), REQUESTS[0][1])])[0]
    assert again.error is None and again.finish_reason in ("stop", "length")


def test_a_forward_fault_of_the_whole_batch_still_fails_the_batch():
    """When every chunk succeeds alone, the fault is the batch's: step raises (AsyncEngine then
    fails the step's requests), as documented in runtime/isolation.py."""
    engine = fake_engine()
    reqs = [engine.add_request([ord(c) for c in t], _params()) for t in ("one", "two")]
    real = engine.runner.execute
    engine.runner.execute = lambda chunks, *a, **k: (
        (_ for _ in ()).throw(RuntimeError("device lost")) if len(chunks) > 1 else real(chunks, *a, **k)
    )
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    engine.runner.execute = real
    del engine.runner.execute
    assert {o.finish_reason for o in engine.fail_all(InternalError("x"))} == {"error"}
    assert len(reqs) == 2


def test_the_async_engine_loop_survives_a_request_fault():
    engine = fake_engine()
    alone = engine.generate([([ord(c) for c in "plain neighbour"], _params(), None)])[0].token_ids

    async def main():
        aeng = AsyncEngine(engine=engine)
        try:
            victim = await aeng.submit([ord(c) for c in "victim"], _params(), REQUESTS[0][1], "victim")
            plain = await aeng.submit([ord(c) for c in "plain neighbour"], _params(), None, "plain")
            with FaultInjector(engine, "victim", "forward", after_tokens=1):
                outs = []
                for s in (victim, plain):
                    outs.append([o async for o in s])
            return outs
        finally:
            aeng.shutdown()

    (victim_outs, plain_outs) = asyncio.run(main())
    assert victim_outs[-1].finish_reason == "error" and isinstance(victim_outs[-1].error, InternalError)
    assert plain_outs[-1].token_ids == alone and plain_outs[-1].finish_reason == "length"


class _BrokenParser:
    def feed(self, text):
        raise ValueError("parser exploded")

    def close(self, finish_reason):
        return [], finish_reason


class _Stream:
    request_id = "r1"

    def __init__(self, outs):
        self._outs, self.closed = iter(outs), False

    def __anext__(self):
        return self._next()

    async def _next(self):
        return next(self._outs)

    async def aclose(self):
        self.closed = True


def test_a_tool_call_parser_fault_ends_that_stream_with_an_error_event():
    from agentrt.api.errors import to_api_error

    first = RequestOutput("r1", "hi", "hi", [1], 3, False, None, None)
    stream = _Stream([RequestOutput("r1", "hi there", " there", [1, 2], 3, True, "stop", None)])
    writer = ChunkWriter("id", 0, "m", True, False)

    async def collect():
        return [e async for e in stream_events([stream], [first], writer, [_BrokenParser()], to_api_error)]

    events = asyncio.run(collect())
    assert any('"error"' in e and "parser exploded" in e and "server_error" in e for e in events)
    assert stream.closed  # the request is aborted (its stream closed)
