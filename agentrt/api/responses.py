"""OpenAI's Responses API, `POST /v1/responses`, over the chat serving path.

Spec: OpenAI's API reference for Responses and the openai-python types under
openai/types/responses/ (Response, ResponseStreamEvent, ResponseCreateParams).

A request is translated into a ChatCompletionRequest: `instructions` becomes a system message
first, `input` (a string, or message / function_call / function_call_output items) becomes chat
messages (consecutive calls join one assistant message with tool_calls, an output becomes a tool
message), flat function tools become chat tools, `text.format` becomes response_format,
`max_output_tokens` becomes max_tokens. `OpenAIServing.chat` runs it with a `ResponsesShape`,
which renders the result as a `response` object (or its SSE events) and names fields in errors as
this API does ("messages" -> "input", "response_format.json_schema.schema" -> "text.format.schema",
"tools[0].function.parameters" -> "tools[0].parameters", "max_tokens" -> "max_output_tokens").

The server keeps no state: nothing is stored (`store` is accepted and changes nothing), so
`previous_response_id`, `conversation`, `prompt` and `background: true` are refused with a 400
naming the field, as is every other field this server cannot honour (`reasoning`, `include`,
`truncation: "auto"`, built-in tools, ...). Fields this API does not define are ignored, as in
chat completions.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrt.api.errors import APIError
from agentrt.api.protocol import ChatCompletionRequest, SamplingFields, usage
from agentrt.api.serving import ClientGone, Generation, OpenAIServing, ServingResult, renamed
from agentrt.api.tools import ParseEvent, ToolPlan
from agentrt.api.tools.turns import add_function_call, check_function_call_output
from agentrt.errors import InternalError
from agentrt.runtime.async_engine import RequestStream
from agentrt.runtime.request import RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["ResponsesRequest", "ResponsesShape", "create_response", "to_chat_request"]

STATELESS = "needs server-side state; this server keeps none: send the whole conversation in input"

METADATA_MAX_KEYS, METADATA_MAX_KEY_CHARS, METADATA_MAX_VALUE_CHARS = 16, 64, 512
"""OpenAI's limits on `metadata`: at most 16 pairs, keys up to 64 characters, values up to 512."""

_EXTENSIONS = tuple(SamplingFields.model_fields)
"""agentrt's chat completions extensions also accepted here (same meaning, passed through)."""


class TextFormat(BaseModel):
    """`text.format`: {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "name",
    "schema", "description", "strict"}."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(SamplingFields):
    """The body of POST /v1/responses (OpenAI's names). `input` items and `tools` are checked by
    `to_chat_request`, which names the item or tool at fault; fields in the second group are refused
    (400) unless they ask for nothing; the last group are agentrt's chat extensions."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no obfuscation field is sent
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None  # nothing is stored either way
    prompt_cache_key: str | None = None  # the prefix cache is shared by every request anyway
    max_tool_calls: int | None = None  # limits built-in tool calls; this server runs none
    # refused unless they ask for nothing (see _refuse_unsupported)
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    reasoning: Any = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    context_management: Any = None
    moderation: Any = None
    # the chat/completions constraint fields (agentrt's, vLLM's, SGLang's): refused here, never
    # silently dropped (this API's own constraint is text.format)
    sql: Any = None
    regex: Any = None
    grammar: Any = None
    lark: Any = None
    choice: Any = None
    ebnf: Any = None
    json_schema: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


_CHAT_CONSTRAINTS = (
    "sql", "regex", "grammar", "lark", "choice", "ebnf", "json_schema", "response_format", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
)  # fmt: skip


async def create_response(serving: OpenAIServing, req: ResponsesRequest, gone: ClientGone) -> ServingResult:
    """POST /v1/responses: a `response` object (or its SSE events when `stream`). `gone` returns when
    the client leaves (its work is then cancelled). Raises APIError (400 naming the field in this
    API's names; 404 for another model; 499 when the client left) or the engine's AgentrtError
    (QueueFullError, RequestTimeoutError, ServiceUnavailableError, ...)."""
    chat_req, shape = to_chat_request(req, serving.model_name)
    return await serving.chat(chat_req, gone, shape=shape)


def to_chat_request(req: ResponsesRequest, model_name: str) -> tuple[ChatCompletionRequest, ResponsesShape]:
    """The chat completions request that runs `req`, and the shape that renders its result.
    `model_name`: the served model (echoed in responses). Raises APIError (400) naming the field
    (OpenAI's Responses names) for what this server cannot honour or a malformed item or tool."""
    _refuse_unsupported(req)
    messages, origins = _messages(req)
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    for name in ("temperature", "top_p", "user", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    tools = _tools(req.tools)
    if tools is not None:
        chat["tools"] = [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools
        ]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    response_format = _response_format(fmt)
    if response_format is not None:
        chat["response_format"] = response_format
    for name in _EXTENSIONS:
        if name in req.model_fields_set:
            chat[name] = getattr(req, name)
    echo = _echo(req, tools, fmt)
    return ChatCompletionRequest.model_validate(chat), ResponsesShape(model_name, echo, origins)


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming the first field that asks for what this server cannot do."""
    for name in _CHAT_CONSTRAINTS:
        if getattr(req, name) is not None:
            hint = "text.format (json_schema) on this API, or " if name != "sql" else ""
            raise APIError(
                f"{name} is not supported on /v1/responses: use {hint}/v1/chat/completions or "
                "/v1/completions, which enforce it",
                param=name,
            )
    for name in ("previous_response_id", "conversation"):
        if getattr(req, name) is not None:
            raise APIError(f"{name} {STATELESS}", param=name)
    if req.prompt is not None:
        raise APIError(
            "prompt (a stored prompt template) needs server-side state; this server keeps none: send the "
            "instructions and input themselves",
            param="prompt",
        )
    if req.background:
        raise APIError(
            "background: true needs server-side state (a response to poll later); this server keeps none: "
            "send the request without it (stream to see progress)",
            param="background",
        )
    r = req.reasoning
    if r is not None and not (
        isinstance(r, dict)
        and r.get("effort") in (None, "none")
        and all(v is None for k, v in r.items() if k != "effort")
    ):
        raise APIError(
            "reasoning is not supported: the served model has no reasoning mode (send null or "
            '{"effort": "none"})',
            param="reasoning",
        )
    for i, value in enumerate(req.include or ()):
        if value != "reasoning.encrypted_content":  # that one holds nothing here: no reasoning items
            raise APIError(
                f"include[{i}] '{value}' is not supported: this server returns no logprobs and runs no "
                "built-in tools",
                param=f"include[{i}]",
            )
    refusals = (
        (
            "truncation",
            (None, "disabled"),
            (
                "truncation 'auto' (dropping earlier input to fit the context) is not supported: input "
                "beyond the context is a 400 context_length_exceeded"
            ),
        ),
        ("top_logprobs", (None, 0), "top_logprobs is not supported: this server returns no logprobs"),
        ("service_tier", (None, "auto", "default"), "service_tier: this server has one tier ('default')"),
        (
            "prompt_cache_retention",
            (None, "in_memory"),
            (
                "prompt_cache_retention: only 'in_memory' (the prefix cache lives in memory, least "
                "recently used out; no retention time is promised)"
            ),
        ),
        ("prompt_cache_options", (None,), "prompt_cache_options is not supported by this server"),
        ("context_management", (None, []), "context_management (server-side compaction) is not supported"),
        ("moderation", (None,), "moderation is not supported by this server"),
    )
    for name, noop, why in refusals:
        value = getattr(req, name)
        if not any(value == v and type(value) is type(v) for v in noop):
            raise APIError(why, param=name)
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise APIError(
            "text.verbosity: only 'medium' (the model's own verbosity cannot be steered)",
            param="text.verbosity",
        )
    metadata = req.metadata or {}
    if len(metadata) > METADATA_MAX_KEYS:
        raise APIError(f"metadata: at most {METADATA_MAX_KEYS} pairs, got {len(metadata)}", param="metadata")
    for k, v in metadata.items():
        if len(k) > METADATA_MAX_KEY_CHARS or len(v) > METADATA_MAX_VALUE_CHARS:
            raise APIError(
                f"metadata: keys up to {METADATA_MAX_KEY_CHARS} characters, values up to "
                f"{METADATA_MAX_VALUE_CHARS}; '{k[:METADATA_MAX_KEY_CHARS]}' is over",
                param="metadata",
            )


def _messages(req: ResponsesRequest) -> tuple[list[dict], list[str]]:
    """(chat messages, the Responses field each came from) of `instructions` and `input`. Raises
    APIError naming the item at fault."""
    messages: list[dict] = []
    origins: list[str] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        origins.append("instructions")
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        origins.append("input")
        return messages, origins
    if not req.input:
        raise APIError("input is empty: give a string or at least one item", param="input")
    call_ids: set[str] = set()
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(
                f"{where} must be an object (a message, function_call or function_call_output item)",
                param=where,
            )
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    f"{where}.role must be 'user', 'system', 'developer' or 'assistant'",
                    param=f"{where}.role",
                )
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            origins.append(where)
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            arguments = _string(item, "arguments", where, empty=True)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":  # calls join the assistant turn before them
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(where)
            add_function_call(call_ids, call_id, arguments, where)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            check_function_call_output(call_ids, call_id, where)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
            origins.append(where)
        elif kind == "item_reference":
            raise APIError(f"{where}: item_reference {STATELESS}", param=f"{where}.type")
        else:
            raise APIError(
                f"{where}.type '{kind}' is not supported: this server takes message, function_call and "
                "function_call_output items",
                param=f"{where}.type",
            )
    return messages, origins


def _string(item: dict, key: str, where: str, empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not empty):
        raise APIError(
            f"{where}.{key} must be a{'' if empty else ' non-empty'} string", param=f"{where}.{key}"
        )
    return value


def _text(content: Any, where: str) -> str:
    """The text of a message's content or a call's output: a string, or a list of input_text /
    output_text parts (joined). Raises APIError naming the part at fault."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise APIError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(
                f"{where}[{j}]: {kind} is not supported: the served model reads text only",
                param=f"{where}[{j}].type",
            )
        else:
            raise APIError(
                f"{where}[{j}] must be a content part of type input_text or output_text",
                param=f"{where}[{j}]",
            )
    return "".join(texts)


def _tools(tools: list[Any] | None) -> list[dict] | None:
    """Responses function tools ({"type": "function", "name", "description", "parameters",
    "strict"}; strict defaults to true, as in this API) with their defaults filled; the rest of each
    tool is checked by the chat path (errors renamed by ResponsesShape.param). Raises APIError for
    a tool that is not a function tool."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise APIError(f'tools[{i}] must be {{"type": "function", "name": ...}}', param=f"tools[{i}]")
        if t.get("type") != "function":
            raise APIError(
                f"tools[{i}].type {json.dumps(t.get('type'))} is not supported: this server offers function "
                "tools only (the client runs them)",
                param=f"tools[{i}].type",
            )
        tool = {"type": "function", "name": t.get("name"), "description": t.get("description")}
        tool["parameters"] = t.get("parameters")
        tool["strict"] = True if t.get("strict") is None else t["strict"]
        out.append(tool)
    return out


_CHOICE_SHAPES = 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'


def _tool_choice(choice: Any) -> Any:
    """A Responses tool_choice as chat completions writes it. Raises APIError naming tool_choice."""
    if isinstance(choice, str) and choice in ("none", "auto", "required"):
        return choice
    if not isinstance(choice, dict):
        raise APIError(_CHOICE_SHAPES, param="tool_choice")
    kind = choice.get("type")
    if kind == "function":
        if not isinstance(choice.get("name"), str):
            raise APIError(_CHOICE_SHAPES, param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools":
        raise APIError(
            "tool_choice 'allowed_tools' is not supported: offer only the allowed tools in tools instead",
            param="tool_choice",
        )
    raise APIError(
        f"tool_choice type {json.dumps(kind)} is not supported: this server offers function tools only",
        param="tool_choice",
    )


def _response_format(fmt: TextFormat | None) -> dict | None:
    """`text.format` as chat's response_format (None: plain text)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise APIError("text.format.schema is required for type json_schema", param="text.format.schema")
    schema: dict[str, Any] = {"schema": fmt.schema_}
    for name in ("name", "description", "strict"):
        if getattr(fmt, name) is not None:
            schema[name] = getattr(fmt, name)
    return {"type": "json_schema", "json_schema": schema}


def _echo(req: ResponsesRequest, tools: list[dict] | None, fmt: TextFormat | None) -> dict:
    """The request settings every response object carries (OpenAI's defaults where not given).
    Raises APIError naming a field whose text is not valid Unicode (it could not be sent back)."""
    echo = {
        "background": False,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
            "verbosity": "medium",
        },
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
        "tools": tools or [],
        "top_logprobs": 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "user": req.user,
    }
    for name, value in echo.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            field = {"text": "text.format"}.get(name, name)
            raise APIError(
                f"{field} is not valid Unicode text (e.g. a lone surrogate)", param=field
            ) from None
    return echo


_MESSAGE_PARAM = re.compile(r"messages\[(\d+)\](.*)", re.DOTALL)
_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function(.*)", re.DOTALL)


class ResponsesShape:
    """Renders a chat generation as OpenAI's Responses API (serving.ResponseShape): a `response`
    object, or its SSE events (`event: <type>` and `data: <JSON with type and sequence_number>`).

    model: the served model name; echo: the request settings every response object carries;
    origins: per chat message, the Responses field it came from ("instructions", "input[3]"), to
    name fields in errors. Output items follow the model text in order: a `message` item for text
    (whitespace alone between calls is dropped), a `function_call` item per tool call."""

    def __init__(self, model: str, echo: dict, origins: list[str]):
        self.model, self.echo, self.origins = model, echo, origins

    def param(self, name: str | None) -> str | None:
        """This API's name for a chat completions field (see the module docstring)."""
        if name is None:
            return None
        if name in ("max_tokens", "max_completion_tokens"):
            return "max_output_tokens"
        if name in ("messages", "prompt"):
            return "input"
        if name.startswith("response_format"):
            return "text.format" + name[len("response_format") :].replace(".json_schema", "", 1)
        m = _TOOL_PARAM.fullmatch(name)
        if m:
            return f"tools[{m[1]}]{m[2]}"
        m = _MESSAGE_PARAM.fullmatch(name)
        if m:
            i = int(m[1])
            origin = self.origins[i] if i < len(self.origins) else "input"
            rest = ".call_id" if m[2] == ".tool_call_id" and origin.startswith("input[") else ""
            return origin + rest
        return name

    def body(self, gen: Generation, last: RequestOutput, created: int, not_enforced: list[str]) -> dict:
        """The `response` object of a finished generation."""
        output = _Output(gen.tools)
        output.feed(last.text)
        output.finish(last.finish_reason, last.closed_by_budget)
        return self._response(gen, created, output.items, last, not_enforced)

    async def events(
        self, gen: Generation, stream: RequestStream, first: RequestOutput, created: int
    ) -> AsyncIterator[str]:
        """response.created, response.in_progress, the output items' events (output_item.added,
        content_part.added, output_text.delta / .done, content_part.done, function_call_arguments
        .delta / .done, output_item.done), then response.completed (response.incomplete when the
        output hit max_output_tokens) with the whole response. A failure after the first output is
        one `error` event (type, code, message, param) ending the stream. Closing the iterator
        aborts the request."""
        seq = itertools.count()

        def event(data: dict) -> str:
            data = {"type": data["type"], "sequence_number": next(seq), **data}
            return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        try:
            started = self._response(gen, created, [], None, [])
            yield event({"type": "response.created", "response": started})
            yield event({"type": "response.in_progress", "response": started})
            output = _Output(gen.tools)
            out = first
            while True:
                if out.finish_reason == "error":
                    yield event(self._error(gen.api_error(out.error)))
                    return
                try:
                    events = output.feed(out.delta_text)
                    if out.finished:
                        events += output.finish(out.finish_reason, out.closed_by_budget)
                except Exception as e:  # a parser fault fails this stream alone, with an error event
                    logger.exception("output parsing failed for %s", stream.request_id)
                    error = InternalError(f"internal error while parsing the output: {type(e).__name__}: {e}")
                    yield event(self._error(gen.api_error(error)))
                    return
                for data in events:
                    yield event(data)
                if out.finished:
                    break
                out = await anext(stream)
            final = self._response(gen, created, output.items, out, stream.not_enforced)
            done = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield event({"type": done, "response": final})
        finally:
            await stream.aclose()

    def _error(self, e: APIError) -> dict:
        e = renamed(e, self)
        return {"type": "error", "code": e.code, "message": e.message, "param": e.param}

    def _response(
        self,
        gen: Generation,
        created: int,
        items: list[dict],
        last: RequestOutput | None,
        not_enforced: list[str],
    ) -> dict:
        """The `response` object: in progress while `last` is None, else finished ("incomplete" with
        reason max_output_tokens when the output hit its token limit: its last item is incomplete)."""
        status = "in_progress"
        if last is not None:
            status = "incomplete" if items[-1]["status"] == "incomplete" else "completed"
        body = {
            "id": "resp_" + gen.request_id.split("-", 1)[-1],
            "object": "response",
            "created_at": created,
            "status": status,
            "completed_at": int(time.time()) if last is not None else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": copy.deepcopy(items),
            "usage": _usage(last) if last is not None else None,
            **self.echo,
        }
        if not_enforced:
            body["not_enforced"] = list(not_enforced)
        return body


def _usage(last: RequestOutput) -> dict:
    """The Responses `usage` of a finished output (tokens; cached_tokens: prompt tokens served from
    the prefix cache)."""
    u = usage(last)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class _Output:
    """The output items of one generation, built from its text as it arrives (the same machine for
    streamed and non-streamed responses, so both give the same items): text becomes a `message`
    item, tool calls (parsed by the plan's ToolCallParser; `plan` None: text only) `function_call`
    items, in the text's order. feed / finish return the stream events (dicts without
    sequence_number) of what they opened, grew and closed; `items` holds the items so far."""

    def __init__(self, plan: ToolPlan | None):
        self.parser = plan.new_parser() if plan is not None else None
        self.items: list[dict] = []
        self._open: dict | None = None
        self._blank = ""  # whitespace not yet shown: it opens a message only when text follows it

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        parsed = self.parser.feed(text) if self.parser is not None else [ParseEvent("content", text)]
        return self._apply(parsed)

    def finish(self, finish_reason: str, closed_by_budget: bool = False) -> list[dict]:
        """The events that end the output: the parser's last ones, the open item closed (status
        "incomplete" when finish_reason is "length", or text `closed_by_budget` cut: ToolCallParser
        .close), and one message item when there was no output at all (its text possibly empty)."""
        events: list[dict] = []
        if self.parser is not None:
            parsed, finish_reason = self.parser.close(finish_reason, closed_by_budget)
            events += self._apply(parsed)
        if not self.items:
            events += self._open_message()
            if self._blank:
                events += self._text(self._blank)
        events += self._close("incomplete" if finish_reason == "length" else "completed")
        return events

    def _apply(self, parsed: list[ParseEvent]) -> list[dict]:
        events: list[dict] = []
        for p in parsed:
            if p.kind == "content":
                if self._open is not None and self._open["type"] == "message":
                    events += self._text(p.text)
                elif (self._blank + p.text).strip():
                    text, self._blank = self._blank + p.text, ""
                    events += self._close("completed") + self._open_message() + self._text(text)
                else:
                    self._blank += p.text
            elif p.kind == "call":
                self._blank = ""
                events += self._close("completed") + self._open_call(p)
            else:  # arguments of the open call
                item = self._open
                item["arguments"] += p.text
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": item["id"],
                        "output_index": len(self.items) - 1,
                        "delta": p.text,
                    }
                )
        return events

    def _open_item(self, item: dict) -> dict:
        self.items.append(item)
        self._open = item
        return {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": copy.deepcopy(item),
        }

    def _open_message(self) -> list[dict]:
        item = {"id": _new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress"}
        item["content"] = []
        added = self._open_item(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return [
            added,
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": len(self.items) - 1,
                "content_index": 0,
                "part": copy.deepcopy(part),
            },
        ]

    def _open_call(self, p: ParseEvent) -> list[dict]:
        item = {
            "id": _new_id("fc_"),
            "type": "function_call",
            "status": "in_progress",
            "arguments": "",
            "call_id": p.id,
            "name": p.name,
        }
        return [self._open_item(item)]

    def _text(self, text: str) -> list[dict]:
        item = self._open
        item["content"][0]["text"] += text
        return [
            {
                "type": "response.output_text.delta",
                "item_id": item["id"],
                "output_index": len(self.items) - 1,
                "content_index": 0,
                "delta": text,
                "logprobs": [],
            }
        ]

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                },
                {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": copy.deepcopy(part),
                },
            ]
        else:
            events = [
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "arguments": item["arguments"],
                }
            ]
        events.append(
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}
        )
        return events
