"""Constraint compiles in child processes that can be killed at their deadline.

xgrammar compiles in C++ without a cancellation point. In a thread, a compile past
`compile_timeout_s` was answered (400) but kept running: two requests with schemas that take
minutes (an `anyOf` of 2,000 objects, an object with 5,000 required properties) held the compile
threads and every new constraint on the server got a 503 for minutes. The same held for the
Python work before the compile (JSON Schema normalization and conversion, regex / Lark -> EBNF,
tool-call structural tags, the finite-output check), which also holds the GIL: measured with two
3,000-rule `grammar` constraints and a 10 s limit when only xgrammar's compile ran here, every new
constraint got a 503 from 38 s to past 97 s, the conversion still running on unkillable threads.
So the child runs the whole pipeline, `xgrammar_backend.build_constraint` (spec -> grammar ->
finite check -> compile): the deadline covers all of it (same test: both 400 at 10 and 15 s, every
new constraint compiled meanwhile).

A `Zygote` is a small single-threaded helper process (`python -m agentrt.grammars.compile_child`)
holding xgrammar, the tokenizer's `TokenizerInfo` and the conversion's modules (loaded once before
any fork: importing jsonschema alone takes ~2 s). For each compile it forks a child (a fork of a
single-threaded process is safe; forking the multi-threaded server is not: a child can inherit a
lock another thread holds, and hang). The child receives the spec (kind, value, strict) and the
JSON layout options, runs the pipeline, and sends back over its own socket, whose other end the
zygote hands to the server (SCM_RIGHTS): the grammar as EBNF text (xgrammar's own printing of
it, which `Grammar.from_ebnf` reads back exactly) with the keywords dropped under best effort and
the forced-text bound, once the child has compiled it (the proof that the compile ends within the
deadline); or the ConstraintError's fields (message, param, keyword, JSON pointer, tool index),
raised here as they were; or the traceback of an unexpected exception (CompileChildError: a bug,
not a 400). Past the deadline the server kills the child; its CPU time (/proc) tells an expensive
constraint (400) from a starved one (503). The child lowers its priority to the calling compile
thread's nice value.

Why the text and not the compiled grammar: the server compiles the grammar again from its text
(xgrammar_backend.GrammarBackend: the same work the child just finished, so bounded by the same
deadline; xgrammar releases the GIL while it compiles, measured: the event loop's longest pause
5 ms during a 3 s compile). xgrammar's JSON serialization of a grammar is not proportional to it:
measured on this box, the schema-aware SQL grammar of a 4-table Spider database (274 kB of EBNF,
compiled in 1.0 s, 9 MB in memory) serialized to 1.1 GB of JSON in 87 s, a bounded variant of it
ran out of memory (std::bad_alloc past 8 GB), and so did one JSONSchemaBench sample schema; another
(0.1 s to compile, 0.6 MB) took 5.3 s to serialize and load. Its printed EBNF is 22 kB for a
schema whose serialization is 18 MB, and reads back in 7 ms. Over a third of the JSONSchemaBench
sample the compile and the serialize+load cost the same in total (13 s each), so compiling twice
costs about what the transfer did, without its blow-ups.

Costs, 2-core dev box, SmolLM2's 49k vocabulary: the zygote starts in ~5 s on an idle box
(importing xgrammar imports torch), ~2 s more with the conversion's modules, and holds ~300 MB
(measured on a loaded box, load ~5: 13.2 s and 305 MB RSS vs 8.1 s and 283 MB when it loaded
xgrammar only); per compile a fork and the transfers (a small JSON Schema, same loaded box: 0.26 s
in a child vs 0.13 s in process). POSIX only; GrammarConfig.compile_in_child turns it off (the same
pipeline then runs on the compile thread, unkillable).
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
from typing import NamedTuple

import xgrammar as xgr

from agentrt.errors import ConstraintError
from agentrt.grammars.finite import ForcedBound
from agentrt.grammars.spec import ConstraintSpec

_HEADER = struct.Struct("!Q")
_OK, _ERROR, _FAULT = b"O", b"E", b"F"


class Built(NamedTuple):
    """What one constraint compiles to (xgrammar_backend.build_constraint), here or in a child:
    the compiled grammar (None when it comes from a child: compile `ebnf` again), the grammar's
    EBNF text (xgrammar's printing, root rule "root"), the keywords dropped under best effort
    ("keyword at /pointer"), and the bound on text the grammar can force (grammars/finite.py;
    None: unknown)."""

    grammar: xgr.CompiledGrammar | None
    ebnf: str
    not_enforced: list[str]
    forced_bound: ForcedBound | None
    unique_plan: list | None = None  # the unique-strings check's plan (grammars/unique_items.py)


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
        """`xgrammar_backend.build_constraint(spec, ws, GrammarCompiler(info))` in a child at `nice`:
        all of it (JSON parsing, schema normalization and conversion, the finite check, the
        compile) is bounded by `deadline`, time.monotonic() after which the child is killed. The
        result's `grammar` is None: the caller compiles `ebnf` (see the module docstring).
        Raises CompileTimeout past the deadline; the ConstraintError the pipeline raised (message,
        param, keyword, pointer, tool_index as they were); RuntimeError when the child or the
        zygote died (or the result could not be loaded); CompileChildError on a bug in the child."""
        job = {"kind": spec.kind, "value": spec.value, "strict": spec.strict, "ws": ws}
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
    """Load once, before any fork, what a compile imports on first use: the backend's pipeline,
    jsonschema (~2 s: its format checkers build Lark parsers at import), lark, the tool formats;
    and convert one small schema (the normalizer's lazy set-up). Single-threaded, so forks stay
    safe. A failure here is left to the compile that meets it."""
    with contextlib.suppress(Exception):
        import agentrt.grammars.lark_grammar
        import agentrt.grammars.tool_calls  # noqa: F401
        from agentrt.grammars.xgrammar_backend import spec_grammar

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
    from agentrt.grammars.xgrammar_backend import build_constraint  # (loaded by _warm_up)

    try:
        job = json.loads(job_json)
        spec = ConstraintSpec(job["kind"], job["value"], job["strict"])
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
