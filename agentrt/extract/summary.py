"""The end-of-job summary of `agentrt extract`: rows, valid, failures by reason, tokens/s, prefix-cache
hit share, wall time and, with gold outputs, field accuracy (exact match per leaf JSON pointer)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from agentrt.extract.confidence import escape_pointer_token
from agentrt.extract.types import ExtractResult

_MISSING = object()


def gold_leaves(gold: Any, pointer: str = "") -> dict[str, Any]:
    """JSON pointer -> value of every leaf of `gold` (values other than objects and arrays; an empty
    object or array is a leaf itself: it must be matched as a whole)."""
    if isinstance(gold, dict) and gold:
        out: dict[str, Any] = {}
        for k, v in gold.items():
            out.update(gold_leaves(v, f"{pointer}/{escape_pointer_token(str(k))}"))
        return out
    if isinstance(gold, list) and gold:
        out = {}
        for i, v in enumerate(gold):
            out.update(gold_leaves(v, f"{pointer}/{i}"))
        return out
    return {pointer: gold}


def resolve(doc: Any, pointer: str) -> Any:
    """The value at an RFC 6901 pointer, or _MISSING."""
    if pointer == "":
        return doc
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(doc, dict) and token in doc:
            doc = doc[token]
        elif isinstance(doc, list) and token.isdigit() and int(token) < len(doc):
            doc = doc[int(token)]
        else:
            return _MISSING
    return doc


def same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but True is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


class JobSummary:
    """Counts of one run of a job; `add` each result, then `as_dict`."""

    def __init__(self) -> None:
        self.rows = self.valid = 0
        self.failures: Counter[str] = Counter()
        self.needs_review = 0
        self.repaired_rows = 0  # rows with a value closed by runaway-value repair
        self.closed_rows = 0  # rows the length-safe policy closed because the budget ran short
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.fields: dict[str, list[int]] = {}  # pointer -> [exact matches, rows with gold there]

    def add(self, r: ExtractResult) -> None:
        self.rows += 1
        self.valid += r.valid
        if not r.valid:
            self.failures[r.failure or "error"] += 1
        self.needs_review += bool(r.needs_review)
        self.repaired_rows += bool(r.repaired)
        self.closed_rows += r.closed_by_budget
        self.prompt_tokens += r.usage.prompt_tokens
        self.completion_tokens += r.usage.completion_tokens
        self.cached_tokens += r.usage.cached_tokens
        if r.gold is not None:
            output = r.output if r.valid else None
            for pointer, want in gold_leaves(r.gold).items():
                got = resolve(output, pointer) if output is not None else _MISSING
                acc = self.fields.setdefault(pointer, [0, 0])
                acc[0] += got is not _MISSING and same(got, want)
                acc[1] += 1

    def field_accuracy(self) -> dict[str, Any] | None:
        """{"overall": share, "per_field": {pointer: share}} over rows with gold (None without any)."""
        if not self.fields:
            return None
        hit = sum(a for a, _ in self.fields.values())
        total = sum(n for _, n in self.fields.values())
        return {
            "overall": round(hit / total, 4),
            "per_field": {p: round(a / n, 4) for p, (a, n) in sorted(self.fields.items())},
        }

    def as_dict(self, wall_s: float, **extra: Any) -> dict[str, Any]:
        wall = max(wall_s, 1e-9)
        d = {
            "rows": self.rows,
            "valid": self.valid,
            "failed": self.rows - self.valid,
            "failed_by_reason": dict(sorted(self.failures.items())),
            "repaired_rows": self.repaired_rows,
            "closed_by_budget_rows": self.closed_rows,
            "wall_s": round(wall_s, 3),
            "docs_per_s": round(self.rows / wall, 4),
            "valid_docs_per_s": round(self.valid / wall, 4),
            "completion_tokens": self.completion_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens_per_s": round(self.completion_tokens / wall, 2),
            "prefix_cache_hit_share": round(self.cached_tokens / self.prompt_tokens, 4)
            if self.prompt_tokens
            else None,
        }
        d.update(extra)
        acc = self.field_accuracy()
        if acc is not None:
            d["field_accuracy"] = acc
        return d

    def lines(self, d: dict[str, Any]) -> list[str]:
        """The summary in a few human-readable lines."""
        failed = ", ".join(f"{k} {v}" for k, v in d["failed_by_reason"].items()) or "none"
        hit = d["prefix_cache_hit_share"]
        out = [
            (
                f"rows {d['rows']}: valid {d['valid']}, failed {d['failed']} ({failed}), repaired "
                f"{d['repaired_rows']}, closed by the token budget {d['closed_by_budget_rows']}"
            ),
            f"wall {d['wall_s']:.1f} s, {d['docs_per_s']:.2f} docs/s, {d['completion_tokens_per_s']:.1f} "
            f"completion tokens/s, prefix-cache hit share " + (f"{hit:.1%}" if hit is not None else "n/a"),
        ]
        if "field_accuracy" in d:
            out.append(f"field accuracy {d['field_accuracy']['overall']:.1%} (per field in the summary file)")
        return out
