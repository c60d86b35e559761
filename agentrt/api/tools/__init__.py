"""Tool calling: OpenAI's tools contract over the model's own call syntax.

A *tool-call format* is how a model family writes calls in its text:

- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``,
  one block per call. It is also the *generic* format, for chat templates with no tool support
  (the default model's): tool definitions go into the system prompt (``TOOLS_PROMPT``), earlier
  calls and tool results are written back as text in the same syntax.
- ``llama3_json`` (Llama 3.1/3.2/3.3): the output is ``{"name": "f", "parameters": {...}}``
  (optionally after ``<|python_tag|>``); several calls are separated by ``; ``.
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``.

Calls are constrained with xgrammar structural tags: each tool is a tag whose begin text holds
its name (the model cannot invent one) and whose content is the tool's parameter schema, compiled
by the same faithful JSON-Schema pipeline as ``response_format`` (unsupported keywords are a 400
naming the tool). ``required`` / a named tool: the whole output is one call (or one or more with
``parallel_tool_calls``); ``auto``: free text until the format's trigger, then a constrained call.

The package, in request order:

- ``validation``: `tools` / `tool_choice` -> ``ToolPlan`` (APIError naming the field);
- ``turns``: the tool turns of chat messages, Responses input items and Messages turns (call ids
  unique, arguments JSON objects, each answer to a call its API allows);
- ``rendering``: the call format read from the chat template (``ToolPrompt``), tools and tool turns
  written into the prompt;
- ``parsing``: ``ToolCallParser``, model text -> content and calls, incrementally (one machine for
  streamed and non-streamed responses, so deltas concatenate to the whole whatever the chunking).
"""

from agentrt.api.tools.detection import Detected, detect
from agentrt.api.tools.parsing import ParseEvent, ToolCall, ToolCallParser, new_call_id
from agentrt.api.tools.rendering import TOOLS_PROMPT, ToolPrompt, detect_format, render_messages
from agentrt.api.tools.turns import check_tool_messages
from agentrt.api.tools.validation import ToolPlan, check_tool_schemas, plan_tools

__all__ = [
    "TOOLS_PROMPT",
    "Detected",
    "ParseEvent",
    "ToolCall",
    "ToolCallParser",
    "ToolPlan",
    "ToolPrompt",
    "check_tool_messages",
    "check_tool_schemas",
    "detect",
    "detect_format",
    "new_call_id",
    "plan_tools",
    "render_messages",
]
