"""Typed errors shared by every layer (no imports: grammars, runtime, api and the SDK all use it).

The layer that knows what went wrong raises one of these with the facts as fields; the API layer
alone maps them to an HTTP status and OpenAI's error shape (`agentrt/api/errors.py`), and the SDK
raises them as they are. No layer reads another's error text.

    AgentrtError
    ├── InvalidRequestError (also a ValueError)   the request is at fault; `param` names the field
    │   ├── ConstraintError                       a constraint cannot be compiled or enforced;
    │   │                                         `keyword`, `pointer` (RFC 6901), `tool_index`
    │   ├── ContextLengthError                    prompt (+ max_tokens) beyond the context limit
    │   ├── ChatTemplateError                     the chat template refused the messages (its
    │   │                                         raise_exception, or its code failed on them)
    │   ├── TemplateBudgetError                   the chat template spent its time or size budget
    │   │                                         rendering the messages; `limit`, the budget
    │   └── IncompleteOutputError                 the output ended (max_tokens) before the structured
    │                                             result was complete (SDK extract); `finish_reason`
    ├── ServiceUnavailableError                   retryable: shutting down, overloaded, busy compiler;
    │   │                                         `retry_after_s` when the server can say when
    │   └── QueueFullError                        too many requests already wait to run
    │                                             (`max_queued_requests`)
    ├── RequestTimeoutError                       the request ran past the server's time limit
    │                                             (`timeout_s`); its work so far is dropped
    └── InternalError                             a bug or a fault while serving this request

`InvalidRequestError` subclasses `ValueError` so callers that catch `ValueError` (the SDK's
documented contract) keep working.
"""

from __future__ import annotations


class AgentrtError(Exception):
    """Base of agentrt's errors. `message` is the full text shown to the user (HTTP and SDK alike)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidRequestError(AgentrtError, ValueError):
    """The request is malformed or cannot be served as asked. `param`: the request field at fault
    (OpenAI's `param`, e.g. "max_tokens", "response_format.json_schema"), or None."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ConstraintError(InvalidRequestError):
    """A constraint cannot be compiled or enforced. `keyword` / `pointer` name a JSON Schema
    keyword and its location (RFC 6901 JSON Pointer) when the schema is at fault; `tool_index`
    the offered tool whose parameters are at fault (tool-call constraints)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        keyword: str | None = None,
        pointer: str | None = None,
        tool_index: int | None = None,
    ):
        super().__init__(message, param)
        self.keyword, self.pointer, self.tool_index = keyword, pointer, tool_index

    def in_tool(self, index: int, name: str) -> ConstraintError:
        """The same error attributed to offered tool `index` (message prefixed with its name)."""
        return ConstraintError(
            f"tool '{name}' parameters: {self.message}",
            self.param,
            keyword=self.keyword,
            pointer=self.pointer,
            tool_index=index,
        )


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt plus max_tokens, does not fit the context limit (tokens)."""

    def __init__(self, message: str, param: str | None = None, *, num_prompt_tokens: int, limit: int):
        super().__init__(message, param)
        self.num_prompt_tokens, self.limit = num_prompt_tokens, limit


class ChatTemplateError(InvalidRequestError):
    """The chat template cannot render the request's messages: the tokenizer has none, or the
    template refused them (its raise_exception) or its code failed on them. `reason`: what the
    template (or transformers) said; `param` "messages"."""

    def __init__(self, reason: str, param: str | None = "messages"):
        super().__init__(f"messages cannot be rendered by the chat template: {reason}", param)
        self.reason = reason


class TemplateBudgetError(InvalidRequestError):
    """Rendering the chat template spent its budget and was stopped: `limit` "time" (wall-clock
    seconds, `time_s`) or "size" (bytes built, `max_bytes`); `param` "messages". The message names
    the budget and the serve flag that sets it."""

    def __init__(
        self, message: str, param: str | None = "messages", *, limit: str, time_s: float, max_bytes: int
    ):
        super().__init__(message, param)
        self.limit, self.time_s, self.max_bytes = limit, time_s, max_bytes


class IncompleteOutputError(InvalidRequestError):
    """The output ended before the structured result it must hold was complete (e.g. it ran out of
    max_tokens mid-JSON). `finish_reason`: why it ended ("length", ...); `text`: the partial output."""

    def __init__(self, message: str, param: str | None = "max_tokens", *, finish_reason: str, text: str):
        super().__init__(message, param)
        self.finish_reason, self.text = finish_reason, text


class ServiceUnavailableError(AgentrtError):
    """The server cannot serve the request now (shutting down, overloaded); retrying may succeed.
    `retry_after_s`: seconds after which a retry may succeed (None: unknown)."""

    def __init__(self, message: str, *, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueFullError(ServiceUnavailableError):
    """Refused at admission: `num_waiting` requests already wait to run (compiling their constraint,
    or queued for the engine, preempted ones included), the limit `max_queued_requests`. Nothing of
    the request was queued; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, *, num_waiting: int, max_queued_requests: int, retry_after_s: int = 1):
        super().__init__(message, retry_after_s=retry_after_s)
        self.num_waiting, self.max_queued_requests = num_waiting, max_queued_requests


class RequestTimeoutError(AgentrtError):
    """The request was still unfinished `timeout_s` seconds after it was submitted (its constraint
    compile and queueing included); it was stopped and its KV and grammar state freed. Output
    produced so far is not returned as a result (a stream has already sent it)."""

    def __init__(self, message: str, *, timeout_s: float):
        super().__init__(message)
        self.timeout_s = timeout_s


class InternalError(AgentrtError):
    """An unexpected fault while serving a request (a bug); the request fails, others continue."""
