"""One engine replica: the engine and FastAPI app of `agentrt serve`, answering requests the ingress
forwards as they arrived (method, path, query, headers, body), through its own ASGI app, and
streaming the response back message by message.

    ForwardedRequest   what the ingress sends (plain data, pickled by Ray)
    ResponseStart      the first item of every answer: status, headers, the replica's id
    AsgiForwarder      runs one ForwardedRequest through an ASGI app -> ResponseStart, then bytes
    EngineReplica      the Serve deployment class (deploy.py wraps it): AsyncEngine + create_app

Because the replica's own app answers, every endpoint, constraint kind, tool call, SSE stream and
error shape is that of `agentrt serve`. When the ingress stops reading (its client left), Serve
cancels the `forward` generator here; the app then sees `http.disconnect` (the serving layer's
ClientGone aborts the request, freeing its KV and grammar state) and its task is cancelled.

The engine loop runs on AsyncEngine's own thread: in a Ray actor the main thread belongs to Ray
(the plain server's main-thread loop is measured ~30% faster on CPU, async_engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from agentrt.api.errors import error_body
from agentrt.api.middleware import ServerOptions
from agentrt.runtime.async_engine import AdmissionConfig
from agentrt.runtime.config import EngineConfig

logger = logging.getLogger(__name__)

INTERNAL_ERROR_BODY = json.dumps(
    error_body("internal error: the replica's app failed before answering", "server_error", None, None)
).encode()


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica builds: the engine config (its `model.threads` is the replica's thread
    budget on CPU), the served model name, the app's tool-call settings, its perimeter options
    (the ingress checks API keys and CORS; replicas get none of either), admission limits, and
    the `--database NAME=URL` entries it opens."""

    config: EngineConfig
    model_name: str
    tool_call_format: str = "auto"
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_format: str = "auto"
    reasoning_budget_message: str = ""
    options: ServerOptions = field(default_factory=ServerOptions)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    databases: tuple[str, ...] = ()


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it: ASGI `headers` (lower-case names, bytes),
    `query_string` (bytes, without '?'), the whole `body`, the client's (host, port)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseStart:
    """The status and headers of a replica's answer, and the replica's id (Serve's unique id)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    replica: str


class AsgiForwarder:
    """Runs ForwardedRequests through one ASGI `app` as HTTP/1.1 requests; `replica` names the
    answering replica in each ResponseStart."""

    def __init__(self, app: Any, replica: str):
        self.app, self.replica = app, replica

    def _scope(self, req: ForwardedRequest) -> dict:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": req.method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.path.encode("utf-8", "surrogateescape"),
            "root_path": "",
            "query_string": req.query_string,
            "headers": [(bytes(k), bytes(v)) for k, v in req.headers],
            "client": req.client,
            "server": ("agentrt-replica", 0),
            "state": {},
        }

    async def forward(self, req: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The answer to `req`: one ResponseStart, then the body's non-empty chunks as the app
        sends them. An app that fails before starting its response gives a 500 in OpenAI's error
        shape. Closing the iterator early disconnects the request (see the module docstring)."""
        messages: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await messages.put(message)

        async def run() -> None:
            try:
                await self.app(self._scope(req), receive, send)
            finally:
                await messages.put(None)

        task = asyncio.create_task(run())
        started = False
        try:
            while True:
                message = await messages.get()
                if message is None:  # the app returned (or raised) without finishing its body
                    if task.done() and not task.cancelled() and task.exception() is not None:
                        logger.error("the app failed: %r", task.exception())
                    if not started:
                        yield ResponseStart(500, ((b"content-type", b"application/json"),), self.replica)
                        yield INTERNAL_ERROR_BODY
                    return
                if message["type"] == "http.response.start":
                    started = True
                    headers = tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ()))
                    yield ResponseStart(message["status"], headers, self.replica)
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        return
        finally:
            disconnected.set()
            if not task.done():
                # let the app see the disconnect and abort its engine request, then stop it
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), timeout=1.0)
                task.cancel()
            task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning


class EngineReplica:
    """The engine deployment's replica (Serve builds it in its actor; deploy.py wraps it with
    `serve.deployment`): loads the model, opens the databases and builds the app of `agentrt
    serve`. Raises ValueError / SchemaError for a bad config or database (the replica then fails
    to start and Serve reports it)."""

    def __init__(self, spec: ReplicaSpec):
        threads = spec.config.model.threads
        if threads is not None:
            import torch

            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        from agentrt.api.app import create_app
        from agentrt.runtime.async_engine import AsyncEngine
        from agentrt.sql.service import SQLDatabases, parse_database_args

        databases = SQLDatabases(parse_database_args(list(spec.databases) or None))
        databases.load()
        self.engine = AsyncEngine(spec.config, start_thread=True, admission=spec.admission)
        app = create_app(
            self.engine,
            spec.model_name,
            tool_call_format=spec.tool_call_format,
            exclude_tools_when_tool_choice_none=spec.exclude_tools_when_tool_choice_none,
            reasoning_format=spec.reasoning_format,
            reasoning_budget_message=spec.reasoning_budget_message,
            options=spec.options,
            databases=databases,
        )
        self.replica_id = _replica_id()
        self.forwarder = AsgiForwarder(app, self.replica_id)
        runner = self.engine.runner
        logger.info(
            "replica %s: %s on %s, %d threads, %d KV slots",
            self.replica_id,
            spec.model_name,
            runner.device,
            runner.num_threads,
            runner.kv.num_slots,
        )

    async def forward(
        self, request: ForwardedRequest, route: Any = None
    ) -> AsyncIterator[ResponseStart | bytes]:
        """Serve streaming method: the answer to `request` (AsgiForwarder.forward). `route` is the
        request's RouteKey, read by the request router and unused here."""
        async for item in self.forwarder.forward(request):
            yield item

    def check_health(self) -> None:
        """Serve's health check: raises RuntimeError when the engine loop thread has stopped (Serve
        then replaces the replica)."""
        thread = getattr(self.engine, "_thread", None)
        if thread is not None and not thread.is_alive():
            raise RuntimeError("the engine loop thread has stopped")

    def record_replica_metadata(self) -> dict:
        """Serve hook, read by the request router: the KV capacity (tokens) bounds this replica's
        routing tree; the pid helps operators (and tests) find the process."""
        return {"kv_tokens": int(self.engine.runner.kv.num_slots), "pid": os.getpid()}

    def __del__(self) -> None:
        """Serve's graceful shutdown: stop the engine loop, then end every request still queued
        or running with a 503 (streams: an error event), so nothing waits on a dead loop."""
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        engine.shutdown()
        engine.fail_pending("the replica is shutting down")


def _replica_id() -> str:
    """Serve's unique id of the replica running this code (the pid outside Serve)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 (outside a replica Serve raises RayServeException)
        return f"pid{os.getpid()}"
