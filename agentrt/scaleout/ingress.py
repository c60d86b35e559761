"""The ingress: the HTTP front of a replicated deployment. It reads each request's body only as far
as its routing key (routing_key.py), hands the request as received to the engine deployment (the
request router picks the replica from the key) and streams the replica's answer back as it comes.

    IngressCore         the FastAPI app, over any `ReplicaCall` (tests pass a local one)
    IngressDeployment   the Serve deployment class (deploy.py wraps it with serve.ingress/deployment)

What the ingress answers itself:

- /metrics: the routing counters (policy.py) and every live replica's own /metrics, each sample
  labelled `replica` (metrics.py; one targeted request per replica, in turn, `scrape_timeout_s`
  each).
- a replica that fails (its process died, Ray cannot reach it) before its response started: 503
  in the API's error shape (OpenAI's; Anthropic's under /v1/messages) with Retry-After: 1; after
  a stream started: the stream's own error event (chat/completions: `data: {"error": ...}` then
  `data: [DONE]`; /v1/responses: an `error` event; /v1/messages: Anthropic's `error` event), then
  the end. Never a hang: Ray reports a dead actor to the caller of its stream.
- the perimeter: API keys, body limit and CORS (middleware.py) apply here, before any routing; the
  replicas run without keys or CORS.

Every other request, every path, goes to a replica unchanged, and its status, headers and body come
back unchanged, plus an `x-agentrt-replica` header naming the replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from agentrt.api.app import install_middleware
from agentrt.api.errors import install_error_handlers, is_messages_path, to_api_error
from agentrt.api.middleware import ServerOptions
from agentrt.errors import ServiceUnavailableError
from agentrt.scaleout.metrics import merge_replica_metrics
from agentrt.scaleout.policy import RoutingTable
from agentrt.scaleout.replica import ForwardedRequest, ResponseStart
from agentrt.scaleout.routing_key import ROUTED_PATHS, RouteKey, route_key

logger = logging.getLogger(__name__)

METRICS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REPLICA_HEADER = "x-agentrt-replica"
RESPONSES_PATH = "/v1/responses"
_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


class ReplicaStream(Protocol):
    """A replica's answer in flight: async-iterates ResponseStart then bytes; `cancel()` stops it
    (the replica sees a disconnect). Ray Serve's DeploymentResponseGenerator is one."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def __anext__(self) -> Any: ...

    def cancel(self) -> None: ...


ReplicaCall = Callable[[ForwardedRequest, RouteKey | None], ReplicaStream]
"""Sends a request with its routing key to a replica (chosen by the router) and returns the answer."""


def replica_failed(path: str, e: BaseException) -> Response:
    """The 503 answer to a request whose replica failed before answering (shape by `path`)."""
    error = ServiceUnavailableError(
        f"the replica serving this request failed ({type(e).__name__}); retry: the others serve meanwhile "
        "and it is being restarted",
        retry_after_s=1,
    )
    return to_api_error(error).response(path)


def stream_error_event(path: str, e: BaseException, num_events: int) -> bytes:
    """The SSE bytes that end a stream whose replica failed mid-way: the error event of the API
    at `path` (`num_events`: events already sent, the Responses API's sequence_number), then, for
    chat and text completions, `data: [DONE]`."""
    message = f"the replica serving this request failed mid-stream ({type(e).__name__}); retry"
    error = to_api_error(ServiceUnavailableError(message, retry_after_s=1))
    if is_messages_path(path):
        return f"event: error\ndata: {json.dumps(error.anthropic_body())}\n\n".encode()
    if path == RESPONSES_PATH:
        data = {"type": "error", "code": error.code, "message": error.message, "param": None}
        data["sequence_number"] = num_events
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    return f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()


class IngressCore:
    """The ingress app over `table` (the router's table, for /metrics and the replica list) and
    `call` (the way to a replica). options: the perimeter (API keys, body limit, CORS);
    chunk_chars: the routing key's chunk size (the table's config); scrape_timeout_s: seconds a
    replica has to answer a /metrics scrape."""

    def __init__(
        self,
        table: RoutingTable,
        call: ReplicaCall,
        options: ServerOptions | None = None,
        scrape_timeout_s: float = 5.0,
    ):
        self.table, self.call = table, call
        self.options = options or ServerOptions()
        self.scrape_timeout_s = scrape_timeout_s

    def build_app(self) -> FastAPI:
        app = FastAPI(
            title="agentrt (replicas)", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None
        )
        app.state.options = self.options
        install_error_handlers(app)
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/{path:path}", self.forward, methods=_METHODS)
        install_middleware(app, self.options, expose_headers=(REPLICA_HEADER,))
        return app

    # ---- forwarding -------------------------------------------------------------------------
    def routing_key(self, method: str, path: str, body: bytes) -> RouteKey | None:
        """The key of a request (None: not a prompt route, or a body that is not JSON)."""
        if method != "POST" or path not in ROUTED_PATHS:
            return None
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):  # not UTF-8 or JSON, or nested past the parser
            return None  # the replica answers it with its own 400 (api/json_body.py)
        return route_key(path, parsed, self.table.config.chunk_chars)

    async def forward(self, request: Request) -> Response:
        """Send the request to a replica and stream its answer back (see the module docstring)."""
        body = await request.body()
        scope = request.scope
        path = scope["path"]
        forwarded = ForwardedRequest(
            method=scope["method"],
            path=path,
            query_string=scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in scope.get("headers", ())),
            body=body,
            client=tuple(scope["client"]) if scope.get("client") else None,
        )
        stream = self.call(forwarded, self.routing_key(forwarded.method, path, body))
        try:
            start = await stream.__anext__()
        except Exception as e:  # noqa: BLE001 (Ray raises many kinds: actor died, unavailable, ...)
            stream.cancel()
            logger.warning("replica failed before answering %s %s: %r", forwarded.method, path, e)
            return replica_failed(path, e)
        if not isinstance(start, ResponseStart):
            stream.cancel()
            raise TypeError(f"a replica answered with {type(start).__name__}, not ResponseStart")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers}
        headers[REPLICA_HEADER] = start.replica
        is_sse = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(
            self._body(stream, path, is_sse, start.replica), status_code=start.status, headers=headers
        )

    async def _body(
        self, stream: ReplicaStream, path: str, is_sse: bool, replica: str
    ) -> AsyncIterator[bytes]:
        num_events = 0
        done = False
        try:
            async for chunk in stream:
                num_events += chunk.count(b"\n\n") if is_sse else 0
                yield chunk
            done = True
        except Exception as e:  # noqa: BLE001 (the replica died mid-answer: Ray raises many kinds)
            done = True
            logger.warning("replica %s failed mid-answer to %s: %r", replica, path, e)
            if is_sse:
                yield stream_error_event(path, e, num_events)
        finally:
            if not done:  # the client left: stop the replica's work
                stream.cancel()

    # ---- /metrics ---------------------------------------------------------------------------
    async def metrics(self) -> Response:
        """The routing counters, then every live replica's metrics labelled by replica."""
        ids = self.table.replica_ids()
        if not ids:  # the router has not seen the replicas yet: one request makes it look
            await self._scrape(None)
            ids = self.table.replica_ids()
        # one replica at a time: Serve gives every call made while serving one HTTP request that
        # request's id, and its router matches a routed replica to the pending call by that id
        texts = {rid: await self._scrape(rid) for rid in ids}
        merged = merge_replica_metrics(texts)
        return Response(self.table.metrics_text() + merged, media_type=METRICS_MEDIA_TYPE)

    async def _scrape(self, replica: str | None) -> str | None:
        """`replica`'s /metrics text (None: it did not answer in time, or another replica did)."""
        stream = self.call(ForwardedRequest("GET", "/metrics"), RouteKey(target=replica))

        async def read() -> tuple[Any, list[bytes]]:
            first = await stream.__anext__()
            return first, [chunk async for chunk in stream]

        try:
            start, chunks = await asyncio.wait_for(read(), self.scrape_timeout_s)
        except Exception as e:  # noqa: BLE001 (a timeout, or the replica is gone)
            stream.cancel()
            logger.info("replica %s did not answer the metrics scrape: %r", replica, e)
            return None
        if not isinstance(start, ResponseStart) or start.status != 200 or start.replica != replica:
            return None
        return b"".join(chunks).decode("utf-8", "replace")


class IngressDeployment:
    """The Serve ingress deployment class: `engine` is the engine deployment's handle (Serve passes
    it for the bound deployment), `deployment` its name, `routing` the RoutingConfig (the same as
    the request router's), `options` the perimeter. Serve calls `__serve_build_asgi_app__` after
    the constructor (serve.ingress() without an app) to get the ASGI app."""

    def __init__(self, engine: Any, deployment: str, routing: Any, options: ServerOptions):
        from ray import serve

        from agentrt.scaleout.policy import shared_table, table_key

        app_name = serve.get_replica_context().app_name
        self._handle = engine.options(stream=True)
        table = shared_table(table_key(app_name, deployment), routing)
        self.core = IngressCore(table, self._call, options)

    def _call(self, request: ForwardedRequest, key: RouteKey | None) -> ReplicaStream:
        return self._handle.forward.remote(request, route=key)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self.core.build_app()
