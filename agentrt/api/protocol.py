"""OpenAI-compatible request models (pydantic) and their translation to engine inputs."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.request import SamplingParams


class APIError(Exception):
    """An error with an HTTP status and OpenAI error fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type_, code


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
    logprobs: bool | int | None = None
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
            if value != type(self).model_fields[name].default and not (name == "best_of" and value == 1):
                raise APIError(f"{name} is not supported by this server", param=name)
        if self.n != 1:
            raise APIError("n must be 1: agentrt returns one choice per request", param="n")
        if self.logprobs:
            raise APIError("logprobs are not supported yet", param="logprobs")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError("logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logit_bias=bias,
            max_tokens_policy=self.max_tokens_policy, speculative=self.speculative,
        )

    unsupported_fields: ClassVar[tuple[str, ...]] = ()

    def constraint(self, response_format: ResponseFormat | None = None) -> tuple[ConstraintSpec | None, str]:
        """The request's one constraint (or None) and the request field it came from. Raises APIError (400) naming the field when the
        constraint is invalid or several are given."""
        given = []
        if response_format is not None and response_format.type != "text":
            given.append("response_format")
        given += [name for name in ("regex", "grammar", "lark", "choice") if getattr(self, name) is not None]
        if len(given) > 1:
            raise APIError(f"give at most one constraint, got {', '.join(given)}", param=given[1])
        if not given:
            return None, ""
        field = given[0]
        if self.stop:
            raise APIError(f"stop cannot be combined with {field}: a stop string could cut the constrained "
                           "output; the constraint decides where the output ends", param="stop")
        param = field
        try:
            if field == "response_format":
                if response_format.type == "json_object":
                    return ConstraintSpec.json_object(), field
                if response_format.json_schema is None:
                    raise APIError("response_format.json_schema is required for type json_schema",
                                   param="response_format.json_schema")
                param = "response_format.json_schema.schema"
                return ConstraintSpec.json_schema(response_format.json_schema.schema_,
                                                  strict=response_format.json_schema.strict), param
            if field == "regex":
                return ConstraintSpec.regex(self.regex), field
            if field == "grammar":
                return ConstraintSpec.grammar(self.grammar), field
            if field == "lark":
                return ConstraintSpec.lark(self.lark), field
            return ConstraintSpec.choice(self.choice), field
        except ValueError as e:
            raise APIError(f"{param}: {e}", param=param) from None


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
    unsupported_fields: ClassVar[tuple[str, ...]] = ("functions", "function_call")


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    unsupported_fields: ClassVar[tuple[str, ...]] = ("echo", "best_of", "suffix")
