"""Constraint compiles in child processes that can be killed at their deadline.

xgrammar compiles in C++ without a cancellation point, and the Python work before it (JSON Schema
normalization and conversion, regex / Lark -> EBNF, tool-call structural tags, the finite-output
check) holds the GIL: on a thread neither can be stopped. So a child process runs the whole
pipeline, `pipeline.build_constraint` (spec -> grammar -> finite check -> compile), and the
deadline covers all of it.

What runs where: a `Zygote` is a small single-threaded helper process (`python -m
agentrt.grammars.compile_child`) holding xgrammar, the tokenizer's `TokenizerInfo` and the
pipeline's modules, loaded once before any fork. For each compile it forks a child (a fork of a
single-threaded process is safe; a fork of the multi-threaded server could inherit a lock another
thread holds, and hang). The child lowers its priority to the calling compile thread's nice value
and may grow its address space by at most `memory_bytes` past the zygote's (RLIMIT_AS).

What crosses the process boundary: to the child, the spec (kind, value, strict) and the JSON
layout options as JSON; back, over the child's own socket, whose other end the zygote hands to the
server (SCM_RIGHTS), one of: the grammar as EBNF text (xgrammar's own printing of it, which
`Grammar.from_ebnf` reads back exactly) with the keywords dropped under best effort, the
forced-text bound and the unique-strings plan, sent once the child has compiled it (the proof that
the compile ends within the deadline); the ConstraintError's fields (message, param, keyword, JSON
pointer, tool index), raised here as they were; or the traceback of an unexpected exception. The
compiled grammar does not cross: the server compiles the EBNF again (GrammarBackend in
xgrammar_backend.py: the work the child just finished, so bounded by the same deadline; xgrammar
releases the GIL while it compiles), because xgrammar's serialization of a compiled grammar is not
proportional to it (docs/benchmarks.md, "The compile child sends EBNF text").

Limits and errors: past the deadline the server kills the child and raises CompileTimeout with
the CPU time it used (/proc), which tells an expensive constraint (400) from a starved one (503);
a compile past the memory budget is a ConstraintError naming the limit; a bug in the child is
CompileChildError (not a 400); a zygote or child that died is RuntimeError. The zygote takes
seconds to start and holds ~300 MB; a compile in a child costs a fork and the transfers
(docs/benchmarks.md, "All of a compile in the child"). POSIX only; GrammarConfig.compile_in_child
turns it off (the same pipeline then runs on the compile thread, unkillable).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import xgrammar as xgr

from agentrt.errors import ConstraintError
from agentrt.grammars.finite import ForcedBound
from agentrt.grammars.pipeline import Built, build_constraint, spec_grammar
from agentrt.grammars.spec import ConstraintSpec

_HEADER = struct.Struct("!Q")
_OK, _ERROR, _FAULT = b"O", b"E", b"F"


class CompileChildError(Exception):
    """The child failed with an unexpected exception (a bug, not a refusal): its traceback is the
    message. Deliberately not a RuntimeError/ValueError, so it is not answered as a 400."""


class CompileTimeout(Exception):
    """The child ran past the deadline and was killed. `cpu_s`: the CPU time it had used."""

    def __init__(self, cpu_s: float):
        super().__init__(f"compile killed after {cpu_s:.1f} s of CPU")
        self.cpu_s = cpu_s


class Zygote:
    """The compile helper process for one TokenizerInfo (started on first use, restarted when it
    dies). Thread-safe: compiles from several threads run in parallel children."""

    def __init__(self, info: xgr.TokenizerInfo, memory_bytes: int | None = None):
        """Starts the zygote now, on the calling thread (it inherits that thread's nice value,
        which bounds its children's: create it on an unniced thread); it loads while the server
        starts. A restart after it died happens on a compile thread. `memory_bytes`: how far each
        child's address space may grow past the zygote's (RLIMIT_AS; None: no limit); a compile
        that needs more fails with a ConstraintError naming the limit."""
        self.info = info
        self.memory_bytes = memory_bytes
        self._info_json: bytes | None = None
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._sent_info = False
        self._spawn()
        # it imports xgrammar and loads the vocabulary (seconds) while the server starts
        threading.Thread(target=self._warm_up, name="grammar-zygote-start", daemon=True).start()

    def _warm_up(self) -> None:
        with contextlib.suppress(OSError, EOFError):
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the zygote has started and loaded the vocabulary (its first compile then
        starts at once). Raises OSError or EOFError when it cannot start."""
        with self._lock:
            self._ensure_started()

    def compile(self, spec: ConstraintSpec, ws: dict, deadline: float, nice: int = 0) -> Built:
        """`pipeline.build_constraint(spec, ws, GrammarCompiler(info))` in a child at `nice`:
        all of it (JSON parsing, schema normalization and conversion, the finite check, the
        compile) is bounded by `deadline`, time.monotonic() after which the child is killed. The
        result's `grammar` is None: the caller compiles `ebnf` (see the module docstring).
        Raises CompileTimeout past the deadline; the ConstraintError the pipeline raised (message,
        param, keyword, pointer, tool_index as they were); RuntimeError when the child or the
        zygote died (or the result could not be loaded); CompileChildError on a bug in the child."""
        job = {
            "kind": spec.kind,
            "value": spec.value,
            "strict": spec.strict,
            "reasoning": spec.reasoning,
            "ws": ws,
        }
        head = {"nice": nice, "memory": self.memory_bytes}
        request = json.dumps(head).encode() + b"\n" + json.dumps(job, ensure_ascii=False).encode()
        waited = time.monotonic()
        with self._lock:
            try:
                sock = self._ensure_started()
            except (OSError, EOFError) as e:
                self._stop()
                raise RuntimeError(f"the compile helper process did not start: {e}") from None
            deadline += time.monotonic() - waited  # (its start-up is not this compile's time)
            try:
                _send(sock, request)
                msg, fds, _, _ = socket.recv_fds(sock, 64, 1)
            except OSError as e:
                self._stop()
                raise RuntimeError(f"the compile helper process failed: {e}") from None
            if not fds:
                self._stop()
                raise RuntimeError("the compile helper process ended")
        pid = int(msg.decode())
        with socket.socket(fileno=fds[0]) as result:
            data = _recv_until(result, deadline)
            if data is None:
                cpu = _cpu_seconds(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise CompileTimeout(cpu)
        return self._load(data)

    def _load(self, data: bytes) -> Built:
        """The child's answer: _OK + JSON head line + the grammar's EBNF text, _ERROR + the
        ConstraintError's fields as JSON, _FAULT + a traceback."""
        kind, body = data[:1], data[1:]
        if kind == _OK:
            head, _, ebnf = body.partition(b"\n")
            meta = json.loads(head)
            bound = meta["forced_bound"]
            return Built(
                None,
                ebnf.decode(),
                meta["not_enforced"],
                None if bound is None else ForcedBound(*bound),
                meta.get("unique_plan"),
            )
        if kind == _ERROR:
            f = json.loads(body)
            raise ConstraintError(
                f["message"],
                f["param"],
                keyword=f["keyword"],
                pointer=f["pointer"],
                tool_index=f["tool_index"],
            )
        if kind == _FAULT:
            raise CompileChildError(body.decode(errors="replace"))
        raise RuntimeError("the grammar compile process ended without a result")

    def _ensure_started(self) -> socket.socket:
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._spawn()
        if not self._sent_info:  # blocks until the zygote has imported xgrammar and loaded it
            if self._info_json is None:
                self._info_json = self.info.serialize_json().encode()
            _send(self._sock, self._info_json)
            _recv_exact(self._sock, 1)  # ready
            self._sent_info = True
        return self._sock

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "agentrt.grammars.compile_child", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: Ctrl-C reaches the server only
        )
        theirs.close()
        self._sock, self._sent_info = ours, False

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the zygote exits on EOF and kills its children
            self._sock = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _recv_until(sock: socket.socket, deadline: float) -> bytes | None:
    """Everything the child writes until it closes its end (b"" if it died), or None at the
    deadline."""
    parts = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([sock], [], [], remaining)[0]:
            return None
        chunk = sock.recv(1 << 20)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc); infinity when unknown (counts as expensive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("inf")


# ---- the zygote process ------------------------------------------------------------------------
def _zygote_main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _warm_up()
        info = xgr.TokenizerInfo.deserialize_json(
            _recv_exact(sock, _HEADER.unpack(_recv_exact(sock, 8))[0]).decode()
        )
        # the objects loaded so far are never garbage: children's collections skip them (and do
        # not write to, so copy, the pages they share with this process)
        gc.freeze()
        sock.sendall(b"R")  # ready
        while True:
            request = _recv_exact(sock, _HEADER.unpack(_recv_exact(sock, 8))[0])
            head, _, job = request.partition(b"\n")
            parent_end, child_end = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                sock.close()
                parent_end.close()
                limits = json.loads(head)
                _child(info, limits["nice"], limits["memory"], job, child_end)
            child_end.close()
            socket.send_fds(sock, [str(pid).encode()], [parent_end.fileno()])
            parent_end.close()
    except (EOFError, OSError):  # the server closed its end (or is gone)
        pass
    finally:
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)  # our children too (we lead our own process group)


def _warm_up() -> None:
    """Load once, before any fork, what a compile imports on first use beside the pipeline (imported
    with this module): jsonschema (its format checkers build Lark parsers at import), lark, the
    tool formats; and convert one small schema (the normalizer's lazy set-up). Single-threaded, so
    forks stay safe. A failure here is left to the compile that meets it."""
    with contextlib.suppress(Exception):
        import agentrt.grammars.lark_grammar
        import agentrt.grammars.tool_calls  # noqa: F401

        schema = '{"type":"object","properties":{"a":{"type":"string","pattern":"^a"}},"required":["a"]}'
        spec_grammar(ConstraintSpec("json_schema", schema), [], {"any_whitespace": False, "indent": None})


def _child(
    info: xgr.TokenizerInfo, nice: int, memory: int | None, job_json: bytes, out: socket.socket
) -> None:
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if nice:
            with contextlib.suppress(OSError):
                os.nice(nice)
        if memory is not None:  # the address space it has (the zygote's, shared) plus the budget
            vm = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(resource.RLIMIT_AS, (vm + memory, resource.RLIM_INFINITY))
        out.sendall(_run_job(info, job_json, memory))
        code = 0
    finally:
        with contextlib.suppress(BaseException):
            out.close()
        os._exit(code)


def _run_job(info: xgr.TokenizerInfo, job_json: bytes, memory: int | None = None) -> bytes:
    """The answer to one compile job (the format Zygote._load reads). Running out of the memory
    budget (MemoryError: Python's, or xgrammar's std::bad_alloc) is the constraint's error."""
    try:
        job = json.loads(job_json)
        spec = ConstraintSpec(job["kind"], job["value"], job["strict"], job.get("reasoning", ""))
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        built = build_constraint(spec, job["ws"], compiler)
        head = json.dumps(
            {
                "not_enforced": built.not_enforced,
                "forced_bound": built.forced_bound,
                "unique_plan": built.unique_plan,
            }
        )
        return _OK + head.encode() + b"\n" + built.ebnf.encode()
    except ConstraintError as e:
        if "bad_alloc" in e.message:  # xgrammar's std::bad_alloc, wrapped by build_constraint
            return _memory_refusal(memory)
        fields = {
            "message": e.message,
            "param": e.param,
            "keyword": e.keyword,
            "pointer": e.pointer,
            "tool_index": e.tool_index,
        }
        return _ERROR + json.dumps(fields, default=str).encode()
    except MemoryError:
        return _memory_refusal(memory)
    except Exception as e:  # noqa: BLE001 (a bug: its traceback goes to the server's log)
        return _FAULT + "".join(traceback.format_exception(e)).encode(errors="replace")


def _memory_refusal(memory: int | None) -> bytes:
    """The answer to a compile that ran out of its memory budget (a 400 naming the limit)."""
    gc.collect()
    limit = f"{memory / (1 << 20):.0f} MiB" if memory is not None else "the memory available"
    message = f"the constraint needs more memory to compile than the compile limit ({limit})"
    return _ERROR + json.dumps({"message": message, "param": None, "keyword": None, "pointer": None,
                                "tool_index": None}).encode()  # fmt: skip


if __name__ == "__main__":
    # (the importable module, so that the backend the children import shares its classes)
    from agentrt.grammars.compile_child import _zygote_main as main

    main(int(sys.argv[1]))
