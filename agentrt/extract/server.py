"""Extraction against any OpenAI-compatible server (`agentrt extract --server URL`).

Each document is one chat completion with `response_format` json_schema (strict: true), the same
messages as in-process (agentrt/extract/prompt.py), greedy unless told otherwise, sent by the
official `openai` async client with at most `max_in_flight` requests open at once. The client runs
an asyncio loop on a helper thread; results come back through a queue, in completion order, as
the same ExtractResult the in-process driver yields, judged the same way (jsonschema with format
checking). Token logprobs (`logprobs: true`) are asked for, for per-field confidence; a server that
refuses the field (a 400 whose `param` is "logprobs") is asked again without it, and the job
continues without confidence. Runaway-value repair (`repetition_repair`, agentrt's extension
field, on unless `--no-repair`) is asked for the same way and dropped for a server that refuses it;
an agentrt server reports the closed values (`agentrt_repaired`) as the row's `repaired`. The
length-safe policy (`max_tokens_policy`, `--max-tokens-policy`) likewise: an agentrt server's
`agentrt_closed_by_budget` becomes the row's `closed_by_budget`; servers that ignore the field
(llama-server) just cut at max_tokens. Closing the iterator cancels the requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from agentrt.extract.confidence import below, field_confidence, token_ends_from_bytes
from agentrt.extract.prompt import PromptTemplate, prompt_messages
from agentrt.extract.types import ExtractInput, ExtractResult, Usage
from agentrt.extract.validate import SchemaValidators, judge

_DONE = object()


def _openai():
    try:
        import openai
    except ImportError:
        raise ValueError(
            "--server needs the openai client, which is not installed: `pip install openai` "
            "(or agentrt[extract])"
        ) from None
    return openai


def server_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists (GET /v1/models). Raises ValueError when it cannot be
    reached or lists none."""
    openai = _openai()
    client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", timeout=30, max_retries=2)
    try:
        models = client.models.list().data
    except openai.APIError as e:
        raise ValueError(f"cannot list the models of {base_url}: {e}") from None
    if not models:
        raise ValueError(f"{base_url} lists no models: give --model")
    return models[0].id


class ServerExtractor:
    """The job's documents against one server. base_url: the API root (".../v1")."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        max_in_flight: int = 8,
        prompt: PromptTemplate | None = None,
        min_confidence: float | None = None,
        timeout_s: float = 600.0,
        repetition_repair: bool = False,
        max_tokens_policy: str = "length",
    ):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.openai = _openai()
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.temperature, self.max_tokens = temperature, max_tokens
        self.window, self.prompt, self.min_confidence = max_in_flight, prompt, min_confidence
        self.timeout_s = timeout_s
        self.validators = SchemaValidators()
        self.logprobs = True
        # agentrt's runaway-value repair (an extension field): dropped for a server that refuses it
        self.repetition_repair = repetition_repair
        # agentrt's length-safe policy (an extension field): likewise dropped when refused
        self.max_tokens_policy = max_tokens_policy

    def _extra_body(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"repetition_repair": True} if self.repetition_repair else {}
        if self.max_tokens_policy != "length":
            extra["max_tokens_policy"] = self.max_tokens_policy
        return extra

    def run(self, inputs: Iterable[ExtractInput], schema: dict | None = None) -> Iterator[ExtractResult]:
        """Results in completion order (the driver's contract: one per input, never raising for a
        document)."""
        out: queue.Queue = queue.Queue(maxsize=4 * self.window)
        state: dict[str, Any] = {}
        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            state["loop"] = loop
            try:
                task = loop.create_task(self._main(inputs, schema, out))
                state["task"] = task
                ready.set()
                loop.run_until_complete(task)
            except BaseException as e:  # noqa: BLE001 (handed to the consumer)
                state["error"] = e
            finally:
                ready.set()
                out.put(_DONE)
                loop.close()

        thread = threading.Thread(target=main, name="agentrt-extract-client", daemon=True)
        thread.start()
        ready.wait()
        try:
            while True:
                item = out.get()
                if item is _DONE:
                    break
                yield item
            err = state.get("error")
            if err is not None and not isinstance(err, asyncio.CancelledError):
                raise err
        finally:
            loop, task = state.get("loop"), state.get("task")
            if thread.is_alive() and loop is not None and task is not None:
                with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: the thread is ending
                    loop.call_soon_threadsafe(task.cancel)
                while thread.is_alive():  # drain so a blocked put cannot hold the thread
                    try:
                        out.get(timeout=0.1)
                    except queue.Empty:
                        pass
            thread.join()

    async def _main(self, inputs: Iterable[ExtractInput], schema: dict | None, out: queue.Queue) -> None:
        client = self.openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key or "none", timeout=self.timeout_s, max_retries=2
        )
        tasks: set[asyncio.Task] = set()
        try:
            for index, inp in enumerate(inputs):
                while len(tasks) >= self.window:
                    _, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                tasks.add(asyncio.create_task(self._one(client, index, inp, schema, out)))
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            await client.close()

    async def _put(self, out: queue.Queue, item: ExtractResult) -> None:
        while True:
            try:
                out.put_nowait(item)
                return
            except queue.Full:
                await asyncio.sleep(0.01)

    async def _one(
        self, client, index: int, inp: ExtractInput, schema: dict | None, out: queue.Queue
    ) -> None:
        await self._put(out, await self._extract(client, index, inp, schema))

    async def _extract(self, client, index: int, inp: ExtractInput, schema: dict | None) -> ExtractResult:
        res = ExtractResult(index, inp.id, gold=inp.gold)
        schema = inp.schema if inp.schema is not None else schema
        if inp.error is not None or schema is None or not isinstance(inp.text, (str, list)):
            res.error, res.failure = inp.error or "no schema or no text for this document", "input"
            return res
        messages = inp.text if isinstance(inp.text, list) else prompt_messages(inp.text, schema, self.prompt)
        name = re.sub(r"[^A-Za-z0-9_-]", "_", inp.schema_name or "extraction")[:64]
        kwargs: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": schema, "strict": True},
            },
        }
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        openai = self.openai
        while True:
            try:
                resp = await client.chat.completions.create(
                    **kwargs,
                    **({"logprobs": True} if self.logprobs else {}),
                    **({"extra_body": extra} if (extra := self._extra_body()) else {}),
                )
                break
            except openai.BadRequestError as e:
                body = e.body if isinstance(e.body, dict) else {}
                if self.logprobs and body.get("param") == "logprobs":
                    self.logprobs = False  # this server has no logprobs: go on without confidence
                    continue
                if self.repetition_repair and body.get("param") == "repetition_repair":
                    self.repetition_repair = False  # not an agentrt server: go on without repair
                    continue
                if self.max_tokens_policy != "length" and body.get("param") == "max_tokens_policy":
                    self.max_tokens_policy = "length"  # not an agentrt server: OpenAI's behaviour
                    continue
                code = body.get("code")
                res.error = f"the server refused the request: {body.get('message') or e.message}"
                res.failure = (
                    "context_length"
                    if code == "context_length_exceeded"
                    else ("schema" if "response_format" in str(body.get("param") or "") else "error")
                )
                res.needs_review = below(None, self.min_confidence)
                return res
            except openai.APIError as e:
                res.error, res.failure = f"the request failed: {e}", "error"
                res.needs_review = below(None, self.min_confidence)
                return res
        choice = resp.choices[0]
        res.text = choice.message.content or ""
        res.repaired = list(getattr(choice, "agentrt_repaired", None) or [])
        res.closed_by_budget = bool(getattr(choice, "agentrt_closed_by_budget", False))
        res.finish_reason = choice.finish_reason
        if resp.usage is not None:
            details = getattr(resp.usage, "prompt_tokens_details", None)
            res.usage = Usage(
                resp.usage.prompt_tokens,
                resp.usage.completion_tokens,
                (getattr(details, "cached_tokens", None) or 0) if details is not None else 0,
            )
        validator = self.validators.get(schema)
        res.output, res.valid, res.error, res.failure = judge(
            res.text, res.finish_reason, validator, res.usage.completion_tokens
        )
        if res.output is not None:
            res.confidence = _confidence(res.text, choice)
        res.needs_review = below(res.confidence, self.min_confidence)
        if res.needs_review is not None:  # a budget close forces values at confidence 1.0
            res.needs_review = res.needs_review or res.closed_by_budget
        return res


def _confidence(text: str, choice: Any) -> dict[str, float] | None:
    """Per-field confidence from OpenAI's `choice.logprobs.content` (None without it)."""
    content = getattr(getattr(choice, "logprobs", None), "content", None)
    if not content:
        return None
    pieces = [bytes(c.bytes) if c.bytes is not None else c.token.encode() for c in content]
    ends = token_ends_from_bytes(pieces)
    if ends[-1] != len(text):
        return None
    try:
        return field_confidence(text, ends, [c.logprob for c in content])
    except ValueError:
        return None
