"""AsyncEngine: runs the Engine's step loop in its own thread and streams outputs to asyncio callers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator

from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.config import EngineConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    """Thread-safe front of one Engine. `generate` is an async iterator of RequestOutput; every
    engine call happens on the engine's loop thread (requests and aborts cross over through an
    inbox).

    start_thread=True runs the loop in a background thread. The server instead calls
    `run_forever()` on the main thread and serves HTTP from another: torch's CPU intra-op
    parallelism (OpenMP) is measured ~30% slower when driven from a non-main thread
    (SmolLM2 decode: 19 vs 14 tokens/s on 2 cores)."""

    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None,
                 start_thread: bool = True):
        self._owns_engine = engine is None
        self.engine = engine or Engine(config)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="agentrt-engine", daemon=True)
            self._thread.start()

    def run_forever(self, should_stop=lambda: False) -> None:
        """Run the engine loop on the calling thread until shutdown() or should_stop() is true."""
        self._run(should_stop)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    async def compile(self, spec: ConstraintSpec):
        """Compile (or find cached) a constraint without blocking the event loop; returns the
        CompiledConstraint. Raises ValueError."""
        return await asyncio.wrap_future(self.engine.grammar.submit(spec))

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       constraint: ConstraintSpec | None = None,
                       request_id: str | None = None, cache_salt: str = "") -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs until the final one. Validation errors (ValueError)
        and constraint compile errors are raised before the first output. Closing the iterator
        early (client disconnect) aborts the request and frees its KV and grammar state."""
        if constraint is not None:
            await self.compile(constraint)
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        self._inbox.put(("add", (prompt_ids, params, constraint, request_id, cache_salt, loop, stream, added)))
        await added
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._inbox.put(("abort", request_id))

    def request_stop(self) -> None:
        """Ask the engine loop to exit within 0.5 s; safe in a signal handler (sets an event, takes
        no lock: the handler may interrupt the loop's own thread while it holds the inbox lock)."""
        self._stop.set()

    def fail_pending(self, message: str) -> None:
        """After the loop has stopped (on the thread that ran it): end every request, queued or
        running, with an error, so streams finish with an error event instead of hanging."""
        with contextlib.suppress(queue.Empty):
            while True:
                kind, payload = self._inbox.get_nowait()
                if kind == "add":
                    loop, added = payload[5], payload[7]
                    loop.call_soon_threadsafe(_set_exception, added, RuntimeError(message))
        for out in self.engine.fail_all(message, status=503):
            self._deliver(out)

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if self._owns_engine:
            self.engine.grammar.shutdown()

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self, should_stop=lambda: False) -> None:
        engine = self.engine
        while not self._stop.is_set() and not should_stop():
            block = not engine.has_work()
            while True:
                try:
                    kind, payload = self._inbox.get(block=block, timeout=0.5 if block else None)
                except queue.Empty:
                    break
                block = False
                self._handle(kind, payload)
            if not engine.has_work():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug must not take the server down: fail the batch, go on
                logger.exception("engine step failed")
                outputs = engine.fail_all(f"internal engine error: {type(e).__name__}: {e}")
            for out in outputs:
                self._deliver(out)

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            prompt_ids, params, constraint, request_id, cache_salt, loop, stream, added = payload
            try:
                self.engine.add_request(prompt_ids, params, constraint, request_id, cache_salt)
            except ValueError as e:
                loop.call_soon_threadsafe(_set_exception, added, e)
                return
            self._streams[request_id] = (loop, stream)
            loop.call_soon_threadsafe(_set_result, added)
        elif kind == "abort":
            out = self.engine.abort(payload)
            if out is not None:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        loop, stream = entry
        try:
            loop.call_soon_threadsafe(stream.put_nowait, out)
        except RuntimeError:  # the caller's event loop is closed
            pass


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future, e: Exception) -> None:
    if not fut.done():
        fut.set_exception(e)
