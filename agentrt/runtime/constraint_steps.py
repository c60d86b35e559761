"""A constrained request's lifecycle in the engine. `ConstraintSteps`: what one engine does with a
request's `ConstraintState` (runtime/constraint_state.py), from the compiled constraint to the
request's end: setting the state up (closing guard, runaway-value repair, the reasoning tracker),
the per-token constraint step around each output token, and dropping the state when the request
ends. It sits above runtime/request.py; the per-request states it builds sit below it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrt.errors import AgentrtError, ConstraintError, InvalidRequestError
from agentrt.grammars.length_policy import ClosingGuard, ClosingPath
from agentrt.grammars.reasoning import AnswerGate
from agentrt.runtime.constraint_state import ConstraintState
from agentrt.runtime.reasoning_budget import ReasoningTracker
from agentrt.runtime.repetition import REPAIRABLE_KINDS, RepetitionConfig, RepetitionGuard, vocab_bytes

if TYPE_CHECKING:
    from agentrt.grammars.spec import GrammarConfig
    from agentrt.grammars.xgrammar_backend import CompiledConstraint, GrammarBackend
    from agentrt.runtime.metrics import EngineStats
    from agentrt.runtime.request import Request, TokenLogprob


class ConstraintSteps:
    """One engine's constraint steps (engine thread only). grammar: the engine's GrammarBackend;
    stop_ids: the model's stop ids (a closing path ends with the first); tokenizer: for
    jump-forward's token ids; config: the engine's GrammarConfig (its `jump_forward`, read at each
    token); stats: the engine's EngineStats (length-forced and jump-forward token counts)."""

    def __init__(
        self,
        grammar: GrammarBackend,
        stop_ids: tuple[int, ...],
        tokenizer,
        config: GrammarConfig,
        stats: EngineStats,
    ):
        self.grammar, self.stop_ids, self.tokenizer = grammar, stop_ids, tokenizer
        self.config, self.stats = config, stats
        self._vocab_bytes: list[bytes] | None = None  # token bytes for runaway repair, on first use
        self._token_bytes: list[bytes] | None = None  # every token's bytes, for reasoning trackers

    def start(self, r: Request, compiled: CompiledConstraint) -> AgentrtError | None:
        """Give r its ConstraintState (r.grammar: a new matcher; with max_tokens_policy "close" the
        closing guard) and, with repetition_repair on a JSON constraint, its RepetitionGuard. Returns
        the error r must finish with (ConstraintError: no closing path from the start;
        InvalidRequestError: max_tokens below the closing path), else None."""
        matcher = self.grammar.new_matcher(compiled, r.params.stop_token_ids)
        r.grammar = ConstraintState(
            matcher, finder=self.grammar.jump_finder, forced_bound=compiled.forced_bound
        )
        if r.params.max_tokens_policy == "close":
            r.grammar.closing = ClosingGuard(self.grammar.planner, self.stop_ids[0])
            self._set_bridge(r, at_start=True)
            need = r.grammar.closing.start(matcher)
            r.grammar.closing.head = None
            if need is None:
                return ConstraintError(
                    "max_tokens_policy 'close' is not available for this constraint: the closing-path "
                    f"planner found no way to complete it from its start: {self.grammar.planner.failure}",
                    param="max_tokens_policy",
                )
            if need > r.max_tokens:
                return InvalidRequestError(
                    f"max_tokens {r.max_tokens} is below the {need} tokens the "
                    "constraint needs to close (max_tokens_policy 'close')",
                    param="max_tokens",
                )
        if r.params.repetition_repair and r.constraint.kind in REPAIRABLE_KINDS:
            if self._vocab_bytes is None:
                info = self.grammar.info
                self._vocab_bytes = vocab_bytes(info.decoded_vocab, info.special_token_ids)
            gate = AnswerGate.for_spec(r.constraint.reasoning)  # a reasoning model: the answer only
            r.repetition = RepetitionGuard(
                RepetitionConfig(), self._vocab_bytes, self.grammar.planner, gate, self.token_bytes
            )
        return None

    def accept(
        self, r: Request, tok: int, logprob: TokenLogprob | None
    ) -> tuple[int, TokenLogprob | None, str | None] | None:
        """The grammar's part of a new output token before it is appended: (the token to append,
        its logprob (None when the length policy replaced the sampled token), "stop" when the
        grammar is complete after it, else None). None when r's matcher rejects `tok` (a bug: the
        bitmask should have prevented it). An unconstrained r keeps the token as it is."""
        if r.grammar is None:
            return tok, logprob, None
        self._set_bridge(r, at_start=r.num_output_tokens == 0)
        accepted = r.grammar.accept(tok, r.max_tokens - r.num_output_tokens - 1)
        if r.grammar.closing is not None:
            r.grammar.closing.head = None
        if accepted is None:
            return None
        if accepted.token_id != tok:  # the closing path's token replaced the sampled one
            logprob = None
        self.stats.num_length_forced_tokens += accepted.forced
        return accepted.token_id, logprob, "stop" if r.grammar.is_terminated() else None

    def start_reasoning(self, r: Request) -> None:
        """Give r its ReasoningTracker when it is a reasoning model's request (params.reasoning)."""
        p = r.params.reasoning
        if p is not None:
            r.reasoning = ReasoningTracker(
                p, self.tokenizer.encode(p.close_text + p.end, add_special_tokens=False)
            )

    def _set_bridge(self, r: Request, at_start: bool = False) -> None:
        """Closing paths go through the reasoning's end marker while r may still reason, and
        (`at_start`: the first output token's search) may open with the answer's header
        (Harmony's final channel, the way to answer without reasoning)."""
        closing, tracker = r.grammar.closing, r.reasoning
        if closing is None or tracker is None:
            return
        closing.head = None
        if tracker.state == "answer":  # past the reasoning: the marker could only go inside the answer
            closing.bridge = None
            return
        p = tracker.params
        if closing.bridge is None:
            closing.bridge = self._path(p.end + p.after_end)
        if at_start and p.header:
            closing.head = self._path(p.header)

    def _path(self, text: str) -> ClosingPath:
        return ClosingPath(text, self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def token_bytes(self) -> list[bytes]:
        """Each token id's text as bytes (special tokens' too), for the reasoning tracker."""
        if self._token_bytes is None:
            self._token_bytes = [bytes(b) for b in self.grammar.info.decoded_vocab]
        return self._token_bytes

    def _reasoning_step(self, r: Request, tok: int) -> int:
        """Follow r's reasoning past `tok`; when its thinking budget is spent, append the close
        text and end marker (through the grammar when r is constrained). Returns the last token."""
        tracker = r.reasoning
        vocab = self.token_bytes
        tracker.observe(vocab[tok] if 0 <= tok < len(vocab) else b"")
        if not tracker.due() or tracker.forced:
            return tok
        tracker.forced = True  # tried once: under the length policy its closing guard ends it
        ids, left = tracker.close_ids, r.max_tokens - r.num_output_tokens
        if not ids or len(ids) > left:  # no room for them: the output ends by length
            return tok
        if r.grammar is not None and not r.grammar.force(ids, left):
            return tok
        r.append_output(ids)
        r.pending_jump_forward += len(ids)  # their KV is computed with the next step's chunk
        self.stats.num_reasoning_forced_tokens += len(ids)
        self._observe(r, ids)
        return ids[-1]

    def after_token(self, r: Request, tok: int) -> None:
        """After r's output token `tok` was appended (the grammar not complete): the reasoning's
        end when its thinking budget is spent, a runaway value's closing tokens
        (runtime/repetition.py), then the text the grammar forces (jump-forward), are appended as
        forced tokens whose KV the next step's chunk computes."""
        if r.reasoning is not None:
            tok = self._reasoning_step(r, tok)
            if r.reasoning.in_reasoning:  # free text: no runaway repair, nothing forced
                return
        if r.repetition is not None:  # a runaway value: force it closed
            left = r.max_tokens - r.num_output_tokens
            drop, ids = r.repetition.check(r.token_ids, r.num_prompt_tokens, r.grammar, left)
            if ids:  # forced like jump-forward text: their KV is computed with the next step's chunk
                if drop:  # the last token, not emitted yet, is replaced (its KV is not computed)
                    del r.token_ids[-1]
                    if r.logprobs is not None:
                        del r.logprobs[-1]
                r.append_output(ids)
                r.pending_jump_forward += len(ids) - drop
                tok = ids[-1]
                self._observe(r, ids)
        if r.grammar is not None and self.config.jump_forward:
            self._set_bridge(r)  # the reasoning may have ended with this token
            ids = r.grammar.jump_forward(self.tokenizer, tok, r.max_tokens - r.num_output_tokens)
            if ids:  # their KV is computed with the next step's chunk
                r.append_output(ids)
                r.num_jump_forward_tokens += len(ids)
                r.pending_jump_forward += len(ids)
                self.stats.num_jump_forward_tokens += len(ids)
                self._observe(r, ids)

    def _observe(self, r: Request, ids: list[int]) -> None:
        """Forced tokens (jump-forward, a repair) count for r's reasoning as sampled ones do: they
        can open it (Harmony's "analysis<|message|>" after a sampled "<|channel|>a")."""
        if r.reasoning is not None:
            vocab = self.token_bytes
            for t in ids:
                r.reasoning.observe(vocab[t] if 0 <= t < len(vocab) else b"")

    @staticmethod
    def release(r: Request) -> None:
        """Drop r's constraint state at its end, keeping whether the closing guard closed it
        (r.closed_by_budget)."""
        if r.grammar is not None and r.grammar.closing is not None:
            r.closed_by_budget = r.grammar.closing.closed
        r.grammar = None
