"""OpenAI-compatible request models (pydantic), their translation to engine inputs, and the small
response shapes shared by streamed and non-streamed responses."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, NamedTuple

import regex
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from agentrt.api.errors import APIError, shown
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.request import MAX_LOGPROBS, RequestOutput, SamplingParams

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "RequestConstraint",
    "TokenizeRequest",
    "usage",
]


MAX_N = 16
"""The most choices (`n`) one request may ask for: each is a sequence the engine decodes."""
MAX_TEMPERATURE = 2.0
"""The highest `temperature` accepted (OpenAI's range is 0 to 2)."""


class TextPart(BaseModel):
    """A content part; only `text` parts are served (image, audio and file parts are refused with a
    400 naming the part: the served models read text only)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text":
            raise ValueError(f"{shown(self.type)} parts are not supported: the served model reads text only")
        if self.text is None:
            raise ValueError("a text part needs a `text` string")
        return self


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
    reasoning_content: str | None = None  # an earlier assistant turn's reasoning (vLLM's name)
    reasoning: str | None = None  # the same, by its newer name

    def as_dict(self) -> dict:
        """role, content text, and tool_calls / tool_call_id / reasoning_content when present
        (OpenAI shapes; an assistant turn's reasoning goes to the chat template, which keeps or
        drops it as its family expects)."""
        d: dict = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None and self.role == "assistant":
            d["reasoning_content"] = thought
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


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field: exactly one of json / regex / choice / grammar /
    json_object. Its other options are accepted where they ask for what agentrt does anyway:
    whitespace_pattern (see _check_whitespace_pattern), disable_any_whitespace (agentrt's JSON
    has no free whitespace), disable_fallback (agentrt never falls back to a weaker constraint)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: StrictBool | None = None
    disable_fallback: StrictBool | None = None


class SQLConstraint(BaseModel):
    """agentrt's `sql` constraint: read-only SQL naming only a schema's tables and columns
    (agentrt/sql/). Exactly one of `database` (a name the server was started with, `--database
    NAME=URL`; `refresh`: introspect it again first) and `schema` (CREATE TABLE text or JSON
    {table: {column: type}}, in `dialect`, default SQLite). Never a connection URL. `tables`: only
    these tables of it (Schema.subset: foreign keys among them kept), for a schema over the
    grammar's table limit."""

    model_config = ConfigDict(extra="forbid")
    dialect: Literal["sqlite", "duckdb", "postgres", "postgresql"] | None = None
    schema_: str | dict[str, Any] | None = Field(None, alias="schema")
    database: str | None = None
    refresh: StrictBool = False
    tables: list[StrictStr] | None = Field(None, min_length=1, max_length=1000)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """Sampling fields every route that samples takes with the same meaning (chat, completions and
    the Responses API, whose request passes them through, checked as chat checks them): OpenAI's
    seed, stop, penalties and logit_bias and agentrt's top_k, min_p, repetition_penalty,
    ignore_eos, stop_token_ids, cache_salt, max_tokens_policy, speculative and repetition_repair
    (opt-in: with a JSON constraint, close a string value or array that repeats itself; the closed
    values' JSON pointers come back as the choice's `agentrt_repaired`)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    max_tokens_policy: Literal["length", "close"] = "length"
    speculative: bool = True
    repetition_repair: bool = False


class _CommonRequest(SamplingFields):
    """Fields shared by chat and text completions (OpenAI names; extra: top_k, min_p,
    repetition_penalty, regex, grammar (EBNF), lark, choice, ignore_eos, stop_token_ids, cache_salt,
    max_tokens_policy, speculative: false opts this request out of the server's speculative decoding,
    sql (schema-aware SQL, agentrt/sql/); vLLM's guided_* / structured_outputs and SGLang's ebnf /
    json_schema as constraint aliases)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_logprobs: int | None = None
    user: str | None = None
    regex: str | None = None
    grammar: str | None = None
    lark: str | None = None
    choice: list[str] | None = None
    # vLLM's and SGLang's names for constraints (constraint_fields maps them onto the above)
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted and ignored: agentrt has one backend
    structured_outputs: StructuredOutputs | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    sql: SQLConstraint | None = None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        for name in self.unsupported_fields:
            value = getattr(self, name)
            if value != type(self).model_fields[name].default and value not in self.unsupported_noop.get(
                name, ()
            ):
                raise APIError(f"{name} is not supported by this server", param=name)
        if not 1 <= self.n <= MAX_N:
            raise APIError(f"n must be between 1 and {MAX_N}, got {self.n}", param="n")
        if self.temperature is not None and not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise APIError(
                f"temperature must be between 0 and {MAX_TEMPERATURE} (OpenAI's range), got {self.temperature}",
                param="temperature",
            )
        if self.cache_salt == "":  # as vLLM: an empty salt would share the cache of unsalted requests
            raise APIError("cache_salt must be a non-empty string when given", param="cache_salt")
        if self.cache_salt is not None and not _utf8(self.cache_salt):
            raise APIError(
                "cache_salt must be valid Unicode text (it has a lone surrogate)", param="cache_salt"
            )
        if self.seed is not None and self.n > 1 and self.seed + self.n - 1 >= 2**63:
            raise APIError(
                f"seed + n - 1 must be below 2^63 (choice i samples with seed + i), got seed {self.seed}",
                param="seed",
            )
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
            max_tokens_policy=self._max_tokens_policy(),
            speculative=self.speculative,
            logprobs=self.num_logprobs(),
            repetition_repair=self.repetition_repair,
        )

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs for this request (None: no logprobs). Raises APIError naming the
        field for a value outside [0, MAX_LOGPROBS]."""
        return None

    def _max_tokens_policy(self) -> str:
        """The request's max_tokens_policy; with a `sql` constraint and no policy given, "close":
        the bounded SQL grammar (agentrt/sql/grammar.py) then always ends its query within
        max_tokens, where "length" would cut it (measured: docs/benchmarks.md, Spider)."""
        if getattr(self, "sql", None) is not None and "max_tokens_policy" not in self.model_fields_set:
            return "close"
        return self.max_tokens_policy

    unsupported_fields: ClassVar[tuple[str, ...]] = ()
    """Fields refused with a 400 naming them when given a value other than their default, or one
    of `unsupported_noop`'s values for that field (values that ask for nothing)."""
    unsupported_noop: ClassVar[dict[str, tuple]] = {}

    def constraint(
        self,
        response_format: ResponseFormat | None = None,
        sql: ConstraintSpec | None = None,
        max_bytes: int | None = None,
    ) -> RequestConstraint:
        """The request's one constraint (spec None when it has none), from agentrt's own fields or
        the vLLM / SGLang aliases (`constraint_fields`); `sql`: the grammar the server built for the
        request's `sql` field; `max_bytes`: a JSON Schema larger than this (compact JSON) is refused
        before its meta-schema check. Raises APIError (400) naming the field when the constraint is
        invalid, or naming all of them when several are given."""
        given = self.constraint_fields(response_format)
        if len(given) > 1:
            names = ", ".join(g[0] for g in given)
            raise APIError(f"give at most one constraint, got {names}", param=given[1][0])
        if not given:
            return RequestConstraint(None, "", "")
        field, kind, value = given[0]
        param = field
        try:
            if kind == "json_object":
                return RequestConstraint(ConstraintSpec.json_object(), field, field)
            if kind == "sql":
                if sql is None:
                    raise APIError("sql constraints are built by the server", param="sql")
                return RequestConstraint(sql, field, field)
            if field == "response_format":
                if response_format.json_schema is None:
                    raise APIError(
                        "response_format.json_schema is required for type json_schema",
                        param="response_format.json_schema",
                    )
                param = "response_format.json_schema.schema"
                spec = ConstraintSpec.json_schema(
                    response_format.json_schema.schema_, response_format.json_schema.strict, max_bytes
                )
            elif kind == "json_schema":  # vLLM's and SGLang's xgrammar backends close objects
                spec = ConstraintSpec.json_schema(value, strict=True, max_bytes=max_bytes)
            else:
                make = {
                    "regex": ConstraintSpec.regex,
                    "grammar": ConstraintSpec.grammar,
                    "lark": ConstraintSpec.lark,
                    "choice": ConstraintSpec.choice,
                }[kind]
                spec = make(value)
        except ValueError as e:
            raise APIError(f"{param}: {e}", param=param) from None
        return RequestConstraint(spec, field, param)

    def constraint_fields(self, response_format: ResponseFormat | None) -> list[tuple[str, str, Any]]:
        """Every constraint the request gives, as (field, kind, value): kind is a ConstraintSpec
        kind ("json_schema", "json_object", "regex", "grammar", "lark", "choice"). vLLM's
        `guided_*` and `structured_outputs` fields and SGLang's `ebnf` / `json_schema` map onto
        agentrt's own; a schema given to `guided_json` / `structured_outputs.json` / SGLang's
        `json_schema` is compiled as `response_format` with `strict: true` (objects closed, as the
        xgrammar backends of vLLM and SGLang do); a grammar given to `guided_grammar` /
        `structured_outputs.grammar` is EBNF when it has a `::=` rule and Lark otherwise (as vLLM
        decides)."""
        given: list[tuple[str, str, Any]] = []
        if response_format is not None and response_format.type != "text":
            given.append(("response_format", response_format.type, None))
        for name in ("regex", "grammar", "lark", "choice"):
            if getattr(self, name) is not None:
                given.append((name, name, getattr(self, name)))
        aliases = {
            "guided_json": "json_schema",
            "guided_regex": "regex",
            "guided_choice": "choice",
            "guided_grammar": "grammar",
            "ebnf": "grammar",
            "json_schema": "json_schema",
        }
        for name, kind in aliases.items():
            value = getattr(self, name, None)
            if value is not None:
                given.append((name, _grammar_kind(value) if name == "guided_grammar" else kind, value))
        if getattr(self, "sql", None) is not None:
            given.append(("sql", "sql", self.sql))
        so = getattr(self, "structured_outputs", None)
        if so is not None:
            for name, kind, value in (
                ("json", "json_schema", so.json_),
                ("regex", "regex", so.regex),
                ("choice", "choice", so.choice),
            ):
                if value is not None:
                    given.append((f"structured_outputs.{name}", kind, value))
            if so.grammar is not None:
                given.append(("structured_outputs.grammar", _grammar_kind(so.grammar), so.grammar))
            if so.json_object:
                given.append(("structured_outputs.json_object", "json_object", None))
        if given:
            _check_whitespace_pattern(self)
        return given


def _grammar_kind(grammar: Any) -> str:
    """ "grammar" (EBNF) when `grammar` has a `::=` rule, else "lark" (vLLM's rule of thumb)."""
    return "grammar" if not isinstance(grammar, str) or "::=" in grammar else "lark"


MAX_WHITESPACE_PATTERN_CHARS = 32
"""The longest whitespace pattern compiled (with no counted repetition, its compile is tiny)."""


def _check_whitespace_pattern(req: Any) -> None:
    """vLLM's `guided_whitespace_pattern` / `structured_outputs.whitespace_pattern`: the regex of
    the whitespace between JSON tokens. agentrt writes JSON with the fixed separators ", " and ": "
    and nothing elsewhere, so a pattern is honoured exactly when it matches both "" and " ";
    any other pattern is a 400 (never output the pattern would not allow)."""
    so = getattr(req, "structured_outputs", None)
    for name, pattern in (
        ("guided_whitespace_pattern", getattr(req, "guided_whitespace_pattern", None)),
        ("structured_outputs.whitespace_pattern", so.whitespace_pattern if so is not None else None),
    ):
        if pattern is None:
            continue
        if len(pattern) > MAX_WHITESPACE_PATTERN_CHARS or "{" in pattern:
            raise APIError(  # compiling nested counted repeats can take gigabytes: never compiled
                f"{name} must be at most {MAX_WHITESPACE_PATTERN_CHARS} characters without counted "
                "repetition ({m,n}); e.g. '[ ]?' or '[\\n\\t ]*'",
                param=name,
            )
        try:
            ok = regex.fullmatch(pattern, "") is not None and regex.fullmatch(pattern, " ") is not None
        except regex.error as e:
            raise APIError(f"{name} is not a valid regex: {e}", param=name) from None
        if not ok:
            raise APIError(
                f"{name} {pattern!r} cannot be honoured: agentrt writes JSON with the fixed separators "
                "', ' and ': ' (no other whitespace), so the pattern must match both '' and ' '",
                param=name,
            )


class RequestConstraint(NamedTuple):
    """A request's constraint: `spec` (None: unconstrained), `field` the request field that gave it
    ("response_format", "regex", ...; "" when none) and `param` the field to name when the spec fails
    to compile (e.g. "response_format.json_schema.schema")."""

    spec: ConstraintSpec | None
    field: str
    param: str


_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "tokenize",
        "chat_template",
        "continue_final_message",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # checked with or without tools
    # extension: false leaves tool calls unconstrained (parsed only), for A/B benchmarks
    tool_call_constraint: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    logprobs: bool | None = None
    # reasoning models (api/reasoning.py): vLLM's chat_template_kwargs (e.g. enable_thinking) and
    # thinking_token_budget, OpenAI's reasoning_effort
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    reasoning_effort: str | None = None
    unsupported_fields: ClassVar[tuple[str, ...]] = ("functions", "function_call")

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, checked: the names the server sets itself (messages, tools, ...)
        are a 400 naming the field."""
        kwargs = dict(self.chat_template_kwargs or {})
        taken = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise APIError(
                f"chat_template_kwargs may not set {', '.join(taken)} (the server sets them)",
                param="chat_template_kwargs",
            )
        return kwargs

    def num_logprobs(self) -> int | None:
        """`logprobs: true` asks for each token's logprob, `top_logprobs` (0..20, OpenAI's limit) for
        that many alternatives too; top_logprobs without logprobs: true is a 400 (as OpenAI)."""
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(
                    f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.top_logprobs}",
                    param="top_logprobs",
                )
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


class CompletionRequest(_CommonRequest):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = 16
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None
    logprobs: int | None = None  # any value, 0 included, asks for logprobs
    unsupported_fields: ClassVar[tuple[str, ...]] = ("echo", "best_of", "suffix")
    unsupported_noop: ClassVar[dict[str, tuple]] = {"best_of": (1,)}

    def num_logprobs(self) -> int | None:
        """`logprobs: k` asks for each token's logprob and the k most likely tokens (OpenAI's legacy
        limit is 5; up to 20 accepted, as chat's top_logprobs). `top_logprobs` is chat's field: a 400
        naming it, pointing to `logprobs`."""
        if self.top_logprobs is not None:
            raise APIError(
                "top_logprobs is not a completions field: ask with logprobs (an integer, the number of "
                "alternatives)",
                param="top_logprobs",
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(
                f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}", param="logprobs"
            )
        return self.logprobs


def usage(*outs: RequestOutput, reasoning: bool = False) -> dict:
    """OpenAI's `usage` object of finished outputs (tokens): the choices of one request share its
    prompt, counted once (with its cached tokens, as the first choice found them); completion
    tokens are summed over the choices; `prompt_tokens_details.cached_tokens_by_tier` (device / host
    / disk) appears when a lower KV tier served some of them. reasoning: a reasoning model's request, whose
    `completion_tokens_details.reasoning_tokens` counts the reasoning (markers included)."""
    n = sum(len(out.token_ids) for out in outs)
    prompt = outs[0].num_prompt_tokens
    body = {
        "prompt_tokens": prompt,
        "completion_tokens": n,
        "total_tokens": prompt + n,
        "prompt_tokens_details": {"cached_tokens": outs[0].num_cached_tokens},
    }
    tiers = outs[0].cached_tokens_by_tier
    if tiers:  # some of the cached tokens came back from a lower KV tier (runtime/kv_tiers.py)
        lower = {t: tiers.get(t, 0) for t in ("host", "disk")}
        device = outs[0].num_cached_tokens - sum(lower.values())
        body["prompt_tokens_details"]["cached_tokens_by_tier"] = {"device": device, **lower}
    if reasoning:
        body["completion_tokens_details"] = {"reasoning_tokens": sum(o.num_reasoning_tokens for o in outs)}
    return body


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize body: a `prompt` (text, tokenized as /v1/completions does) or chat
    `messages` (rendered by the chat template as /v1/chat/completions does, with `tools`)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize body: token ids -> text."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


def _utf8(text: str) -> bool:
    """Whether text encodes as UTF-8 (JSON lets a client send a lone surrogate, "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
