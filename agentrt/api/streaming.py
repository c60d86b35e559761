"""Server-sent events for streamed chat and text completions (OpenAI's chunk shapes).

A chat stream opens with a role chunk (one per choice when `n` > 1; the choices' chunks then
interleave, each carrying its index), sends content deltas (or tool-call deltas: a call's id and
name first, then fragments of its arguments JSON), ends with a chunk carrying finish_reason, then
an optional usage chunk and `data: [DONE]`. An error after the first output is one
`data: {"error": {...}}` event (the response status is already 200): the request's own error, or
an InternalError when turning its text into chunks (the tool-call parser) raised; the request is
then aborted, and nothing else is affected.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from agentrt.api.errors import APIError
from agentrt.api.logprobs import LogprobStream
from agentrt.api.output_text import OutputParser
from agentrt.api.protocol import usage
from agentrt.api.tools import ParseEvent
from agentrt.errors import AgentrtError, InternalError
from agentrt.runtime.async_engine import RequestStream
from agentrt.runtime.request import RequestOutput

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(data: dict) -> str:
    """One server-sent event carrying `data` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class ChunkWriter:
    """Builds the SSE chunks of one response: `chat` (chat.completion.chunk) or a text completion;
    `include_usage` adds `"usage": null` to every chunk and a final usage chunk (stream_options);
    `index`: the choice the chunks belong to (requests with `n` > 1 have one writer per choice);
    `repair`: the request asked for runaway repair, so the closing chunk carries the JSON pointers of
    the values closed as `agentrt_repaired` (agentrt's extension, as on the non-streamed choice);
    `close`: the request has max_tokens_policy "close", so the closing chunk carries
    `agentrt_closed_by_budget` (RequestOutput.closed_by_budget); `reasoning`: a reasoning model's
    request (its usage counts reasoning tokens)."""

    stream_id: str
    created: int
    model: str
    chat: bool
    include_usage: bool
    index: int = 0
    repair: bool = False
    close: bool = False
    reasoning: bool = False

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def choice(self, choice: dict) -> str:
        body = {
            "id": self.stream_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def role(self) -> str:
        """The opening chunk of a chat stream."""
        return self.choice(
            {
                "index": self.index,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
                "logprobs": None,
            }
        )

    def text(
        self,
        delta_text: str | None,
        finish: str | None = None,
        logprobs: dict | None = None,
        repaired: list[str] | None = None,
        closed_by_budget: bool = False,
    ) -> str:
        """A content delta, or (finish given, no text) the closing chunk; `logprobs`: the choice's
        logprobs object for the tokens this chunk reports (None: not asked for, or none new);
        `repaired`: on the closing chunk of a request with `repair`, the values closed as runaways."""
        if not self.chat:
            choice = {
                "index": self.index,
                "text": delta_text or "",
                "finish_reason": finish,
                "logprobs": logprobs,
            }
        else:
            delta = {} if finish is not None and not delta_text else {"content": delta_text}
            choice = {"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        if finish is not None and self.repair:
            choice["agentrt_repaired"] = list(repaired or [])
        if finish is not None and self.close:
            choice["agentrt_closed_by_budget"] = closed_by_budget
        return self.choice(choice)

    def events(self, events: Iterable[ParseEvent], logprobs: dict | None = None) -> list[str]:
        """Chunks for output parser events (api/output_text.py): reasoning and content deltas, a
        call's start (id, name), argument fragments; `logprobs` goes with the first chunk."""
        out = []
        for e in events:
            lp, logprobs = logprobs, None
            if e.kind == "content":
                out.append(self.text(e.text, logprobs=lp))
                continue
            if e.kind == "reasoning":  # vLLM's reasoning_content, and `reasoning`, its newer name
                delta = {"reasoning_content": e.text, "reasoning": e.text}
                out.append(
                    self.choice({"index": self.index, "delta": delta, "finish_reason": None, "logprobs": lp})
                )
                continue
            if e.kind == "call":
                tc = {
                    "index": e.index,
                    "id": e.id,
                    "type": "function",
                    "function": {"name": e.name, "arguments": ""},
                }
            else:
                tc = {"index": e.index, "function": {"arguments": e.text}}
            out.append(
                self.choice(
                    {
                        "index": self.index,
                        "delta": {"tool_calls": [tc]},
                        "finish_reason": None,
                        "logprobs": lp,
                    }
                )
            )
        return out

    def usage(self, *lasts: RequestOutput) -> str:
        return sse(
            {
                "id": self.stream_id,
                "object": self.object,
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(*lasts, reasoning=self.reasoning),
            }
        )


async def stream_events(
    streams: Sequence[RequestStream],
    firsts: Sequence[RequestOutput],
    writer: ChunkWriter,
    parsers: Sequence[OutputParser | None],
    to_error: Callable[[AgentrtError | None], APIError],
    logprobs: Sequence[LogprobStream] | None = None,
) -> AsyncIterator[str]:
    """The SSE events of one request's choices (one engine stream per choice), `firsts` (their
    first outputs, already received) included; the choices' chunks interleave as they come.
    parsers: per choice, turns the text into reasoning and tool-call deltas (None: plain content); to_error: the
    HTTP error of a failed output (its body is the error event, which ends the whole stream);
    logprobs: per choice, when the request asked for them (each chunk carries those of the tokens
    new since the last chunk that carried any).
    Closing the iterator early (client gone) aborts every choice's request."""
    writers = [replace(writer, index=i) for i in range(len(streams))]
    try:
        if writer.chat:
            for w in writers:
                yield w.role()
        lasts = list(firsts)
        async for i, out in merged_outputs(streams, firsts):
            lasts[i] = out
            if out.finish_reason == "error":
                yield sse(to_error(out.error).body())
                break
            try:
                chunks = _deltas(writers[i], parsers[i], out, logprobs[i] if logprobs else None)
            except Exception as e:  # a parser fault fails this stream alone, with an error event
                logger.exception("output parsing failed for %s", streams[i].request_id)
                error = InternalError(f"internal error while parsing the output: {type(e).__name__}: {e}")
                yield sse(to_error(error).body())
                break
            for chunk in chunks:
                yield chunk
        if writer.include_usage:
            yield writer.usage(*lasts)
        yield DONE
    finally:
        for stream in streams:
            await stream.aclose()


async def merged_outputs(
    streams: Sequence[RequestStream], firsts: Sequence[RequestOutput]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of every output of `streams` until each has finished, `firsts` (their
    first outputs, already received) included, in arrival order. One stream is read directly;
    several are read by one task each (cancelled when the iterator closes)."""
    if len(streams) == 1:
        out = firsts[0]
        yield 0, out
        while not out.finished:
            out = await anext(streams[0])
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        out = firsts[i]
        try:
            await queue.put((i, out))
            while not out.finished:
                out = await anext(streams[i])
                await queue.put((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        left = len(streams)
        while left:
            i, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            left -= out.finished
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


def _deltas(
    writer: ChunkWriter, parser: OutputParser | None, out: RequestOutput, logprobs: LogprobStream | None
) -> list[str]:
    """The chunks of one output: its new text (as content or tool-call deltas), and when it is the
    last one, the rest of the parser's events and the closing chunk with finish_reason. The
    logprobs of tokens not reported yet go with the first chunk (the closing one at the latest)."""
    chunks = []

    def pending() -> dict | None:
        return logprobs.pending(out) if logprobs is not None and not chunks else None

    if out.delta_text:
        lp = pending()
        if parser:
            chunks += writer.events(parser.feed(out.delta_text), lp)
        else:
            chunks.append(writer.text(out.delta_text, logprobs=lp))
    if out.finished:
        finish = out.finish_reason
        if parser is not None:
            events, finish = parser.close(finish, out.closed_by_budget)
            chunks += writer.events(events, pending())
        chunks.append(
            writer.text(
                None,
                finish,
                logprobs=pending(),
                repaired=out.repaired,
                closed_by_budget=out.closed_by_budget and finish != "length",  # text cut: not closed
            )
        )
    if chunks and logprobs is not None:
        logprobs.commit(out)
    return chunks
