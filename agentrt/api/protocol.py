"""OpenAI-compatible request models (pydantic), their translation to engine inputs, and the small
response shapes shared by streamed and non-streamed responses."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from agentrt.api.errors import APIError
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.request import RequestOutput, SamplingParams

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "RequestConstraint", "usage"]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict:
        """role, content text, and tool_calls / tool_call_id when present (OpenAI shapes)."""
        d: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _CommonRequest(BaseModel):
    """Fields shared by chat and text completions (OpenAI names; extra: top_k, min_p,
    repetition_penalty, regex, grammar (EBNF), lark, choice, ignore_eos, stop_token_ids, cache_salt,
    max_tokens_policy, speculative: false opts this request out of the server's speculative decoding)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = None
    user: str | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    regex: str | None = None
    grammar: str | None = None
    lark: str | None = None
    choice: list[str] | None = None
    cache_salt: str | None = None
    max_tokens_policy: Literal["length", "close"] = "length"
    speculative: bool = True

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        for name in self.unsupported_fields:
            value = getattr(self, name)
            if value != type(self).model_fields[name].default and value not in self.unsupported_noop.get(
                name, ()
            ):
                raise APIError(f"{name} is not supported by this server", param=name)
        if self.n != 1:
            raise APIError("n must be 1: agentrt returns one choice per request", param="n")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(
                "logit_bias keys must be token ids (integers as strings)", param="logit_bias"
            ) from None
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logit_bias=bias,
            max_tokens_policy=self.max_tokens_policy,
            speculative=self.speculative,
        )

    unsupported_fields: ClassVar[tuple[str, ...]] = ("top_logprobs",)
    """Fields refused with a 400 naming them when given a value other than their default, or one
    of `unsupported_noop`'s values for that field (values that ask for nothing)."""
    unsupported_noop: ClassVar[dict[str, tuple]] = {}

    def constraint(self, response_format: ResponseFormat | None = None) -> RequestConstraint:
        """The request's one constraint (spec None when it has none). Raises APIError (400) naming the
        field when the constraint is invalid, combined with `stop`, or several are given."""
        given = []
        if response_format is not None and response_format.type != "text":
            given.append("response_format")
        given += [name for name in ("regex", "grammar", "lark", "choice") if getattr(self, name) is not None]
        if len(given) > 1:
            raise APIError(f"give at most one constraint, got {', '.join(given)}", param=given[1])
        if not given:
            return RequestConstraint(None, "", "")
        field = given[0]
        if self.stop:
            raise APIError(
                f"stop cannot be combined with {field}: a stop string could cut the constrained "
                "output; the constraint decides where the output ends",
                param="stop",
            )
        param = field
        try:
            if field == "response_format":
                if response_format.type == "json_object":
                    return RequestConstraint(ConstraintSpec.json_object(), field, field)
                if response_format.json_schema is None:
                    raise APIError(
                        "response_format.json_schema is required for type json_schema",
                        param="response_format.json_schema",
                    )
                param = "response_format.json_schema.schema"
                spec = ConstraintSpec.json_schema(
                    response_format.json_schema.schema_, strict=response_format.json_schema.strict
                )
            else:
                make = {
                    "regex": ConstraintSpec.regex,
                    "grammar": ConstraintSpec.grammar,
                    "lark": ConstraintSpec.lark,
                    "choice": ConstraintSpec.choice,
                }[field]
                spec = make(getattr(self, field))
        except ValueError as e:
            raise APIError(f"{param}: {e}", param=param) from None
        return RequestConstraint(spec, field, param)


class RequestConstraint(NamedTuple):
    """A request's constraint: `spec` (None: unconstrained), `field` the request field that gave it
    ("response_format", "regex", ...; "" when none) and `param` the field to name when the spec fails
    to compile (e.g. "response_format.json_schema.schema")."""

    spec: ConstraintSpec | None
    field: str
    param: str


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # extension: false leaves tool calls unconstrained (parsed only), for A/B benchmarks
    tool_call_constraint: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    logprobs: bool | None = None
    unsupported_fields: ClassVar[tuple[str, ...]] = ("functions", "function_call", "logprobs", "top_logprobs")
    unsupported_noop: ClassVar[dict[str, tuple]] = {"logprobs": (False,)}


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    logprobs: int | None = None  # any value, 0 included, asks for logprobs
    unsupported_fields: ClassVar[tuple[str, ...]] = ("echo", "best_of", "suffix", "logprobs", "top_logprobs")
    unsupported_noop: ClassVar[dict[str, tuple]] = {"best_of": (1,)}


def usage(out: RequestOutput) -> dict:
    """OpenAI's `usage` object of a finished output (tokens), with cached prompt tokens."""
    n = len(out.token_ids)
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": n,
        "total_tokens": out.num_prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }
