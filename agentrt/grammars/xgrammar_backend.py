"""The one adapter to xgrammar: compile specs (cached, off the engine loop), make matchers, fill
and apply token bitmasks.

A compile is `pipeline.build_constraint` (spec -> xgrammar Grammar -> finite-output check ->
xgrammar's compile; grammars/pipeline.py). With `compile_in_child` all of it runs in a child
process killed at `compile_timeout_s` (grammars/compile_child.py), so no part of a client's
constraint runs unbounded in the server process; without, on a compile thread.

Bitmasks are int32 tensors [batch, ceil(vocab_size / 32)]; bit j of a row allows token j.
Stop ids are set per matcher (`override_stop_tokens`), so no stop/EOS id is allowed before the
grammar can terminate (xgrammar only admits stop tokens in an accepting state).

Errors: a constraint that cannot be compiled fails its future with `agentrt.errors.ConstraintError`
(keyword/pointer kept from a schema error; `tool_index` set for a tool's parameters).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from agentrt.errors import ConstraintError
from agentrt.grammars.compile_child import CompileTimeout, Zygote
from agentrt.grammars.compile_queue import CompileQueue, compile_timeout_error
from agentrt.grammars.finite import ForcedBound
from agentrt.grammars.pipeline import build_constraint, clean_error, whitespace_options
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig


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
    reasoning: str = ""  # the spec's reasoning (grammars/reasoning.py): the check reads the answer only


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
                    f"{spec.kind} constraint cannot be compiled: {clean_error(e)}"
                ) from None
            built = built._replace(grammar=grammar)
        return CompiledConstraint(
            built.grammar,
            built.not_enforced,
            time.perf_counter() - t0,
            built.forced_bound,
            built.unique_plan,
            spec.reasoning,
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
        from agentrt.grammars.reasoning import AnswerGate
        from agentrt.grammars.unique_items import UniqueItemsMatcher, VocabBytes

        if self._vocab_bytes is None:
            self._vocab_bytes = VocabBytes(self.info.decoded_vocab, self.info.special_token_ids)
        gate = AnswerGate.for_spec(compiled.reasoning)  # the check starts where the answer does
        return UniqueItemsMatcher(matcher, compiled.unique_plan, self._vocab_bytes, gate)

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
