"""A constrained request's grammar state and its lifecycle in the engine. `ConstraintState`: its
matcher, the length policy's closing guard and jump-forward, behind one object so the engine never
reaches into the pieces. `ConstraintSteps`: what one engine does with it, from the compiled
constraint to the request's end: setting the state up (closing guard, runaway-value repair), the
per-token constraint step around each output token, and dropping the state when the request ends."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from agentrt.errors import AgentrtError, ConstraintError, InvalidRequestError
from agentrt.grammars.finite import ForcedBound
from agentrt.grammars.jump_forward import FAST_MAX_CHARS, ForcedTextFinder, forced_token_ids
from agentrt.grammars.length_policy import ClosingGuard, ClosingPath
from agentrt.grammars.reasoning import AnswerGate
from agentrt.runtime.reasoning_budget import ReasoningTracker
from agentrt.runtime.repetition import REPAIRABLE_KINDS, RepetitionConfig, RepetitionGuard, vocab_bytes

if TYPE_CHECKING:
    from agentrt.grammars.spec import GrammarConfig
    from agentrt.grammars.xgrammar_backend import CompiledConstraint, GrammarBackend
    from agentrt.runtime.metrics import EngineStats
    from agentrt.runtime.request import Request, TokenLogprob


class Accepted(NamedTuple):
    """The token kept after a sampled one went into the grammar: `token_id` (the sampled token, or
    the next token of a closing path when the length policy replaced it, `forced` True)."""

    token_id: int
    forced: bool


class ConstraintState:
    """Per-request constraint state (engine thread only).

    matcher: the request's xgrammar GrammarMatcher (grammars.xgrammar_backend.GrammarBackend.new_matcher),
    advanced by every output token; its bitmask rows are filled from it. closing: the
    max_tokens_policy "close" guard (grammars/length_policy.py), or None. finder / forced_bound:
    the bounded jump-forward search and the compiled grammar's bound on forced text (None: no
    jump-forward / unknown bound). `num_chars`: an upper bound on the characters accepted so far
    (bytes of the accepted tokens)."""

    def __init__(
        self,
        matcher,
        closing: ClosingGuard | None = None,
        finder: ForcedTextFinder | None = None,
        forced_bound: ForcedBound | None = None,
    ):
        self.matcher, self.closing = matcher, closing
        self.finder, self.forced_bound = finder, forced_bound
        self.num_chars = 0
        self._skip = self._backoff = 0  # jump-forward calls to skip after fruitless slow searches

    def is_terminated(self) -> bool:
        """The grammar has accepted its end (the output is complete)."""
        return self.matcher.is_terminated()

    def _count(self, token_id: int) -> None:
        if self.finder is not None and 0 <= token_id < self.finder.vocab_size:
            self.num_chars += int(self.finder.token_bytes[token_id])

    def accept(self, token_id: int, left: int) -> Accepted | None:
        """Advance by a sampled token; `left`: output tokens the budget allows after it. Returns the
        token to keep, or None when the matcher rejects `token_id` (the bitmask should have
        prevented it: a bug)."""
        if not self.matcher.accept_token(token_id):
            return None
        if self.closing is None or self.matcher.is_terminated():
            self._count(token_id)
            return Accepted(token_id, False)
        before = self.closing.num_forced
        token_id = self.closing.keep(self.matcher, token_id, left)
        self._count(token_id)
        return Accepted(token_id, self.closing.num_forced > before)

    def force(self, token_ids: list[int], left: int) -> bool:
        """Advance by tokens the runtime chose instead of sampling (a repair's closing text,
        runtime/repetition.py). `left`: output tokens the budget allows from before them; under the
        length-safe policy they are taken only when a closing path from after them fits the rest.
        Returns False, the matcher unchanged, when one is rejected or the path does not fit."""
        for i, t in enumerate(token_ids):
            if not self.matcher.accept_token(t):
                if i:
                    self.matcher.rollback(i)
                return False
        if self.closing is not None and token_ids:
            verified = self.closing.path
            need = self.closing.start(self.matcher)  # its path: the verified one after them
            if need is None or need > left - len(token_ids):
                self.matcher.rollback(len(token_ids))
                self.closing.path = verified
                return False
        for t in token_ids:
            self._count(t)
        return True

    def jump_forward(self, tokenizer, last_id: int, left: int) -> list[int]:
        """Tokens of the text the grammar forces next (SGLang's jump-forward, see
        grammars/jump_forward.py), already accepted by the matcher; [] when none or unsafe.
        `last_id`: the last output token; `left`: output tokens the budget still allows. At most
        left - 1 tokens (one stays for the model), found in at most what those tokens could spell
        (left x the longest token's characters, and FAST_MAX_CHARS), and under the length policy
        only as many as leave a closing path that fits (a bisection: O(log n) closing searches)."""
        finder = self.finder
        if finder is None or left <= 1 or (self.closing is not None and self.closing.plan):
            return []  # following a closing path: its tokens are already the forced ones
        budget = min(FAST_MAX_CHARS, left * finder.max_token_chars)
        if self._skip > 0:  # the step-by-step search found nothing usable lately: not every token
            self._skip -= 1
            return []
        forced = finder.find(self.matcher, self.forced_bound, self.num_chars, budget)
        ids = forced_token_ids(tokenizer, finder.token_texts, last_id, forced)[: left - 1] if forced else []
        if finder.last_stepwise and not ids:  # back off 1, 2, 4 ... 64 tokens: bounded cost per token
            self._backoff = min(64, 2 * self._backoff or 1)
            self._skip = self._backoff
        elif ids:
            self._backoff = 0
        if not ids:
            return []
        for i, t in enumerate(ids):
            if not self.matcher.accept_token(t):  # cannot happen for a forced string; stay safe
                ids = ids[:i]
                break
        if self.closing is not None and ids:
            ids = self._fit_closing(ids, left)
        for t in ids:
            self._count(t)
        return ids

    def _fit_closing(self, ids: list[int], left: int) -> list[int]:
        """Length-safe: the longest prefix of the accepted `ids` (found by bisection, assuming a
        longer prefix never needs a shorter closing path than it leaves room for) after which a
        closing path fits the budget; the matcher ends after that prefix, and the guard's verified
        path is the one found there (a prefix of 0: the one keep() left)."""
        closing = self.closing
        verified, found = closing.path, {}

        def fits(k: int) -> bool:
            if left - k > closing.bound:  # any path fits
                found[k] = None
                return True
            need = closing.start(self.matcher)
            found[k] = closing.path
            return need is not None and need <= left - k

        at = len(ids)

        def move(k: int) -> None:
            nonlocal at
            if k < at:
                self.matcher.rollback(at - k)
            for t in ids[at:k]:
                self.matcher.accept_token(t)
            at = k

        if fits(at):
            closing.path = found[at]
            return ids
        lo, hi = 0, at - 1  # the answer is in [lo, hi]; 0 fits (keep() left a verified path, or more
        # tokens than any path needs)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            move(mid)
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        move(lo)
        closing.path = found[lo] if lo else verified
        return ids[:lo]


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
