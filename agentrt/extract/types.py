"""The records of an extraction job: one input document and one result (the SDK's and the CLI's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_TOKENS = 512
"""Completion tokens per document unless the caller says otherwise."""


@dataclass
class ExtractInput:
    """One document. text: the document (a user message's text) or a whole conversation (a list of
    chat messages, used as is); id: the caller's id, copied into the result; schema: this document's
    JSON Schema (None: the job's schema); error: a document already known to be bad (e.g. an input
    line that is not JSON): yielded as an error result without running; gold: expected output
    (field accuracy), carried through untouched."""

    text: str | list[dict[str, str]] | None
    id: Any = None
    schema: dict | None = None
    error: str | None = None
    gold: Any = None
    schema_name: str | None = None


@dataclass
class Usage:
    """Tokens of one document: prompt_tokens, completion_tokens, and cached_tokens (prompt tokens
    served from the prefix cache)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }


FAILURES = ("input", "context_length", "schema", "length", "invalid", "error", "abort")
"""Why a result is not valid (ExtractResult.failure): input (a bad input row), context_length (the
prompt does not fit), schema (its schema cannot be compiled or enforced), length (the output ran
out of max_tokens), invalid (the output does not validate; should not happen under the grammar),
error (the engine or server failed the request), abort (stopped before it finished)."""


@dataclass
class ExtractResult:
    """One document's outcome. index: its position in the inputs (0-based); id: ExtractInput.id;
    output: the parsed JSON (None when there is none); valid: output validates against the schema
    (jsonschema, format checking on); error: why not (None when valid); failure: a FAILURES
    category (None when valid); finish_reason: the engine's ("stop", "length", "error", "abort"),
    None when it never ran; usage: tokens; confidence: JSON pointer -> probability of each leaf
    value (agentrt/extract/confidence.py), None when no token logprobs were available;
    needs_review: some confidence is below the job's min_confidence (None when none was set); text:
    the raw output text; gold: ExtractInput.gold; repaired: JSON pointers of the values the engine
    closed because they repeated themselves (SamplingParams.repetition_repair; empty: none or off);
    closed_by_budget: under max_tokens_policy "close", the budget ran short and the engine ended the
    JSON on the shortest valid completion (RequestOutput.closed_by_budget): the values written last
    may be cut short, so such a row deserves review even when valid."""

    index: int
    id: Any
    output: Any = None
    valid: bool = False
    error: str | None = None
    failure: str | None = None
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    confidence: dict[str, float] | None = None
    needs_review: bool | None = None
    text: str = ""
    gold: Any = None
    repaired: list[str] = field(default_factory=list)
    closed_by_budget: bool = False

    def row(self) -> dict[str, Any]:
        """The output row of `agentrt extract` (one JSON Lines record)."""
        row = {
            "id": self.id,
            "output": self.output,
            "valid": self.valid,
            "error": self.error,
            "finish_reason": self.finish_reason,
            "usage": self.usage.as_dict(),
            "confidence": self.confidence,
            "repaired": self.repaired,
            "closed_by_budget": self.closed_by_budget,
        }
        if self.needs_review is not None:
            row["needs_review"] = self.needs_review
        return row
