"""xgrammar compiles in child processes that can be killed at their deadline.

xgrammar compiles in C++ without a cancellation point. In a thread, a compile past
`compile_timeout_s` was answered (400) but kept running: two requests with schemas that take
minutes (an `anyOf` of 2,000 objects, an object with 5,000 required properties) held the compile
threads and every new constraint on the server got a 503 for minutes.

A `Zygote` is a small single-threaded helper process (`python -m agentrt.grammars.compile_child`)
holding xgrammar and the tokenizer's `TokenizerInfo`. For each compile it forks a child (a fork of
a single-threaded process is safe; forking the multi-threaded server is not: a child can inherit a
lock another thread holds, and hang). The child compiles and sends the compiled grammar back as
xgrammar's JSON serialization over its own socket, whose other end the zygote hands to the server
(SCM_RIGHTS). Past the deadline the server kills the child; its CPU time (/proc) tells an
expensive constraint (400) from a starved one (503). The child lowers its priority to the calling
compile thread's nice value.

Costs, 2-core dev box, SmolLM2's 49k vocabulary: the zygote starts in ~5 s (importing xgrammar
imports torch) and holds ~260 MB; per compile a fork and the transfers (a small
JSON Schema: 0.15 s in a child vs 0.05 s in process), and for a 2 MB compiled grammar
~0.27 s to serialize (in the child) and ~0.14 s to deserialize (here), beside a 0.9 s compile.
POSIX only; GrammarConfig.compile_in_child turns it off.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import xgrammar as xgr

_HEADER = struct.Struct("!Q")
_OK, _ERROR = b"O", b"E"


class CompileTimeout(Exception):
    """The child ran past the deadline and was killed. `cpu_s`: the CPU time it had used."""

    def __init__(self, cpu_s: float):
        super().__init__(f"compile killed after {cpu_s:.1f} s of CPU")
        self.cpu_s = cpu_s


class Zygote:
    """The compile helper process for one TokenizerInfo (started on first use, restarted when it
    dies). Thread-safe: compiles from several threads run in parallel children."""

    def __init__(self, info: xgr.TokenizerInfo):
        """Starts the zygote now, on the calling thread (it inherits that thread's nice value,
        which bounds its children's: create it on an unniced thread); it loads while the server
        starts. A restart after it died happens on a compile thread."""
        self.info = info
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

    def compile(self, grammar: xgr.Grammar, deadline: float, nice: int = 0) -> xgr.CompiledGrammar:
        """`GrammarCompiler(info).compile_grammar(grammar)` in a child at `nice`; `deadline`:
        time.monotonic() after which the child is killed. Raises CompileTimeout past the deadline,
        RuntimeError with xgrammar's reason when it refused the grammar (as compiling in process
        would), or when the child or the zygote died."""
        request = json.dumps({"nice": nice}).encode() + b"\n" + grammar.serialize_json().encode()
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
        if data[:1] == _OK:
            return xgr.CompiledGrammar.deserialize_json(data[1:].decode(), self.info)
        if data[:1] == _ERROR:
            raise RuntimeError(data[1:].decode(errors="replace"))
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
        info = xgr.TokenizerInfo.deserialize_json(
            _recv_exact(sock, _HEADER.unpack(_recv_exact(sock, 8))[0]).decode()
        )
        sock.sendall(b"R")  # ready
        while True:
            request = _recv_exact(sock, _HEADER.unpack(_recv_exact(sock, 8))[0])
            head, _, grammar_json = request.partition(b"\n")
            parent_end, child_end = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                sock.close()
                parent_end.close()
                _child(info, json.loads(head)["nice"], grammar_json, child_end)
            child_end.close()
            socket.send_fds(sock, [str(pid).encode()], [parent_end.fileno()])
            parent_end.close()
    except (EOFError, OSError):  # the server closed its end (or is gone)
        pass
    finally:
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)  # our children too (we lead our own process group)


def _child(info: xgr.TokenizerInfo, nice: int, grammar_json: bytes, out: socket.socket) -> None:
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if nice:
            with contextlib.suppress(OSError):
                os.nice(nice)
        try:
            grammar = xgr.Grammar.deserialize_json(grammar_json.decode())
            compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_grammar(grammar)
            payload = _OK + compiled.serialize_json().encode()
        except Exception as e:  # noqa: BLE001 (sent to the server, which raises it)
            payload = _ERROR + str(e).encode(errors="replace")
        out.sendall(payload)
        code = 0
    finally:
        with contextlib.suppress(BaseException):
            out.close()
        os._exit(code)


if __name__ == "__main__":
    _zygote_main(int(sys.argv[1]))
