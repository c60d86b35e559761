"""The one adapter to xgrammar: compile specs (cached, off the engine loop), make matchers, fill
and apply token bitmasks.

A compile is `build_constraint`: the spec's text -> xgrammar Grammar (JSON Schema through the
faithful-schema pass and xgrammar's converter, regex / Lark -> EBNF, tool-call structural tags) ->
finite-output check (grammars/finite.py) -> xgrammar's compile. With `compile_in_child` all of it
runs in a child process killed at `compile_timeout_s` (grammars/compile_child.py), so no part of a
client's constraint runs unbounded in the server process; without, on a compile thread.

Bitmasks are int32 tensors [batch, ceil(vocab_size / 32)]; bit j of a row allows token j.
Stop ids are set per matcher (`override_stop_tokens`), so no stop/EOS id is allowed before the
grammar can terminate (xgrammar only admits stop tokens in an accepting state).

Errors: a constraint that cannot be compiled fails its future with `agentrt.errors.ConstraintError`
(keyword/pointer kept from a schema error; `tool_index` set for a tool's parameters).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from agentrt.errors import ConstraintError
from agentrt.grammars.compile_child import Built, CompileTimeout, Zygote
from agentrt.grammars.compile_queue import CompileQueue, compile_timeout_error
from agentrt.grammars.finite import ForcedBound, check_finite
from agentrt.grammars.json_schema import normalize_schema
from agentrt.grammars.json_schema.nodes import put_nodes, take_nodes
from agentrt.grammars.regex import regex_to_ebnf, regex_to_json_string_ebnf
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig

_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


# xgrammar's length-bounded strings (minLength/maxLength) are `name{lo, hi}` over a rule
# `name ::= (([^\"\\\r\n]))`: it admits raw control characters (invalid JSON, seen in a random walk)
# and no escapes. Measured on xgrammar 0.2.9: a counted repetition is fast only when its unit is one
# character class; with an escape alternative in the unit a mask costs 20 ms per token at maxLength
# 32 and 235 ms at 1000 (the plain class: 10 us). So the unit becomes the class of characters JSON
# takes raw (no control characters, quote or backslash); a maxLength string has no escapes, and a
# minLength-only string has its first `lo` - 1 characters raw and escapes after them (`x+` is fast).
# Stricter than the schema (never admits an invalid string), documented in the README.
_BOUNDED_RULE = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_RAW_CHAR = '[^\\0-\\x1f\\"\\\\]'
_JSON_CHAR = f'(({_JSON_RAW_CHAR}) | ("\\\\" [\\"\\\\/bfnrt]))'


def _take_patterns(schema):
    """Swap every `pattern` / `patternProperties` regex for a placeholder xgrammar keeps verbatim.
    xgrammar's own regex conversion inside JSON strings is wrong for an optional group that ends in
    a repetition: measured (0.2.9), `1(?:x[0-9]+)?Z` admits "10Z". The placeholders get EBNF from
    grammars/regex.py (see lark_grammar.py's docstring for the measurements)."""
    patterns: list[str] = []

    def walk(s):
        if isinstance(s, list):
            return [walk(x) for x in s]
        if not isinstance(s, dict):
            return s
        out = {}
        for k, v in s.items():
            if k == "pattern" and isinstance(v, str):
                patterns.append(v)
                out[k] = f"AGENTRTPAT{len(patterns) - 1}X"
            elif k == "patternProperties" and isinstance(v, dict):
                pp = {}
                for pat, sub in v.items():
                    patterns.append(pat)
                    pp[f"AGENTRTPAT{len(patterns) - 1}X"] = walk(sub)
                out[k] = pp
            elif k in ("properties", "$defs") and isinstance(v, dict):
                out[k] = {name: walk(sub) for name, sub in v.items()}
            else:
                out[k] = walk(v)
        return out

    return walk(schema), patterns


def _put_patterns(ebnf: str, patterns: list[str]) -> str:
    for i, pat in enumerate(patterns):
        placeholder = f'Regex("AGENTRTPAT{i}X", json_string=true)'
        if placeholder not in ebnf:
            raise ConstraintError(f"pattern {pat!r} could not be placed in the grammar")
        ebnf = ebnf.replace(placeholder, "(" + regex_to_json_string_ebnf(pat) + ")")
    return ebnf


def _fix_bounded_strings(ebnf: str) -> str:
    names = _BOUNDED_RULE.findall(ebnf)
    if not names:
        return ebnf
    ebnf = _BOUNDED_RULE.sub(lambda m: f"{m.group(1)} ::= {_JSON_RAW_CHAR}", ebnf)
    for name in names:
        # minLength only
        ebnf, n = re.subn(
            rf"\b{name}\{{(\d+), -1\}}", lambda m, name=name: _at_least(name, int(m.group(1))), ebnf
        )
        if n:
            ebnf += f"\n{name}_any ::= {_JSON_CHAR}\n"
    return ebnf


def _at_least(name: str, lo: int) -> str:
    """`lo`+ string characters: the first lo - 1 raw, then one or more of any (escapes included).
    `x+` keeps masks fast; `x{1, 1} x*` measured 26 ms per token in an object."""
    return f"{name}{{{lo - 1}, {lo - 1}}} {name}_any+" if lo > 1 else f"{name}_any+"


def _schema_ebnf(
    schema, strict: bool | None, not_enforced: list[str], ws: dict, plans: list | None = None
) -> str:
    """EBNF (root rule `root`) of a JSON Schema through the faithful pipeline: normalize (refuse or,
    with strict False, drop what cannot be enforced, appending "keyword at pointer" to
    `not_enforced`), xgrammar's converter, then our bounded strings and patterns. With `plans` (a
    list), `uniqueItems` over free strings is kept and its matcher check's plan appended there
    (grammars/unique_items.py; None appended when the schema has none); without, it is refused.
    Raises ConstraintError (UnsupportedSchemaError / UnsatisfiableSchemaError from the normalizer)
    or xgrammar's RuntimeError."""
    best_effort = strict is False
    norm = normalize_schema(
        schema, best_effort=best_effort, close_objects=strict is True, unique_strings=plans is not None
    )
    not_enforced.extend(norm.not_enforced)
    schema = norm.schema
    if plans is not None:
        from agentrt.grammars.unique_items import has_marks, strip_marks, unique_plan

        plan = None
        if has_marks(schema):
            plan = unique_plan(schema, best_effort, not_enforced)
            schema = strip_marks(schema)
        plans.append(plan)
    schema, nodes = take_nodes(schema, ws)  # subschemas with grammars of our own (json_schema/nodes.py)
    schema, patterns = _take_patterns(schema)
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema, ensure_ascii=False), strict_mode=False, **ws)
    return put_nodes(_put_patterns(_fix_bounded_strings(str(grammar)), patterns), nodes, ws)


def _clean_error(e: Exception) -> str:
    """The reason to show for `e`: xgrammar's text without its prefix; never empty or Python's
    own wording for a recursion limit."""
    if isinstance(e, RecursionError):
        return "it is nested too deeply (the converter's recursion limit was reached)"
    text = _XGR_PREFIX.sub("", str(e)).strip()
    return (
        text or f"xgrammar refused it with {type(e).__name__} and no message (e.g. a number beyond 64 bits)"
    )


def _refusal(message: str, cause: Exception) -> ConstraintError:
    """A ConstraintError with `message` that keeps the keyword, pointer and tool index of `cause`
    when it is a ConstraintError (a schema error deep in the constraint)."""
    if isinstance(cause, ConstraintError):
        return ConstraintError(
            message, cause.param, keyword=cause.keyword, pointer=cause.pointer, tool_index=cause.tool_index
        )
    return ConstraintError(message)


def whitespace_options(config: GrammarConfig) -> dict:
    """xgrammar's JSON layout options from `config` (the `ws` argument of `_schema_ebnf`)."""
    ws = {"any_whitespace": config.any_whitespace, "indent": config.indent}
    if config.any_whitespace:
        ws["max_whitespace_cnt"] = config.max_whitespace_cnt
    return ws


def spec_grammar(
    spec: ConstraintSpec, not_enforced: list[str], ws: dict, plans: list | None = None
) -> xgr.Grammar | None:
    """The spec as an xgrammar Grammar whose root rule is `root` (None for an unknown kind).
    Dropped keywords (best effort) are appended to `not_enforced`; a json_schema spec's
    unique-strings plan to `plans` when given (see `_schema_ebnf`; tool arguments never get one).
    Raises ConstraintError, or xgrammar's RuntimeError / ValueError (build_constraint turns them
    into ConstraintError)."""
    if spec.kind == "json_schema":
        ebnf = _schema_ebnf(json.loads(spec.value), spec.strict, not_enforced, ws, plans)
        return xgr.Grammar.from_ebnf(ebnf)
    if spec.kind == "tool_calls":
        from agentrt.grammars.tool_calls import structural_tag

        plan = json.loads(spec.value)
        args = []
        for i, t in enumerate(plan["tools"]):
            dropped: list[str] = []
            try:
                ebnf = _schema_ebnf(t["parameters"], t["strict"], dropped, ws)
                check_finite(ebnf, "root")
            except (RuntimeError, ValueError) as e:
                raise _refusal(_clean_error(e), e).in_tool(i, t["name"]) from None
            not_enforced.extend(f"{d} (tool '{t['name']}')" for d in dropped)
            args.append(ebnf)
        return xgr.Grammar.from_structural_tag(json.dumps(structural_tag(plan, args), ensure_ascii=False))
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **ws)
    if spec.kind == "lark":
        from agentrt.grammars.lark_grammar import lark_to_ebnf

        return xgr.Grammar.from_ebnf(lark_to_ebnf(spec.value), root_rule_name="root")
    if spec.kind == "regex":
        # our converter, not xgrammar's from_regex (which ignores anchors inside a pattern:
        # `ab$c` admits "abc"); a whole-match regex, ^ and $ at its ends optional
        return xgr.Grammar.from_ebnf(f"root ::= {regex_to_ebnf(spec.value)}\n", root_rule_name="root")
    if spec.kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.value, root_rule_name="root")
    if spec.kind == "choice":
        alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in json.loads(spec.value))
        return xgr.Grammar.from_ebnf(f"root ::= {alts}")
    return None


def build_constraint(spec: ConstraintSpec, ws: dict, compiler: xgr.GrammarCompiler) -> Built:
    """All the work of one constraint: the spec's text parsed and converted to an xgrammar Grammar
    (`spec_grammar`: the faithful-schema normalizer and xgrammar's JSON Schema converter, regex /
    Lark -> EBNF, tool-call structural tags), the finite-output check and forced-text bound
    (grammars/finite.py), then `compiler.compile_grammar`. `ws`: `whitespace_options(config)`.
    GrammarBackend runs it in a compile child that is killed at the deadline
    (grammars/compile_child.py), or on the compile thread without one. Raises ConstraintError
    "<kind> constraint cannot be compiled: <reason>", keeping the keyword, JSON pointer and tool
    index of a schema error."""
    not_enforced: list[str] = []
    plans: list = []
    try:
        grammar = spec_grammar(spec, not_enforced, ws, plans)
        if grammar is None:
            raise ConstraintError(f"unknown constraint kind '{spec.kind}'")
        ebnf = str(grammar)
        bound = check_finite(ebnf, "root")
        plan = plans[0] if plans else None
        return Built(compiler.compile_grammar(grammar), ebnf, not_enforced, bound, plan)
    except (RuntimeError, ValueError, TypeError) as e:
        raise _refusal(f"{spec.kind} constraint cannot be compiled: {_clean_error(e)}", e) from None


@dataclass
class CompiledConstraint:
    """grammar: the backend's compiled grammar; not_enforced: keywords dropped under best-effort
    ("keyword at /pointer"); compile_s: wall time of the compile; forced_bound: how long a text the
    grammar can force at once (grammars/finite.py; None: unknown), which decides how jump-forward
    may search it (grammars/jump_forward.py)."""

    grammar: xgr.CompiledGrammar
    not_enforced: list[str] = field(default_factory=list)
    compile_s: float = 0.0
    forced_bound: ForcedBound | None = None
    unique_plan: list | None = None  # the matcher's unique-strings check (grammars/unique_items.py)


class GrammarBackend:
    """Engine-level grammar compiler and bitmask helpers.

    tokenizer: a Hugging Face tokenizer; vocab_size: logits width (model embedding rows), may exceed
    the tokenizer's size; stop_ids: the model's end-of-generation ids.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...], config: GrammarConfig):
        self.config = config
        self.vocab_size = vocab_size
        self.stop_ids = tuple(stop_ids)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids)
        )
        self.info = info
        self._tokenizer = tokenizer
        self._planner = None
        self._jump_finder = None
        self._vocab_bytes = None  # unique_items.VocabBytes, built on first use
        # one xgrammar thread per compile worker: compile concurrency is the worker count
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        # the whole pipeline (spec -> grammar -> finite check -> compile) in killable child
        # processes (grammars/compile_child.py); they meet their own deadline, the queue's limit is
        # a backstop for the work around them here (sending the spec, compiling the grammar again
        # from its text: as long as the child's compile at most, hence the grace of one more limit)
        self._zygote = (
            Zygote(info, config.compile_memory_bytes)
            if config.compile_in_child and hasattr(os, "fork")
            else None
        )
        grace = 1.5 * config.compile_timeout_s if self._zygote is not None else 0.0
        self._queue = CompileQueue(self._compile, config, grace)
        # mask overlap: bitmasks are filled on this thread while the engine runs the forward pass
        # (xgrammar releases the GIL; the rows of a batch are filled by its own thread pool)
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._batch_matcher = xgr.BatchGrammarMatcher(max(1, (os.cpu_count() or 2) // 2))

    def submit(self, spec: ConstraintSpec) -> Future:
        """This caller's future of the CompiledConstraint (equal specs share one compile; LRU-cached;
        grammars/compile_queue.py). Its exception is a ConstraintError naming the problem when the
        spec cannot be compiled (with the schema keyword/pointer and tool index when known), is
        larger than `max_constraint_bytes`, or takes longer than `compile_timeout_s` of its own
        compute; a ServiceUnavailableError (retryable, not cached) when the server is too busy to
        compile it (queued past `compile_queue_timeout_s`, starved of CPU, or earlier compiles
        still hold the threads past their limit). The exception object is shared by every request
        with an equal spec: copy it before changing its fields.

        Releasing: `future.cancel()` says this caller no longer waits (a client that left, a
        request aborted while WAITING_FOR_GRAMMAR); once no caller waits, a compile not yet started
        is cancelled. Cancelling an asyncio task that awaits `asyncio.wrap_future(future)` (as
        AsyncEngine.compile does) cancels the future, so it releases too."""
        size = len(spec.value.encode())
        if size > self.config.max_constraint_bytes:
            fut: Future = Future()
            fut.set_exception(
                ConstraintError(
                    f"{spec.kind} constraint is {size} bytes, over the "
                    f"{self.config.max_constraint_bytes}-byte limit"
                )
            )
            return fut
        return self._queue.submit(spec)

    @property
    def _pool(self):
        """The compile worker pool (tests read num_stuck / max_stuck)."""
        return self._queue.pool

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """Compile (or fetch from cache), blocking. Raises ConstraintError on an invalid spec."""
        return self.submit(spec).result()

    def _compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """On a compile thread: `build_constraint` in a compile child killed at `compile_timeout_s`
        (its CPU time then tells 400 from 503), or here without one."""
        t0, cpu_start = time.perf_counter(), time.thread_time()
        cfg, ws = self.config, whitespace_options(self.config)
        if self._zygote is None:
            built = build_constraint(spec, ws, self._compiler)
        else:
            deadline = time.monotonic() + cfg.compile_timeout_s
            nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            try:
                built = self._zygote.compile(spec, ws, deadline, nice)
                # the child's compile proved this one ends in time; its grammar comes as EBNF text
                # (compile_child: xgrammar's serialization of a compiled grammar can take GBs)
                grammar = self._compiler.compile_grammar(xgr.Grammar.from_ebnf(built.ebnf))
            except CompileTimeout as e:  # killed at the deadline: 400, or 503 when it was starved
                cpu = e.cpu_s + time.thread_time() - cpu_start
                raise compile_timeout_error(spec.kind, cfg.compile_timeout_s, cpu) from None
            except RuntimeError as e:  # the child or the helper failed (refusals arrive as ConstraintError)
                raise ConstraintError(
                    f"{spec.kind} constraint cannot be compiled: {_clean_error(e)}"
                ) from None
            built = built._replace(grammar=grammar)
        return CompiledConstraint(
            built.grammar, built.not_enforced, time.perf_counter() - t0, built.forced_bound, built.unique_plan
        )

    def new_matcher(
        self, compiled: CompiledConstraint, extra_stop_ids: list[int] = (), max_rollback_tokens: int = -1
    ) -> xgr.GrammarMatcher:
        """A fresh per-request matcher; every model stop id and `extra_stop_ids` is allowed only
        where the grammar may end."""
        stops = sorted(set(self.stop_ids) | set(extra_stop_ids))
        matcher = xgr.GrammarMatcher(
            compiled.grammar, override_stop_tokens=stops, max_rollback_tokens=max_rollback_tokens
        )
        if compiled.unique_plan is None:
            return matcher
        from agentrt.grammars.unique_items import UniqueItemsMatcher, VocabBytes

        if self._vocab_bytes is None:
            self._vocab_bytes = VocabBytes(self.info.decoded_vocab, self.info.special_token_ids)
        return UniqueItemsMatcher(matcher, compiled.unique_plan, self._vocab_bytes)

    @property
    def planner(self):
        """The ClosingPlanner for this tokenizer (length-safe policy), built on first use."""
        if self._planner is None:
            from agentrt.grammars.length_policy import ClosingPlanner

            special = set(self.info.special_token_ids)
            texts = []
            for i, b in enumerate(self.info.decoded_vocab):
                try:
                    texts.append(None if i in special else bytes(b).decode("utf-8"))
                except UnicodeDecodeError:
                    texts.append(None)
            tok = self._tokenizer
            self._planner = ClosingPlanner(texts, lambda t: tok.encode(t, add_special_tokens=False))
        return self._planner

    @property
    def jump_finder(self):
        """The ForcedTextFinder (bounded jump-forward search, grammars/jump_forward.py) for this
        tokenizer, built on first use."""
        if self._jump_finder is None:
            from agentrt.grammars.jump_forward import ForcedTextFinder

            sizes = [len(bytes(b)) for b in self.info.decoded_vocab]
            self._jump_finder = ForcedTextFinder(self.planner.token_texts, sizes)
        return self._jump_finder

    def allocate_bitmask(self, batch: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(batch, self.vocab_size)

    @staticmethod
    def fill_bitmask(matcher: xgr.GrammarMatcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_bitmasks_async(self, matchers: list[xgr.GrammarMatcher], rows: list[int], batch: int) -> Future:
        """Start filling `rows` of a fresh bitmask [batch, ceil(vocab_size / 32)] int32 (CPU) from
        `matchers` (one per row) on the mask thread; the future's result is the bitmask. The caller
        must not advance these matchers before the future is done."""
        bitmask = self.allocate_bitmask(batch)

        def fill() -> torch.Tensor:
            inner = [getattr(m, "inner", m) for m in matchers]  # unique_items.UniqueItemsMatcher
            self._batch_matcher.batch_fill_next_token_bitmask(inner, bitmask, rows)
            for m, bare, row in zip(matchers, inner, rows):
                if m is not bare:  # the unique-strings check after xgrammar's mask
                    m.restrict(bitmask, row)
            return bitmask

        return self._mask_pool.submit(fill)

    @staticmethod
    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set disallowed logits to -inf in place with xgrammar's kernel (C++ on CPU, its Triton
        kernel on CUDA). logits [B, V] fp32/bf16 on any device; bitmask on CPU [B, ceil(V/32)]
        int32; only `rows` are masked. Engine code calls `agentrt.runtime.sampler.apply_bitmask`,
        which picks the kernel per device (this one off CUDA; the reasons are written there)."""
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)

    def shutdown(self) -> None:
        self._queue.shutdown()
        self._mask_pool.shutdown(wait=False, cancel_futures=True)
        if self._zygote is not None:
            self._zygote.close()  # its compiles in flight are killed
