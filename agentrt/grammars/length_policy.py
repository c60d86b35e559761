"""Length-safe constrained output (`max_tokens_policy="close"`): keep enough token budget to
finish the grammar, and spend the last of it on a path to a valid end.

At each step of a request under this policy the engine asks for a *closing path* from the matcher's
current state: a short string the grammar accepts that ends where the grammar may stop. It is
found greedily over the vocabulary's single-character tokens, preferring closers (`"`, `}`, `]`, `)`),
then separators (`:` `;` space `*` `,`: a comma extends a list, so it comes late, and `*` makes
the shortest SQL select list), digits, letters and the rest. After 6 repeats of one character
(free text: a key, an email local part), the next step instead takes the character after
which the grammar allows the fewest candidates, which moves toward structure (`@` in an email,
the closing quote) rather than more free text. The path's canonical
tokenization (checked to spell the path exactly; else one token per character) gives the tokens
still needed, plus one for the stop token. Invariant kept by the engine: tokens left >= path length + 1.
A sampled token that would break it is undone and the path found before it is followed from then
on, token by token, to the end (`ClosingGuard`): re-planning after each forced token could find a
longer path (the greedy search is not monotone: after `12:00:00.` it prefers six more digits to
`Z`), and a path that fit once always fits while it is followed.

This is a heuristic shortest path (greedy, not a search over all token sequences): it can be longer
than the true shortest completion, which only makes the policy close earlier than necessary.
When no path is found within `max_chars` from a request's start, the policy cannot guarantee
validity and the engine refuses the request under it (a 400 naming max_tokens_policy and
`failure`: runtime/engine.py).

A character no token spells alone (an emoji, U+202E, U+200B, a BOM in an SQL name: byte-level
vocabularies split it into tokens of partial UTF-8, whose text is None here) is spelled with those
fragment tokens: when no token with text is allowed, the planner takes an allowed fragment token
(lowest id first; the grammar decides which bytes may follow). Such a path's text holds U+FFFD for
each fragment, `until` is not called for them, and its token_ids are the tokens taken, never a
re-tokenization of the text.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field

_PREFERENCE = (
    '"}])'
    + ":; *,"  # a comma extends a list (SQL select items), a space can end it; `SELECT *` is short
    + string.digits
    + string.ascii_lowercase
    + string.ascii_uppercase
    + "\n-.+_/"
    + "".join(c for c in string.punctuation if c not in '"}]),:;*-.+_/')
    + "\t"
)


@dataclass
class ClosingPath:
    """text: the characters to emit; token_ids: tokens spelling exactly `text`."""

    text: str
    token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        """Tokens needed to finish: the path plus the stop token."""
        return len(self.token_ids) + 1


class ClosingPlanner:
    """Builds closing paths for one tokenizer. `token_texts[i]` is token i's decoded text (None
    for special tokens)."""

    def __init__(
        self,
        token_texts: list[str | None],
        encode=None,
        max_chars: int = 512,
        max_escapes: int = 48,
        max_fills: int = 256,
    ):
        """encode: text -> token ids without special tokens (the tokenizer's canonical split).
        max_chars / max_escapes / max_fills (bitmask fills, ~2 ms each on large grammars) bound
        the work of one search (no path: None)."""
        self.max_chars = max_chars
        self.max_escapes = max_escapes
        self.max_fills = max_fills
        self._fills = 0
        self.failure = ""  # why the last closing_path() returned None (for error messages)
        self.token_texts = token_texts
        self.vocab_size = len(token_texts)
        self._bitmask = None
        self.encode = encode
        self.text_to_id: dict[str, int] = {}
        for i, t in enumerate(token_texts):
            if t and t not in self.text_to_id:
                self.text_to_id[t] = i
        self.max_token_chars = max((len(t) for t in self.text_to_id), default=1)
        seen = set()
        self.candidates: list[tuple[str, int]] = []
        for c in _PREFERENCE:
            if c not in seen and c in self.text_to_id:
                seen.add(c)
                self.candidates.append((c, self.text_to_id[c]))
        self.probes = [ct for ct in self.candidates if ct[0] in '"}],0aA@. -:/']

    def closing_path(
        self, matcher, until=None, bridge: ClosingPath | None = None, head: ClosingPath | None = None
    ) -> ClosingPath | None:
        """Probe from the matcher's state (restored before returning; the matcher needs a rollback
        window of at least `max_chars`). None when no path is found. `until`: a callable given each
        piece of text as it is chosen; True ends the path there, before the grammar can end (e.g.
        once the current JSON string is closed: runtime/repetition.py). A reasoning model's text
        the greedy search would not find: `head`, taken first when the grammar accepts it whole
        (Harmony's final channel, to answer without reasoning); else `bridge`, taken once, at the
        first point where the grammar accepts it whole (the reasoning's end marker: free text the
        search would not leave). Their tokens are kept as given."""
        text: list[str] = []
        ids: list[int] = []
        self._fills = 0
        self.failure = ""
        try:
            if head is not None and self._take(matcher, head):
                ids += head.token_ids
                text += list(head.text)
                bridge = None
            return self._search(matcher, until, bridge, text, ids)
        finally:
            if ids:
                matcher.rollback(len(ids))

    @staticmethod
    def _take(matcher, piece: ClosingPath) -> bool:
        """Accept all of `piece`'s tokens, or none (the matcher as it was)."""
        for i, t in enumerate(piece.token_ids):
            if not matcher.accept_token(t):
                if i:
                    matcher.rollback(i)
                return False
        return True

    def _search(
        self, matcher, until, bridge: ClosingPath | None, text: list[str], ids: list[int]
    ) -> ClosingPath | None:
        """The greedy search of `closing_path` from after `text` / `ids` (a head already taken),
        appending to both (the caller rolls the matcher back by len(ids)). Tokens up to the last
        head or bridge are kept as taken; the text after them is tokenized canonically."""
        run_char, run, escapes, last_escape = "", 0, 0, 0
        fragments = False  # a token of partial UTF-8 was taken: the ids are kept as taken
        fixed, fixed_text = len(ids), len(text)  # ids / text entries kept as taken
        while not matcher.is_completed():
            if bridge is not None and self._take(matcher, bridge):
                ids += bridge.token_ids
                text += list(bridge.text)
                fixed, fixed_text, bridge = len(ids), len(text), None
                run_char, run, last_escape = "", 0, len(text)
                continue
            if len(ids) >= self.max_chars:
                self.failure = f"the path it built passed {self.max_chars} characters"
                return None
            # free text: one character repeated, or a short cycle (`abab`, `xyzxyz`)
            stuck = run >= 6 or (len(text) - last_escape >= 12 and _periodic(text[-12:]))
            if stuck:
                escapes += 1
                if escapes > self.max_escapes:
                    self.failure = f"it gave up after {len(text)} characters in a repeating part"
                    return None
            pick = self._least_free(matcher) if stuck else None
            if pick is None:  # (in free text of fragments only, no candidate is allowed)
                pick = self._first(matcher, run_char if run >= 8 else "")
            if stuck:
                last_escape = len(text) + 1
            if pick is None:
                self.failure = self.failure or (
                    f"no text it can build is allowed after {''.join(text)[-40:]!r}"
                    if text
                    else "no text it can build is allowed at the start"
                )
                return None
            c, tid = pick
            ids.append(tid)
            if c is None:  # a fragment of a character: no text, and no run or cycle
                fragments = True
                text.append("\ufffd")
                run_char, run, last_escape = "", 0, len(text)
                continue
            text.append(c)
            run = run + 1 if c == run_char else 1
            run_char = c
            if until is not None and until(c):
                break
        joined = "".join(text)
        if fragments:
            return ClosingPath(joined, list(ids))
        rest = "".join(text[fixed_text:])
        return ClosingPath(joined, ids[:fixed] + self._tokenize(rest, ids[fixed:]))

    def _first(self, matcher, last_resort: str):
        """Accept the first candidate the grammar allows (`last_resort` tried last): accept
        attempts for the first 8, then one bitmask fill to find the first allowed of the rest, then
        the shortest allowed token with text, then an allowed token of partial UTF-8 (returned as
        (None, id)). None when nothing is allowed."""
        order = self.candidates
        if last_resort:
            order = [ct for ct in order if ct[0] != last_resort] + [
                ct for ct in order if ct[0] == last_resort
            ]
        for c, tid in order[:8]:  # most steps end here: accept attempts cost microseconds
            if matcher.accept_token(tid):
                return c, tid
        order = order[8:]
        self._fills += 1
        if self._fills > self.max_fills:
            self.failure = f"the search passed its limit of {self.max_fills} bitmask fills"
            return None
        if self._bitmask is None:  # then one bitmask fill (milliseconds on large grammars)
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(self._bitmask, 0)
        words = self._bitmask[0].numpy()
        for c, tid in order:
            if (int(words[tid >> 5]) >> (tid & 31)) & 1 and matcher.accept_token(tid):
                return c, tid
        # no single ASCII character fits (a pattern of Greek letters, CJK): the shortest allowed token
        import numpy as np

        allowed = np.flatnonzero(
            np.unpackbits(words.view(np.uint8), bitorder="little")[: len(self.token_texts)]
        )
        texts = [(len(self.token_texts[i]), int(i)) for i in allowed if self.token_texts[i]]
        for _n, tid in sorted(texts)[:8]:
            if matcher.accept_token(tid):
                return self.token_texts[tid], tid
        # a character no token spells alone (an emoji, U+202E): a token of its partial UTF-8
        for tid in [int(i) for i in allowed if self.token_texts[i] is None][:8]:
            if matcher.accept_token(tid):
                return None, tid
        return None

    def _num_allowed(self, matcher) -> int:
        """How many of a small probe set of characters the grammar allows here (a cheap measure of
        how free the text is)."""
        n = 0
        for _c, tid in self.probes:
            if matcher.accept_token(tid):
                matcher.rollback(1)
                n += 1
        return n

    def _least_free(self, matcher):
        """In free text (a loop, or a long path): accept the allowed candidate after which the
        fewest candidates are allowed -- the character that moves toward structure (`@` in an
        email, a closing quote) rather than more free text."""
        best, best_n = None, None
        for c, tid in self.candidates:
            if not matcher.accept_token(tid):
                continue
            n = -1 if matcher.is_completed() else self._num_allowed(matcher)  # an end beats all
            matcher.rollback(1)
            if best_n is None or n < best_n:
                best, best_n = (c, tid), n
                if n < 0:
                    break
        if best is not None:
            matcher.accept_token(best[1])
        return best

    def _tokenize(self, text: str, fallback: list[int]) -> list[int]:
        if self.encode is None or not text:
            return fallback
        ids = self.encode(text)
        if "".join(self.token_texts[i] or "\0" for i in ids) != text:
            return fallback
        return ids


def _periodic(chars: list[str]) -> bool:
    """The characters repeat with a period of 2 or 3."""
    return any(all(chars[i] == chars[i - k] for i in range(k, len(chars))) for k in (2, 3))


@dataclass
class ClosingGuard:
    """Per-request state of the length-safe policy. `stop_id`: the token that ends the output when
    the grammar is complete (the model's end-of-sequence id).

    Invariant: after every kept token a closing path that fits the tokens left is known (`path`,
    the verified path from the matcher's current state, or `plan`, the path being followed), or the
    tokens left exceed the longest path the planner can return (`ClosingPlanner.max_chars` + 1), so
    whatever path it finds later fits. Checks are never skipped inside that bound: skipping them on
    slow grammars (the earlier design, every 8th token while "2 x the last path + 32" tokens were
    left) let one unchecked token grow the path past the budget (Spider, cre_Doc_Template_Mgt: a
    column of a table not yet in FROM made the path 4 -> 71 tokens at 73 left, and the output ended
    by max_tokens)."""

    planner: ClosingPlanner
    stop_id: int
    plan: list[int] = field(default_factory=list)  # the rest of a path being followed
    path: list[int] | None = None  # a verified path from the current state (tokens, without stop)
    num_forced: int = 0  # sampled tokens replaced
    closed: bool = False  # a closing path was entered because the budget ran short
    bridge: ClosingPath | None = None  # a reasoning's end marker (closing_path's bridge), while it reasons
    head: ClosingPath | None = None  # an answer's header (closing_path's head), before any reasoning

    @property
    def bound(self) -> int:
        """Tokens the longest path the planner can return needs (path + stop)."""
        return self.planner.max_chars + 1

    def start(self, matcher) -> int | None:
        """Tokens needed to close from the matcher's state (None: no path found). The path found
        becomes the verified one (the caller checks it fits)."""
        path = self.planner.closing_path(matcher, bridge=self.bridge, head=self.head)
        self.path = None if path is None else list(path.token_ids)
        return None if path is None else path.num_tokens

    def keep(self, matcher, tok: int, left: int) -> int:
        """`tok` was just accepted by `matcher`; `left`: tokens the budget allows after it. Returns
        the token to keep: `tok`, or the next token of a closing path (the matcher is moved onto it).
        Costs one closing-path search per token (milliseconds on large grammars), except while
        the model writes the verified path itself (then the path's rest is the path) or while more
        tokens are left than any path can need."""
        if self.plan:
            self.path = None
            return self._force(matcher, tok, self.plan.pop(0))
        before = self.path
        if before and before[0] == tok:  # the model follows the path: its rest still fits
            self.path = before[1:]
            return tok
        if left > self.bound:  # any path found later fits: no search needed yet
            self.path = None
            return tok
        path = self.planner.closing_path(matcher, bridge=self.bridge, head=self.head)
        if path is not None and path.num_tokens <= left:
            self.path = list(path.token_ids)
            return tok
        # over budget, or a state with no known way to close: never enter it
        matcher.rollback(1)
        if before is None:  # the last state was over `bound` from the end, unchecked: search it
            found = self.planner.closing_path(matcher, bridge=self.bridge, head=self.head)
            before = None if found is None else list(found.token_ids)
        if before is None:  # the search gave up there too: keep the token, the next one checks again
            matcher.accept_token(tok)
            self.path = None
            return tok
        self.plan = [*before, self.stop_id]
        self.closed = True
        self.path = None
        matcher.accept_token(tok)
        return self._force(matcher, tok, self.plan.pop(0))

    def _force(self, matcher, tok: int, forced: int) -> int:
        if forced != tok:
            matcher.rollback(1)
            if not matcher.accept_token(forced):  # cannot happen: the path was accepted from here
                raise RuntimeError("closing path token rejected by the grammar")
            self.num_forced += 1
        return forced
