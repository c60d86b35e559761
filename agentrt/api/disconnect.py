"""Watching the client while a request runs: `ClientGone` (returns when the client has left),
`client_gone` (one over an ASGI `receive`: a task waiting for the `http.disconnect` message, not a
poll between outputs) and `while_connected`, which cancels a request's work wherever it is when its
client leaves (tokenizing, waiting for its constraint to compile: it never starts; queued or
running: the engine aborts it before its next step, freeing its KV slots, radix-tree locks and
grammar matcher), for streamed and non-streamed requests alike."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import replace
from typing import Any

from agentrt.api.errors import APIError
from agentrt.api.generation import ServingResult

ClientGone = Callable[[], Awaitable[object]]
"""Returns when the client has gone (its connection closed); the caller cancels it when it no
longer needs to know. `client_gone(receive)` makes one from an ASGI `receive`."""


def client_gone(receive: Callable[[], Awaitable[Mapping]]) -> ClientGone:
    """A ClientGone over an ASGI `receive` callable: waits for its "http.disconnect" message. Use it
    once the request body has been read (a route's parsed body): the server then sends nothing else,
    and several waiters may share one `receive` (uvicorn answers every call after a disconnect)."""

    async def wait() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return wait


async def while_connected(work: Coroutine[Any, Any, ServingResult], gone: ClientGone) -> ServingResult:
    """Run `work` (one request) while waiting for the client to leave. When it leaves first, `work` is
    cancelled (which aborts its request wherever it is) and APIError 499 is raised. A streamed
    result keeps the watch until its events end: its request is aborted when the client leaves even
    if the events are never read (the response may be cancelled before it starts)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if not task.done():  # the client left first
        task.cancel()
        await asyncio.wait((task,))
    if watch.done():
        _retrieve(watch)
        if not task.cancelled() and task.exception() is None:
            for stream in task.result().streams:
                stream.cancel()  # finished just as the client left: nobody reads it
        if task.cancelled() or task.exception() is None:
            raise APIError("client disconnected", status=499)
    try:
        result = task.result()
    except BaseException:
        watch.cancel()
        raise
    if not result.streams:
        watch.cancel()
        return result
    streams = result.streams

    def on_gone(w: asyncio.Future) -> None:
        if not w.cancelled():
            _retrieve(w)
            for stream in streams:
                stream.cancel()

    watch.add_done_callback(on_gone)
    return replace(result, events=_watched(result.events, watch))


async def _watched(events: AsyncIterator[str], watch: asyncio.Future) -> AsyncIterator[str]:
    """`events`, then the end of `watch` (the wait for the client to leave)."""
    try:
        async for event in events:
            yield event
    finally:
        watch.cancel()
        await events.aclose()


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a finished future's exception as retrieved (a wait that failed counts as the client gone)."""
    if not fut.cancelled():
        fut.exception()
