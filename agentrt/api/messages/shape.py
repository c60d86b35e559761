"""How a chat generation is shown as Anthropic's Messages API: `MessagesShape` (a
generation.ResponseShape) renders a `Message` or its SSE events (message_start, content blocks and
their deltas, message_delta, message_stop), reports stop_reason and stop_sequence, and names chat
completions fields as the Messages API does (`tools[0].input_schema`, `stop_sequences`, ...);
`_Content` builds the thinking, text and tool_use blocks from the model text as it arrives.

Spec: Anthropic's API reference for Messages and streaming, and the `anthropic` Python SDK's types.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import regex

from agentrt.api.errors import APIError, to_api_error
from agentrt.api.generation import Generation, renamed
from agentrt.api.output_text import OutputParser
from agentrt.api.tools import ParseEvent
from agentrt.errors import InternalError
from agentrt.runtime.async_engine import RequestStream
from agentrt.runtime.request import RequestOutput

logger = logging.getLogger(__name__)


_RENAMES = {
    "prompt": "messages",
    "stop": "stop_sequences",
    "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
    "max_completion_tokens": "max_tokens",
    "response_format": "output_config.format",
    "response_format.json_schema": "output_config.format",
    "response_format.json_schema.schema": "output_config.format.schema",
    "thinking_token_budget": "thinking.budget_tokens",
}
_TOOL_FIELD = regex.compile(r"tools\[(\d+)\]\.function\.(parameters|name|description|strict)(.*)")
_MESSAGE_FIELD = regex.compile(r"messages\[(\d+)\]")

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


@dataclass
class MessagesShape:
    """Renders a chat generation as Anthropic's Messages API (generation.ResponseShape).

    model: the `model` to report; tokenizer: the engine's, to tell which stop sequence ended the
    text; where: per chat message, the Messages field it came from (to name it in errors);
    omit_thinking: thinking blocks carry no text (the request's thinking.display "omitted")."""

    model: str
    tokenizer: Any
    where: list[str] = field(default_factory=list)
    omit_thinking: bool = False

    def param(self, name: str | None) -> str | None:
        """The Messages API name of a chat completions field: tools[i].function.parameters ->
        tools[i].input_schema, stop -> stop_sequences, messages[k] -> the turn or block it came
        from, response_format -> output_config.format; others are the same in both APIs."""
        if name is None:
            return None
        if name in _RENAMES:
            return _RENAMES[name]
        m = _TOOL_FIELD.fullmatch(name)
        if m:
            key = "input_schema" if m.group(2) == "parameters" else m.group(2)
            return f"tools[{m.group(1)}].{key}{m.group(3)}"
        m = _MESSAGE_FIELD.match(name)
        if m and int(m.group(1)) < len(self.where):
            return self.where[int(m.group(1))]
        return name

    def body(
        self, gen: Generation, lasts: Sequence[RequestOutput], created: int, not_enforced: list[str]
    ) -> dict:
        """The Message of a finished generation (its one choice, `lasts[0]`): thinking, text and
        tool_use blocks in output order, stop_reason, stop_sequence and usage."""
        last = lasts[0]
        content = _Content(gen.new_parser(), self.omit_thinking)
        if last.text:
            content.feed(last.text)
        _, finish = content.close(last.finish_reason)
        stop_reason, stop_sequence = self._stop(gen, last, finish)
        body = self._message(
            gen, last, content.final_blocks(), stop_reason, stop_sequence, len(last.token_ids)
        )
        if not_enforced:
            body["not_enforced"] = not_enforced
        return body

    async def events(
        self, gen: Generation, streams: Sequence[RequestStream], firsts: Sequence[RequestOutput], created: int
    ) -> AsyncIterator[str]:
        """Anthropic's stream of the one choice (`streams[0]`, `firsts[0]`): message_start, then per
        content block content_block_start, its deltas (thinking_delta then an empty
        signature_delta, text_delta, or input_json_delta fragments of a tool input) and
        content_block_stop, then message_delta (stop_reason, stop_sequence,
        usage.output_tokens) and message_stop. An error after the first output is one `error`
        event (Anthropic's error shape) that ends the stream. Closing the iterator aborts the
        request."""
        stream, first = streams[0], firsts[0]
        content = _Content(gen.new_parser(), self.omit_thinking)
        try:
            start = self._message(gen, first, [], None, None, 0)
            yield _event("message_start", {"type": "message_start", "message": start})
            out = first
            while True:
                if out.finish_reason == "error":
                    yield self._error_event(gen.api_error(out.error))
                    return
                try:
                    events = content.feed(out.delta_text) if out.delta_text else []
                    if out.finished:
                        closing, finish = content.close(out.finish_reason)
                        events += closing
                        stop_reason, stop_sequence = self._stop(gen, out, finish)
                except Exception as e:  # a parser fault fails this stream alone, with an error event
                    logger.exception("output parsing failed for %s", stream.request_id)
                    error = InternalError(f"internal error while parsing the output: {type(e).__name__}: {e}")
                    yield self._error_event(to_api_error(error))
                    return
                for event in events:
                    yield event
                if out.finished:
                    break
                try:
                    out = await anext(stream)
                except StopAsyncIteration:  # cancelled: the client has gone
                    return
            delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
            usage = {"output_tokens": len(out.token_ids)}
            yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
            yield _event("message_stop", {"type": "message_stop"})
        finally:
            await stream.aclose()

    def _message(
        self,
        gen: Generation,
        out: RequestOutput,
        content: list[dict],
        stop_reason: str | None,
        stop_sequence: str | None,
        output_tokens: int,
    ) -> dict:
        """A Message object; usage.input_tokens counts the prompt tokens not read from the prefix
        cache, cache_read_input_tokens those read from it (Anthropic's split)."""
        cached = out.num_cached_tokens
        return {
            "id": "msg_" + gen.request_id.removeprefix("chatcmpl-"),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": out.num_prompt_tokens - cached,
                "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached,
            },
        }

    def _stop(self, gen: Generation, last: RequestOutput, finish: str) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence). The engine reports "stop" for the end of turn and for a stop
        string alike; a stop string cut the text where it began, so the tokens, decoded as the
        engine decodes them, continue the text with it (after an end-of-turn token they do not:
        it is not part of the decoded text). The shortest such string is reported (the one
        completed first when several begin there)."""
        stops = gen.params.stop
        if finish != "stop" or not stops:
            return _STOP_REASONS.get(finish, "end_turn"), None
        decoded = self.tokenizer.decode(last.token_ids, skip_special_tokens=gen.params.skip_special_tokens)
        at = len(last.text)
        if decoded.startswith(last.text):
            matched = [s for s in stops if decoded.startswith(s, at)]
            if matched:
                return "stop_sequence", min(matched, key=len)
        return "end_turn", None

    def _error_event(self, e: APIError) -> str:
        return _event("error", renamed(e, self).anthropic_body())


def _event(kind: str, data: dict) -> str:
    """One server-sent event of Anthropic's stream: its type as the event name, then the JSON data."""
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Content:
    """A message's content blocks built from model text, in output order: a reasoning model's
    thinking block (signature "": nothing to verify here; its text left out when `omit_thinking`),
    text blocks and tool_use blocks (a tool call the parser found; ids "toolu_" + the call id's
    hex). `parser`: Generation.new_parser() (None: text only). `feed` / `close` return the stream
    events for what they add (block start, deltas, block stop)."""

    def __init__(self, parser: OutputParser | None, omit_thinking: bool = False):
        self.parser, self.omit_thinking = parser, omit_thinking
        self.blocks: list[dict] = []
        self._inputs: list[str] = []  # per block: the tool input JSON so far ("" for text blocks)
        self._open: int | None = None
        self._call_block: dict[int, int] = {}  # parser call index -> block index

    def feed(self, text: str) -> list[str]:
        return self._apply(self.parser.feed(text) if self.parser else [ParseEvent("content", text)])

    def close(self, finish_reason: str) -> tuple[list[str], str]:
        """The events for the rest of the text and the open block's stop, and the finish reason
        ("tool_calls" when calls were made and the output stopped)."""
        events, finish = self.parser.close(finish_reason) if self.parser else ([], finish_reason)
        out = self._apply(events)
        out += self._stop_open()
        return out, finish

    def final_blocks(self) -> list[dict]:
        """The content of the finished message: a tool_use block's input is its JSON object (an
        input cut off by max_tokens is not valid JSON: {} then)."""
        out = []
        for block, raw in zip(self.blocks, self._inputs):
            if block["type"] == "tool_use":
                try:
                    value = json.loads(raw)
                except json.JSONDecodeError:
                    value = {}
                block = {**block, "input": value if isinstance(value, dict) else {}}
            out.append(block)
        return out

    def _apply(self, events: list[ParseEvent]) -> list[str]:
        out: list[str] = []
        for e in events:
            if e.kind == "reasoning":
                if self._open is None or self.blocks[self._open]["type"] != "thinking":
                    out += self._stop_open()
                    out.append(self._start({"type": "thinking", "thinking": "", "signature": ""}))
                if not self.omit_thinking:
                    self.blocks[self._open]["thinking"] += e.text
                    out.append(self._delta(self._open, {"type": "thinking_delta", "thinking": e.text}))
            elif e.kind == "content":
                if not e.text:
                    continue
                if self._open is None or self.blocks[self._open]["type"] != "text":
                    out += self._stop_open()
                    out.append(self._start({"type": "text", "text": ""}))
                self.blocks[self._open]["text"] += e.text
                delta = {"type": "text_delta", "text": e.text}
                out.append(self._delta(self._open, delta))
            elif e.kind == "call":
                out += self._stop_open()
                block = {
                    "type": "tool_use",
                    "id": "toolu_" + e.id.removeprefix("call_"),
                    "name": e.name,
                    "input": {},
                }
                out.append(self._start(block))
                self._call_block[e.index] = self._open
            else:  # "args": a fragment of the call's input JSON
                i = self._call_block[e.index]
                self._inputs[i] += e.text
                out.append(self._delta(i, {"type": "input_json_delta", "partial_json": e.text}))
        return out

    def _start(self, block: dict) -> str:
        self.blocks.append(block)
        self._inputs.append("")
        self._open = len(self.blocks) - 1
        start = {"type": "content_block_start", "index": self._open, "content_block": dict(block)}
        return _event("content_block_start", start)

    def _delta(self, index: int, delta: dict) -> str:
        return _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def _stop_open(self) -> list[str]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        out = []
        if self.blocks[index]["type"] == "thinking":  # Anthropic sends the signature last
            out.append(self._delta(index, {"type": "signature_delta", "signature": ""}))
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        return out
