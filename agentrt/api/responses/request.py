"""OpenAI's Responses API, `POST /v1/responses`: the request, its translation and `create_response`.

Spec: OpenAI's API reference for Responses and the openai-python types under
openai/types/responses/ (Response, ResponseStreamEvent, ResponseCreateParams).

A request is translated into a ChatCompletionRequest: `instructions` becomes a system message
first, `input` (a string, or message / function_call / function_call_output items) becomes chat
messages (consecutive calls join one assistant message with tool_calls, an output becomes a tool
message), flat function tools become chat tools, `text.format` becomes response_format,
`max_output_tokens` becomes max_tokens, `reasoning.effort` becomes reasoning_effort (a thinking
budget, api/reasoning.py; `reasoning.summary` is accepted and ignored: no summaries are written, a
reasoning item carries the whole reasoning as `reasoning_text` content). `reasoning` items in
`input` (earlier turns' reasoning) go to the chat template as the next assistant turn's
reasoning_content, which the template keeps or drops, as chat completions does. `OpenAIServing.chat` runs it with a `ResponsesShape`
(shape.py), which renders the result as a `response` object (or its SSE events) and names fields
in errors as this API does ("messages" -> "input", "response_format.json_schema.schema" ->
"text.format.schema", "tools[0].function.parameters" -> "tools[0].parameters", "max_tokens" ->
"max_output_tokens", "reasoning_effort" -> "reasoning.effort").

The server keeps no state: nothing is stored (`store` is accepted and changes nothing), so
`previous_response_id`, `conversation`, `prompt` and `background: true` are refused with a 400
naming the field, as is every other field this server cannot honour (`include`, `truncation:
"auto"`, built-in tools, `reasoning` asking a model that does not reason for reasoning, ...).
Chat completions' names for what this API names otherwise (`max_tokens`, `reasoning_effort`, `n`
other than 1, `logprobs`) are refused naming the field to use; agentrt's sampling extensions
(`logit_bias`, `stop_token_ids`, `ignore_eos`, `top_k`, ... : protocol.SamplingFields) pass through,
checked as chat completions checks them. Other fields this API does not define are ignored, as in
chat completions.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrt.api.disconnect import ClientGone
from agentrt.api.errors import APIError, field_path, shown
from agentrt.api.generation import ServingResult
from agentrt.api.protocol import ChatCompletionRequest, SamplingFields
from agentrt.api.reasoning import EFFORT_BUDGETS
from agentrt.api.responses.shape import ResponsesShape
from agentrt.api.serving import OpenAIServing
from agentrt.api.tools.turns import CallIds

STATELESS = "needs server-side state; this server keeps none: send the whole conversation in input"

METADATA_MAX_KEYS, METADATA_MAX_KEY_CHARS, METADATA_MAX_VALUE_CHARS = 16, 64, 512
"""OpenAI's limits on `metadata`: at most 16 pairs, keys up to 64 characters, values up to 512."""

_EXTENSIONS = (*SamplingFields.model_fields, "thinking_token_budget", "chat_template_kwargs")
"""agentrt's chat completions extensions also accepted here (same meaning, passed through)."""

EFFORTS = (*EFFORT_BUDGETS, "xhigh", "max")
"""OpenAI's reasoning.effort values; "xhigh" and "max" are "high" here (no budget: up to
max_output_tokens)."""

SUMMARIES = ("auto", "concise", "detailed")
"""OpenAI's reasoning.summary values (accepted; no summary is written)."""


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
    reasoning: Any = None  # {"effort", "summary"}: checked by _reasoning
    # refused unless they ask for nothing (see _refuse_unsupported)
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    n: int | None = None  # chat's; a response holds one output
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
    # chat completions' names for what this API names otherwise: refused with the name to use
    max_tokens: Any = None
    max_completion_tokens: Any = None
    reasoning_effort: Any = None
    logprobs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # agentrt's reasoning extensions, passed through as on chat completions (api/reasoning.py)
    thinking_token_budget: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


_CHAT_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
    "logprobs": "/v1/chat/completions (this server returns no logprobs on /v1/responses)",
}
"""Chat completions fields sent to this API, and what to use instead (never silently dropped)."""

_CHAT_CONSTRAINTS = (
    "sql", "regex", "grammar", "lark", "choice", "ebnf", "json_schema", "response_format", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
)  # fmt: skip


async def create_response(serving: OpenAIServing, req: ResponsesRequest, gone: ClientGone) -> ServingResult:
    """POST /v1/responses: a `response` object (or its SSE events when `stream`). `gone` returns when
    the client leaves (its work is then cancelled). Raises APIError (400 naming the field in this
    API's names; 404 for another model; 499 when the client left) or the engine's AgentrtError
    (QueueFullError, RequestTimeoutError, ServiceUnavailableError, ...)."""
    chat_req, shape = to_chat_request(req, serving.model_name, reasons=serving.reasoning.fmt is not None)
    return await serving.chat(chat_req, gone, shape=shape)


def to_chat_request(
    req: ResponsesRequest, model_name: str, reasons: bool = False
) -> tuple[ChatCompletionRequest, ResponsesShape]:
    """The chat completions request that runs `req`, and the shape that renders its result.
    `model_name`: the served model (echoed in responses); `reasons`: the served model reasons (its
    chat template has a reasoning format), else `reasoning` asking for reasoning is refused.
    Raises APIError (400) naming the field (OpenAI's Responses names) for what this server cannot
    honour or a malformed item or tool."""
    _refuse_unsupported(req)
    effort, summary = _reasoning(req.reasoning, reasons)
    messages, origins = _messages(req)
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    for name in ("temperature", "top_p", "user", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            chat[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    if effort is not None:
        chat["reasoning_effort"] = "high" if effort in ("xhigh", "max") else effort
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
    echo = _echo(req, tools, fmt, {"effort": effort, "summary": summary})
    return ChatCompletionRequest.model_validate(chat), ResponsesShape(model_name, echo, origins)


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming the first field that asks for what this server cannot do."""
    _refuse_chat_fields(req)
    _refuse_state(req)
    _refuse_options(req)
    _check_metadata(req.metadata or {})


def _refuse_chat_fields(req: ResponsesRequest) -> None:
    """400 for a field of the chat API (a constraint, a chat-only name, n other than 1)."""
    for name in _CHAT_CONSTRAINTS:
        if getattr(req, name) is not None:
            hint = "text.format (json_schema) on this API, or " if name != "sql" else ""
            raise APIError(
                f"{name} is not supported on /v1/responses: use {hint}/v1/chat/completions or "
                "/v1/completions, which enforce it",
                param=name,
            )
    for name, instead in _CHAT_NAMES.items():
        if getattr(req, name) is not None:
            raise APIError(f"{name} is a chat completions field: on /v1/responses use {instead}", param=name)
    if req.n is not None and req.n != 1:
        raise APIError(
            f"n must be 1 on /v1/responses (a response holds one output), got {req.n}: send n requests, or "
            "use /v1/chat/completions",
            param="n",
        )


def _refuse_state(req: ResponsesRequest) -> None:
    """400 for what needs server-side state: a stored response, conversation or prompt, background."""
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


# (field, the values that ask for nothing this server lacks, the 400's message when another is given)
_NOOP_ONLY = (
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


def _refuse_options(req: ResponsesRequest) -> None:
    """400 for an include, a _NOOP_ONLY field or a text.verbosity asking for what this server lacks."""
    for i, value in enumerate(req.include or ()):
        if value != "reasoning.encrypted_content":  # nothing is encrypted: reasoning items are plain text
            raise APIError(
                f"include[{i}] {shown(value)} is not supported: this server returns no logprobs and runs no "
                "built-in tools",
                param=f"include[{i}]",
            )
    for name, noop, why in _NOOP_ONLY:
        value = getattr(req, name)
        if not any(value == v and type(value) is type(v) for v in noop):
            raise APIError(why, param=name)
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise APIError(
            "text.verbosity: only 'medium' (the model's own verbosity cannot be steered)",
            param="text.verbosity",
        )


def _check_metadata(metadata: dict) -> None:
    """400 (param metadata) past METADATA_MAX_KEYS pairs or a key or value over its length limit."""
    if len(metadata) > METADATA_MAX_KEYS:
        raise APIError(f"metadata: at most {METADATA_MAX_KEYS} pairs, got {len(metadata)}", param="metadata")
    for k, v in metadata.items():
        if len(k) > METADATA_MAX_KEY_CHARS or len(v) > METADATA_MAX_VALUE_CHARS:
            raise APIError(
                f"metadata: keys up to {METADATA_MAX_KEY_CHARS} characters, values up to "
                f"{METADATA_MAX_VALUE_CHARS}; '{k[:METADATA_MAX_KEY_CHARS]}' is over",
                param="metadata",
            )


def _reasoning(value: Any, reasons: bool) -> tuple[str | None, str | None]:
    """(effort, summary) of `reasoning` ({"effort", "summary", "generate_summary" (summary's old
    name)} or null). Raises APIError naming the key at fault, or `reasoning` when it asks a model
    that does not reason (`reasons` false) for reasoning (an effort other than "none" / "minimal",
    as OpenAI refuses it for a model without reasoning)."""
    if value is None:
        return None, None
    if not isinstance(value, dict):
        raise APIError(
            'reasoning must be an object {"effort": ..., "summary": ...} or null', param="reasoning"
        )
    extra = sorted(set(value) - {"effort", "summary", "generate_summary"})
    if extra:
        key = field_path(["reasoning", extra[0]])
        raise APIError(f"{key} is not supported by this server", param=key)
    effort = value.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise APIError(
            f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {shown(effort)}",
            param="reasoning.effort",
        )
    for key in ("summary", "generate_summary"):
        if value.get(key) is not None and value[key] not in SUMMARIES:
            raise APIError(
                f"reasoning.{key} must be one of {', '.join(SUMMARIES)} or null, got {shown(value[key])}",
                param=f"reasoning.{key}",
            )
    if not reasons and effort not in (None, "none", "minimal"):
        raise APIError(
            f"reasoning: effort {shown(effort)} is not supported: the served model has no reasoning "
            'mode (send null or {"effort": "none"})',
            param="reasoning",
        )
    return effort, value.get("summary") or value.get("generate_summary")


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
    call_ids = CallIds("function_call item")  # each call id once, each call answered at most once
    thought: str | None = None  # a reasoning item's text, for the assistant turn after it
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
            if role != "assistant":  # the model's own items may sit among its calls
                call_ids.check_answered(where)
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            origins.append(where)
            if role == "assistant" and thought is not None:
                messages[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call":
            call_id, name = _string(item, "call_id", where), _string(item, "name", where)
            arguments = _string(item, "arguments", where, empty=True)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":  # calls join the assistant turn before them
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(where)
                if thought is not None:
                    messages[-1]["reasoning_content"], thought = thought, None
            call_ids.call(call_id, arguments, f"{where}.call_id", f"{where}.arguments")
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            call_ids.answer(call_id, f"{where}.call_id")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
            origins.append(where)
        elif kind == "reasoning":  # an earlier turn's reasoning: to the template with its turn
            thought = _reasoning_item(item, where)
        elif kind == "item_reference":
            raise APIError(f"{where}: item_reference {STATELESS}", param=f"{where}.type")
        else:
            raise APIError(
                f"{where}.type {shown(kind)} is not supported: this server takes message, reasoning, "
                "function_call and function_call_output items",
                param=f"{where}.type",
            )
    if not any(m["role"] != "system" for m in messages):
        raise APIError("input holds no message or function call (reasoning items alone)", param="input")
    return messages, origins


def _reasoning_item(item: dict, where: str) -> str:
    """The text of a `reasoning` input item ({"id", "summary", "content", "encrypted_content",
    "status"}): its content's reasoning_text parts, else its summary's; its summary and content
    are lists of text parts. It goes to the chat template as the next assistant turn's
    reasoning_content (the template keeps or drops it). Raises APIError naming the part at fault."""
    for key, part_type in (("summary", "summary_text"), ("content", "reasoning_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise APIError(f"{where}.{key} must be a list of {part_type} parts", param=f"{where}.{key}")
        for j, part in enumerate(parts):
            if (
                not isinstance(part, dict)
                or part.get("type") != part_type
                or not isinstance(part.get("text"), str)
            ):
                raise APIError(
                    f'{where}.{key}[{j}] must be {{"type": "{part_type}", "text": "..."}}',
                    param=f"{where}.{key}[{j}]",
                )
    texts = {key: "".join(part["text"] for part in item.get(key) or []) for key in ("content", "summary")}
    return texts["content"] or texts["summary"]


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
                f"tools[{i}].type {shown(t.get('type'))} is not supported: this server offers function "
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
        f"tool_choice type {shown(kind)} is not supported: this server offers function tools only",
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


def _echo(req: ResponsesRequest, tools: list[dict] | None, fmt: TextFormat | None, reasoning: dict) -> dict:
    """The request settings every response object carries (OpenAI's defaults where not given;
    `reasoning`: the request's {"effort", "summary"}). Raises APIError naming a field whose text
    is not valid Unicode (it could not be sent back)."""
    echo = {
        "background": False,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": None,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": reasoning,
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
            if name == "tools":  # name the tool
                field = next(f"tools[{i}]" for i, t in enumerate(value) if not _encodes(t))
            raise APIError(
                f"{field} is not valid Unicode text (e.g. a lone surrogate)", param=field
            ) from None
    return echo


def _encodes(value: Any) -> bool:
    """Whether `value`'s JSON text encodes as UTF-8 (no lone surrogate)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
