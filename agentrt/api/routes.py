"""HTTP routes: parse (pydantic) -> OpenAIServing -> response. The serving object is the app's
`state.serving` and the perimeter settings its `state.options` (set by create_app); errors raised
here are answered by errors.py's handlers. Request bodies are logged only with
`options.log_requests`."""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentrt.api.disconnect import client_gone
from agentrt.api.generation import ServingResult
from agentrt.api.json_body import JSONBodyRoute
from agentrt.api.messages import MessagesRequest, create_message
from agentrt.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from agentrt.api.responses import ResponsesRequest, create_response
from agentrt.api.serving import OpenAIServing

METRICS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LOG_REQUEST_MAX_CHARS = 4000
"""With log_requests: characters of a request body written to the log (the rest is elided)."""

logger = logging.getLogger(__name__)


def agentrt_version() -> str:
    """The installed agentrt distribution's version ("unknown" when run from an uninstalled tree)."""
    try:
        return package_version("agentrt")
    except PackageNotFoundError:
        return "unknown"


def build_router() -> APIRouter:
    """The API's routes: /health (GET, HEAD), /metrics, /v1/models, /v1/chat/completions,
    /v1/completions, /v1/responses, /v1/sql/databases, and vLLM's utility routes /tokenize,
    /detokenize, /version. Request bodies are read by api/json_body.py (each failure a clear 400)."""
    router = APIRouter(route_class=JSONBodyRoute)
    router.add_api_route("/health", health, methods=["GET"])
    # load balancers probe with HEAD; one operation per method keeps OpenAPI operation ids unique
    router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
    router.add_api_route("/metrics", metrics, methods=["GET"])
    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/v1/completions", completions, methods=["POST"])
    router.add_api_route("/v1/responses", responses, methods=["POST"])
    router.add_api_route("/v1/messages", messages, methods=["POST"])
    router.add_api_route("/tokenize", tokenize, methods=["POST"])
    router.add_api_route("/detokenize", detokenize, methods=["POST"])
    router.add_api_route("/version", version, methods=["GET"])
    router.add_api_route("/v1/sql/databases", sql_databases, methods=["GET"])
    return router


def _serving(raw: Request) -> OpenAIServing:
    return raw.app.state.serving


def _respond(result: ServingResult) -> Response:
    if result.events is not None:
        return StreamingResponse(result.events, media_type="text/event-stream", headers=result.headers)
    return JSONResponse(result.body, headers=result.headers)


async def health() -> dict:
    return {"status": "ok"}


async def metrics(raw: Request) -> Response:
    """Prometheus metrics of the engine (text exposition format)."""
    return Response(_serving(raw).metrics_text(), media_type=METRICS_MEDIA_TYPE)


async def models(raw: Request) -> dict:
    return _serving(raw).models()


async def sql_databases(raw: Request) -> dict:
    """The named databases of `sql` constraints, with their schema as the SQL prompt shows it."""
    from agentrt.api.sql_constraint import sql_databases_listing

    return await sql_databases_listing(_serving(raw).databases)


async def version() -> dict:
    """The agentrt package version (vLLM's /version)."""
    return {"version": agentrt_version()}


async def tokenize(req: TokenizeRequest, raw: Request) -> dict:
    return await _serving(raw).tokenize(req)


async def detokenize(req: DetokenizeRequest, raw: Request) -> dict:
    return _serving(raw).detokenize(req)


def _log_request(raw: Request, req: ChatCompletionRequest | CompletionRequest | ResponsesRequest) -> None:
    """Log the request's fields (as sent) when the server runs with log_requests; never otherwise."""
    if not raw.app.state.options.log_requests:
        return
    try:
        text = req.model_dump_json(exclude_unset=True, by_alias=True)
    except ValueError:  # text JSON cannot hold (a lone surrogate)
        text = repr(req.model_dump(exclude_unset=True, by_alias=True))
    if len(text) > LOG_REQUEST_MAX_CHARS:
        text = f"{text[:LOG_REQUEST_MAX_CHARS]}... ({len(text) - LOG_REQUEST_MAX_CHARS} more characters)"
    logger.info("%s %s: %s", raw.method, raw.url.path, text)


async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
    _log_request(raw, req)
    return _respond(await _serving(raw).chat(req, client_gone(raw.receive)))


async def completions(req: CompletionRequest, raw: Request) -> Response:
    _log_request(raw, req)
    return _respond(await _serving(raw).completion(req, client_gone(raw.receive)))


async def responses(req: ResponsesRequest, raw: Request) -> Response:
    """OpenAI's Responses API (agentrt/api/responses/): no server-side state."""
    _log_request(raw, req)
    return _respond(await create_response(_serving(raw), req, client_gone(raw.receive)))


async def messages(req: MessagesRequest, raw: Request) -> Response:
    """Anthropic's Messages API (agentrt/api/messages/); errors in Anthropic's shape (errors.py)."""
    _log_request(raw, req)
    return _respond(await create_message(_serving(raw), req, client_gone(raw.receive)))
