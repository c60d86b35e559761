"""How a chat generation is shown as OpenAI's Responses API: `ResponsesShape` (a
generation.ResponseShape) renders the `response` object or its SSE events and names chat
completions fields as this API does; `_Output` builds the output items (reasoning, message and
function_call) from the model text as it arrives, the same for streamed and complete responses.

Spec: OpenAI's API reference for Responses and the openai-python types under
openai/types/responses/ (Response, ResponseStreamEvent).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from agentrt.api.errors import APIError
from agentrt.api.generation import Generation, renamed
from agentrt.api.output_text import OutputParser
from agentrt.api.protocol import usage
from agentrt.api.tools import ParseEvent, ToolPlan
from agentrt.errors import InternalError
from agentrt.runtime.async_engine import RequestStream
from agentrt.runtime.request import RequestOutput

logger = logging.getLogger(__name__)

_MESSAGE_PARAM = re.compile(r"messages\[(\d+)\](.*)", re.DOTALL)
_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function(.*)", re.DOTALL)


class ResponsesShape:
    """Renders a chat generation as OpenAI's Responses API (generation.ResponseShape): a `response`
    object, or its SSE events (`event: <type>` and `data: <JSON with type and sequence_number>`).

    model: the served model name; echo: the request settings every response object carries;
    origins: per chat message, the Responses field it came from ("instructions", "input[3]"), to
    name fields in errors. Output items follow the model text in order: a reasoning model's
    `reasoning` item first (its reasoning as one `reasoning_text` part; `summary` empty), then a
    `message` item for text (whitespace alone between calls is dropped), a `function_call` item
    per tool call."""

    def __init__(self, model: str, echo: dict, origins: list[str]):
        self.model, self.echo, self.origins = model, echo, origins

    def param(self, name: str | None) -> str | None:
        """This API's name for a chat completions field (see request.py's docstring)."""
        if name is None:
            return None
        if name in ("max_tokens", "max_completion_tokens"):
            return "max_output_tokens"
        if name == "reasoning_effort":
            return "reasoning.effort"
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

    def body(
        self, gen: Generation, lasts: Sequence[RequestOutput], created: int, not_enforced: list[str]
    ) -> dict:
        """The `response` object of a finished generation (its one choice, `lasts[0]`)."""
        last = lasts[0]
        output = _Output(gen.new_parser())
        output.feed(last.text)
        output.finish(last.finish_reason, last.closed_by_budget)
        return self._response(gen, created, output.items, last, not_enforced)

    async def events(
        self, gen: Generation, streams: Sequence[RequestStream], firsts: Sequence[RequestOutput], created: int
    ) -> AsyncIterator[str]:
        """The events of the one choice (`streams[0]`, `firsts[0]`): response.created,
        response.in_progress, the output items' events (output_item.added, content_part.added,
        reasoning_text.delta / .done or output_text.delta / .done, content_part.done,
        function_call_arguments.delta / .done, output_item.done), then response.completed
        (response.incomplete when the output hit max_output_tokens) with the whole response. A
        failure after the first output is one `error` event (type, code, message, param) ending
        the stream. Closing the iterator aborts the request."""
        stream, first = streams[0], firsts[0]
        seq = itertools.count()

        def event(data: dict) -> str:
            data = {"type": data["type"], "sequence_number": next(seq), **data}
            return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        try:
            started = self._response(gen, created, [], None, [])
            yield event({"type": "response.created", "response": started})
            yield event({"type": "response.in_progress", "response": started})
            output = _Output(gen.new_parser())
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
    the prefix cache; reasoning_tokens: those of a reasoning model's reasoning, markers included)."""
    u = usage(last)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": last.num_reasoning_tokens},
        "total_tokens": u["total_tokens"],
    }


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class _Output:
    """The output items of one generation, built from its text as it arrives (the same machine for
    streamed and non-streamed responses, so both give the same items): reasoning becomes a
    `reasoning` item, text a `message` item, tool calls `function_call` items, in the text's order.
    `parser`: the generation's (Generation.new_parser: reasoning, then the answer's tool calls;
    a ToolPlan: its tool calls alone; None: text only). feed / finish return the stream events
    (dicts without sequence_number) of what they opened, grew and closed; `items` holds the items
    so far."""

    def __init__(self, parser: OutputParser | ToolPlan | None):
        self.parser = OutputParser(None, parser) if isinstance(parser, ToolPlan) else parser
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
        .close), and one message item when there was no answer (its text possibly empty), unless
        the output was cut inside its reasoning (the reasoning item is then the incomplete one)."""
        events: list[dict] = []
        if self.parser is not None:
            parsed, finish_reason = self.parser.close(finish_reason, closed_by_budget)
            events += self._apply(parsed)
        answered = any(item["type"] != "reasoning" for item in self.items)
        if not answered and (finish_reason != "length" or not self.items):
            events += self._close("completed") + self._open_message()
            if self._blank:
                events += self._text(self._blank)
        events += self._close("incomplete" if finish_reason == "length" else "completed")
        return events

    def _apply(self, parsed: list[ParseEvent]) -> list[dict]:
        events: list[dict] = []
        for p in parsed:
            if p.kind == "reasoning":
                if self._open is None or self._open["type"] != "reasoning":
                    events += self._close("completed") + self._open_reasoning()
                events += self._text(p.text)
            elif p.kind == "content":
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
        return self._open_with_part(
            item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        )

    def _open_reasoning(self) -> list[dict]:
        item = {
            "id": _new_id("rs_"),
            "type": "reasoning",
            "summary": [],
            "content": [],
            "status": "in_progress",
        }
        return self._open_with_part(item, {"type": "reasoning_text", "text": ""})

    def _open_with_part(self, item: dict, part: dict) -> list[dict]:
        """Open `item` (its content empty) and add its one content `part`."""
        added = self._open_item(item)
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
        """Grow the open message's (or reasoning item's) text part by `text`."""
        item = self._open
        item["content"][0]["text"] += text
        delta = {
            "type": "response.output_text.delta",
            "item_id": item["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "delta": text,
            "logprobs": [],
        }
        if item["type"] == "reasoning":
            delta["type"] = "response.reasoning_text.delta"
            del delta["logprobs"]
        return [delta]

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item["status"] = status
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done = {
                "type": "response.output_text.done",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "text": part["text"],
                "logprobs": [],
            }
            if item["type"] == "reasoning":
                done["type"] = "response.reasoning_text.done"
                del done["logprobs"]
            events = [
                done,
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
