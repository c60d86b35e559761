"""OpenAI's Responses API (`POST /v1/responses`) over the chat serving path, stateless: request.py
holds the request (`ResponsesRequest`), its translation into a chat completions request
(`to_chat_request`) and `create_response`, which runs it; shape.py holds `ResponsesShape`, which
renders the result as a `response` object or its SSE events and names fields in errors as this
API does."""

from agentrt.api.responses.request import ResponsesRequest, create_response, to_chat_request
from agentrt.api.responses.shape import ResponsesShape

__all__ = ["ResponsesRequest", "ResponsesShape", "create_response", "to_chat_request"]
