"""A constrained request's grammar state. `ConstraintState`: its matcher, the length policy's
closing guard and jump-forward, behind one object so the engine never reaches into the pieces.
What the engine does with it over a request's life is runtime/constraint_steps.py
(`ConstraintSteps`); this module sits below runtime/request.py and never imports it."""

from __future__ import annotations

from typing import NamedTuple

from agentrt.grammars.finite import ForcedBound
from agentrt.grammars.jump_forward import FAST_MAX_CHARS, ForcedTextFinder, forced_token_ids
from agentrt.grammars.length_policy import ClosingGuard


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
