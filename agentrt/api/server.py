"""FastAPI app: OpenAI-compatible /v1/chat/completions, /v1/completions, /v1/models, /health."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrt.api.protocol import APIError, ChatCompletionRequest, CompletionRequest, _CommonRequest
from agentrt.api.tools import (
    ToolCallParser,
    ToolPlan,
    check_tool_messages,
    detect_format,
    plan_tools,
    render_messages,
)
from agentrt.errors import (
    AgentrtError,
    ConstraintError,
    ContextLengthError,
    InvalidRequestError,
    ServiceUnavailableError,
)
from agentrt.grammars.spec import ConstraintSpec
from agentrt.grammars.tool_calls import FORMATS
from agentrt.runtime.async_engine import AsyncEngine
from agentrt.runtime.request import RequestOutput

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "json-or-python"}


def _utf8(text: str) -> str:
    """Text safe to encode as UTF-8 (lone surrogates from the client are escaped)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": _utf8(message), "type": type_, "param": param and _utf8(param), "code": code}}


def to_api_error(e: AgentrtError, default_param: str | None = None) -> APIError:
    """The HTTP status and OpenAI error fields for a typed runtime error."""
    if isinstance(e, InvalidRequestError):
        code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
        return APIError(e.message, status=400, param=e.param or default_param, code=code)
    if isinstance(e, ServiceUnavailableError):
        return APIError(e.message, status=503, type_="server_error")
    return APIError(e.message, status=500, type_="server_error")


def create_app(engine: AsyncEngine, served_model_name: str,
               on_ready: Callable[[], None] | None = None, tool_call_format: str = "auto",
               exclude_tools_when_tool_choice_none: bool = False) -> FastAPI:
    """The HTTP app around one AsyncEngine. `served_model_name` is the only accepted `model`;
    `on_ready` runs once the app has started. tool_call_format: "auto" (read from the chat
    template) or a name in grammars/tool_calls.FORMATS; exclude_tools_when_tool_choice_none: leave
    the tools out of the prompt when tool_choice is "none". Raises ValueError on an unknown format."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="agentrt", version="0.1.0", lifespan=lifespan)
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    template = getattr(tokenizer, "chat_template", None)
    detected, native_tools = detect_format(template if isinstance(template, str) else json.dumps(template))
    if tool_call_format not in ("auto", *FORMATS):
        raise ValueError(f"unknown tool call format '{tool_call_format}' (auto, {', '.join(FORMATS)})")
    tool_format = FORMATS[detected if tool_call_format == "auto" else tool_call_format]
    # a template that renders tools in another syntax than the one asked for: use the generic prompt
    native_tools = native_tools and tool_format.name == detected
    logger.info("tool calls: format %s (%s prompt)", tool_format.name, "template" if native_tools else "generic")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return JSONResponse(error_body(f"request body of {length} bytes exceeds the limit of {MAX_BODY_BYTES}",
                                           "invalid_request_error", None, None), status_code=413)
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        type_ = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), type_, None, None), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _is_type_tag(p)]
        param = ".".join(loc) or None
        if err.get("type") == "json_invalid":
            param = None
            message = f"request body is not valid JSON: {err.get('ctx', {}).get('error') or err.get('msg')}"
        else:
            message = f"{param or 'body'}: {err.get('msg')}"
        return JSONResponse(error_body(message, "invalid_request_error", param, None), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception):
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error", None, None),
                            status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": served_model_name, "object": "model", "created": 0, "owned_by": "agentrt",
             "max_model_len": max_model_len}]}

    def check_model(req: _CommonRequest) -> None:
        if req.model != served_model_name:
            raise APIError(f"model '{req.model}' does not exist; this server serves '{served_model_name}'",
                           status=404, param="model", code="model_not_found")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tool_format,
                          constrained=req.tool_call_constraint)
        tool_constraint = None
        if plan is not None:
            for i, t in enumerate(plan.all_tools):
                try:  # the meta-schema check, as for response_format
                    t["parameters"] = json.loads(ConstraintSpec.json_schema(t["parameters"]).value)
                except ValueError as e:
                    where = f"tools[{i}].function.parameters"
                    raise APIError(f"{where}: {e}", param=where) from None
            if plan.mode != "none" and plan.constrained:
                tool_constraint = ConstraintSpec.tool_calls(plan.constraint_value())
        messages = [m.as_dict() for m in req.messages]
        check_tool_messages(messages)
        rendered, template_tools = render_messages(messages, plan, native_tools, exclude_tools_when_tool_choice_none)
        prompt_ids = await asyncio.to_thread(_render_chat, tokenizer, rendered, template_tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        return await _run(req, raw, prompt_ids, max_tokens, req.response_format, "messages", chat=True,
                          plan=plan, tool_constraint=tool_constraint)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError("prompt: give one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(_encode, tokenizer, prompt, "prompt")
            if not prompt_ids:
                raise APIError("prompt is empty", param="prompt")
        else:
            prompt_ids = list(prompt)
        return await _run(req, raw, prompt_ids, req.max_tokens, req.response_format, "prompt", chat=False)

    async def _run(req, raw, prompt_ids, max_tokens, response_format, prompt_param, chat: bool,
                   plan: ToolPlan | None = None, tool_constraint: ConstraintSpec | None = None):
        params = req.sampling_params(max_tokens)
        constraint, constraint_param = req.constraint(response_format)
        calls = plan is not None and plan.mode != "none"
        if calls:
            params.skip_special_tokens = plan.fmt.skip_special_tokens
        if tool_constraint is not None:
            if constraint is not None:
                raise APIError(f"{constraint_param} cannot be combined with tools unless tool_choice is 'none'",
                               param=constraint_param.split(".")[0])
            if req.stop:
                raise APIError("stop cannot be combined with constrained tool calls: a stop string could cut "
                               "a call", param="stop")
            constraint, constraint_param = tool_constraint, "tools"
        stream_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:  # validates, then compiles the constraint once, then queues
            gen = await engine.submit(prompt_ids, params, constraint, request_id=stream_id,
                                      cache_salt=req.cache_salt or "")
        except ConstraintError as e:
            param = constraint_param
            if e.tool_index is not None and plan is not None:  # name the tool's schema
                param = f"tools[{e.tool_index}].function.parameters"
            elif plan is not None and constraint is tool_constraint:
                for i, t in enumerate(plan.all_tools):
                    if f"tool '{t['name']}' parameters" in str(e):
                        param = f"tools[{i}].function.parameters"
            raise APIError(f"{param}: {e}", param=param) from None
        except InvalidRequestError as e:
            raise _request_error(e, req, prompt_param) from None
        except AgentrtError as e:  # e.g. the server is shutting down (AsyncEngine.fail_pending)
            raise to_api_error(e) from None
        not_enforced = gen.not_enforced
        first = await gen.__anext__()
        if first.finished and first.finish_reason == "error":
            raise _request_error(first.error, req, None) from None
        created = int(time.time())
        # best-effort schemas (strict: false): keywords dropped are named in a header and a field
        headers = {"X-Agentrt-Not-Enforced": ", ".join(not_enforced)} if not_enforced else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                _sse(gen, first, stream_id, created, chat, include_usage, len(prompt_ids),
                     _parser(plan) if calls else None),
                media_type="text/event-stream", headers=headers,
            )
        last = first
        async for out in gen:
            last = out
            if await raw.is_disconnected():  # the client left: stop generating (frees KV and grammar)
                await gen.aclose()
                raise APIError("client disconnected", status=499)
        if last.finish_reason == "error":
            raise _request_error(last.error, req, None) from None
        usage = _usage(last)
        choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
        if chat and calls:
            parser = _parser(plan)
            parser.feed(last.text)
            parser.finish(cut_off=last.finish_reason == "length")
            choice["message"] = {"role": "assistant", "content": parser.content or None}
            if parser.calls:
                choice["message"]["tool_calls"] = [_call_json(c) for c in parser.calls]
                if last.finish_reason == "stop":
                    choice["finish_reason"] = "tool_calls"
            obj = "chat.completion"
        elif chat:
            choice["message"] = {"role": "assistant", "content": last.text}
            obj = "chat.completion"
        else:
            choice["text"] = last.text
            obj = "text_completion"
        body = {"id": stream_id, "object": obj, "created": created, "model": served_model_name,
                "choices": [choice], "usage": usage}
        if not_enforced:
            body["not_enforced"] = not_enforced
        return JSONResponse(body, headers=headers)

    async def _sse(gen: AsyncIterator[RequestOutput], first: RequestOutput, stream_id: str, created: int,
                   chat: bool, include_usage: bool, num_prompt: int, parser: ToolCallParser | None = None):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def body(choice: dict) -> str:
            b = {"id": stream_id, "object": obj, "created": created, "model": served_model_name,
                 "choices": [choice]}
            if include_usage:
                b["usage"] = None
            return f"data: {json.dumps(b, ensure_ascii=False)}\n\n"

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {"content": delta_text}
                if finish is not None and not delta_text:
                    delta = {}
                return body({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None})
            return body({"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None})

        def events(evs) -> list[str]:
            out = []
            for e in evs:
                if e.kind == "content":
                    out.append(chunk(e.text, None))
                    continue
                if e.kind == "call":
                    tc = {"index": e.index, "id": e.id, "type": "function",
                          "function": {"name": e.name, "arguments": ""}}
                else:
                    tc = {"index": e.index, "function": {"arguments": e.text}}
                out.append(body({"index": 0, "delta": {"tool_calls": [tc]}, "finish_reason": None,
                                 "logprobs": None}))
            return out

        last = first
        try:
            if chat:
                yield chunk(None, None, role=True)
            out = first
            while True:
                last = out
                if out.finish_reason == "error":
                    err = error_body(str(out.error or "generation failed"), "server_error", None, None)
                    yield f"data: {json.dumps(err)}\n\n"
                    break
                if out.delta_text:
                    if parser is None:
                        yield chunk(out.delta_text, None)
                    else:
                        for c in events(parser.feed(out.delta_text)):
                            yield c
                if out.finished:
                    finish = out.finish_reason
                    if parser is not None:
                        for c in events(parser.finish(cut_off=finish == "length")):
                            yield c
                        if parser.calls and finish == "stop":
                            finish = "tool_calls"
                    yield chunk(None, finish)
                    break
                out = await gen.__anext__()
            if include_usage:
                b = {"id": stream_id, "object": obj, "created": created, "model": served_model_name,
                     "choices": [], "usage": _usage(last)}
                yield f"data: {json.dumps(b)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()

    return app


def _request_error(e: AgentrtError, req, prompt_param: str | None) -> APIError:
    err = to_api_error(e, prompt_param)
    if err.param == "prompt" and prompt_param is not None:  # the chat API's prompt is its messages
        err.param = prompt_param
    if err.param == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        err.param = "max_completion_tokens"
    return err


def _parser(plan: ToolPlan) -> ToolCallParser:
    return ToolCallParser(plan.fmt, names={t["name"] for t in plan.tools})


def _call_json(c) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _usage(out: RequestOutput) -> dict:
    n = len(out.token_ids)
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": n,
            "total_tokens": out.num_prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _is_type_tag(part) -> bool:
    """pydantic names union branches in error locations ('str', 'list[...]'); they are not fields."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


def _encode(tokenizer, text: str, param: str) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except (TypeError, UnicodeError):
        raise APIError(f"{param} is not valid Unicode text (e.g. a lone surrogate)", param=param) from None


def _render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - template errors are the caller's messages
        raise APIError(f"messages cannot be rendered by the chat template: {e}", param="messages") from None
    return _encode(tokenizer, prompt, "messages")
