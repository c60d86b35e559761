"""Anthropic's Messages API (`POST /v1/messages`) over the chat completions path: request.py holds
the request (`MessagesRequest`), its translation into a chat completions request (`to_chat`) and
`create_message`, which runs it; shape.py holds `MessagesShape`, which renders the result as a
`Message` or its SSE events and names fields in errors as the Messages API does."""

from agentrt.api.messages.request import MessageParam, MessagesRequest, create_message, to_chat
from agentrt.api.messages.shape import MessagesShape

__all__ = ["MessageParam", "MessagesRequest", "MessagesShape", "create_message", "to_chat"]
