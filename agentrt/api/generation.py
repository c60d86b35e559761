"""What the serving layer passes between its parts: `Generation` (one request as the engine runs
it, and what its response needs), `ServingResult` (a complete body or the SSE events of a stream),
`ResponseShape` (how an API renders a generation and names request fields: chat_shape.py for
chat and text completions, responses/shape.py, messages/shape.py) and `renamed` (an error in a
shape's field names). No HTTP framework and no engine calls here."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from agentrt.api.errors import APIError, to_api_error
from agentrt.api.output_text import OutputParser
from agentrt.api.tools import ToolPlan
from agentrt.errors import AgentrtError, ConstraintError, InternalError, InvalidRequestError
from agentrt.grammars.reasoning import ReasoningFormat, ReasoningMode
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.async_engine import RequestStream
from agentrt.runtime.request import RequestOutput, SamplingParams


@dataclass(frozen=True)
class Generation:
    """One request as the engine runs it, and what its response needs.

    constraint_param: the request field named when the constraint fails to compile ("" when none);
    tools: the tool plan when the output may hold tool calls (None: plain text); param_names: the
    engine's field names -> this request's (the chat API's prompt is its "messages", its max_tokens
    may be "max_completion_tokens"); reasoning: a reasoning model's format and where its reasoning
    stands after the prompt (None: no reasoning to parse)."""

    request_id: str
    chat: bool
    prompt_ids: list[int]
    params: SamplingParams
    constraint: ConstraintSpec | None
    constraint_param: str
    tools: ToolPlan | None
    param_names: Mapping[str, str]
    cache_salt: str
    stream: bool
    include_usage: bool
    n: int = 1
    reasoning: tuple[ReasoningFormat, ReasoningMode] | None = None

    def new_parser(self) -> OutputParser | None:
        """A parser of one choice's text into reasoning, content and tool calls (None: the text is
        all content)."""
        if self.reasoning is None and self.tools is None:
            return None
        return OutputParser(self.reasoning, self.tools)

    def api_error(self, e: AgentrtError | None, default_param: str | None = None) -> APIError:
        """The HTTP error of a failed request (None: a failure without a reason), naming the field
        as this request calls it; default_param: the field when the error names none."""
        if e is None:
            e = InternalError("generation failed")
        if isinstance(e, ConstraintError) and default_param is None:  # e.g. every token masked mid-output
            default_param = self.constraint_param or None
        param = (e.param or default_param) if isinstance(e, InvalidRequestError) else None
        return to_api_error(e, self.param_names.get(param, param))


@dataclass(frozen=True)
class ServingResult:
    """What a request gives back: a complete JSON `body`, or the SSE `events` of a stream (and the
    engine `streams` behind them, one per choice, to abort them when the events are never read);
    `headers` either way (X-Agentrt-Not-Enforced names schema keywords dropped under strict: false)."""

    body: dict | None = None
    events: AsyncIterator[str] | None = None
    headers: dict[str, str] | None = None
    streams: tuple[RequestStream, ...] = ()


class ResponseShape(Protocol):
    """How an API shows a chat or text generation: chat and text completions (chat_shape.py), or
    another API (Responses, Messages) whose request is translated to a ChatCompletionRequest and
    run by `OpenAIServing.chat(..., shape=)`. `lasts`, `streams` and `firsts` hold one entry per
    choice (always one for the other APIs: their n is 1)."""

    def body(
        self, gen: Generation, lasts: Sequence[RequestOutput], created: int, not_enforced: list[str]
    ) -> dict:
        """The complete response of a finished generation (`created`: Unix seconds;
        `not_enforced`: schema keywords dropped under strict: false)."""
        ...

    def events(
        self, gen: Generation, streams: Sequence[RequestStream], firsts: Sequence[RequestOutput], created: int
    ) -> AsyncIterator[str]:
        """The SSE events of a streamed generation, `firsts` (each choice's first output) included;
        errors after the first output (gen.api_error) become an error event. Closing it aborts
        `streams`."""
        ...

    def param(self, name: str | None) -> str | None:
        """This API's name for a chat completions request field ("messages", "tools[0]...",
        "response_format.json_schema.schema"), to name it in errors."""
        ...


def renamed(e: APIError, shape: ResponseShape) -> APIError:
    """`e` with its param, and the param's mentions in its message, in `shape`'s names."""
    name = shape.param(e.param)
    if e.param and name != e.param:
        e.message, e.param = e.message.replace(e.param, name), name
    return e
