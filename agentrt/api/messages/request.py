"""Anthropic's Messages API (`POST /v1/messages`): the request, its translation and `create_message`.

A Messages request is translated into a ChatCompletionRequest (`to_chat`) and run by
`OpenAIServing.chat(..., shape=MessagesShape(...))` (shape.py): the same validation, chat
template, tool plan (tool inputs are constrained exactly as chat tool calls are), engine and
disconnect handling. The shape renders the result as Anthropic's `Message` (non-streamed) or its SSE events (streamed), and
names request fields in errors as the Messages API does (`tools[0].input_schema`,
`stop_sequences`, ...). Errors take Anthropic's shape `{"type": "error", "error": {"type",
"message"}}` (errors.py, by path), with the status agentrt gives any request.

The spec followed: Anthropic's API reference for Messages and streaming, and the types of the
`anthropic` Python SDK (2.x). Supported: model, max_tokens, system (text or text blocks), messages
(text, tool_use and tool_result blocks; consecutive turns of one role are combined into one turn, as
Anthropic does), tools (client tools), tool_choice (auto / any / tool / none,
disable_parallel_tool_use), stop_sequences, temperature (0-1), top_p, top_k, stream, metadata,
output_config.format (a JSON Schema for the text answer, enforced like response_format), and as
no-ops cache_control (prompt prefixes are cached automatically), service_tier (one tier).
Everything else (images, documents, server tools, a final assistant turn to continue, unknown
fields) is a 400 naming the field and why.

Thinking, for a model that reasons (its chat template has a reasoning format, api/reasoning.py):
`thinking` {"type": "enabled", "budget_tokens": N} (N >= 1024 and < max_tokens, as Anthropic
requires) is a thinking budget of N tokens, {"type": "disabled"} a budget of 0 (the prompt closes
the reasoning: no thinking block), {"type": "adaptive"} or no `thinking` the model's own default
(its template's), bounded by max_tokens alone; display "omitted" leaves the thinking text out of
the blocks. The reasoning comes back as `thinking` blocks (signature ""). Thinking and
redacted_thinking blocks of earlier assistant turns are accepted; a thinking block's text goes to the
chat template as that turn's reasoning_content, which the template keeps or drops (as on chat
completions). A model that does not reason
refuses enabled / adaptive thinking (disabled is a no-op).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrt.api.disconnect import ClientGone
from agentrt.api.errors import APIError, field_path, shown
from agentrt.api.generation import ServingResult
from agentrt.api.messages.shape import MessagesShape
from agentrt.api.protocol import ChatCompletionRequest
from agentrt.api.serving import OpenAIServing
from agentrt.api.tools.turns import ToolUseIds


class MessageParam(BaseModel):
    """One turn of `messages`: content is text or a list of content blocks (checked by `to_chat`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """The body of POST /v1/messages (Anthropic's MessageCreateParams). Fields outside those
    declared are kept (`model_extra`) so that `to_chat` can refuse them by name."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


_REFUSED = {
    "container": "code execution containers are not available on this server",
    "mcp_servers": "this server connects to no MCP servers",
    "context_management": "context editing is not supported",
    "inference_geo": "this server cannot choose where it runs",
    "speed": "this server has one speed",
    "diagnostics": "prompt-cache diagnostics are not supported",
}
"""Messages API fields agentrt refuses, and why (any other unknown field is refused too)."""

MIN_THINKING_BUDGET = 1024
"""Anthropic's least thinking.budget_tokens."""

_THINKING_BLOCKS = ("thinking", "redacted_thinking")
"""Blocks of an earlier assistant turn's thinking: accepted there (thinking text as its
reasoning_content)."""

_BLOCK_REASONS = {
    "image": "this server's model reads text only",
    "document": "this server's model reads text only",
    "search_result": "search result blocks are not supported",
    "server_tool_use": "server tools are not supported",
    "container_upload": "code execution containers are not available on this server",
}


def _bad(message: str, param: str | None) -> APIError:
    return APIError(message, param=param)


def _check_keys(obj: dict, allowed: Iterable[str], where: str) -> None:
    """Refuse (400) a key of `obj` outside `allowed`, naming it."""
    extra = sorted(set(obj) - set(allowed))
    if extra:
        key = field_path([extra[0]])  # a client's key: cut when long
        raise _bad(f"{where}.{key} is not supported by this server", f"{where}.{key}")


def _check_cache_control(value: Any, param: str) -> None:
    """cache_control (the field `param`) is accepted as a no-op (agentrt's prefix cache keeps every
    prompt prefix without breakpoints) when it has Anthropic's shape {"type": "ephemeral", "ttl"?}."""
    if value is None:
        return
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise _bad(f'{param} must be {{"type": "ephemeral"}} or null', param)


def _text_block(block: dict, where: str) -> str:
    """The text of a text block (type, text, cache_control, empty citations). Raises APIError."""
    _check_keys(block, ("type", "text", "cache_control", "citations"), where)
    if not isinstance(block.get("text"), str):
        raise _bad(f"{where}.text must be a string", f"{where}.text")
    if block.get("citations"):
        raise _bad(f"{where}.citations: citations are not supported by this server", f"{where}.citations")
    _check_cache_control(block.get("cache_control"), f"{where}.cache_control")
    return block["text"]


def _blocks(content: str | list, where: str) -> list[tuple[str, dict]]:
    """(where, block) for each content block; a string is one text block."""
    if isinstance(content, str):
        return [(where, {"type": "text", "text": content})]
    out = []
    for j, block in enumerate(content):
        w = f"{where}[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{w} must be a content block object with a type", w)
        kind = block["type"]
        if kind in _BLOCK_REASONS:
            raise _bad(f"{w}: {kind} blocks are not supported: {_BLOCK_REASONS[kind]}", f"{w}.type")
        if kind not in ("text", "tool_use", "tool_result", *_THINKING_BLOCKS):
            raise _bad(
                f"{w}: content blocks of type {shown(kind)} are not supported by this server", f"{w}.type"
            )
        out.append((w, block))
    return out


def _check_thinking_block(block: dict, where: str) -> None:
    """A thinking block {type, thinking, signature} or redacted_thinking block {type, data} of an
    earlier assistant turn (left out of the prompt). Raises APIError naming the key at fault."""
    keys = ("thinking", "signature") if block["type"] == "thinking" else ("data",)
    _check_keys(block, ("type", *keys), where)
    for key in keys:
        if key != "signature" and key not in block:
            raise _bad(f"{where}.{key} is required", f"{where}.{key}")
        if key in block and not isinstance(block[key], str):
            raise _bad(f"{where}.{key} must be a string", f"{where}.{key}")


def _parts(texts: list[str]) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def _tool_result_text(block: dict, where: str) -> str:
    """A tool_result's content as text: a string or text blocks (joined as a chat message's parts
    are); with is_error the text is prefixed "Error: " (the only way to tell the model)."""
    _check_keys(block, ("type", "tool_use_id", "content", "is_error", "cache_control"), where)
    _check_cache_control(block.get("cache_control"), f"{where}.cache_control")
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for k, b in enumerate(content):
            w = f"{where}.content[{k}]"
            if not isinstance(b, dict) or b.get("type") != "text":
                kind = b.get("type") if isinstance(b, dict) and isinstance(b.get("type"), str) else None
                why = _BLOCK_REASONS.get(kind, "a tool result holds text blocks only here")
                raise _bad(f"{w}: {shown(kind)} blocks are not supported in a tool result: {why}", w)
            texts.append(_text_block(b, w))
        text = "".join(texts)
    else:
        raise _bad(f"{where}.content must be a string or a list of text blocks", f"{where}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise _bad(f"{where}.is_error must be a boolean", f"{where}.is_error")
    return f"Error: {text}" if is_error else text


def _assistant_turn(blocks: list[tuple[str, dict]], tool_ids: ToolUseIds) -> dict:
    """A chat assistant message from an assistant turn's text and tool_use blocks; its thinking
    blocks' text is the message's reasoning_content (the chat template keeps or drops it, as chat
    completions does; redacted_thinking blocks are checked and left out)."""
    texts, calls, thoughts = [], [], []
    for w, block in blocks:
        if block["type"] == "text":
            texts.append(_text_block(block, w))
            continue
        if block["type"] in _THINKING_BLOCKS:
            _check_thinking_block(block, w)
            if block["type"] == "thinking" and block.get("thinking"):
                thoughts.append(block["thinking"])
            continue
        if block["type"] == "tool_result":
            raise _bad(f"{w}: tool_result blocks belong in user turns", f"{w}.type")
        _check_keys(block, ("type", "id", "name", "input", "cache_control", "caller"), w)
        _check_cache_control(block.get("cache_control"), f"{w}.cache_control")
        caller = block.get("caller")
        if caller is not None and (not isinstance(caller, dict) or caller.get("type") != "direct"):
            raise _bad(f"{w}.caller: only direct tool calls are supported", f"{w}.caller")
        for key, kind in (("id", str), ("name", str), ("input", dict)):
            if not isinstance(block.get(key), kind) or (kind is str and not block[key]):
                what = "an object" if kind is dict else "a non-empty string"
                raise _bad(f"{w}.{key} must be {what}", f"{w}.{key}")
        tool_ids.add(block["id"], f"{w}.id")
        arguments = json.dumps(block["input"], ensure_ascii=False)
        calls.append(
            {
                "id": block["id"],
                "type": "function",
                "function": {"name": block["name"], "arguments": arguments},
            }
        )
    message: dict = {"role": "assistant", "content": _parts(texts) if texts else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def _user_turn(blocks: list[tuple[str, dict]], tool_ids: ToolUseIds, turn: str) -> list[tuple[str, dict]]:
    """(where, chat message) for a user turn (`turn`: where it begins): each tool_result as a tool
    message, then its text as a user message. As Anthropic requires, the tool_result blocks come
    first (text before one is refused) and answer every tool_use block of the assistant turn before
    (`tool_ids`)."""
    out: list[tuple[str, dict]] = []
    texts: list[str] = []
    for w, block in blocks:
        if block["type"] == "text":
            texts.append(_text_block(block, w))
        elif block["type"] in ("tool_use", *_THINKING_BLOCKS):
            raise _bad(f"{w}: {block['type']} blocks belong in assistant turns", f"{w}.type")
        else:
            if texts:
                raise _bad(
                    f"{w}: tool_result blocks come first in a user turn, before any text (as Anthropic "
                    "requires): move the text after them",
                    w,
                )
            tid = tool_ids.answer(block.get("tool_use_id"), f"{w}.tool_use_id")
            out.append((w, {"role": "tool", "tool_call_id": tid, "content": _tool_result_text(block, w)}))
    tool_ids.check_answered(turn)
    if texts or not out:
        out.append((turn, {"role": "user", "content": _parts(texts)}))
    return out


def _tool(t: Any, i: int) -> dict:
    """A client tool {name, description, input_schema, ...} as a chat tool."""
    where = f"tools[{i}]"
    if not isinstance(t, dict):
        raise _bad(f"{where} must be a tool object", where)
    kind = t.get("type")
    if kind not in (None, "custom"):
        raise _bad(
            f"{where}: server tools (type {shown(kind)}) are not supported: only client tools "
            "{name, description, input_schema}",
            f"{where}.type",
        )
    if t.get("input_examples"):
        raise _bad(f"{where}.input_examples is not supported by this server", f"{where}.input_examples")
    if t.get("defer_loading"):
        raise _bad(
            f"{where}.defer_loading: tool search is not supported by this server", f"{where}.defer_loading"
        )
    callers = t.get("allowed_callers")
    if callers is not None and callers != ["direct"]:
        raise _bad(
            f"{where}.allowed_callers: only direct tool calls are supported", f"{where}.allowed_callers"
        )
    allowed = ("type", "name", "description", "input_schema", "cache_control", "strict")
    _check_keys(
        t, (*allowed, "eager_input_streaming", "input_examples", "defer_loading", "allowed_callers"), where
    )
    _check_cache_control(t.get("cache_control"), f"{where}.cache_control")
    if "input_schema" not in t:
        raise _bad(f"{where}.input_schema is required", f"{where}.input_schema")
    if not isinstance(t["input_schema"], dict):
        raise _bad(f"{where}.input_schema must be a JSON Schema object", f"{where}.input_schema")
    function = {"name": t.get("name"), "parameters": t["input_schema"]}
    for key in ("description", "strict"):
        if key in t:
            function[key] = t[key]
    return {"type": "function", "function": function}


def _tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    keys = {
        "auto": ("type", "disable_parallel_tool_use"),
        "any": ("type", "disable_parallel_tool_use"),
        "tool": ("type", "name", "disable_parallel_tool_use"),
        "none": ("type",),
    }
    if not isinstance(kind, str) or kind not in keys:
        raise _bad('tool_choice.type must be "auto", "any", "tool" or "none"', "tool_choice.type")
    _check_keys(choice, keys[kind], "tool_choice")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _bad(
            "tool_choice.disable_parallel_tool_use must be a boolean", "tool_choice.disable_parallel_tool_use"
        )
    parallel = None if disable is None else not disable
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise _bad('tool_choice.name is required with "type": "tool"', "tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _response_format(config: dict | None) -> dict | None:
    """output_config.format ({"type": "json_schema", "schema"}) as a chat response_format."""
    if config is None:
        return None
    _check_keys(config, ("format", "effort"), "output_config")
    if config.get("effort") is not None:
        raise _bad(
            "output_config.effort is not supported: this server's model has no effort setting",
            "output_config.effort",
        )
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise _bad(
            'output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format"
        )
    _check_keys(fmt, ("type", "schema"), "output_config.format")
    if not isinstance(fmt.get("schema"), dict):
        raise _bad("output_config.format.schema must be a JSON Schema object", "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _thinking(req: MessagesRequest, reasons: bool) -> tuple[int | None, bool]:
    """(the thinking budget in tokens, None: no budget; whether display "omitted" leaves the
    thinking text out) of `thinking` (see the module docstring); `reasons`: the served model
    reasons. Raises APIError naming the field, as Anthropic validates it."""
    thinking = req.thinking
    if thinking is None:
        return None, False
    kinds = {"enabled": ("budget_tokens", "display"), "adaptive": ("display",), "disabled": ()}
    kind = thinking.get("type")
    if not isinstance(kind, str) or kind not in kinds:
        raise _bad('thinking.type must be "enabled", "adaptive" or "disabled"', "thinking.type")
    _check_keys(thinking, ("type", *kinds[kind]), "thinking")
    if kind == "disabled":
        return 0, False
    if not reasons:
        raise _bad(
            "thinking: extended thinking is not supported: this server's model writes no thinking blocks",
            "thinking",
        )
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise _bad('thinking.display must be "summarized" or "omitted"', "thinking.display")
    if kind == "adaptive":
        return None, display == "omitted"
    budget = thinking.get("budget_tokens")
    if budget is None:
        raise _bad('thinking.budget_tokens is required with "type": "enabled"', "thinking.budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise _bad(
            f"thinking.budget_tokens must be an integer, got {shown(budget)}", "thinking.budget_tokens"
        )
    if budget < MIN_THINKING_BUDGET:
        raise _bad(
            f"thinking.budget_tokens must be >= {MIN_THINKING_BUDGET}, got {budget}", "thinking.budget_tokens"
        )
    if budget >= req.max_tokens:
        raise _bad(
            f"thinking.budget_tokens must be less than max_tokens ({req.max_tokens}), got {budget}",
            "thinking.budget_tokens",
        )
    return budget, display == "omitted"


def to_chat(req: MessagesRequest, reasons: bool = False) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat completions request that runs `req`, and for each of its messages the Messages
    field it came from ("system", "messages[2]", "messages[3].content[0]"). `reasons`: the served
    model reasons (else enabled / adaptive thinking is refused). Raises APIError (400) naming the
    field for anything the Messages API allows that agentrt cannot honour (see the module
    docstring), or that the Messages API itself refuses."""
    _refuse_extra_fields(req)
    budget, _ = _thinking(req, reasons)
    _check_options(req)
    messages: list[dict] = []
    where: list[str] = []
    if req.system is not None:
        messages.append(_system_message(req.system))
        where.append("system")
    for w, message in _turn_messages(_turns(req)):
        messages.append(message)
        where.append(w)
    chat = _chat_fields(req, messages, budget)
    try:
        return ChatCompletionRequest.model_validate(chat), where
    except ValidationError as e:  # every field is checked above: this names what slipped through
        err = e.errors()[0]
        loc = field_path(err.get("loc", ()))
        raise _bad(f"the request cannot be run as a chat completion: {loc}: {err.get('msg')}", None) from None


def _refuse_extra_fields(req: MessagesRequest) -> None:
    """400 naming the first field that is not a Messages API field agentrt implements."""
    for name in req.model_extra or {}:
        why = _REFUSED.get(name, "it is not a Messages API field agentrt implements")
        raise _bad(f"{field_path([name])} is not supported: {why}", field_path([name]))


def _check_options(req: MessagesRequest) -> None:
    """400 for a temperature outside [0, 1], metadata other than a string user_id, or a bad
    cache_control."""
    if req.temperature is not None and not 0 <= req.temperature <= 1:
        raise _bad(f"temperature must be between 0 and 1, got {req.temperature}", "temperature")
    if req.metadata is not None:
        _check_keys(req.metadata, ("user_id",), "metadata")
        if req.metadata.get("user_id") is not None and not isinstance(req.metadata["user_id"], str):
            raise _bad("metadata.user_id must be a string", "metadata.user_id")
    _check_cache_control(req.cache_control, "cache_control")


def _system_message(system) -> dict:
    """The chat system message of the Messages `system` (a string or text blocks). Raises APIError
    for a block that is not text."""
    blocks = _blocks(system, "system")
    for w, b in blocks:
        if b["type"] != "text":
            raise _bad(f"{w}: the system prompt holds text blocks only", f"{w}.type")
    texts = [_text_block(b, w) for w, b in blocks]
    return {"role": "system", "content": _parts(texts)}


def _turns(req: MessagesRequest) -> list[tuple[str, str, list[tuple[str, dict]]]]:
    """[(role, the field "messages[i]", its (field, block) pairs)], consecutive turns of one role
    merged. Raises APIError for an empty turn or a final assistant turn (prefill)."""
    # consecutive turns of one role are one turn (as Anthropic combines them)
    turns: list[tuple[str, str, list[tuple[str, dict]]]] = []
    for i, m in enumerate(req.messages):
        if not m.content:  # as Anthropic: only a final assistant turn (not served here) may be empty
            raise _bad(
                f"messages[{i}].content is empty: every turn needs content (text or blocks)",
                f"messages[{i}].content",
            )
        blocks = _blocks(m.content, f"messages[{i}].content")
        if turns and turns[-1][0] == m.role:
            turns[-1][2].extend(blocks)
        else:
            turns.append((m.role, f"messages[{i}]", blocks))
    if turns[-1][0] == "assistant":
        last = len(req.messages) - 1
        raise _bad(
            f"messages[{last}]: a final assistant turn (prefill, continuing the assistant's text) is not "
            "supported: end with a user turn",
            f"messages[{last}]",
        )
    return turns


def _turn_messages(turns) -> list[tuple[str, dict]]:
    """[(the Messages field it came from, chat message)] of the turns: an assistant turn is one
    message, a user turn one per tool result plus its other content."""
    out: list[tuple[str, dict]] = []
    tool_ids = ToolUseIds()  # unique; a user turn's results answer the assistant turn before it
    for role, w, blocks in turns:
        if role == "assistant":
            out.append((w, _assistant_turn(blocks, tool_ids.new_turn())))
        else:
            out.extend(_user_turn(blocks, tool_ids, w))
    return out


def _chat_fields(req: MessagesRequest, messages: list[dict], budget: int | None) -> dict[str, Any]:
    """The chat completions request body of `req` with these messages and thinking budget."""
    chat: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "stream": req.stream,
    }
    if req.tools is not None:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    chat["tool_choice"], chat["parallel_tool_calls"] = _tool_choice(req.tool_choice)
    for name in ("temperature", "top_p"):
        if getattr(req, name) is not None:
            chat[name] = float(getattr(req, name))
    if req.top_k is not None:
        chat["top_k"] = req.top_k
    if req.stop_sequences is not None:
        chat["stop"] = req.stop_sequences
    chat["response_format"] = _response_format(req.output_config)
    if budget is not None:
        chat["thinking_token_budget"] = budget
    return chat


async def create_message(serving: OpenAIServing, req: MessagesRequest, gone: ClientGone) -> ServingResult:
    """POST /v1/messages: `req` run as a chat completion, rendered as a Message or its stream.
    Raises APIError (400 naming the Messages field, 404 for another model, ...) or the engine's
    AgentrtError, as `OpenAIServing.chat`; errors.py gives them Anthropic's shape by path."""
    reasons = serving.reasoning.fmt is not None
    chat, where = to_chat(req, reasons)
    _, omit_thinking = _thinking(req, reasons)
    shape = MessagesShape(req.model, serving.engine.tokenizer, where, omit_thinking)
    return await serving.chat(chat, gone, shape=shape)
