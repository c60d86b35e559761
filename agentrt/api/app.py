"""The FastAPI app: OpenAI-compatible /v1/chat/completions, /v1/completions, /v1/models, plus
/health and /metrics, around one AsyncEngine.

    routes.py     HTTP handlers: parse -> serving -> response
    serving.py    request -> engine (sampling params, constraint, tool plan) -> result
    generation.py Generation, ServingResult, ResponseShape (what serving passes between its parts)
    disconnect.py client_gone: a request's work cancelled when its client leaves
    chat_shape.py chat and text completions bodies (ChatShape)
    streaming.py  SSE chunks (content and tool-call deltas)
    responses/    /v1/responses: request.py (the request, its translation), shape.py (the response)
    messages/     /v1/messages: request.py (the request, its translation), shape.py (the Message)
    errors.py     typed errors -> HTTP status and OpenAI's error shape; the exception handlers
    middleware.py API keys, body-size limit (pure ASGI) and ServerOptions
    protocol.py   request models (pydantic)
    tools/        tool definitions and turns: validation, prompt rendering, call parsing
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI

from agentrt.api.errors import install_error_handlers
from agentrt.api.middleware import ServerOptions, install_middleware
from agentrt.api.reasoning import ReasoningSetup
from agentrt.api.routes import build_router
from agentrt.api.serving import OpenAIServing
from agentrt.api.tools import ToolPrompt
from agentrt.runtime.async_engine import AsyncEngine
from agentrt.sql.service import SQLDatabases

logger = logging.getLogger(__name__)


def create_app(
    engine: AsyncEngine,
    served_model_name: str,
    on_ready: Callable[[], None] | None = None,
    tool_call_format: str = "auto",
    exclude_tools_when_tool_choice_none: bool = False,
    options: ServerOptions | None = None,
    databases: SQLDatabases | None = None,
    reasoning_format: str = "auto",
    reasoning_budget_message: str = "",
) -> FastAPI:
    """The HTTP app around one AsyncEngine. `served_model_name` is the only accepted `model`;
    `on_ready` runs once the app has started. tool_call_format: "auto" (read from the chat
    template) or a name in grammars/tool_calls.FORMATS; exclude_tools_when_tool_choice_none: leave
    the tools out of the prompt when tool_choice is "none"; options: API keys, body limit, CORS,
    request logging (default ServerOptions(): no keys, 16 MiB bodies, no CORS, nothing logged);
    databases: the named databases `sql` constraints may name (loaded by the caller);
    reasoning_format: "auto" (read from the chat template), "none" or a format name
    (api/reasoning.py); reasoning_budget_message: text forced before the reasoning's end marker
    when a thinking budget is spent. Raises ValueError on an unknown format."""
    options = options or ServerOptions()
    tool_prompt = ToolPrompt.for_template(
        getattr(engine.tokenizer, "chat_template", None),
        tool_call_format,
        exclude_tools_when_tool_choice_none,
    )
    logger.info(
        "tool calls: format %s (%s prompt)",
        tool_prompt.fmt.name,
        "template" if tool_prompt.native else "generic",
    )
    reasoning = ReasoningSetup.for_template(
        getattr(engine.tokenizer, "chat_template", None),
        reasoning_format,
        reasoning_budget_message,
        engine.tokenizer,
    )
    if reasoning.fmt is not None:
        logger.info(
            "reasoning: %s ... %s (reasoning_content; constraints apply to the answer after it)",
            reasoning.fmt.start,
            reasoning.fmt.end,
        )
    app = FastAPI(title="agentrt", version="0.1.0", lifespan=_lifespan)
    app.state.serving = OpenAIServing(engine, served_model_name, tool_prompt, databases, reasoning)
    app.state.on_ready = on_ready
    app.state.options = options
    install_error_handlers(app)
    app.include_router(build_router())
    install_middleware(app, options)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.serving.start_renders()  # an app started again after a shutdown renders again
    if app.state.on_ready is not None:
        app.state.on_ready()
    yield
    app.state.serving.stop_renders()  # a render still running would hold the process's exit
