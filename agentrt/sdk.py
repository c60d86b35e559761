"""Python SDK: an in-process engine (no server) for generation, chat and structured extraction."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrt.errors import IncompleteOutputError, InternalError
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.runtime.chat_template import chat_prompt_ids
from agentrt.runtime.config import DEFAULT_MODEL, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from agentrt.extract.prompt import PromptTemplate
    from agentrt.extract.types import ExtractInput, ExtractResult

Messages = list[dict[str, str]]


@dataclass
class SQLResult:
    """What `LLM.sql` gives back. query: the generated SQL; valid: it passed every check run;
    error / stage: why not ("length": it did not end within max_tokens; else a stage of
    agentrt/sql/validate.Validation: "parse", "read_only", "schema", "database", or "connection":
    the database could not be reached, no verdict on the query); checked_database: the database
    itself checked it (EXPLAIN); rows: the result (agentrt.sql.validate.QueryResult:
    columns, rows, truncated) with execute=True, else None."""

    query: str
    valid: bool
    error: str | None = None
    stage: str | None = None
    checked_database: bool = False
    rows: Any = None


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
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = SchedulerConfig.max_num_seqs,
        grammar: GrammarConfig | None = None,
    ):
        self.engine = Engine(
            EngineConfig(
                model=ModelConfig(model=model, device=device, dtype=dtype, max_model_len=max_model_len),
                cache=CacheConfig(kv_cache_bytes=kv_cache_bytes, kv_cache_dtype=kv_cache_dtype),
                scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
                grammar=grammar or GrammarConfig(),
            )
        )
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over an engine built from `config` (every engine option, as `agentrt serve` takes)."""
        return cls.from_engine(Engine(config))

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """An LLM over an existing engine (not copied: its cache and requests are shared)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm.tokenizer = engine.tokenizer
        return llm

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

    def extract_batch(
        self,
        inputs: Iterable[str | ExtractInput],
        schema: dict | type | None,
        *,
        sampling_params: SamplingParams | None = None,
        max_in_flight: int | None = None,
        prompt: PromptTemplate | str | None = None,
        min_confidence: float | None = None,
    ) -> Iterator[ExtractResult]:
        """Extract `schema` from many documents, yielding one ExtractResult per input AS IT
        COMPLETES (index/id, output dict, valid, error, finish_reason, usage, confidence); never
        raises for one bad document (too long for the context, cut by max_tokens, failed): that is a
        result with valid=False and the reason. inputs: document texts, conversations, or
        ExtractInput (id, a per-document schema, ...), pulled lazily: at most `max_in_flight`
        (default 2 x max_num_seqs) run at once, continuously batched (agentrt/extract/batch.py).
        prompt: a PromptTemplate or template text with {text} and {schema} (default: the schema
        in a system message, the text as the user message; agentrt/extract/prompt.py). Greedy with
        max_tokens 512 unless `sampling_params` says otherwise. min_confidence: mark results whose
        least confident field is below it (needs_review). Raises ValueError when `schema` is not a
        JSON Schema (or pydantic model class), ConstraintError (keyword + JSON pointer) when it
        cannot be compiled or enforced, InvalidRequestError for invalid sampling values: all before
        any document runs. Closing the iterator early aborts the documents in flight."""
        from agentrt.extract.batch import run_batch
        from agentrt.extract.prompt import PromptTemplate

        schema_dict = _schema_of(schema)[0] if schema is not None else None
        template = PromptTemplate.parse(prompt) if isinstance(prompt, str) else prompt
        return run_batch(
            self.engine,
            self._chat_ids,
            inputs,
            schema_dict,
            sampling_params=sampling_params,
            max_in_flight=max_in_flight,
            prompt=template,
            min_confidence=min_confidence,
        )

    def sql(
        self,
        question: str,
        database: Any,
        *,
        dialect: str | None = None,
        tables: list[str] | None = None,
        execute: bool = False,
        max_rows: int = 1000,
        timeout_s: float = 10.0,
        max_tokens: int = 256,
        sampling_params: SamplingParams | None = None,
    ) -> SQLResult:
        """A read-only SQL query answering `question`, generated under the schema-aware grammar
        (agentrt/sql/: only the database's tables and columns, in its dialect) with the prompt of
        agentrt/sql/service.py, then checked: parsed by sqlglot, its names looked up in the schema
        and, for a live database, `EXPLAIN`ed by the database itself. A query that fails a check is
        returned with `valid=False` and the reason, never as good SQL.

        database: a URL (sqlite:///PATH, duckdb:///PATH, postgresql://...) or a SQLAlchemy Engine
        (introspected, opened read-only), or a schema without a connection (CREATE TABLE text, JSON
        {table: {column: type}} as a dict or text; `dialect` says its dialect, default SQLite).
        tables: only these tables of it (Schema.subset: foreign keys among them kept), for a
        database over the grammar's table limit or to keep the prompt short.
        execute: run the query read-only on the database (at most `max_rows` rows, `timeout_s`
        seconds); needs a live database. Greedy decoding unless `sampling_params` says otherwise.
        A database that cannot be reached for the check or the run gives stage "connection" with
        checked_database False (no verdict on the query).
        Raises SchemaError (a ValueError) for a schema or database that cannot be read or used, or
        a table in `tables` it lacks, and ValueError for execute without a database or a negative
        max_rows, before anything is generated."""
        from agentrt.sql.dialect import dialect_name
        from agentrt.sql.introspect import dialect_of, introspect, open_database
        from agentrt.sql.service import sql_constraint, sql_messages
        from agentrt.sql.sources import load_schema
        from agentrt.sql.validate import QueryError, validate
        from agentrt.sql.validate import execute as run_query

        if max_rows < 0:
            raise ValueError(f"max_rows must be >= 0, got {max_rows}")
        owned = isinstance(database, str) and database.strip().split("\n", 1)[0].count("://") == 1
        owned = owned and not database.strip().upper().startswith("CREATE")
        engine = open_database(database.strip()) if owned else None
        if engine is None and hasattr(database, "dialect") and hasattr(database, "connect"):
            engine = database  # a SQLAlchemy Engine
        if execute and engine is None:
            raise ValueError("execute=True needs a database (a URL or a SQLAlchemy Engine), not a schema")
        try:
            if engine is not None:
                schema, d = introspect(engine), dialect_of(engine)
            else:
                schema = load_schema(database, dialect)
                d = dialect_name(dialect or schema.dialect or "sqlite")
            if tables is not None:
                schema = schema.subset(list(tables))
            spec = sql_constraint(schema, d)
            params = sampling_params or SamplingParams(
                temperature=0.0, max_tokens=max_tokens, max_tokens_policy="close"
            )
            out = self._run([(self._chat_ids(sql_messages(question, schema, d)), params, spec)])[0]
            if out.finish_reason != "stop":
                return SQLResult(
                    out.text, False, f"the query did not end within {len(out.token_ids)} tokens", "length"
                )
            check = validate(out.text, schema, d, engine, timeout_s=timeout_s)
            if not check.ok or not execute:
                return SQLResult(out.text, check.ok, check.error, check.stage, check.checked_database)
            try:
                rows = run_query(out.text, engine, schema, max_rows=max_rows, timeout_s=timeout_s)
            except QueryError as e:
                stage = e.stage or "database"
                return SQLResult(out.text, False, e.message, stage, stage != "connection")
            return SQLResult(out.text, True, None, None, True, rows)
        finally:
            if owned:
                engine.dispose()

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
        return chat_prompt_ids(self.tokenizer, messages)
