"""The HTTP perimeter: pure ASGI middleware for API keys and the request-body limit, and the
options that configure them (`ServerOptions`).

Pure ASGI (not starlette's BaseHTTPMiddleware): the request's `receive` reaches the route
unchanged except for byte counting, so a route's `request.is_disconnected()` sees the client
leave. Starlette's own RequestBodyLimitMiddleware answers a plain-text 413; these answer in
OpenAI's error shape like every other failure (Anthropic's under /v1/messages, as errors.py).

Order in the app, outermost first: CORS (only with allowed origins), API key, body limit, FastAPI's
exception handling, the routes. So a client without a key learns nothing (401 before any limit or
route), and a CORS preflight or a 401 still carries the CORS headers a browser needs.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentrt.api.errors import APIError

DEFAULT_MAX_BODY_BYTES = 16 << 20
"""Default request-body limit (bytes received, chunked bodies included): 16 MiB."""


@dataclass(frozen=True)
class ServerOptions:
    """The HTTP server's perimeter settings.

    api_keys: accepted keys, sent as `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's
    clients) (empty: no authentication).
    metrics_require_key: /metrics needs a key too (default: open, like /health).
    max_body_bytes: largest request body in bytes, counted as received (413 beyond).
    allowed_origins: origins allowed by CORS ("*" for any); empty: no CORS headers at all.
    log_requests: log each API request body (INFO, truncated); off: bodies and prompts are never
    logged."""

    api_keys: tuple[str, ...] = ()
    metrics_require_key: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    allowed_origins: tuple[str, ...] = ()
    log_requests: bool = False

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")

    def open_paths(self) -> frozenset[str]:
        """Paths served without a key when keys are set: /health, and /metrics unless
        metrics_require_key. Every other path (all of /v1/*, the OpenAPI docs, unknown paths)
        needs a key."""
        return frozenset({"/health"} if self.metrics_require_key else {"/health", "/metrics"})


class APIKeyMiddleware:
    """Answers 401 (OpenAI's shape, code "invalid_api_key", `WWW-Authenticate: Bearer`; Anthropic's
    shape under /v1/messages) to an HTTP request, unless its path is in `open_paths`, whose
    `Authorization: Bearer KEY` and `x-api-key: KEY` (what Anthropic's clients send) headers are
    both missing, or match none of `api_keys` (either header matching is enough). A key is compared
    with every accepted key, each by hmac.compare_digest over SHA-256 digests (constant time, no
    early exit, lengths hidden)."""

    def __init__(self, app: ASGIApp, api_keys: Collection[str], open_paths: Collection[str]):
        if not api_keys:
            raise ValueError("APIKeyMiddleware needs at least one key")
        self.app = app
        self._digests = tuple(_digest(k.encode()) for k in api_keys)
        self._open = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        header, x_api_key = headers.get("authorization"), headers.get("x-api-key")
        if header is None and x_api_key is None:
            return await _unauthorized(
                "no API key given: send it as the header 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                scope,
                receive,
                send,
            )
        ok = False
        if header is not None:
            scheme, _, token = header.partition(" ")
            ok = self._accepts(token.strip()) and scheme.lower() == "bearer"
        if not ok and x_api_key is not None:
            ok = self._accepts(x_api_key.strip())
        if not ok:
            return await _unauthorized("incorrect API key", scope, receive, send)
        await self.app(scope, receive, send)

    def _accepts(self, token: str) -> bool:
        given = _digest(token.encode("latin-1"))  # the header's raw bytes (starlette decodes latin-1)
        ok = False
        for digest in self._digests:  # every key, no early exit
            ok |= hmac.compare_digest(given, digest)
        return ok


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


async def _unauthorized(message: str, scope: Scope, receive: Receive, send: Send) -> None:
    error = APIError(message, status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    await error.response(scope["path"])(scope, receive, send)


class BodyTooLargeError(HTTPException):
    """The request body passed `max_body_bytes` (413). An HTTPException, so a route reading its body
    gets it answered by the app's handlers (OpenAI's shape)."""

    def __init__(self, limit: int, declared: int | None = None):
        size = f"of {declared} bytes " if declared is not None else ""
        super().__init__(413, f"request body {size}exceeds the limit of {limit} bytes")


class BodyLimitMiddleware:
    """Refuses request bodies over `max_body_bytes` (413, OpenAI's shape): at once when the
    Content-Length header says so, otherwise as soon as the bytes received (each chunk of a chunked
    body counted) pass the limit, before more is read."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app, self.limit = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            error = BodyTooLargeError(self.limit, int(declared))
            await _too_large(error, scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLargeError(self.limit)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except BodyTooLargeError as e:  # read outside a route (its handlers answer it there)
            if started:
                raise
            await _too_large(e, scope, receive, send)


async def _too_large(e: BodyTooLargeError, scope: Scope, receive: Receive, send: Send) -> None:
    # the rest of the body is never read: the server closes the connection after this answer
    await APIError(str(e.detail), status=413).response(scope["path"])(scope, receive, send)


def install_middleware(app: Starlette, options: ServerOptions, expose_headers: tuple[str, ...] = ()) -> None:
    """The server's middleware from `options`: the body limit, API keys, CORS (exposing
    Retry-After, X-Agentrt-Not-Enforced and `expose_headers`). The last added runs first: CORS,
    then the key check, then the body limit. (Shared with the scale-out ingress.)"""
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=options.max_body_bytes)
    if options.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=options.api_keys, open_paths=options.open_paths())
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=["GET", "HEAD", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["Retry-After", "X-Agentrt-Not-Enforced", *expose_headers],
        )
