"""Compile scheduling: a small pool of low-priority daemon threads, one shared job per constraint
(equal specs compile once) with counted waiters, and time limits that tell a constraint's own cost
(400, ConstraintError) from a busy server (503, ServiceUnavailableError, retryable).

- Concurrency: `GrammarConfig.compile_threads` workers (default 1 per 4 cores, at least 1: on the
  2-core development box one compile may use one core while the engine loop keeps the other;
  xgrammar's own compile threads are 1 per worker for the same reason). A compile past its time
  limit cannot be interrupted (xgrammar runs it in C++ without a cancellation point): it keeps its
  thread, a replacement worker takes its place, and while `max_stuck` such compiles still run, new
  constraints are refused with a ServiceUnavailableError instead of queuing behind them.
- Priority: each worker lowers its own scheduling priority (`os.setpriority` on its native thread
  id: Linux nice values are per thread; threads xgrammar starts inherit it), so the engine loop
  keeps the CPU while grammars compile.
- Waiters: `submit` returns one future per caller. Cancelling it releases that caller's interest;
  when no caller is left, a compile still queued is cancelled (never started), and a running one
  is left to finish in the background (its result is cached) while a replacement worker serves the
  queue.
- Time limits: a compile still queued after `compile_queue_timeout_s` fails with
  ServiceUnavailableError (the queue, not the constraint, is slow). A running compile past
  `compile_timeout_s` fails with ConstraintError when its thread used at least a tenth of that time
  in CPU (the constraint is expensive), else with ServiceUnavailableError (it was starved of CPU:
  a compile at a lowered priority on a saturated machine).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from agentrt.errors import ConstraintError, ServiceUnavailableError
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig


class _Job:
    """One compile shared by every request with an equal spec."""

    def __init__(self, spec: ConstraintSpec):
        self.spec = spec
        self.done: Future = Future()  # the shared outcome
        self.inner: Future | None = None  # the pool's task
        self.waiters = 0
        self.cpu_clock: int | None = None  # the worker thread's CPU clock while it runs
        self.cpu_start = 0.0


class CompileQueue:
    """Runs `compile_fn(spec)` (-> CompiledConstraint, raising ConstraintError) on the pool, caches
    outcomes by `spec.key` (LRU, `config.cache_size`). Thread-safe."""

    def __init__(self, compile_fn: Callable, config: GrammarConfig):
        self._fn, self.config = compile_fn, config
        self.pool = DaemonPool(
            config.compile_threads, "grammar-compile", max(2, config.compile_threads), config.compile_nice
        )
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, spec: ConstraintSpec) -> Future:
        """This caller's future of the CompiledConstraint (see the module docstring for the errors
        it may hold). `future.cancel()` releases the caller's interest in the compile."""
        with self._lock:
            job = self._jobs.get(spec.key)
            if job is not None:
                self._jobs.move_to_end(spec.key)
            else:
                if self.pool.num_stuck >= self.pool.max_stuck:
                    return _failed(  # the server is busy, not the request at fault: 503, not cached
                        ServiceUnavailableError(
                            f"{self.pool.num_stuck} earlier constraints are still compiling past the "
                            f"{self.config.compile_timeout_s:g} s limit; this one was not started, "
                            "try again later"
                        )
                    )
                job = _Job(spec)
                job.inner = self.pool.submit(self._run, job)
                # a cancelled task (queue timeout, nobody waiting) is answered by whoever cancelled it
                job.inner.add_done_callback(lambda f, job=job: f.cancelled() or _forward(f, job.done))
                timer = threading.Timer(self.config.compile_queue_timeout_s, self._queue_timeout, (job,))
                timer.daemon = True
                timer.start()
                job.done.add_done_callback(lambda _f, t=timer: t.cancel())
                self._jobs[spec.key] = job
                while len(self._jobs) > self.config.cache_size:
                    self._jobs.popitem(last=False)
            waiter: Future = Future()
            if not job.done.done():
                job.waiters += 1
                waiter.add_done_callback(lambda w, job=job: self._on_waiter_done(w, job))
        job.done.add_done_callback(lambda d: _forward(d, waiter))
        return waiter

    @property
    def num_queued(self) -> int:
        """Compiles waiting for a worker."""
        return self.pool.num_queued

    def _on_waiter_done(self, waiter: Future, job: _Job) -> None:
        if not waiter.cancelled():
            return
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.done.done():
                return
            if job.inner.cancel():  # still queued: never starts
                self._drop(job)
                started = False
            else:
                started = True
        if started:
            self.pool.abandon(job.inner)  # it finishes in the background; the queue moves on
        else:
            job.done.cancel()

    def _run(self, job: _Job):
        """On a worker: the compile, with its own time limit from now on."""
        job.cpu_clock = time.pthread_getcpuclockid(threading.get_ident())
        job.cpu_start = time.clock_gettime(job.cpu_clock)
        timer = threading.Timer(self.config.compile_timeout_s, self._run_timeout, (job,))
        timer.daemon = True
        timer.start()
        try:
            return self._fn(job.spec)
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
        limit = self.config.compile_timeout_s
        try:
            cpu = time.clock_gettime(job.cpu_clock) - job.cpu_start
        except OSError:  # the thread ended just now
            return
        if cpu >= limit / 10:
            error = ConstraintError(f"{job.spec.kind} constraint did not compile within {limit:g} s")
        else:
            error = ServiceUnavailableError(
                f"the {job.spec.kind} constraint did not compile within {limit:g} s on a busy server "
                f"(its compile got {cpu:.1f} s of CPU); try again later"
            )
        if self._fail(job, error):
            self.pool.abandon(job.inner)

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

    def shutdown(self) -> None:
        self.pool.shutdown()


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
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        while (item := self._queue.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (handed to the waiting request)
                fut.set_exception(e)
            with self._lock:
                if fut in self._abandoned:  # replaced meanwhile: this worker is one too many
                    self._abandoned.discard(fut)
                    self._threads.remove(threading.current_thread())
                    return

    def shutdown(self) -> None:
        """Cancel what has not started; idle workers exit, busy ones are left to the process."""
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._queue.put(None)


def _failed(error: Exception) -> Future:
    fut: Future = Future()
    fut.set_exception(error)
    return fut


def _forward(src: Future, dst: Future) -> None:
    """Copy a finished future's outcome into `dst` unless `dst` is already done (timed out,
    cancelled)."""
    with contextlib.suppress(InvalidStateError):
        if src.cancelled():
            dst.cancel()
        elif src.exception() is not None:
            dst.set_exception(src.exception())
        else:
            dst.set_result(src.result())
