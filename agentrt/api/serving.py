"""OpenAI serving: a chat or text completion request -> the engine -> a result (a complete response
body, or the events of a stream). No HTTP framework here: routes.py makes the result a response, and
errors.py maps the errors raised.

Per request: validate (tools, tool turns), render the chat template and tokenize (off the event
loop; the template within its budget, runtime/chat_template.py, stopped when the client leaves or
the server shuts down: `stop_renders`), build a `Generation` (sampling params, the one constraint,
the tool plan), submit it to the AsyncEngine (which validates, compiles the constraint once and
queues), then stream or collect.

The result is rendered by a ResponseShape (generation.py): chat and text completions by
chat_shape.py, the Responses and Messages APIs by their own. The client is watched the whole time
(disconnect.py): when it leaves, the request's work is cancelled wherever it is.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import replace

from agentrt.api.chat_shape import ChatShape
from agentrt.api.disconnect import ClientGone, while_connected
from agentrt.api.errors import APIError, shown, to_api_error
from agentrt.api.generation import Generation, ResponseShape, ServingResult, renamed
from agentrt.api.output_text import call_markers
from agentrt.api.prompt_limit import PromptBound, token_bound
from agentrt.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _CommonRequest,
)
from agentrt.api.reasoning import ReasoningSetup, RequestReasoning, thinking_budget
from agentrt.api.sql_constraint import SQLTarget, add_sql_checks, sql_target
from agentrt.api.tools import ToolPlan, ToolPrompt, check_tool_messages, check_tool_schemas, plan_tools
from agentrt.errors import ConstraintError, InvalidRequestError
from agentrt.runtime.async_engine import AsyncEngine, RequestStream
from agentrt.runtime.chat_template import ChatRenderer
from agentrt.runtime.request import RequestOutput
from agentrt.sql.service import SQLDatabases


class OpenAIServing:
    """OpenAI's completions API over one AsyncEngine. `model_name` is the only accepted `model`;
    `tool_prompt` says how tools are written into prompts and which call format is parsed;
    `databases`: the named databases `sql` constraints may name (agentrt/sql/service.py);
    `reasoning`: the model's reasoning format (api/reasoning.py; default: none). The chat template
    renders within the engine's `ModelConfig.chat_template_budget`."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        tool_prompt: ToolPrompt,
        databases: SQLDatabases | None = None,
        reasoning: ReasoningSetup | None = None,
    ):
        self.engine, self.model_name, self.tool_prompt = engine, model_name, tool_prompt
        self.databases = databases
        self.reasoning = reasoning or ReasoningSetup()
        limit = min(engine.max_model_len, engine.runner.kv.num_slots)  # as the engine's context check
        self.prompt_bound = PromptBound(token_bound(engine.tokenizer), limit)
        # a JSON Schema over the compile limit is refused before its (costly) meta-schema check
        self._max_constraint_bytes = engine.grammar_config.max_constraint_bytes
        self.chat_shape = ChatShape(model_name, engine)
        self.renderer = ChatRenderer(engine.tokenizer, engine.model_config.chat_template_budget)
        self._renders: set[threading.Event] = set()  # the cancel Events of renders in flight
        self._renders_lock = threading.Lock()
        self._stopping = False

    def stop_renders(self) -> None:
        """Stop every chat template render in flight, and any started later, within one loop
        iteration or output piece (server shutdown: a worker thread still rendering would hold the
        process's exit). Any thread."""
        with self._renders_lock:
            self._stopping = True
            for cancel in self._renders:
                cancel.set()

    def start_renders(self) -> None:
        """Renders run again after `stop_renders` (the app started again: its lifespan, as a test
        client re-entering the same app does). Any thread."""
        with self._renders_lock:
            self._stopping = False

    async def _in_worker(self, fn, *args):
        """`fn(*args, cancel)` in a worker thread; `cancel` (a threading.Event) is set when this
        coroutine is cancelled (the client left) or `stop_renders` runs, so a render in `fn` stops."""
        cancel = threading.Event()
        with self._renders_lock:
            self._renders.add(cancel)
            if self._stopping:
                cancel.set()
        try:
            return await asyncio.to_thread(fn, *args, cancel)
        except asyncio.CancelledError:
            cancel.set()
            raise
        finally:
            with self._renders_lock:
                self._renders.discard(cancel)

    def _render(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        cancel: threading.Event,
        add_generation_prompt: bool = True,
        template_kwargs: dict | None = None,
    ) -> str:
        """`messages` through the chat template within its budget (runtime/chat_template.py), stopped
        as soon as the text rendered so far cannot fit the context (`prompt_bound`). Raises
        ChatTemplateError, TemplateBudgetError, ContextLengthError (param "messages"),
        ServiceUnavailableError (cancelled)."""
        bound = self.prompt_bound
        return self.renderer.render(
            messages,
            tools,
            add_generation_prompt,
            template_kwargs,
            cancel=cancel,
            check_prefix=None if bound.tokens is None else (lambda text: bound.check(text, "messages")),
            check_from=bound.limit,
        )

    def models(self) -> dict:
        """The /v1/models listing: the one served model."""
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "agentrt",
                    "max_model_len": self.engine.max_model_len,
                }
            ],
        }

    async def tokenize(self, req: TokenizeRequest) -> dict:
        """vLLM's /tokenize: the token ids of a prompt or of chat messages (through the chat template
        and the tool prompt, exactly as a chat request is rendered), their count and the context
        limit. Raises APIError naming the field (none or both given, a template that refuses the
        messages, text that is not valid Unicode, an unknown model)."""
        if req.model is not None:
            self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        tokenizer = self.engine.tokenizer
        if req.prompt is not None:
            self.prompt_bound.check(req.prompt, "prompt")
            try:
                ids = await asyncio.to_thread(
                    tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens
                )
            except (TypeError, UnicodeError):
                raise APIError("prompt is not valid Unicode text", param="prompt") from None
        else:
            plan = plan_tools(req.tools, None, None, self.tool_prompt.fmt)
            messages = [m.as_dict() for m in req.messages]
            check_tool_messages(messages)
            rendered, template_tools = self.tool_prompt.render(messages, plan)

            def render(cancel: threading.Event) -> list[int]:
                text = self._render(rendered, template_tools, cancel, req.add_generation_prompt)
                return _encode(tokenizer, text, "messages", self.prompt_bound)

            ids = await self._in_worker(render)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        """vLLM's /detokenize: the text of token ids (special tokens kept). Raises APIError naming
        `tokens` when an id is outside the vocabulary or the list is longer than the context."""
        if req.model is not None:
            self.check_model(req.model)
        if len(req.tokens) > self.engine.max_model_len:
            raise APIError(
                f"tokens: at most {self.engine.max_model_len} ids (the context), got {len(req.tokens)}",
                param="tokens",
            )
        vocab = self.engine.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"tokens: {bad} is not a token id (the vocabulary has {vocab})", param="tokens")
        return {"prompt": self.engine.tokenizer.decode(req.tokens)}

    def metrics_text(self) -> bytes:
        return self.engine.metrics_text()

    def check_model(self, model: str) -> None:
        """Raises APIError (404 model_not_found) unless `model` is the served one."""
        if model != self.model_name:
            raise APIError(
                f"model {shown(model)} does not exist; this server serves '{self.model_name}'",
                status=404,
                param="model",
                code="model_not_found",
            )

    async def chat(
        self, req: ChatCompletionRequest, gone: ClientGone, shape: ResponseShape | None = None
    ) -> ServingResult:
        """/v1/chat/completions; `gone` returns when the client leaves (its work is then cancelled);
        `shape` renders the result for another API (None: chat completions, `chat_shape`). Raises
        APIError (4xx naming the field, in the shape's names; 499 when the client left) or an
        AgentrtError the engine raised (QueueFullError, RequestTimeoutError,
        ServiceUnavailableError while shutting down, ...)."""
        shape = self.chat_shape if shape is None else shape
        try:
            return await while_connected(self._chat(req, shape), gone)
        except (APIError, InvalidRequestError) as e:  # e.g. a prompt beyond the context
            error = renamed(e if isinstance(e, APIError) else to_api_error(e, e.param), shape)
            if error is e:
                raise
            raise error from None

    async def completion(self, req: CompletionRequest, gone: ClientGone) -> ServingResult:
        """/v1/completions (one prompt: text, a one-element list of text, or token ids). Raises as
        `chat`."""
        return await while_connected(self._completion(req), gone)

    async def _chat(self, req: ChatCompletionRequest, shape: ResponseShape) -> ServingResult:
        self.check_model(req.model)
        # tools, tool turns and the template: client-sized work, off the event loop
        plan, prompt_ids, reasoning = await self._in_worker(self._chat_prompt, req)
        names = {"prompt": "messages"}
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:
            max_tokens, names["max_tokens"] = req.max_completion_tokens, "max_completion_tokens"
        target = await sql_target(self.databases, req.sql) if req.sql is not None else None
        gen = await asyncio.to_thread(
            self._generation, req, True, prompt_ids, max_tokens, plan, names, target, reasoning
        )
        return await add_sql_checks(await self._run(gen, shape), target)

    async def _completion(self, req: CompletionRequest) -> ServingResult:
        self.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError("prompt: give one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await asyncio.to_thread(
                _encode, self.engine.tokenizer, prompt, "prompt", self.prompt_bound
            )
            if not prompt_ids:
                raise APIError("prompt is empty", param="prompt")
        else:
            prompt_ids = list(prompt)
        target = await sql_target(self.databases, req.sql) if req.sql is not None else None
        gen = await asyncio.to_thread(
            self._generation, req, False, prompt_ids, req.max_tokens, None, {"prompt": "prompt"}, target
        )
        return await add_sql_checks(await self._run(gen, self.chat_shape), target)

    def _chat_prompt(
        self, req: ChatCompletionRequest, cancel: threading.Event
    ) -> tuple[ToolPlan | None, list[int], RequestReasoning | None]:
        """The tool plan (tools and tool_choice checked, parameter schemas meta-validated), the
        prompt's token ids (tool turns checked, rendered by the chat template with the request's
        chat_template_kwargs) and, for a reasoning model, the request's reasoning (its thinking
        budget; 0 closes the reasoning in the prompt). Raises APIError naming the field,
        ContextLengthError, as `_render`. Runs in a worker thread: its work grows with the request;
        `cancel` stops its render."""
        budget = thinking_budget(
            req.thinking_token_budget, req.reasoning_effort, "thinking_token_budget", "reasoning_effort"
        )
        fmt = self.reasoning.fmt
        if fmt is None and budget != 0 and (req.thinking_token_budget, req.reasoning_effort) != (None, None):
            field = "thinking_token_budget" if req.thinking_token_budget is not None else "reasoning_effort"
            raise APIError(
                f"{field} is not supported: the served model does not reason (its chat template has no "
                "reasoning format; --reasoning-format names one)",
                param=field,
            )
        kwargs = req.template_kwargs()
        if fmt is not None and fmt.name == "harmony" and req.reasoning_effort in ("low", "medium", "high"):
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)  # gpt-oss's "Reasoning: ..." line
        plan = plan_tools(
            req.tools,
            req.tool_choice,
            req.parallel_tool_calls,
            self.tool_prompt.fmt,
            constrained=req.tool_call_constraint,
        )
        if plan is not None:
            check_tool_schemas(plan, self._max_constraint_bytes)
        messages = [m.as_dict() for m in req.messages]
        check_tool_messages(messages)
        rendered, template_tools = self.tool_prompt.render(messages, plan)
        prompt = self._render(rendered, template_tools, cancel, template_kwargs=kwargs)
        prompt, reasoning = self.reasoning.for_request(prompt, budget)
        return plan, _encode(self.engine.tokenizer, prompt, "messages", self.prompt_bound), reasoning

    def _generation(
        self,
        req: _CommonRequest,
        chat: bool,
        prompt_ids: list[int],
        max_tokens: int | None,
        plan: ToolPlan | None,
        param_names: dict[str, str],
        sql: SQLTarget | None = None,
        reasoning: RequestReasoning | None = None,
    ) -> Generation:
        """The request's sampling params and its one constraint (response_format / regex / sql /
        ... or the tool-call grammar; with tools under tool_choice "auto" and a JSON response
        schema, tool calls or a final answer valid against it), applied after the reasoning of a
        reasoning model. Raises APIError naming the field."""
        params = req.sampling_params(max_tokens)
        if reasoning is not None:
            params.reasoning = reasoning.params(call_markers(plan))  # a call may end the reasoning
        chosen = req.constraint(
            req.response_format, sql.spec if sql is not None else None, self._max_constraint_bytes
        )
        constraint, constraint_param = chosen.spec, chosen.param
        calls = plan if plan is not None and plan.calls else None
        # one decision: special tokens stay in the text when the reasoning's markers or the call
        # format's markers are special tokens (each parser needs its own markers)
        keep_markers = params.reasoning is not None and self.reasoning.keep_special
        if calls is not None and not calls.fmt.skip_special_tokens:
            keep_markers = True
        if keep_markers:
            params.skip_special_tokens = False
        tool_constraint = plan.constraint() if plan is not None else None
        answer_or_calls = False
        if tool_constraint is not None and calls is not None:
            if constraint is not None and constraint.kind not in ("json_schema", "json_object"):
                raise APIError(
                    f"{chosen.field} cannot be combined with tools unless tool_choice is 'none' (a "
                    "JSON answer can: response_format json_schema or json_object)",
                    param=chosen.field,
                )
            if constraint is not None and calls.mode == "auto":
                # tool calls or a final answer valid against the schema, one grammar; a compile
                # error without a tool index is the answer's schema's
                constraint, answer_or_calls = calls.with_answer(constraint), True
            else:  # required / named: calls (the schema is for a later turn's answer)
                constraint, constraint_param = tool_constraint, "tools"
        # `stop` applies to free text only: before the first tool call when calls are optional; a
        # wholly constrained output (a schema, a regex, required calls, calls or a schema's answer)
        # ends where its constraint does
        if calls is not None and calls.mode == "auto" and not answer_or_calls:
            params.stop_until = call_markers(plan)  # each text that opens a call (Llama's python tag too)
        elif constraint is not None:
            params.stop = []
        if tool_constraint is not None and calls is None and constraint is None:
            # tool_choice "none": free text (stop strings apply) that never opens a call; free text
            # cut by max_tokens is cut ("length"), there is nothing to close
            constraint, constraint_param = tool_constraint, "tools"
            params.max_tokens_policy = "length"
        if constraint is not None and reasoning is not None and reasoning.spec_value:
            constraint = replace(constraint, reasoning=reasoning.spec_value)
        return Generation(
            request_id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            chat=chat,
            prompt_ids=prompt_ids,
            params=params,
            constraint=constraint,
            constraint_param=constraint_param,
            tools=calls,
            param_names=param_names,
            cache_salt=req.cache_salt or "",
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            n=req.n,
            reasoning=(reasoning.fmt, reasoning.mode) if reasoning is not None else None,
        )

    async def _submit(self, gen: Generation) -> RequestStream:
        """Hand `gen` to the engine. Raises APIError (400 naming the field: invalid values, a prompt
        beyond the context, a constraint that does not compile) or the engine's other AgentrtError."""
        try:
            return await self.engine.submit(
                gen.prompt_ids,
                gen.params,
                gen.constraint,
                request_id=gen.request_id,
                cache_salt=gen.cache_salt,
            )
        except ConstraintError as e:
            param = gen.constraint_param
            if e.tool_index is not None and gen.tools is not None:  # name the offending tool's schema
                param = f"tools[{gen.tools.request_index(e.tool_index)}].function.parameters"
            raise to_api_error(e, param, message=f"{param}: {e.message}") from None
        except InvalidRequestError as e:
            raise gen.api_error(e, default_param=gen.param_names["prompt"]) from None

    async def _run(self, gen: Generation, shape: ResponseShape) -> ServingResult:
        """Submit `gen` (its n choices), wait for the first outputs, then return the events
        (streamed) or the body made from the last outputs. Choices after the first are submitted
        once the first has its first output: its prompt's KV is then in the radix tree, so the
        others reuse it instead of computing it again. Choice i samples with seed + i (when a
        seed is given), so each choice is reproducible. Cancelling it (the client left) aborts
        every choice."""
        gens = [
            gen
            if i == 0
            else replace(
                gen,
                request_id=f"{gen.request_id}-{i}",
                params=replace(gen.params, seed=None if gen.params.seed is None else gen.params.seed + i),
            )
            for i in range(gen.n)
        ]
        streams: list[RequestStream] = []
        try:
            streams.append(await self._submit(gens[0]))
            firsts = [await anext(streams[0])]
            for g in gens[1:]:
                streams.append(await self._submit(g))
            for stream in streams[1:]:
                firsts.append(await anext(stream))
            for first in firsts:
                if first.finished and first.finish_reason == "error":
                    raise gen.api_error(first.error)
            created = int(time.time())
            not_enforced = streams[0].not_enforced
            headers = {"X-Agentrt-Not-Enforced": ", ".join(not_enforced)} if not_enforced else None
            if gen.stream:
                events = shape.events(gen, streams, firsts, created)
                return ServingResult(events=events, headers=headers, streams=tuple(streams))
            lasts = [await _collect(stream, first) for stream, first in zip(streams, firsts)]
        except BaseException:
            for stream in streams:
                await stream.aclose()  # aborts the request unless it has finished
            raise
        for last in lasts:
            if last.finish_reason == "error":
                raise gen.api_error(last.error)
        return ServingResult(body=shape.body(gen, lasts, created, not_enforced), headers=headers)


async def _collect(stream: RequestStream, first: RequestOutput) -> RequestOutput:
    """The last output of `stream` (`first` when it is the last)."""
    last = first
    async for out in stream:
        last = out
    return last


def _encode(tokenizer, text: str, param: str, bound: PromptBound | None = None) -> list[int]:
    """Token ids of `text`. Raises APIError naming `param` when it is not valid Unicode, and
    ContextLengthError, without tokenizing, when `bound` shows it cannot fit the context."""
    if bound is not None:
        bound.check(text, param)
    try:
        return tokenizer.encode(text, add_special_tokens=False)
    except (TypeError, UnicodeError):
        raise APIError(f"{param} is not valid Unicode text (e.g. a lone surrogate)", param=param) from None
