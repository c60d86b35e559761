"""Compile scheduling (grammars/compile_queue.py) with stand-in compile functions: bounded workers at
a lowered priority, shared jobs with counted waiters, cancellation of compiles nobody waits for,
and the 503-vs-400 split between a busy server and an expensive constraint."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import weakref
from concurrent.futures import CancelledError

import pytest

from agentrt.errors import ConstraintError, ServiceUnavailableError
from agentrt.grammars.compile_queue import CompileQueue
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.runtime.request import RequestStatus, SamplingParams
from agentrt.testing import fake_engine

pytestmark = pytest.mark.usefixtures("time_limit")


class Gate:
    """A compile function that blocks on `release` for specs starting with "block", records what
    ran and each run's thread priority."""

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Event()
        self.ran: list[str] = []
        self.nice: list[int] = []

    def __call__(self, spec: ConstraintSpec):
        self.ran.append(spec.value)
        self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        self.started.set()
        if spec.value.startswith("block"):
            self.release.wait(20)
        return f"compiled {spec.value}"


def _queue(gate, **cfg) -> CompileQueue:
    return CompileQueue(gate, GrammarConfig(**{"compile_threads": 1, **cfg}))


def test_one_worker_at_lower_priority_and_equal_specs_compile_once():
    gate = Gate()
    q = _queue(gate, compile_nice=7)
    try:
        a, b = q.submit(ConstraintSpec.regex("x+")), q.submit(ConstraintSpec.regex("x+"))
        assert a.result(10) == b.result(10) == "compiled x+"
        assert q.submit(ConstraintSpec.regex("x+")).result(10) == "compiled x+"  # cached
        assert gate.ran == ["x+"]
        assert gate.nice == [os.getpriority(os.PRIO_PROCESS, 0) + 7] or gate.nice == [19]
    finally:
        gate.release.set()
        q.shutdown()


def test_a_queued_compile_nobody_waits_for_is_cancelled():
    gate = Gate()
    q = _queue(gate)
    try:
        busy = q.submit(ConstraintSpec.regex("block"))
        assert gate.started.wait(10)
        w1, w2 = q.submit(ConstraintSpec.regex("y+")), q.submit(ConstraintSpec.regex("y+"))
        w1.cancel()  # one of two waiters leaves: the compile stays queued for the other
        assert q.num_queued == 1
        w2.cancel()  # the last one leaves: cancelled before it starts
        gate.release.set()
        assert busy.result(10) == "compiled block"
        assert q.submit(ConstraintSpec.regex("z+")).result(10) == "compiled z+"
        assert gate.ran == ["block", "z+"]  # y+ never ran
        with pytest.raises(CancelledError):
            w2.result(0)
    finally:
        gate.release.set()
        q.shutdown()


def test_a_waiter_that_leaves_does_not_cancel_the_others():
    gate = Gate()
    q = _queue(gate)
    try:
        first = q.submit(ConstraintSpec.regex("block2"))
        assert gate.started.wait(10)
        second = q.submit(ConstraintSpec.regex("block2"))
        first.cancel()  # running: it finishes for the remaining waiter
        gate.release.set()
        assert second.result(10) == "compiled block2"
    finally:
        gate.release.set()
        q.shutdown()


def test_a_running_compile_whose_callers_left_is_not_counted_as_stuck():
    """A running compile nobody waits for any more finishes on its worker (cached): it is not a
    compile past its time limit, so it never makes the next constraint fail with a 503 (the soak
    saw one when two clients left while their cheap compiles ran)."""
    gate = Gate()
    q = _queue(gate)
    q.pool.max_stuck = 1
    try:
        left = q.submit(ConstraintSpec.regex("block3"))
        assert gate.started.wait(10)
        left.cancel()
        nxt = q.submit(ConstraintSpec.regex("n+"))
        assert q.pool.num_stuck == 0 and not nxt.done()  # queued behind it, not refused
        gate.release.set()
        assert nxt.result(10) == "compiled n+"
        assert q.submit(ConstraintSpec.regex("block3")).result(10) == "compiled block3"  # cached
        assert gate.ran == ["block3", "n+"]
    finally:
        gate.release.set()
        q.shutdown()


def test_queue_wait_past_the_limit_is_503_not_the_constraints_fault():
    gate = Gate()
    q = _queue(gate, compile_queue_timeout_s=0.2, compile_timeout_s=30)
    try:
        q.submit(ConstraintSpec.regex("block"))
        assert gate.started.wait(10)
        waiting = q.submit(ConstraintSpec.regex("w+"))
        with pytest.raises(ServiceUnavailableError, match="waited 0.2 s for a compile thread"):
            waiting.result(10)
        gate.release.set()
        assert q.submit(ConstraintSpec.regex("w+")).result(10) == "compiled w+"  # not cached: retried
    finally:
        gate.release.set()
        q.shutdown()


def test_compile_timeout_is_400_when_it_computed_and_503_when_it_was_starved():
    stop = threading.Event()

    def compile_(spec):
        if spec.value == "spin":
            while not stop.is_set():  # a compile that really computes
                pass
        else:
            stop.wait(20)  # one that got no CPU
        return "late"

    q = CompileQueue(compile_, GrammarConfig(compile_threads=2, compile_timeout_s=0.3, compile_nice=0))
    try:
        with pytest.raises(ConstraintError, match="did not compile within 0.3 s"):
            q.submit(ConstraintSpec.regex("spin")).result(10)
        with pytest.raises(ServiceUnavailableError, match="on a busy server"):
            q.submit(ConstraintSpec.regex("idle")).result(10)
    finally:
        stop.set()
        q.shutdown()


def test_aborting_a_request_waiting_for_its_grammar_cancels_the_compile(monkeypatch):
    engine = fake_engine()
    gate = Gate()
    real = engine.grammar._compile

    def compile_(spec):
        gate(spec)
        return real(spec)

    monkeypatch.setattr(engine.grammar._queue, "_fn", compile_)
    prompt = [ord(c) for c in "hi"]
    blocker = engine.add_request(prompt, SamplingParams(max_tokens=2), ConstraintSpec.regex("block[a-z]"))
    assert gate.started.wait(10)
    waiting = engine.add_request(prompt, SamplingParams(max_tokens=2), ConstraintSpec.regex("[0-9]+"))
    assert waiting.status is RequestStatus.WAITING_FOR_GRAMMAR
    out = engine.abort(waiting.request_id)
    assert out.finish_reason == "abort"
    gate.release.set()
    while engine.has_work():
        engine.step()
    assert blocker.finish_reason is not None
    assert gate.ran == ["block[a-z]"]  # the aborted request's compile never ran


class _Compiled:
    """A stand-in compiled grammar that can be watched with a weak reference."""


def test_evicted_and_failed_compiles_are_freed_at_once_and_no_thread_starts_per_compile(monkeypatch):
    """Under a stream of fresh constraints, what the LRU evicts (or nobody waits for) is freed by
    reference counting alone: nothing of a finished job refers back to it, so its compiled grammar
    does not wait for a full garbage collection (with threading.Timer callbacks it stayed in a
    reference cycle: all 60 below were alive). Time limits share one timer thread."""
    compiled: list[weakref.ref] = []

    def compile_(spec):
        if spec.value.startswith("bad"):
            raise ConstraintError(f"cannot compile {spec.value}")
        c = _Compiled()
        compiled.append(weakref.ref(c))
        return c

    q = CompileQueue(compile_, GrammarConfig(compile_threads=1, cache_size=4))
    q.submit(ConstraintSpec.regex("warm")).result(10)  # starts the worker and the timer thread
    starts = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda t: starts.append(t.name) or real_start(t))
    gc.disable()
    try:
        for i in range(60):
            waiters = [q.submit(ConstraintSpec.regex(f"x{{{i}}}")) for _ in range(2)]
            assert waiters[0].result(10) is waiters[1].result(10)
            with pytest.raises(ConstraintError):
                q.submit(ConstraintSpec.regex(f"bad{i}")).result(10)
        del waiters
        alive = [r for r in compiled if r() is not None]
        assert len(alive) <= 4, f"{len(alive)} compiled grammars alive, the cache holds 4"
        assert starts == []
    finally:
        gc.enable()
        q.shutdown()


def test_a_cached_compile_error_is_a_fresh_copy_per_request():
    """Every request with a spec that failed gets its own exception (same type, message and fields,
    no traceback): re-raising one shared object chained each request's frames onto it (a leak that
    grew with every repeat of the failing constraint)."""

    def compile_(spec):
        raise ConstraintError("no good", "regex", keyword="pattern", pointer="/x")

    q = _queue(compile_)
    try:
        errors, depths = [], []
        for _ in range(5):
            with pytest.raises(ConstraintError) as info:
                q.submit(ConstraintSpec.regex("x")).result(10)
            errors.append(info.value)
            depths.append(_depth(info.value.__traceback__))
        assert len({id(e) for e in errors}) == 5
        assert depths == [depths[0]] * 5
        e = errors[-1]
        assert (str(e), e.param, e.keyword, e.pointer) == ("no good", "regex", "pattern", "/x")
    finally:
        q.shutdown()


def _depth(tb) -> int:
    n = 0
    while tb is not None:
        n, tb = n + 1, tb.tb_next
    return n


def test_the_cache_is_bounded_by_the_compiled_grammars_bytes():
    class Sized:  # stands in for CompiledConstraint: .grammar.memory_size_bytes
        def __init__(self, nbytes):
            self.grammar = type("G", (), {"memory_size_bytes": nbytes})()

    ran = []

    def compile_(spec):
        ran.append(spec.value)
        return Sized(400 if spec.value.startswith("big") else 100)

    q = CompileQueue(compile_, GrammarConfig(compile_threads=1, cache_size=100, cache_bytes=1000))
    try:
        for v in ["a", "b", "c", "d", "e"]:  # 5 x 100 bytes: all kept
            q.submit(ConstraintSpec.regex(v)).result(10)
        assert q.cached_bytes == 500
        q.submit(ConstraintSpec.regex("a")).result(10)  # a is now the most recently used
        for v in ["big1", "big2"]:  # +800 bytes: the least recently used go (b, c, d)
            q.submit(ConstraintSpec.regex(v)).result(10)
        assert q.cached_bytes == 1000
        for v in ["a", "e", "big1", "big2"]:
            q.submit(ConstraintSpec.regex(v)).result(10)
        assert ran == ["a", "b", "c", "d", "e", "big1", "big2"]  # all four were cached
        q.submit(ConstraintSpec.regex("b")).result(10)  # evicted: compiled again
        assert ran[-1] == "b" and q.cached_bytes <= 1000
    finally:
        q.shutdown()


def test_a_compile_queued_too_long_moves_to_the_relief_worker():
    """Aging: while the low-priority worker is held (here: blocked; on a saturated machine: starved),
    a compile queued past compile_relief_s runs on the relief worker at the process's priority."""
    gate = Gate()
    q = _queue(gate, compile_nice=7, compile_relief_s=0.2)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        busy = q.submit(ConstraintSpec.regex("block3"))
        assert gate.started.wait(10)
        assert q.submit(ConstraintSpec.regex("w+")).result(10) == "compiled w+"  # not behind block3
        assert gate.ran == ["block3", "w+"] and gate.nice[1] == base and gate.nice[0] in (base + 7, 19)
        assert not busy.done()
    finally:
        gate.release.set()
        q.shutdown()
    off = _queue(Gate(), compile_nice=7, compile_relief_s=None)
    assert off.relief is None
    off.shutdown()


def test_compiles_that_end_before_submit_returns_do_not_deadlock():
    """A compile can finish (here: fail at once) before submit() has added its callbacks; the
    Future then runs them in submit's thread, under the queue's lock (a plain Lock deadlocked)."""

    def fail(spec):
        raise ConstraintError(f"bad {spec.value}")

    q = CompileQueue(fail, GrammarConfig(compile_threads=1, compile_nice=0))
    finished = threading.Event()

    def submit_many():
        for i in range(3000):
            with contextlib.suppress(ConstraintError):
                q.submit(ConstraintSpec.regex(f"x{i}")).result(5)
        finished.set()

    threading.Thread(target=submit_many, daemon=True).start()  # (a deadlock must not hang the test)
    try:
        assert finished.wait(25), "submit() deadlocked"
    finally:
        q.shutdown()
