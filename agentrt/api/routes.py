"""HTTP routes: parse (pydantic) -> OpenAIServing -> response. The serving object is the app's
`state.serving` (set by create_app); errors raised here are answered by errors.py's handlers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentrt.api.protocol import ChatCompletionRequest, CompletionRequest
from agentrt.api.serving import OpenAIServing, ServingResult

METRICS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_router() -> APIRouter:
    """The API's routes: /health, /metrics, /v1/models, /v1/chat/completions, /v1/completions."""
    router = APIRouter()
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/metrics", metrics, methods=["GET"])
    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/v1/completions", completions, methods=["POST"])
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


async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
    return _respond(await _serving(raw).chat(req, raw.is_disconnected))


async def completions(req: CompletionRequest, raw: Request) -> Response:
    return _respond(await _serving(raw).completion(req, raw.is_disconnected))
