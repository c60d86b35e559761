"""HTTP errors: the one mapping from agentrt's typed errors (agentrt/errors.py) to an HTTP status and
OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`, and the FastAPI handlers that
apply it. No other module chooses a status for an AgentrtError.

    AgentrtError subclass        status  type                   code
    ContextLengthError           400     invalid_request_error  context_length_exceeded
    TemplateBudgetError          400     invalid_request_error  chat_template_budget_exceeded
    ConstraintError              400     invalid_request_error  None
    InvalidRequestError          400     invalid_request_error  None
    QueueFullError               429     requests               queue_full
    ServiceUnavailableError      503     server_error           None
    RequestTimeoutError          504     server_error           request_timeout
    AgentrtError (e.g. Internal) 500     server_error           None

`param` is the request field at fault (InvalidRequestError's `param`, or the field the API layer
attributes it to); server errors carry none. Under /v1/messages (Anthropic's Messages API) the same
errors, with the same status, take Anthropic's shape `{"type": "error", "error": {"type", "message"}}`
(`anthropic_error_type` names the type). An error with `retry_after_s` (ServiceUnavailableError,
QueueFullError) also sets the `Retry-After` header (seconds). 429's type "requests" and a code are
what OpenAI sends for a request-count limit (its code there is "rate_limit_exceeded").

One style for every request field an error names, on every API: keys joined by ".", list indices
in brackets (`messages[1].content[0].text`, `tools[0].function.parameters`), as OpenAI writes
them; pydantic's validation errors are mapped to it (`field_path`). One rule for a client's value
quoted in a message: `shown`, its JSON text cut to ECHO_MAX_CHARS characters; and no error body
carries a message over MAX_MESSAGE_CHARS or a param over MAX_PARAM_CHARS characters (the rest is
cut, its length said), whatever layer wrote it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import NamedTuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrt.errors import (
    AgentrtError,
    ContextLengthError,
    InvalidRequestError,
    QueueFullError,
    RequestTimeoutError,
    ServiceUnavailableError,
    TemplateBudgetError,
)

logger = logging.getLogger(__name__)

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "json-or-python"}

ECHO_MAX_CHARS = 64
"""The most characters of a client's value an error message quotes (`shown`)."""
MAX_MESSAGE_CHARS = 2000
"""The longest error message sent; longer ones are cut (a value a layer quoted whole)."""
MAX_PARAM_CHARS = 256
"""The longest `param` sent (a path through client-chosen keys can be long)."""


def shown(value: object) -> str:
    """`value`, from the request, as an error message quotes it: its JSON text (a string in double
    quotes), cut to its first ECHO_MAX_CHARS characters and '...' with the whole length when longer
    (a 1 MB field is never sent back)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # too deep, or an int past Python's digit limit
        return f"(a {type(value).__name__})"
    return _cut(text, ECHO_MAX_CHARS)


def field_path(loc: Sequence[str | int]) -> str:
    """A request field's path in the API's one style: keys joined by ".", list indices in brackets
    (("messages", 1, "role") -> "messages[1].role"); a key over ECHO_MAX_CHARS is cut."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            key = str(part) if len(str(part)) <= ECHO_MAX_CHARS else str(part)[:ECHO_MAX_CHARS] + "..."
            out += f".{key}" if out else key
    return out


def _cut(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, '...' and the whole length following when cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class APIError(Exception):
    """An error the API layer decides itself, with its HTTP status and OpenAI error fields (a
    malformed request field, an unknown model (404), a client that left (499), a missing or wrong
    API key (401) or an oversize body (413), both from api/middleware.py). Typed runtime errors
    become one through `to_api_error`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type_, code
        self.headers = headers

    def body(self) -> dict:
        """OpenAI's error body for this error."""
        return error_body(self.message, self.type, self.param, self.code)

    def anthropic_body(self) -> dict:
        """Anthropic's error body for this error (the Messages API)."""
        return {
            "type": "error",
            "error": {"type": anthropic_error_type(self.status), "message": _sendable(self.message)},
        }

    def response(self, path: str = "") -> JSONResponse:
        """This error as an HTTP response to a request for `path`: Anthropic's shape under
        /v1/messages, OpenAI's elsewhere."""
        body = self.anthropic_body() if is_messages_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


MESSAGES_PATH = "/v1/messages"

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def is_messages_path(path: str) -> bool:
    """Whether `path` belongs to Anthropic's Messages API (/v1/messages and paths under it)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status (the types of Anthropic's API docs and its Python
    SDK's ErrorType); a status with no type of its own is "invalid_request_error" (4xx) or
    "api_error" (5xx)."""
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


class ErrorKind(NamedTuple):
    """How one AgentrtError class is shown over HTTP."""

    status: int
    type: str
    code: str | None = None


# most specific first: the first class an error is an instance of decides
_KINDS: tuple[tuple[type[AgentrtError], ErrorKind], ...] = (
    (ContextLengthError, ErrorKind(400, "invalid_request_error", "context_length_exceeded")),
    (TemplateBudgetError, ErrorKind(400, "invalid_request_error", "chat_template_budget_exceeded")),
    (InvalidRequestError, ErrorKind(400, "invalid_request_error")),
    (QueueFullError, ErrorKind(429, "requests", "queue_full")),
    (ServiceUnavailableError, ErrorKind(503, "server_error")),
    (RequestTimeoutError, ErrorKind(504, "server_error", "request_timeout")),
    (AgentrtError, ErrorKind(500, "server_error")),
)


def error_kind(e: AgentrtError) -> ErrorKind:
    """The HTTP status, OpenAI error type and code of a typed error."""
    return next(kind for cls, kind in _KINDS if isinstance(e, cls))


def to_api_error(e: AgentrtError, param: str | None = None, message: str | None = None) -> APIError:
    """`e` as an HTTP error. param: the request field at fault as this request names it (default:
    `e.param` for an InvalidRequestError; server errors never carry one); message: the text shown
    (default: `e.message`)."""
    kind = error_kind(e)
    if isinstance(e, InvalidRequestError):
        param = param or e.param
    else:
        param = None
    retry_after = getattr(e, "retry_after_s", None)
    return APIError(
        e.message if message is None else message,
        status=kind.status,
        param=param,
        type_=kind.type,
        code=kind.code,
        headers={"Retry-After": str(retry_after)} if retry_after is not None else None,
    )


def _utf8(text: str) -> str:
    """Text safe to encode as UTF-8 (lone surrogates from the client are escaped)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _sendable(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An error's text as sent: cut to `limit` characters and safe to encode as UTF-8."""
    return _utf8(_cut(text, limit))


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    """OpenAI's error shape; message and param are cut to MAX_MESSAGE_CHARS / MAX_PARAM_CHARS and
    made safe to encode as UTF-8."""
    param = param and _sendable(param, MAX_PARAM_CHARS)
    return {"error": {"message": _sendable(message), "type": type_, "param": param, "code": code}}


def install_error_handlers(app: FastAPI) -> None:
    """Make every failure of `app` an OpenAI error body (Anthropic's under /v1/messages): APIError and AgentrtError (by the table
    above), pydantic validation errors (400 naming the field), HTTP errors such as 404/405 routes
    and 413 bodies (api/middleware.py), and any other exception (500, logged)."""
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(AgentrtError, _on_agentrt_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(Exception, _on_internal_error)


async def _on_api_error(request: Request, e: APIError) -> JSONResponse:
    return e.response(request.url.path)


async def _on_agentrt_error(request: Request, e: AgentrtError) -> JSONResponse:
    return to_api_error(e).response(request.url.path)


async def _on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
    return APIError(str(e.detail), status=e.status_code, type_=type_).response(request.url.path)


async def _on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    errors = e.errors()
    # a union's branches each report: our own validators' messages (value_error) say the most
    err = next((x for x in errors if x.get("type") == "value_error"), errors[0])
    loc = [p for p in err.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    param = field_path(loc) or None
    if err.get("type") == "json_invalid":
        param = None
        where = err.get("loc", ())[-1:]  # the character offset json reports
        at = f" at character {where[0]}" if where and isinstance(where[0], int) else ""
        message = f"request body is not valid JSON: {err.get('ctx', {}).get('error') or err.get('msg')}{at}"
    else:
        message = f"{param or 'body'}: {err.get('msg')}"
    return APIError(message, param=param).response(request.url.path)


async def _on_internal_error(request: Request, e: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    error = APIError(f"internal error: {type(e).__name__}", status=500, type_="server_error")
    return error.response(request.url.path)


def _is_type_tag(part) -> bool:
    """pydantic names union branches in error locations ('str', 'list[...]'); they are not fields."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)
