"""AsyncEngine: runs the Engine's step loop in its own thread and streams outputs to asyncio callers.

Admission and time limits (`AdmissionConfig`) live here, at the one door every request passes:
a request beyond `max_queued_requests` waiting ones is refused before anything is queued
(QueueFullError), and one unfinished `request_timeout_s` after submission is stopped by the engine
thread (RequestTimeoutError), freeing its KV and grammar state.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from agentrt.errors import (
    AgentrtError,
    InternalError,
    QueueFullError,
    RequestTimeoutError,
    ServiceUnavailableError,
)
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.xgrammar_backend import CompiledConstraint
from agentrt.runtime.config import EngineConfig, ModelConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.metrics import LoadGauges
from agentrt.runtime.request import Request, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionConfig:
    """Limits applied by AsyncEngine.submit.

    max_queued_requests: most requests that may wait to run at once (None: no limit). A request
    waits from its admission until the scheduler first runs it: while its constraint compiles, in
    the engine's inbox, in the scheduler's waiting queue (preempted requests count again); requests
    being tokenized are not yet admitted. One more is refused with QueueFullError.
    request_timeout_s: seconds from admission (compile and queueing included) after which an
    unfinished request is stopped with RequestTimeoutError and its KV freed (None: no limit).
    retry_after_s: the wait (seconds) a QueueFullError suggests."""

    max_queued_requests: int | None = None
    request_timeout_s: float | None = None
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")


@dataclass(frozen=True)
class AddRequest:
    """Inbox message: enqueue a validated request (`compiled`: its constraint, compiled once by the
    caller); `added` resolves on the caller's event loop `loop`, and outputs go to `stream`.
    deadline: time.monotonic() after which it is stopped (None: never)."""

    request: Request
    compiled: CompiledConstraint | None
    loop: asyncio.AbstractEventLoop
    stream: asyncio.Queue
    added: asyncio.Future
    deadline: float | None = None


@dataclass(frozen=True)
class AbortRequest:
    """Inbox message: cancel a request (client gone); frees its KV and grammar state."""

    request_id: str


@dataclass(frozen=True)
class Wake:
    """Inbox message: wake the loop (shutdown)."""


class AsyncEngine:
    """Thread-safe front of one Engine. `generate` is an async iterator of RequestOutput; every
    engine call happens on the engine's loop thread (requests and aborts cross over through an
    inbox).

    start_thread=True runs the loop in a background thread. The server instead calls
    `run_forever()` on the main thread and serves HTTP from another: torch's CPU intra-op
    parallelism (OpenMP) is measured ~30% slower when driven from a non-main thread
    (SmolLM2 decode: 19 vs 14 tokens/s on 2 cores)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        engine: Engine | None = None,
        start_thread: bool = True,
        admission: AdmissionConfig | None = None,
    ):
        self._owns_engine = engine is None
        self.engine = engine or Engine(config)
        self.admission = admission or AdmissionConfig()
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap (engine thread)
        # admitted requests not yet handed to the engine (compiling, or in the inbox); with the
        # engine's waiting queues under `_admit_lock` this is the count `max_queued_requests` bounds
        self._num_admitting = 0
        self._admit_lock = threading.Lock()
        base_load = self.engine.metrics.load
        self.engine.metrics.set_load(lambda: self._load(base_load()))
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

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding (token ids are below it)."""
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        """The model's context limit in tokens."""
        return self.engine.max_model_len

    @property
    def runner(self):
        """The engine's ModelRunner (device, dtype, KV pool, memory plan: read-only use)."""
        return self.engine.runner

    @property
    def model_config(self) -> ModelConfig:
        """The engine's model settings (its chat template's budget, ...: read-only use)."""
        return self.engine.config.model

    @property
    def grammar_config(self) -> GrammarConfig:
        """The engine's constraint settings (compile limits, e.g. max_constraint_bytes: read-only use)."""
        return self.engine.config.grammar

    @property
    def decoded_vocab(self) -> list[bytes]:
        """Each token id's raw bytes as the grammar backend decodes the vocabulary (xgrammar's
        TokenizerInfo.decoded_vocab: one entry per logit row; read-only use)."""
        return self.engine.grammar.info.decoded_vocab

    def metrics_text(self) -> bytes:
        """The engine's Prometheus metrics (text exposition format)."""
        return self.engine.metrics.render()

    @property
    def num_waiting(self) -> int:
        """Requests admitted and not yet running (see AdmissionConfig.max_queued_requests): what the
        `agentrt_num_requests_waiting` gauge shows. Any thread may read it."""
        with self._admit_lock:
            return self._num_waiting_locked()

    @property
    def num_inbox_messages(self) -> int:
        """Messages (new requests, aborts) not yet taken by the engine thread; for tests and
        debugging."""
        return self._inbox.qsize()

    def _num_waiting_locked(self) -> int:
        engine = self.engine
        return self._num_admitting + len(engine.scheduler.waiting) + len(engine.grammar_wait)

    def _load(self, base: LoadGauges) -> LoadGauges:
        return base._replace(num_waiting=base.num_waiting + self._num_admitting)

    async def compile(self, spec: ConstraintSpec, timeout_s: float | None = None):
        """Compile (or find cached) a constraint without blocking the event loop; returns the
        CompiledConstraint. Raises ConstraintError (an InvalidRequestError), ServiceUnavailableError
        (compile threads busy), TimeoutError after `timeout_s` seconds (None: the compile's own
        limit). Cancelling this wait (or its timeout) releases this caller's interest in the
        compile (`_release_compile`); equal specs share one compile, which runs on for others."""
        fut = self.engine.grammar.submit(spec)
        waiter = asyncio.wrap_future(fut)
        waiter.add_done_callback(_retrieve)  # the outcome may come after we stopped waiting
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except (asyncio.CancelledError, TimeoutError):
            self._release_compile(spec, fut)
            raise
        except AgentrtError:
            raise
        except Exception as e:  # a bug in a compile path: this request fails, nothing else
            logger.exception("constraint compile failed")
            raise InternalError(
                f"internal error while compiling the constraint: {type(e).__name__}: {e}"
            ) from None

    def _release_compile(self, spec: ConstraintSpec, fut) -> None:
        """The request waiting for `fut` (its own future of the compile of `spec`) left: client gone
        or request timeout. Cancelling that future releases this caller's interest; the grammar
        backend cancels a compile nobody waits for any more (grammars/compile_queue.py), others with
        an equal spec keep theirs."""
        fut.cancel()

    async def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: ConstraintSpec | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> RequestStream:
        """Validate, admit, compile the constraint (once), enqueue; returns the request's output
        stream. Raises InvalidRequestError / ContextLengthError (validation), QueueFullError (over
        `max_queued_requests`), ConstraintError (compile), RequestTimeoutError (the compile outlasted
        `request_timeout_s`), ServiceUnavailableError (shutting down), all before anything is queued.
        Cancelling the call (the client left) leaves nothing queued: a request cancelled while its
        constraint compiles never starts."""
        request = self.engine.make_request(
            prompt_ids, params, constraint, request_id or uuid.uuid4().hex, cache_salt
        )
        limits = self.admission
        deadline = (
            time.monotonic() + limits.request_timeout_s if limits.request_timeout_s is not None else None
        )
        self._admit()
        handed_over = False
        try:
            compiled = None
            if constraint is not None:
                try:
                    compiled = await self.compile(constraint, _remaining(deadline))
                except TimeoutError:
                    raise self._timeout_error("while its constraint compiled") from None
            loop = asyncio.get_running_loop()
            stream: asyncio.Queue = asyncio.Queue()
            added = loop.create_future()
            self._inbox.put(AddRequest(request, compiled, loop, stream, added, deadline))
            handed_over = True  # the engine thread counts it out of `_num_admitting`
            try:
                await added
            except asyncio.CancelledError:
                self.abort(request.request_id)  # queued behind the AddRequest: it never runs on
                raise
        finally:
            if not handed_over:
                self._handed_over()
        return RequestStream(
            self, request.request_id, stream, list(compiled.not_enforced) if compiled else []
        )

    def _admit(self) -> None:
        """Count one more waiting request, or raise QueueFullError when `max_queued_requests`
        already wait."""
        limit = self.admission.max_queued_requests
        with self._admit_lock:
            if limit is not None:
                n = self._num_waiting_locked()
                if n >= limit:
                    self.engine.stats.num_rejected["queue_full"] += 1
                    raise QueueFullError(
                        f"the server is busy: {n} requests are already waiting to run (limit "
                        f"{limit}, --max-queued-requests); retry after {self.admission.retry_after_s} s",
                        num_waiting=n,
                        max_queued_requests=limit,
                        retry_after_s=self.admission.retry_after_s,
                    )
            self._num_admitting += 1

    def _timeout_error(self, where: str) -> RequestTimeoutError:
        t = self.admission.request_timeout_s
        return RequestTimeoutError(
            f"the request did not finish within the server's limit of {t:g} s (--request-timeout); "
            f"it was stopped {where}",
            timeout_s=t,
        )

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: ConstraintSpec | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """`submit`, then yield the request's outputs until the final one. Closing the iterator early
        (client disconnect) aborts the request and frees its KV and grammar state."""
        stream = await self.submit(prompt_ids, params, constraint, request_id, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Cancel a request (any thread): the engine thread takes it before its next step, so the
        request stops within one step and frees its KV, radix-tree locks and grammar state; its
        stream ends with finish_reason "abort"."""
        self._inbox.put(AbortRequest(request_id))

    def request_stop(self) -> None:
        """Ask the engine loop to exit within 0.5 s; safe in a signal handler (sets an event, takes
        no lock: the handler may interrupt the loop's own thread while it holds the inbox lock)."""
        self._stop.set()

    def fail_pending(self, message: str) -> None:
        """After the loop has stopped (on the thread that ran it): end every request, queued or
        running, with a ServiceUnavailableError, so streams finish with an error event instead of
        hanging."""
        error = ServiceUnavailableError(message)
        with contextlib.suppress(queue.Empty):
            while True:
                msg = self._inbox.get_nowait()
                if isinstance(msg, AddRequest):
                    self._handed_over()
                    _call_soon(msg.loop, _set_exception, msg.added, error)
        for out in self.engine.fail_all(error):
            self._deliver(out)

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(Wake())
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        if self._owns_engine:
            self.engine.grammar.shutdown()
            self.engine.close()

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self, should_stop=lambda: False) -> None:
        engine = self.engine
        while not self._stop.is_set() and not should_stop():
            block = not engine.has_work()
            while True:
                try:
                    msg = self._inbox.get(block=block, timeout=0.5 if block else None)
                except queue.Empty:
                    break
                block = False
                self._handle(msg)
            if self._deadlines:
                self._expire(time.monotonic())
            if not engine.has_work():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug must not take the server down: fail the batch, go on
                logger.exception("engine step failed")
                outputs = engine.fail_all(InternalError(f"internal engine error: {type(e).__name__}: {e}"))
            for out in outputs:
                self._deliver(out)

    def _expire(self, now: float) -> None:
        """Stop the requests whose deadline has passed (finish_reason "error", RequestTimeoutError)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            if request_id in self._streams:  # not finished yet
                out = self.engine.abort(request_id, error=self._timeout_error("while it ran"))
                if out is not None:
                    self._deliver(out)

    def _handle(self, msg: AddRequest | AbortRequest | Wake) -> None:
        if isinstance(msg, AddRequest):
            self._streams[msg.request.request_id] = (msg.loop, msg.stream)
            try:
                out = self.engine.enqueue(msg.request, msg.compiled)
            except Exception as e:  # a fault while queueing fails this request only
                self._handed_over()
                logger.exception("enqueue of %s failed", msg.request.request_id)
                del self._streams[msg.request.request_id]
                err = (
                    e
                    if isinstance(e, AgentrtError)
                    else InternalError(f"internal error: {type(e).__name__}: {e}")
                )
                _call_soon(msg.loop, _set_exception, msg.added, err)
                return
            self._handed_over()  # (after enqueue: may count it twice for an instant, never zero times)
            _call_soon(msg.loop, _set_result, msg.added)
            if msg.deadline is not None:
                heapq.heappush(self._deadlines, (msg.deadline, msg.request.request_id))
            if out is not None:
                self._deliver(out)
        elif isinstance(msg, AbortRequest):
            out = self.engine.abort(msg.request_id)
            if out is not None:
                self._deliver(out)

    def _handed_over(self) -> None:
        """One admitted request left the inbox (into the engine's queues, or failed)."""
        with self._admit_lock:
            self._num_admitting -= 1

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._streams.get(out.request_id)
        if entry is None:
            return
        if out.finished:
            del self._streams[out.request_id]
            if len(self._deadlines) > 2 * len(self._streams) + 64:  # finished ones linger till due
                self._deadlines = [d for d in self._deadlines if d[1] in self._streams]
                heapq.heapify(self._deadlines)
        loop, stream = entry
        _call_soon(loop, stream.put_nowait, out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run fn(*args) on the caller's event loop, unless that loop is closed (the caller is gone)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a future's exception as retrieved (nobody may be waiting for it any more)."""
    if not fut.cancelled():
        fut.exception()


def _set_result(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future, e: Exception) -> None:
    if not fut.done():
        fut.set_exception(e)


class RequestStream:
    """The outputs of one submitted request, in order: `async for out in stream` yields
    RequestOutput until the final one (finished=True). `not_enforced`: schema keywords dropped
    under best-effort (strict: false). `aclose()` aborts the request if it has not finished."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue_: asyncio.Queue, not_enforced: list[str]):
        self._engine, self.request_id, self._queue, self.not_enforced = (
            engine,
            request_id,
            queue_,
            not_enforced,
        )
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._queue.get()
        self.finished = out.finished
        return out

    async def aclose(self) -> None:
        """Abort the request unless it has finished (as `cancel`)."""
        self.cancel()

    def cancel(self) -> None:
        """Abort the request unless it has finished (safe from a callback: does not wait); it stops
        within one engine step."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)
