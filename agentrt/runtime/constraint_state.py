"""A constrained request's grammar state: its matcher, the length policy's closing guard and
jump-forward, behind one object so the engine never reaches into the pieces."""

from __future__ import annotations

from typing import NamedTuple

from agentrt.grammars.jump_forward import forced_token_ids
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
    max_tokens_policy "close" guard (grammars/length_policy.py), or None."""

    def __init__(self, matcher, closing: ClosingGuard | None = None):
        self.matcher, self.closing = matcher, closing

    def is_terminated(self) -> bool:
        """The grammar has accepted its end (the output is complete)."""
        return self.matcher.is_terminated()

    def accept(self, token_id: int, left: int) -> Accepted | None:
        """Advance by a sampled token; `left`: output tokens the budget allows after it. Returns the
        token to keep, or None when the matcher rejects `token_id` (the bitmask should have
        prevented it: a bug)."""
        if not self.matcher.accept_token(token_id):
            return None
        if self.closing is None or self.matcher.is_terminated():
            return Accepted(token_id, False)
        before = self.closing.num_forced
        token_id = self.closing.keep(self.matcher, token_id, left)
        return Accepted(token_id, self.closing.num_forced > before)

    def jump_forward(self, tokenizer, token_texts: list[str | None], last_id: int, left: int) -> list[int]:
        """Tokens of the text the grammar forces next (SGLang's jump-forward, see
        grammars/jump_forward.py), already accepted by the matcher; [] when none or unsafe.
        `last_id`: the last output token; `left`: output tokens the budget still allows. At most
        left - 1 tokens (one stays for the model), and under the length policy only as many as
        leave a closing path that fits."""
        if self.closing is not None and self.closing.plan:
            return []  # following a closing path: its tokens are already the forced ones
        forced = self.matcher.find_jump_forward_string()
        if not forced:
            return []
        ids = forced_token_ids(tokenizer, token_texts, last_id, forced)[: max(0, left - 1)]
        for i, t in enumerate(ids):
            if not self.matcher.accept_token(t):  # cannot happen for a forced string; stay safe
                ids = ids[:i]
                break
        if self.closing is not None:  # length-safe: keep only what leaves a closing path that fits
            while ids:
                need = self.closing.start(self.matcher)
                if need is not None and need <= left - len(ids):
                    break
                self.matcher.rollback(1)
                ids.pop()
        return ids
