"""Constraint specifications: what a request asks its output to satisfy. No backend imports."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from agentrt.errors import ConstraintError

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar", "lark", "choice", "tool_calls"]


@dataclass(frozen=True)
class GrammarConfig:
    """any_whitespace: let JSON grammars accept whitespace between tokens; when False the output is
    compact with fixed separators (`{"a": 1, "b": [2, 3]}`), so whitespace is bounded by design.
    max_whitespace_cnt: with any_whitespace, the most whitespace characters in one gap.
    indent: pretty-print JSON with this indent (newlines + spaces, still a fixed layout) instead
    of the compact one-line layout.
    compile_threads: worker threads that compile grammars off the engine loop (default: one per 4
    CPU cores, at least 1), at scheduling priority `compile_nice` (Linux nice, per thread: the
    engine loop keeps the CPU); see grammars/compile_queue.py.
    cache_size, cache_bytes: compiled grammars kept (LRU) while both hold: at most `cache_size` of
    them, at most `cache_bytes` of their memory (xgrammar's `memory_size_bytes`, measured with a 49k vocabulary: 0.12 MB
    for a small JSON Schema, 0.25-2 MB for `[a-z]{1,n}`; bytes, not the count, bound a cache of
    many distinct grammars).
    compile_timeout_s: a constraint whose compile has run this long is refused (400) when the
    compile used at least a tenth of it in CPU time, else answered 503 (retryable: a busy server);
    with compile_in_child the compile is killed then; otherwise the compile thread finishes in the
    background and its result is dropped, a new thread takes its place meanwhile, and while max(2, compile_threads) such compiles are still running new
    constraints are refused (503) rather than queued behind them.
    compile_queue_timeout_s: a compile still waiting for a thread after this long is answered 503.
    compile_in_child: compile in a child process that is killed at `compile_timeout_s`
    (grammars/compile_child.py; a helper process of ~300 MB starts with the backend; the whole
    pipeline, conversion and finite check included, runs in the child). Off (the
    library default; `agentrt serve` turns it on), a compile past its limit keeps its thread
    until it ends.
    compile_memory_bytes: with compile_in_child, how far a compile child's address space may grow
    (RLIMIT_AS over the helper's; None: no limit): a constraint whose compile needs more is refused
    (400) instead of taking the machine's memory (xgrammar has run out of memory past 8 GB on
    one schema-aware SQL grammar's serialization).
    compile_relief_s: a compile still waiting after this long moves to a relief worker at the
    process's own priority (None: never), so a saturated engine cannot starve compiles.
    max_constraint_bytes: a schema/regex/grammar text longer than this is refused (400).
    jump_forward: append the tokens of grammar-forced text without sampling them (see
    Engine._jump_forward)."""

    any_whitespace: bool = False
    max_whitespace_cnt: int = 2
    indent: int | None = None
    compile_threads: int = max(1, (os.cpu_count() or 2) // 4)
    compile_nice: int = 10
    cache_size: int = 512
    cache_bytes: int = 128 << 20
    compile_timeout_s: float = 30.0
    compile_queue_timeout_s: float = 30.0
    compile_relief_s: float | None = 5.0
    compile_in_child: bool = False
    compile_memory_bytes: int | None = 4 << 30
    jump_forward: bool = True
    max_constraint_bytes: int = 1 << 20


@dataclass(frozen=True)
class ConstraintSpec:
    """A constraint as the user gave it. `value` is a canonical string: JSON text of the schema
    (key order kept: property order decides output order) or of the choice list; the regex; the
    EBNF text (GBNF-style, root rule `root`); the Lark text (start rule `start`). Build with the
    classmethods, which raise ConstraintError (a ValueError; `param` None: the API layer names the
    request field) naming the problem when the input is not a valid constraint. A spec whose text
    is not valid Unicode (a lone surrogate such as JSON's "\\ud800", which has no UTF-8) is
    refused the same way, whichever way it is built."""

    kind: ConstraintKind
    value: str
    strict: bool | None = None
    reasoning: str = ""
    """"" or a reasoning model's format and mode (grammars/reasoning.py `ReasoningFormat.as_json`):
    the constraint then applies to the answer after the model's free reasoning."""

    def __post_init__(self):
        _check_unicode(self.kind, self.value)

    @property
    def key(self) -> str:
        """Cache key: a hash of kind, value and options."""
        text = f"{self.kind}\0{self.strict}\0{self.value}" + (f"\0{self.reasoning}" if self.reasoning else "")
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def json_schema(
        cls, schema: Any, strict: bool | None = None, max_bytes: int | None = None
    ) -> ConstraintSpec:
        """Checks `schema` against its draft's meta-schema (default draft 2020-12), including the
        `regex` format of `pattern`. Raises ConstraintError("... is not a valid JSON Schema: ..."),
        and ConstraintError("json_schema constraint is N bytes, over the M-byte limit") when its
        compact JSON is over `max_bytes` (GrammarConfig.max_constraint_bytes), checked before the
        meta-schema check, whose cost grows with the schema (~0.4 ms per property).

        strict: None (default) follows the spec (objects open unless `additionalProperties`
        closes them) and refuses keywords that cannot be enforced; True also closes every object
        (OpenAI strict mode); False is best-effort: unenforceable keywords are dropped and reported
        (see grammars/json_schema/)."""
        import jsonschema
        from jsonschema.validators import validator_for

        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ConstraintError(f"schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError(f"schema must be a JSON object, got {type(schema).__name__}")
        try:
            value = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        except RecursionError:
            raise ConstraintError("schema is nested too deeply to be checked") from None
        except (TypeError, ValueError) as e:  # (not from JSON: a non-string key, NaN is fine)
            raise ConstraintError(f"schema is not JSON: {e}") from None
        try:
            size = len(value.encode())
        except UnicodeEncodeError:  # JSON's "\ud800" escapes decode to a lone surrogate
            raise ConstraintError(f"schema is not valid Unicode text: {_lone_surrogate(schema)}") from None
        if max_bytes is not None and size > max_bytes:
            raise ConstraintError(f"json_schema constraint is {size} bytes, over the {max_bytes}-byte limit")
        validator = validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            validator.check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "/" + "/".join(str(p) for p in e.absolute_path)
            raise ConstraintError(f"schema is not a valid JSON Schema: at {where}: {e.message}") from None
        except RecursionError:
            raise ConstraintError("schema is nested too deeply to be checked") from None
        except OverflowError as e:  # re.compile in the `regex` format check: a{1,4294967295}
            raise ConstraintError(f"schema is not a valid JSON Schema: a pattern's {e}") from None
        return cls("json_schema", value, strict)

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> ConstraintSpec:
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError("regex must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> ConstraintSpec:
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise ConstraintError("grammar must be a non-empty EBNF string with a `root` rule")
        return cls("grammar", ebnf)

    @classmethod
    def lark(cls, grammar: str) -> ConstraintSpec:
        """A Lark grammar (start rule `start`), converted to EBNF by grammars/lark_grammar.py."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise ConstraintError("lark grammar must be a non-empty string with a `start` rule")
        return cls("lark", grammar)

    @classmethod
    def choice(cls, choices: list[str]) -> ConstraintSpec:
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ConstraintError("choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(choices, ensure_ascii=False))

    @classmethod
    def tool_calls(cls, plan: str) -> ConstraintSpec:
        """Tool calls in a model's format: `plan` is JSON, in a fixed key order with each tool's
        properties in their declared order (the grammar keeps that order), {"format", "mode" ("auto" |
        "required"), "parallel", "tools": [{"name", "parameters" (a checked JSON Schema), "strict"}]}
        (built by agentrt/api/tools/validation.py; compiled as an xgrammar structural tag, see
        grammars/tool_calls.py)."""
        return cls("tool_calls", plan)


def _lone_surrogate(value: Any) -> str:
    """Where a lone surrogate of a JSON value is, in words: "the key at /properties" or
    "the string at /enum/0" (RFC 6901 pointers), with the code point."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, v = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, child in reversed(list(items)):
            key = str(k).replace("~", "~0").replace("/", "~1")
            if isinstance(k, str) and not _encodes(k):
                return f"the key at {where or '/'} holds a lone surrogate{_code_point(k)}"
            if isinstance(child, str) and not _encodes(child):
                return f"the string at {where}/{key} holds a lone surrogate{_code_point(child)}"
            stack.append((f"{where}/{key}", child))
    return "it holds a lone surrogate"


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _code_point(text: str) -> str:
    c = next(c for c in text if 0xD800 <= ord(c) <= 0xDFFF)
    return f" (U+{ord(c):04X}: write the character itself, or a high-low surrogate pair)"


def _check_unicode(kind: str, text: str) -> None:
    """Raise ConstraintError when `text` holds a surrogate code point (U+D800..U+DFFF: JSON's
    "\\ud800" escapes decode to one), which no UTF-8 encoder, tokenizer or grammar engine accepts."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        what = {"json_schema": "schema", "tool_calls": "tool definitions", "lark": "lark grammar"}.get(
            kind, kind
        )
        raise ConstraintError(
            f"{what} is not valid Unicode text: it holds the lone surrogate U+{ord(text[e.start]):04X} "
            "(write the character itself, or a high-low surrogate pair)"
        ) from None
