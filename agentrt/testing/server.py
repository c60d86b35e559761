"""One launcher for `agentrt serve` (a subprocess on a free port) and an in-process uvicorn server
for an app, shared by tests and bench scripts."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO


class ServerStartError(RuntimeError):
    """The server exited or did not answer GET /health in time (the message has its log's tail)."""


@dataclass
class ServerProcess:
    """A running server: `url` (http://127.0.0.1:PORT), the `proc`, its `log_path` (None when its
    output is discarded) and, after the launcher's exit, `returncode`."""

    url: str
    proc: subprocess.Popen
    log_path: Path | None = None
    returncode: int | None = None

    def log_tail(self, n: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_server(
    cmd: Sequence[str],
    port: int,
    *,
    timeout_s: float = 180.0,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    stop_timeout_s: float = 30.0,
) -> Iterator[ServerProcess]:
    """Start `cmd` (which must listen on 127.0.0.1:`port`), wait until GET /health answers 200 and
    yield a ServerProcess; on exit SIGTERM it, wait up to `stop_timeout_s` (then kill) and set
    `returncode`. Output goes to `log_path` (None: discarded). Raises ServerStartError when the
    process exits or is not healthy within `timeout_s` seconds."""
    import httpx

    log: IO | int = subprocess.DEVNULL
    if log_path is not None:
        log = Path(log_path).open("w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        list(cmd), stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy() if env is None else env
    )
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, Path(log_path) if log_path is not None else None)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise ServerStartError(f"{cmd[0]} exited with {proc.returncode}: {server.log_tail()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{' '.join(cmd)} did not become healthy in {timeout_s:g} s: {server.log_tail()}"
                )
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: a clean exit, promptly
            try:
                proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server.returncode = proc.returncode
        if not isinstance(log, int):
            log.close()


@contextlib.contextmanager
def agentrt_server(
    model: str = "smollm2-135m-instruct", *args: str, port: int | None = None, **kwargs
) -> Iterator[ServerProcess]:
    """`agentrt serve MODEL ARGS... --port PORT` (this Python, a free port unless given) via
    `launch_server` (keyword arguments go to it)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "agentrt.cli", "serve", model, *args, "--port", str(port)]
    with launch_server(cmd, port, **kwargs) as server:
        yield server


@contextlib.contextmanager
def serve_in_thread(app, *, timeout_s: float = 30.0, log_level: str = "warning") -> Iterator[str]:
    """Serve the ASGI `app` with uvicorn on a free 127.0.0.1 port from a background thread of this
    process; yields the base URL (http://127.0.0.1:PORT) once it accepts connections, and stops the
    server on exit. Raises ServerStartError when it has not started within `timeout_s` seconds."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise ServerStartError(f"uvicorn did not start on port {port} within {timeout_s:g} s")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
