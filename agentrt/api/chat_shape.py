"""OpenAI's own response shapes for /v1/chat/completions and /v1/completions (`ChatShape`, a
generation.ResponseShape like those of the Responses and Messages APIs): a `chat.completion` or
`text_completion` body with one choice per output (tool calls parsed into the message, logprobs,
agentrt's extension fields), or the chunks of its stream (streaming.py). Request fields keep their
own names in errors."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from agentrt.api.generation import Generation
from agentrt.api.logprobs import LogprobStream, TokenPieces, chat_logprobs, completion_logprobs
from agentrt.api.protocol import usage
from agentrt.api.streaming import ChunkWriter, stream_events
from agentrt.runtime.async_engine import AsyncEngine, RequestStream
from agentrt.runtime.request import RequestOutput


class ChatShape:
    """Renders chat and text completions (`gen.chat` tells which) as OpenAI does. `model`: the
    served model name the responses carry; `engine`: where the token texts and bytes of logprobs
    come from (read at the first request that asks for logprobs)."""

    def __init__(self, model: str, engine: AsyncEngine):
        self.model = model
        self._engine = engine
        self._pieces: TokenPieces | None = None

    @property
    def pieces(self) -> TokenPieces:
        """Token texts and bytes for logprobs (built at the first request that asks)."""
        if self._pieces is None:
            self._pieces = TokenPieces.of_engine(self._engine)
        return self._pieces

    def param(self, name: str | None) -> str | None:
        """`name` itself: these are the APIs whose field names the serving layer uses."""
        return name

    def events(
        self, gen: Generation, streams: Sequence[RequestStream], firsts: Sequence[RequestOutput], created: int
    ) -> AsyncIterator[str]:
        """The stream's chunks (streaming.stream_events): one writer per choice, tool calls as
        tool-call deltas when the request has a tool plan, logprobs when asked for."""
        writer = ChunkWriter(
            gen.request_id,
            created,
            self.model,
            gen.chat,
            gen.include_usage,
            repair=gen.params.repetition_repair,
            close=gen.params.max_tokens_policy == "close",
            reasoning=gen.reasoning is not None,
        )
        parsers = [gen.new_parser() for _ in streams]
        logprobs = (
            [LogprobStream(self.pieces, gen.chat) for _ in streams]
            if gen.params.logprobs is not None
            else None
        )
        return stream_events(streams, firsts, writer, parsers, gen.api_error, logprobs)

    def body(
        self, gen: Generation, lasts: Sequence[RequestOutput], created: int, not_enforced: list[str]
    ) -> dict:
        """The non-streamed response of a finished request (one choice per output). With logprobs,
        every generated token's (the final stop token included, as counted in usage; with tool
        calls, the tokens of the calls too, all under `content`, as vLLM does)."""
        choices = []
        for i, last in enumerate(lasts):
            choice: dict = {"index": i, "finish_reason": last.finish_reason, "logprobs": None}
            if last.logprobs is not None:
                make = chat_logprobs if gen.chat else completion_logprobs
                choice["logprobs"] = make(self.pieces, last.logprobs)
            if gen.chat:
                choice["message"], choice["finish_reason"] = _message(last, gen)
            else:
                choice["text"] = last.text
            if gen.params.repetition_repair:  # agentrt's extension: the values closed as runaways
                choice["agentrt_repaired"] = list(last.repaired)
            if gen.params.max_tokens_policy == "close":  # agentrt's extension: closed (not cut) by the budget
                choice["agentrt_closed_by_budget"] = (
                    last.closed_by_budget and choice["finish_reason"] != "length"
                )
            choices.append(choice)
        body = {
            "id": gen.request_id,
            "object": "chat.completion" if gen.chat else "text_completion",
            "created": created,
            "model": self.model,
            "choices": choices,
            "usage": usage(*lasts, reasoning=gen.reasoning is not None),
        }
        if not_enforced:
            body["not_enforced"] = not_enforced
        return body


def _message(last: RequestOutput, gen: Generation) -> tuple[dict, str]:
    """(the assistant message, the finish_reason to report) of a finished chat output: a reasoning
    model's reasoning as `reasoning_content` (and `reasoning`), tool calls parsed out of the answer
    when the request has a tool plan."""
    parser = gen.new_parser()
    if parser is None:
        return {"role": "assistant", "content": last.text}, last.finish_reason
    parser.feed(last.text)
    _, finish = parser.close(last.finish_reason, last.closed_by_budget)
    message = {"role": "assistant", "content": parser.content or None}
    if gen.reasoning is not None:
        message["reasoning_content"] = message["reasoning"] = parser.reasoning or None
    if parser.calls:
        message["tool_calls"] = [c.as_openai() for c in parser.calls]
    return message, finish
