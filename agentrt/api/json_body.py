"""Request bodies as JSON: one parser for the body of every route, whose failures are each a 400
naming the problem. FastAPI's own parsing (json.loads) answers every failure other than a syntax
error with "There was an error parsing the body"; here:

    the body is not UTF-8 (RFC 8259 section 8.1; UTF-16/32, which json.loads detects, is read too)
        "request body is not valid UTF-8: byte 0xff at offset 12 (invalid start byte)"
    arrays and objects nested deeper than MAX_JSON_DEPTH
        "request body nests arrays and objects 300 levels deep, over the limit of 256 levels"
    an integer with more digits than Python converts (sys.get_int_max_str_digits(), 4300 by default)
        "request body has an integer of more than 4300 digits (Python's limit on integer text)"
    a syntax error: json's message and character offset (FastAPI's RequestValidationError, errors.py)

`JSONBodyRoute` is the route class that parses bodies so (FastAPI's documented custom-route hook:
the route's Request subclass overrides `json()`, which FastAPI awaits to read a JSON body).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

MAX_JSON_DEPTH = 256
"""The deepest nesting of arrays and objects a request body may have (levels; `{"a": [1]}` is 2).
Above any real request (a JSON Schema deeper than ~150 levels is refused by its meta-schema check
anyway); well below where recursive code over the parsed value gives out (json's C scanner near
900 levels under Python's recursion limit of 1000; transformers' chat-template input copy, two
frames a level, near 490)."""

_CLASSES = bytes(
    {ord('"'): 1, ord("\\"): 2, ord("["): 3, ord("{"): 3, ord("]"): 4, ord("}"): 4}.get(x, 0)
    for x in range(256)
)
"""`json_depth`'s byte classes (bytes.translate table): quote 1, backslash 2, [ { 3, ] } 4, other 0."""


class JSONBodyError(HTTPException):
    """A request body that cannot be read as JSON (400; the message says why). An HTTPException, so
    FastAPI passes it on as is and errors.py answers it in the API's error shape."""

    def __init__(self, message: str):
        super().__init__(400, message)


def parse_json_body(body: bytes) -> Any:
    """The JSON value of a request body (bytes). Raises JSONBodyError (text not in its encoding,
    nesting deeper than MAX_JSON_DEPTH, an integer over Python's digit limit) and json's
    JSONDecodeError (a syntax error, with its character offset)."""
    encoding = json.detect_encoding(body)
    try:
        text = body.decode(encoding, "surrogatepass")  # as json.loads decodes bytes
    except UnicodeDecodeError as e:
        name = "UTF-8" if encoding.startswith("utf-8") else encoding.upper()
        raise JSONBodyError(
            f"request body is not valid {name}: byte {body[e.start]:#04x} at offset {e.start} ({e.reason})"
        ) from None
    try:
        value = json.loads(text)
    except RecursionError:  # json's scanner gave out: deeper than the limit (checked below otherwise)
        raise JSONBodyError(_too_deep(None)) from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # the one other failure of json.loads: int("9" * 5000)
        raise JSONBodyError(
            f"request body has an integer of more than {sys.get_int_max_str_digits()} digits "
            "(Python's limit on integer text, sys.get_int_max_str_digits())"
        ) from None
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH:  # else it cannot nest that deep
        depth = json_depth(body if encoding.startswith("utf-8") else text.encode("utf-8", "surrogatepass"))
        if depth > MAX_JSON_DEPTH:
            raise JSONBodyError(_too_deep(depth))
    return value


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in `data`, valid JSON in UTF-8 (0 for a scalar).
    Vectorized (numpy) over the quotes, backslashes and brackets of `data`: a quote after an odd run
    of backslashes is escaped; brackets between an opening and a closing quote are text; the others
    step the depth. Linear in len(data): ~3 ms a MB of text, more where most bytes are marks."""
    classes = np.frombuffer(data.translate(_CLASSES), dtype=np.uint8)
    pos = np.flatnonzero(classes != 0)  # (a bool array: several times faster than uint8)
    b = classes[pos]
    if not pos.size:
        return 0
    slash = b == 2
    after = np.zeros(pos.size, dtype=bool)  # the entry before is the byte just before
    after[1:] = np.diff(pos) == 1
    slashes = np.cumsum(slash)
    starts = slash & ~np.concatenate(([False], slash[:-1] & after[1:]))  # a run of backslashes begins
    before = np.maximum.accumulate(np.where(starts, slashes - 1, 0))
    run = np.where(slash, slashes - before, 0)  # backslashes in the run up to this one
    quote = b == 1
    escaped = np.zeros(pos.size, dtype=bool)
    escaped[1:] = after[1:] & slash[:-1] & (run[:-1] % 2 == 1)
    in_text = np.cumsum(quote & ~escaped) % 2 == 1  # after an opening quote, before its closing one
    steps = np.where(in_text, 0, (b == 3).astype(np.int32) - (b == 4).astype(np.int32))
    return int(max(np.cumsum(steps).max(), 0))


def _too_deep(depth: int | None) -> str:
    how = f"{depth} levels deep, over" if depth is not None else "deeper than"
    return f"request body nests arrays and objects {how} the limit of {MAX_JSON_DEPTH} levels"


class _JSONBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """A route whose JSON body is read by `parse_json_body`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(_JSONBodyRequest(request.scope, request.receive))

        return handle
