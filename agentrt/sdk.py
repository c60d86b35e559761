"""Python SDK: an in-process engine (no server) for generation, chat and structured extraction."""

from __future__ import annotations

import json
from typing import Any

from agentrt.errors import IncompleteOutputError, InternalError
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.runtime.config import DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import RequestOutput, SamplingParams

Messages = list[dict[str, str]]


def _schema_of(schema: dict | type) -> tuple[dict, type | None]:
    """A JSON Schema dict and, for a pydantic model class, the class to parse into."""
    if isinstance(schema, dict):
        return schema, None
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return schema.model_json_schema(), schema
    raise ValueError("schema must be a JSON Schema dict or a pydantic model class")


class LLM:
    """An in-process engine.

    >>> llm = LLM()                                   # the default model, CPU or CUDA
    >>> llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    >>> llm.extract("Tran Van Bao, 31, lives in Hue.", Person)   # -> Person(...)
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        grammar: GrammarConfig | None = None,
    ):
        self.engine = Engine(
            EngineConfig(
                model=ModelConfig(model=model, device=device, dtype=dtype, max_model_len=max_model_len),
                cache=CacheConfig(kv_cache_bytes=kv_cache_bytes),
                scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
                grammar=grammar or GrammarConfig(),
            )
        )
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str],
        sampling_params: SamplingParams | None = None,
        *,
        constraint: ConstraintSpec | None = None,
    ) -> list[RequestOutput]:
        """Complete raw text prompts (batched together). Raises InvalidRequestError (a ValueError;
        `param` names the field) on invalid sampling values or a prompt beyond the context,
        ConstraintError when the constraint cannot be compiled or enforced (naming the keyword and
        its JSON pointer), the error of an output that failed otherwise (an AgentrtError)."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self._run([(i, sampling_params or SamplingParams(), constraint) for i in ids])

    def chat(
        self,
        messages: Messages | list[Messages],
        sampling_params: SamplingParams | None = None,
        *,
        constraint: ConstraintSpec | None = None,
    ) -> list[RequestOutput]:
        """Chat completion(s) through the model's chat template; one conversation or a list of them.
        Raises as `generate`."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self._chat_ids(c) for c in convs]
        return self._run([(i, sampling_params or SamplingParams(), constraint) for i in ids])

    def extract(
        self,
        inputs: str | Messages | list[str | Messages],
        schema: dict | type,
        sampling_params: SamplingParams | None = None,
    ) -> Any:
        """Structured output: each input (a user message text or a conversation) -> an object that
        satisfies `schema` (a JSON Schema dict -> dict; a pydantic model class -> an instance).
        One input gives one object, a list gives a list. Objects are closed (OpenAI strict mode: no
        properties beyond the schema's). Raises ValueError when `schema` is not a JSON Schema (or
        pydantic model class), ConstraintError (a ValueError) when it uses a keyword that cannot be
        enforced (naming the keyword and its JSON pointer, as the HTTP API does),
        IncompleteOutputError (a ValueError) when an output ran out of tokens before the JSON was
        complete, and as `generate` otherwise."""
        schema_dict, model_cls = _schema_of(schema)
        spec = ConstraintSpec.json_schema(schema_dict, strict=True)  # closed objects, as OpenAI strict
        single = isinstance(inputs, str) or (inputs and isinstance(inputs[0], dict))
        items = [inputs] if single else list(inputs)
        convs = [[{"role": "user", "content": x}] if isinstance(x, str) else x for x in items]
        params = sampling_params or SamplingParams(temperature=0.0)
        outs = self._run([(self._chat_ids(c), params, spec) for c in convs])
        results = []
        for out in outs:
            if out.finish_reason != "stop":
                raise IncompleteOutputError(
                    f"output did not complete (finish_reason={out.finish_reason}) after {len(out.token_ids)} "
                    f"tokens: {out.text[:200]!r}; give a larger max_tokens, or max_tokens_policy='close' to "
                    "close the JSON within it",
                    finish_reason=out.finish_reason,
                    text=out.text,
                )
            data = json.loads(out.text)
            results.append(model_cls.model_validate(data) if model_cls else data)
        return results[0] if single else results

    def _run(
        self, requests: list[tuple[list[int], SamplingParams, ConstraintSpec | None]]
    ) -> list[RequestOutput]:
        """Final outputs in input order. Raises the error of the first output that failed, as it is."""
        outs = self.engine.generate(requests)
        for out in outs:
            if out.finish_reason == "error":
                raise out.error or InternalError(f"request {out.request_id} failed without a reason")
        return outs

    def _chat_ids(self, messages: Messages) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)
