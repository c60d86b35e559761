"""Extraction over the in-process engine: many documents, a bounded in-flight window, results as
they complete (the engine of `LLM.extract_batch` and of `agentrt extract`).

The driver keeps up to `max_in_flight` documents submitted to the engine (`Engine.make_request` +
`enqueue`, one compiled grammar shared by every document of a schema) and calls `Engine.step()`
until one finishes, so the continuous batcher always has work and the prefix cache holds the
shared system prompt + schema; inputs are pulled from the iterable only as slots free up.
One document never stops the others: a prompt beyond the context limit, an output cut by
max_tokens or failed by the engine is an error result. A schema that cannot be compiled or
enforced raises ConstraintError before any document runs (per-document schemas: an error result).
Closing the iterator (or an exception in the caller, e.g. KeyboardInterrupt) aborts the documents
in flight, freeing their KV and grammar state.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from agentrt.errors import AgentrtError, ConstraintError, ContextLengthError, InvalidRequestError
from agentrt.extract.confidence import below, field_confidence, token_ends_from_ids
from agentrt.extract.prompt import PromptTemplate, prompt_messages
from agentrt.extract.types import DEFAULT_MAX_TOKENS, ExtractInput, ExtractResult, Usage
from agentrt.extract.validate import SchemaValidators, judge
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.request import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


def extraction_params(sampling_params: SamplingParams | None) -> SamplingParams:
    """The sampling parameters of an extraction: greedy with DEFAULT_MAX_TOKENS and runaway-value
    repair (repetition_repair) unless given, and token logprobs of the sampled token (for
    confidence)."""
    params = sampling_params or SamplingParams(
        temperature=0.0, max_tokens=DEFAULT_MAX_TOKENS, repetition_repair=True
    )
    if params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)
    return params


@dataclass
class _Schema:
    schema: dict
    spec: ConstraintSpec | None = None
    compiled: Any = None
    error: ConstraintError | None = None
    unclosable: str | None = None  # why max_tokens_policy "close" cannot run on it (checked once)
    checked_close: bool = False


class SchemaRegistry:
    """Compiled grammars and validators of an engine's extraction schemas, keyed by schema text."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.validators = SchemaValidators()
        self._schemas: dict[str, _Schema] = {}

    def prepare(self, schema: dict) -> _Schema:
        """Compile `schema` (strict: closed objects, as OpenAI strict mode) or fetch it; a schema
        that cannot be compiled or enforced is remembered with its ConstraintError."""
        spec_error = None
        try:
            spec = ConstraintSpec.json_schema(schema, strict=True)
        except ConstraintError as e:
            spec, spec_error = None, e
        key = spec.key if spec is not None else repr(schema)
        entry = self._schemas.get(key)
        if entry is None:
            entry = self._schemas[key] = _Schema(schema, spec, error=spec_error)
            if spec is not None:
                try:
                    entry.compiled = self.engine.grammar.compile(spec)
                except ConstraintError as e:
                    entry.error = e
        return entry

    def params_for(self, entry: _Schema, params: SamplingParams) -> SamplingParams:
        """`params`, or under max_tokens_policy "close" on a schema the closing-path planner cannot
        close from its start (e.g. a long minLength or a repeating pattern: it gives up in free
        text) the same with "length": its rows then run as with `--max-tokens-policy length`
        instead of every row failing (logged once per schema)."""
        if params.max_tokens_policy != "close" or entry.compiled is None:
            return params
        if not entry.checked_close:
            entry.checked_close = True
            grammar = self.engine.grammar
            matcher = grammar.new_matcher(entry.compiled, params.stop_token_ids or ())
            if grammar.planner.closing_path(matcher) is None:
                entry.unclosable = grammar.planner.failure or "no closing path"
                logger.warning(
                    "the length-safe policy cannot close this schema (%s): its rows run with "
                    "max_tokens_policy length (cut at max_tokens)",
                    entry.unclosable,
                )
        return dataclasses.replace(params, max_tokens_policy="length") if entry.unclosable else params

    def require(self, schema: dict) -> _Schema:
        """`prepare`, raising the schema's ConstraintError (keyword + JSON pointer) when it has one."""
        entry = self.prepare(schema)
        if entry.error is not None:
            raise entry.error
        return entry


def run_batch(
    engine,
    chat_ids: Callable[[list[dict[str, str]]], list[int]],
    inputs: Iterable[str | ExtractInput],
    schema: dict | None,
    *,
    sampling_params: SamplingParams | None = None,
    max_in_flight: int | None = None,
    prompt: PromptTemplate | None = None,
    min_confidence: float | None = None,
    registry: SchemaRegistry | None = None,
) -> Iterator[ExtractResult]:
    """Results of `inputs` in completion order (see the module docstring). chat_ids: messages ->
    prompt token ids (the chat template). max_in_flight: documents submitted at once (default twice
    the engine's max_num_seqs). Raises ConstraintError for a `schema` that cannot be compiled or
    enforced and InvalidRequestError for invalid sampling values, both before anything runs, and
    ValueError for max_in_flight < 1."""
    params = extraction_params(sampling_params)
    params.validate(engine.vocab_size)
    window = max_in_flight if max_in_flight is not None else 2 * engine.config.scheduler.max_num_seqs
    if window < 1:
        raise ValueError(f"max_in_flight must be >= 1, got {window}")
    registry = registry or SchemaRegistry(engine)
    default = registry.require(schema) if schema is not None else None
    return _drive(engine, chat_ids, inputs, default, registry, params, window, prompt, min_confidence)


def _drive(engine, chat_ids, inputs, default, registry, params, window, prompt, min_confidence):
    in_flight: dict[str, tuple[int, ExtractInput, _Schema]] = {}
    source = iter(enumerate(inputs))
    exhausted = False
    try:
        while True:
            while not exhausted and len(in_flight) < window:
                nxt = next(source, None)
                if nxt is None:
                    exhausted = True
                    break
                index, inp = nxt
                inp = inp if isinstance(inp, ExtractInput) else ExtractInput(inp)
                done = _submit(engine, chat_ids, index, inp, default, registry, params, prompt, in_flight)
                if done is not None:
                    yield done
            if not in_flight:
                return
            for out in engine.step():
                if out.finished and out.request_id in in_flight:
                    index, inp, entry = in_flight.pop(out.request_id)
                    yield _result(engine, index, inp, entry, registry, out, min_confidence)
    finally:
        for rid in list(in_flight):
            engine.abort(rid)


def _failed(index: int, inp: ExtractInput, error: str, failure: str, prompt_tokens: int = 0) -> ExtractResult:
    return ExtractResult(
        index, inp.id, error=error, failure=failure, usage=Usage(prompt_tokens=prompt_tokens), gold=inp.gold
    )


def _submit(engine, chat_ids, index, inp, default, registry, params, prompt, in_flight):
    """Queue one document; its result when it fails before running, else None."""
    if inp.error is not None:
        return _failed(index, inp, inp.error, "input")
    if not isinstance(inp.text, (str, list)):
        return _failed(
            index, inp, f"the document text must be a string, got {type(inp.text).__name__}", "input"
        )
    entry = registry.prepare(inp.schema) if inp.schema is not None else default
    if entry is None:
        return _failed(index, inp, "no schema: give extract_batch a schema or the input one", "input")
    if entry.error is not None:
        return _failed(index, inp, str(entry.error), "schema")
    msgs = inp.text if isinstance(inp.text, list) else prompt_messages(inp.text, entry.schema, prompt)
    ids = chat_ids(msgs)
    try:
        req = engine.make_request(ids, registry.params_for(entry, params), entry.spec)
    except ContextLengthError as e:
        return _failed(index, inp, f"the document does not fit the context: {e}", "context_length", len(ids))
    except InvalidRequestError as e:
        return _failed(index, inp, str(e), "input", len(ids))
    out = engine.enqueue(req, entry.compiled)
    if out is not None:
        return _result(engine, index, inp, entry, registry, out, None)
    in_flight[req.request_id] = (index, inp, entry)
    return None


def _result(engine, index, inp, entry, registry, out: RequestOutput, min_confidence) -> ExtractResult:
    usage = Usage(out.num_prompt_tokens, len(out.token_ids), out.num_cached_tokens)
    res = ExtractResult(
        index,
        inp.id,
        finish_reason=out.finish_reason,
        usage=usage,
        text=out.text,
        gold=inp.gold,
        repaired=list(out.repaired),
        closed_by_budget=out.closed_by_budget,
    )
    if out.finish_reason == "error":
        res.error = str(out.error) if out.error is not None else "the request failed without a reason"
        res.failure = "schema" if isinstance(out.error, ConstraintError) else "error"
    else:
        validator = registry.validators.get(entry.schema)
        res.output, res.valid, res.error, res.failure = judge(
            out.text, out.finish_reason, validator, len(out.token_ids)
        )
        res.confidence = output_confidence(engine.tokenizer, out) if res.output is not None else None
    if min_confidence is not None:  # a budget close forces values at confidence 1.0: review it anyway
        res.needs_review = bool(below(res.confidence, min_confidence)) or res.closed_by_budget
    return res


def output_confidence(tokenizer, out: RequestOutput) -> dict[str, float] | None:
    """Per-field confidence of a finished JSON output from its token logprobs (None when the engine
    reported none, or the tokens do not decode to the output text)."""
    logprobs = out.logprobs
    if not logprobs or len(logprobs) != len(out.token_ids):
        return None
    ends = token_ends_from_ids(tokenizer, out.token_ids)
    if not ends or ends[-1] != len(out.text):
        return None
    try:
        return field_confidence(out.text, ends, [t.logprob for t in logprobs])
    except (ValueError, AgentrtError):
        return None
