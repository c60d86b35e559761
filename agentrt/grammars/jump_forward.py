"""Jump-forward decoding: tokens for the text a grammar forces next (SGLang's compressed-FSM
jump-forward, Zheng et al. 2024, arXiv 2312.07104), tokenized the way the model would.

The forced text is client-controlled (`root ::= "a"{2000000000,2147483647}` forces two billion
characters) and xgrammar's `find_jump_forward_string` materialises all of it, one character at a
time (0.2.9, measured: ~0.4 us and ~90 bytes of matcher history per character; 10 M characters
take ~3 s, 1e9 run out of memory) with no limit to pass. `ForcedTextFinder` therefore calls it only
when the grammar's static bound (grammars/finite.py `forced_text_bound`) proves the text short
(`FAST_MAX_CHARS`), and otherwise walks the forced characters itself, one bitmask fill per
character, at most `SLOW_MAX_CHARS` per call: the rest is found on the next step. Either way the
caller's budget (`max_chars`, from the tokens the request may still emit) cuts the text.
"""

from __future__ import annotations

import numpy as np

from agentrt.grammars.finite import ForcedBound

FAST_MAX_CHARS = 1 << 16
"""xgrammar's own search is used when the forced text is provably at most this long (~25 ms, 6 MB
in the worst case)."""

SLOW_MAX_CHARS = 64
"""Characters the step-by-step search takes per call (one bitmask fill each: 0.03-0.7 ms; a
64-character call measured 30-46 ms with SmolLM2's 49K vocabulary on the loaded 2-core box, so
callers back off when it yields nothing: ConstraintState.jump_forward)."""

_PROBES = 'ab01 "}],:'


class ForcedTextFinder:
    """Bounded forced-text search for one tokenizer (engine-level, stateless between calls except a
    scratch bitmask: engine thread only).

    token_texts: the text of each token id (None for special and partial-UTF-8 tokens), as long as
    the logits (vocab_size); token_bytes: each token's length in bytes (an upper bound on its
    characters)."""

    def __init__(self, token_texts: list[str | None], token_bytes: list[int]):
        self.token_texts = token_texts
        self.vocab_size = len(token_texts)
        self.first_char = np.full(self.vocab_size, -1, dtype=np.int64)
        single: dict[str, int] = {}
        for i, t in enumerate(token_texts):
            if t:
                self.first_char[i] = ord(t[0])
                if len(t) == 1:
                    single.setdefault(t, i)
        self.token_bytes = np.asarray(token_bytes, dtype=np.int64)
        self.max_token_chars = max((len(t) for t in token_texts if t), default=1)
        self.probes = [single[c] for c in _PROBES if c in single]
        self._bitmask = None
        self.last_stepwise = False  # the last find() used the step-by-step search

    def find(self, matcher, bound: ForcedBound | None, num_output_chars: int, max_chars: int) -> str:
        """The text `matcher` (an xgrammar GrammarMatcher, left unchanged) forces next, at most
        `max_chars` characters; "" when nothing is forced or the grammar may end here.
        bound: the grammar's static bound (None: unknown); num_output_chars: characters accepted
        so far (an upper bound), which the bound of a recursive grammar grows with."""
        self.last_stepwise = False
        if max_chars <= 0 or matcher.is_terminated() or matcher.is_completed() or self._free(matcher):
            return ""
        if bound is not None and bound.at(num_output_chars) <= FAST_MAX_CHARS:
            return matcher.find_jump_forward_string()[:max_chars]
        self.last_stepwise = True
        return self._stepwise(matcher, min(max_chars, SLOW_MAX_CHARS))

    def _free(self, matcher) -> bool:
        """Two different probe characters are allowed next: nothing is forced (microseconds)."""
        n = 0
        for tid in self.probes:
            if matcher.accept_token(tid):
                matcher.rollback(1)
                n += 1
                if n == 2:
                    return True
        return False

    def _stepwise(self, matcher, max_chars: int) -> str:
        """Forced characters one at a time: a character is forced when every allowed token starts
        with it (byte-level and byte-fallback vocabularies have a token for every next character;
        an allowed token without text, a partial UTF-8 one, stops the search)."""
        if self._bitmask is None:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        chars: list[str] = []
        try:
            while len(chars) < max_chars and not matcher.is_completed():
                if chars and self._free(matcher):
                    break
                matcher.fill_next_token_bitmask(self._bitmask, 0)
                bits = np.unpackbits(self._bitmask[0].numpy().view(np.uint8), bitorder="little")
                codes = self.first_char[np.flatnonzero(bits[: self.vocab_size])]
                if codes.size == 0 or codes[0] < 0 or (codes != codes[0]).any():
                    break
                c = chr(int(codes[0]))
                if not matcher.accept_string(c):
                    break
                chars.append(c)
        finally:
            if chars:
                matcher.rollback(len(chars))
        return "".join(chars)


def forced_token_ids(tokenizer, token_texts: list[str | None], last_id: int, forced: str) -> list[int]:
    """Token ids to append after `last_id` for the forced text, or [] when that is not safe.

    tokenizer: a Hugging Face tokenizer (byte-level BPE or SentencePiece); token_texts: the text of
    each token id (None for special and partial-UTF-8 tokens); last_id: the last sampled token;
    forced: the string the grammar allows next (bounded by the caller: ForcedTextFinder).

    Only the forced text's canonical tokens are used, and only when they spell it exactly and
    retokenizing the last token plus the forced text gives back `[last_id, *ids]` (nothing merges
    across the boundary). The last forced token is left out: the model may extend it into free text
    (`"na` + `me` vs `"name`), so the appended sequence stays one the tokenizer itself produces.
    """
    last = token_texts[last_id] if 0 <= last_id < len(token_texts) else None
    if not forced or last is None:
        return []
    ids = tokenizer.encode(forced, add_special_tokens=False)
    if "".join(token_texts[i] or "\0" if i < len(token_texts) else "\0" for i in ids) != forced:
        return []
    if tokenizer.encode(last + forced, add_special_tokens=False) != [last_id, *ids]:
        return []
    return ids[:-1]
