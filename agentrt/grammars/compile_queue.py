"""Compile scheduling: a small pool of low-priority daemon threads, one shared job per constraint
(equal specs compile once) with counted waiters, and time limits that tell a constraint's own cost
(400, ConstraintError) from a busy server (503, ServiceUnavailableError, retryable).

- Concurrency: `GrammarConfig.compile_threads` workers (default 1 per 4 cores, at least 1: on the
  2-core development box one compile may use one core while the engine loop keeps the other;
  xgrammar's own compile threads are 1 per worker for the same reason). With `compile_in_child`
  the whole compile (conversion and finite check included) runs in a child process killed at its
  limit (grammars/compile_child.py), and the worker is free at once. In process, a compile past its
  time limit cannot be interrupted (xgrammar runs it in C++ without a cancellation point): it keeps
  its thread, a replacement worker takes its place, and while `max_stuck` such compiles still run,
  new constraints are refused with a ServiceUnavailableError instead of queuing behind them.
- Priority: each worker lowers its own scheduling priority (`os.setpriority` on its native thread
  id: Linux nice values are per thread; threads xgrammar starts inherit it), so the engine loop
  keeps the CPU while grammars compile. Aging against starvation: a compile still queued after
  `compile_relief_s` moves to a relief worker at the process's own priority (a lowered thread
  cannot raise itself again without privileges). On a machine saturated by decoding the nice
  worker gets a sliver of a core (the real-model soak: ~1/6, 503s for 6 in 10 fresh grammars);
  the relief worker keeps compiles flowing at the price of decode speed while it runs.
- Waiters: `submit` returns one future per caller. Cancelling it releases that caller's interest;
  when no caller is left, a compile still queued is cancelled (never started), and a running one
  finishes on its worker (its result is cached) within its own time limit, as if its caller had
  stayed. (Giving it up at once, with a replacement worker, counted it as stuck: two clients that
  left while their cheap compiles ran made the next constraint fail with a 503 claiming compiles
  "still running past the limit".)
- Time limits: a compile still queued after `compile_queue_timeout_s` fails with
  ServiceUnavailableError (the queue, not the constraint, is slow). A running compile past
  `compile_timeout_s` fails with ConstraintError when its thread used at least a tenth of that time
  in CPU (the constraint is expensive), else with ServiceUnavailableError (it was starved of CPU:
  a compile at a lowered priority on a saturated machine).
- Cache: outcomes by `spec.key`, least recently used first out while more than `cache_size` are
  kept or the compiled grammars hold more than `cache_bytes` (xgrammar's `memory_size_bytes`).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from functools import partial

from agentrt.errors import AgentrtError, ConstraintError, ServiceUnavailableError
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig

logger = logging.getLogger(__name__)


class _Job:
    """One compile shared by every request with an equal spec. Nothing the job owns refers back
    to it once it is done (no reference cycle), so an evicted job and its compiled grammar are freed
    at once, not at the next full garbage collection."""

    def __init__(self, spec: ConstraintSpec):
        self.spec = spec
        self.done: Future = Future()  # the shared outcome
        self.inner: Future | None = None  # the pool's task
        self.waiters: list[Future] = []  # callers' futures not yet answered (cleared when done)
        self.cpu_clock: int | None = None  # the worker thread's CPU clock while it runs
        self.cpu_start = 0.0
        self.nbytes = 0  # the compiled grammar's memory, once cached
        self.pool: DaemonPool | None = None  # the pool running `inner`


class CompileQueue:
    """Runs `compile_fn(spec)` (-> CompiledConstraint, raising ConstraintError) on the pool, caches
    outcomes by `spec.key` (LRU, `config.cache_size` entries and `config.cache_bytes`). Thread-safe."""

    def __init__(self, compile_fn: Callable, config: GrammarConfig, run_grace_s: float = 0.0):
        """run_grace_s: the queue's own run-time limit is compile_timeout_s plus this (a compile
        function that enforces compile_timeout_s itself, as a child-process compile does, answers
        first; the queue's limit is the backstop for the rest of its work)."""
        self._fn, self.config, self.run_grace_s = compile_fn, config, run_grace_s
        self.pool = DaemonPool(
            config.compile_threads, "grammar-compile", max(2, config.compile_threads), config.compile_nice
        )
        relief = config.compile_relief_s is not None and config.compile_nice != 0
        self.relief = (
            DaemonPool(1, "grammar-compile-relief", max(2, config.compile_threads)) if relief else None
        )
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self.cached_bytes = 0  # sum of the cached jobs' nbytes
        # re-entrant: a Future runs callbacks added after it finished at once, in the adding thread,
        # so a compile that ends before submit() has registered its callbacks calls _answer (which
        # takes this lock) from inside submit (a plain Lock deadlocked there)
        self._lock = threading.RLock()
        self._timers = _Timers("grammar-compile-timer")

    def submit(self, spec: ConstraintSpec) -> Future:
        """This caller's future of the CompiledConstraint (see the module docstring for the errors
        it may hold; each caller gets its own copy of the exception, without a traceback).
        `future.cancel()` releases the caller's interest in the compile."""
        waiter: Future = Future()
        with self._lock:
            job = self._jobs.get(spec.key)
            if job is not None:
                self._jobs.move_to_end(spec.key)
            else:
                if (num_stuck := self._num_stuck()) >= self.pool.max_stuck:
                    return _failed(  # the server is busy, not the request at fault: 503, not cached
                        ServiceUnavailableError(
                            f"{num_stuck} earlier constraints are still compiling past the "
                            f"{self.config.compile_timeout_s:g} s limit; this one was not started, "
                            "try again later"
                        )
                    )
                job = _Job(spec)
                self._start(job, self.pool)
                timers = [
                    self._timers.call_later(self.config.compile_queue_timeout_s, self._queue_timeout, job)
                ]
                if self.relief is not None:
                    timers.append(self._timers.call_later(self.config.compile_relief_s, self._relieve, job))
                # (callbacks hold the waiter list and the timers, never the job: see _Job)
                job.done.add_done_callback(partial(self._answer, job.waiters, timers))
                self._jobs[spec.key] = job
                self._evict()
            if not job.done.done():  # (else _answer has run or runs after this lock: answered below)
                job.waiters.append(waiter)
                waiter.add_done_callback(partial(self._on_waiter_done, job=job))
                return waiter
        _forward(job.done, waiter)
        return waiter

    def _start(self, job: _Job, pool: DaemonPool) -> None:
        job.pool, job.inner = pool, pool.submit(self._run, job)
        # a cancelled task (queue timeout, nobody waiting, moved) is answered by whoever cancelled it
        job.inner.add_done_callback(partial(_forward_unless_cancelled, dst=job.done))

    def _relieve(self, job: _Job) -> None:
        """Still queued after compile_relief_s: move it to the relief worker (module docstring)."""
        with self._lock:
            if job.pool is self.pool and not job.done.done() and job.inner.cancel():
                self._start(job, self.relief)

    def _num_stuck(self) -> int:
        return self.pool.num_stuck + (self.relief.num_stuck if self.relief is not None else 0)

    def _answer(self, waiters: list[Future], timers: list[_Timer], done: Future) -> None:
        """job.done finished: answer every waiter and drop them (the list is the job's)."""
        for timer in timers:
            timer.cancel()
        with self._lock:
            answered = waiters[:]
            waiters.clear()
        for waiter in answered:
            _forward(done, waiter)

    @property
    def num_queued(self) -> int:
        """Compiles waiting for a worker."""
        return self.pool.num_queued + (self.relief.num_queued if self.relief is not None else 0)

    def _on_waiter_done(self, waiter: Future, job: _Job) -> None:
        if not waiter.cancelled():
            return
        with self._lock:
            with contextlib.suppress(ValueError):  # (already answered)
                job.waiters.remove(waiter)
            if job.waiters or job.done.done():
                return
            if not job.inner.cancel():  # running: it finishes (or meets its time limit) on its worker
                return
            self._drop(job)  # still queued: never starts
        job.done.cancel()

    def _run(self, job: _Job):
        """On a worker: the compile, with its own time limit from now on."""
        job.cpu_clock = time.pthread_getcpuclockid(threading.get_ident())
        job.cpu_start = time.clock_gettime(job.cpu_clock)
        timer = self._timers.call_later(
            self.config.compile_timeout_s + self.run_grace_s, self._run_timeout, job
        )
        try:
            result = self._fn(job.spec)
            with self._lock:
                if self._jobs.get(job.spec.key) is job:
                    job.nbytes = _memory_size(result)
                    self.cached_bytes += job.nbytes
                    self._evict()
            return result
        except AgentrtError:
            raise
        except Exception:  # a bug: its traceback is logged here, callers get a copy without it
            logger.exception("compiling a %s constraint failed", job.spec.kind)
            raise
        finally:
            timer.cancel()

    def _queue_timeout(self, job: _Job) -> None:
        if not job.inner.cancel():  # already running (or done): its own limit applies
            return
        self._fail(
            job,
            ServiceUnavailableError(
                f"the {job.spec.kind} constraint waited {self.config.compile_queue_timeout_s:g} s for a "
                "compile thread: the server is busy compiling other constraints; try again later"
            ),
        )

    def _run_timeout(self, job: _Job) -> None:
        try:
            cpu = time.clock_gettime(job.cpu_clock) - job.cpu_start
        except OSError:  # the thread ended just now
            return
        if self._fail(job, compile_timeout_error(job.spec.kind, self.config.compile_timeout_s, cpu)):
            job.pool.abandon(job.inner)

    def _fail(self, job: _Job, error: Exception) -> bool:
        try:
            job.done.set_exception(error)
        except InvalidStateError:  # it finished just now
            return False
        with self._lock:
            self._drop(job)  # a later identical request may try again
        return True

    def _drop(self, job: _Job) -> None:
        if self._jobs.get(job.spec.key) is job:
            del self._jobs[job.spec.key]
            self.cached_bytes -= job.nbytes

    def _evict(self) -> None:
        """Least recently used jobs out until both cache limits hold (the newest always stays)."""
        limit_n, limit_b = self.config.cache_size, self.config.cache_bytes
        while len(self._jobs) > 1 and (len(self._jobs) > limit_n or self.cached_bytes > limit_b):
            _, job = self._jobs.popitem(last=False)
            self.cached_bytes -= job.nbytes

    def shutdown(self) -> None:
        self.pool.shutdown()
        if self.relief is not None:
            self.relief.shutdown()
        self._timers.shutdown()


def compile_timeout_error(kind: str, limit_s: float, cpu_s: float) -> AgentrtError:
    """The error of a compile past its `limit_s`: ConstraintError (400: the constraint is
    expensive) when it used at least a tenth of the limit in CPU, else ServiceUnavailableError
    (503, retryable: it was starved of CPU on a busy server)."""
    if cpu_s >= limit_s / 10:
        return ConstraintError(f"{kind} constraint did not compile within {limit_s:g} s")
    return ServiceUnavailableError(
        f"the {kind} constraint did not compile within {limit_s:g} s on a busy server "
        f"(its compile got {cpu_s:.1f} s of CPU); try again later"
    )


def _memory_size(result) -> int:
    """Bytes held by a compiled constraint (its xgrammar CompiledGrammar), 0 when unknown."""
    return int(getattr(getattr(result, "grammar", None), "memory_size_bytes", 0) or 0)


class DaemonPool:
    """A fixed pool of daemon worker threads at a lowered priority (`nice`, Linux per-thread). A
    task past its time limit keeps running (xgrammar cannot be interrupted); a ThreadPoolExecutor
    would join it at interpreter exit, so a server stopped with SIGTERM hung until the compile
    ended. Daemon threads do not."""

    def __init__(self, num_threads: int, name: str, max_stuck: int = 4, nice: int = 0):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._name, self._lock, self._nice = name, threading.Lock(), nice
        self._threads: list[threading.Thread] = []
        self._abandoned: set[Future] = set()
        self.max_stuck = max_stuck
        for _ in range(num_threads):
            self._spawn()

    def _spawn(self) -> None:
        t = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
        self._threads.append(t)
        t.start()

    @property
    def num_stuck(self) -> int:
        """Tasks given up on (abandon()) that are still running."""
        return len(self._abandoned)

    @property
    def num_queued(self) -> int:
        return self._queue.qsize()

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def abandon(self, fut: Future) -> None:
        """The caller stopped waiting for `fut`. If it is running, a new worker takes its place, so
        queued work is not starved; the old worker exits when the task ends."""
        with self._lock:
            if fut.running() and fut not in self._abandoned:
                self._abandoned.add(fut)
                self._spawn()

    def _work(self) -> None:
        if self._nice:
            with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted
                tid = threading.get_native_id()  # lower than the process's own, never higher
                os.setpriority(
                    os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self._nice)
                )
        while (item := self._queue.get()) is not None:
            if self._run_one(*item):
                return
            item = None  # (the finished task and its result are not kept while this worker waits)

    def _run_one(self, fut: Future, fn, args) -> bool:
        """Run one task; True when this worker was replaced meanwhile (abandon) and must exit."""
        if not fut.set_running_or_notify_cancel():
            return False
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 (handed to the waiting request)
            fut.set_exception(_fresh_copy(e))  # (its traceback's frames would hold `fut`: a cycle)
        with self._lock:
            if fut in self._abandoned:  # replaced meanwhile: this worker is one too many
                self._abandoned.discard(fut)
                self._threads.remove(threading.current_thread())
                return True
        return False

    def shutdown(self) -> None:
        """Cancel what has not started; idle workers exit, busy ones are left to the process."""
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)


class _Timer:
    """A pending call of _Timers; cancel() drops the function and its arguments at once."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args

    def cancel(self) -> None:
        self.fn, self.args = None, ()


class _Timers:
    """Calls at deadlines from one daemon thread, started on first use. Two per compile (queue wait,
    run time) as threading.Timer were two thread starts and stacks per compile: under a stream of
    fresh constraints, thread churn that glibc malloc answers with per-thread arenas."""

    def __init__(self, name: str):
        self._name = name
        self._heap: list[tuple[float, int, _Timer]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._stopped = False

    def call_later(self, delay_s: float, fn: Callable, *args) -> _Timer:
        """Run fn(*args) on the timer thread `delay_s` seconds from now unless cancelled before."""
        timer = _Timer(fn, args)
        with self._cond:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (time.monotonic() + delay_s, next(self._seq), timer))
            self._cond.notify()
        return timer

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._stopped:
                    return
                _, _, timer = heapq.heappop(self._heap)
                fn, args = timer.fn, timer.args
                timer.cancel()
            if fn is not None:
                try:
                    fn(*args)
                except Exception:  # a bug in a time-limit handler must not stop the others
                    logger.exception("compile timer callback failed")
            fn = args = None  # (nothing of a fired call is kept while this thread waits)

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify()


def _failed(error: Exception) -> Future:
    fut: Future = Future()
    fut.set_exception(error)
    return fut


def _forward_unless_cancelled(src: Future, dst: Future) -> None:
    if not src.cancelled():
        _forward(src, dst)


def _forward(src: Future, dst: Future) -> None:
    """Copy a finished future's outcome into `dst` unless `dst` is already done (timed out,
    cancelled). An exception is copied without its traceback: raising one shared exception object
    in every request with an equal spec chains each raise's frames onto its traceback (a leak that
    grows with every request repeating a failing constraint)."""
    with contextlib.suppress(InvalidStateError):
        if src.cancelled():
            dst.cancel()
        elif src.exception() is not None:
            dst.set_exception(_fresh_copy(src.exception()))
        else:
            dst.set_result(src.result())


def _fresh_copy(error: BaseException) -> BaseException:
    """`error` with the same type, args and attributes, without traceback, cause or context (the
    error itself for a type that cannot be rebuilt from its args)."""
    try:
        copy = type(error).__new__(type(error), *error.args)
        copy.__dict__.update(error.__dict__)
    except Exception:  # noqa: BLE001 (an exotic exception type: forwarded as it is)
        return error
    return copy
