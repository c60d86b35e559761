"""Runaway-value repair (`SamplingParams.repetition_repair`): end a JSON string value or array that
has started repeating itself, under the grammar, instead of letting it run to max_tokens.

Small models under a JSON Schema fall into loops that only max_tokens ends, losing the whole row:
inside a string value (`"order_id": "2023-01-01T12:30:00Z-2023-01-01T12:30:00Z-...`) or as identical
array elements (`"line_items": [{...}, {...}, {...}, ...`), both measured on the extraction workload
(bench/runaway.py; numbers in the README, "Runaway values"). This module watches the output of a JSON-constrained request
(constraint kinds json_schema and json_object) token by token:

- `JsonPointerTracker` lexes the output bytes (the grammar guarantees they are a prefix of one JSON
  text, RFC 8259): whether the output is inside a string *value* (not a key), the open objects and
  arrays, and the JSON pointer (RFC 6901) of each. It works on bytes: the structural characters
  (`"` `\\` `{` `[` `:` `,`) never occur inside a multi-byte UTF-8 sequence, so partial-UTF-8
  tokens are safe.
- `TailRepeats` counts, for every unit length n, how long the tail of the output's token ids has
  been n-periodic (O(max_n) per token). A unit of n tokens repeated k times in a row at the tail,
  with n in [min_n, max_n] and k >= max(min_repeats, ceil(min_tokens / n)), is degenerate.
- `RepetitionGuard` (per request) picks the value that holds the whole repetition (the innermost
  string value or array open before it began; `RepetitionGuard._target`) and asks the closing-path
  planner (grammars/length_policy.py) for the shortest text that closes it (usually `"` or `]`;
  more under minLength, a pattern or minItems). The engine appends those tokens as forced tokens
  (logprob 0.0) and the model continues the object freely. Text already emitted is kept (it may
  have been streamed); only an array's last token, not yet emitted, may be replaced when it ran
  past the element boundary (`},` is one token in byte-level BPE vocabularies). The value's pointer
  is recorded (`RequestOutput.repaired`).

A reasoning model's output is watched from where its answer begins (grammars/reasoning.py
`AnswerGate`): the reasoning's quotes, brackets and loops are free text, neither lexed nor counted
(issue 51: a lone `"` in the reasoning turned the answer's strings inside out for the lexer).

Each value is repaired at most once (after the close the output is no longer in it). Not repaired:
loops in arrays of numbers or literals (no safe point to cut: `[1, 1, 1` might go on `11`), in
object keys, and loops whose items differ (a model inventing new array elements is not a repeat).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentrt.grammars.json_lexer import JsonPointerTracker
from agentrt.grammars.length_policy import ClosingPlanner
from agentrt.grammars.reasoning import AnswerGate

if TYPE_CHECKING:
    from agentrt.runtime.constraint_state import ConstraintState

REPAIRABLE_KINDS = ("json_schema", "json_object")
"""Constraint kinds whose output is one JSON text (the tracker's assumption); other kinds are never
repaired."""


@dataclass(frozen=True)
class RepetitionConfig:
    """Detection thresholds (measured on the extraction workload with bench/runaway.py; README,
    "Runaway values"). A unit of n tokens (min_n <= n <= max_n) repeated k times consecutively at the end of a
    string value, k >= max(min_repeats, ceil(min_tokens / n)), is degenerate. Raises ValueError on
    inconsistent values.

    Units of long_n tokens or more count at 2 copies (None: min_repeats for every n).

    max_n 96 (was 64) and long_n 48: on the first 60 documents at max_tokens 300 two event titles
    loop with units of 67 and 74 tokens; 64 missed them, and at 3 copies (222 tokens) the repair
    came too late to finish the object within max_tokens; at 2 copies both rows end valid. Measured
    with the same false positives on the legitimate texts as before (bench/runaway.py --part
    thresholds; docs/benchmarks.md)."""

    min_n: int = 1
    max_n: int = 96
    min_repeats: int = 3
    min_tokens: int = 24
    long_n: int | None = 48

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n} max_n={self.max_n}")
        if self.min_repeats < 2 or self.min_tokens < 2:
            raise ValueError(
                f"min_repeats and min_tokens must be >= 2, got {self.min_repeats}, {self.min_tokens}"
            )
        if self.long_n is not None and self.long_n < 2:
            raise ValueError(f"long_n must be >= 2 or None, got {self.long_n}")

    def repeats_needed(self, n: int) -> int:
        """Consecutive copies of an n-token unit that count as degenerate."""
        copies = 2 if self.long_n is not None and n >= self.long_n else self.min_repeats
        return max(copies, -(-self.min_tokens // n))


class TailRepeats:
    """Periodicity of the tail of a token sequence. `runs[n]`: how many of the last tokens t[i] equal
    t[i - n] in a row, so the last runs[n] + n tokens are n-periodic (runs[n] // n + 1 copies)."""

    def __init__(self, config: RepetitionConfig):
        self.config = config
        self.ids: list[int] = []  # the last tokens (at least max_n + 1 of them)
        self.runs = [0] * (config.max_n + 1)

    def push(self, token_id: int) -> int | None:
        """Append a token; returns the smallest unit length n whose repetition at the tail is
        degenerate (config), or None."""
        ids, runs, cfg = self.ids, self.runs, self.config
        ids.append(token_id)
        if len(ids) > 4 * cfg.max_n + 4:
            del ids[: len(ids) - cfg.max_n - 1]
        m = len(ids)
        found = None
        for n in range(1, min(cfg.max_n, m - 1) + 1):
            runs[n] = runs[n] + 1 if ids[m - 1 - n] == token_id else 0
            if found is None and n >= cfg.min_n and runs[n] >= n * (cfg.repeats_needed(n) - 1):
                found = n
        return found

    def span(self, n: int) -> int:
        """Tokens at the tail that are n-periodic."""
        return self.runs[n] + n


class RepetitionGuard:
    """Per-request state of runaway repair (engine thread only).

    config: thresholds; token_bytes: each token id's bytes (b"" for special tokens); planner: the
    tokenizer's ClosingPlanner. gate: a reasoning model's AnswerGate at the output's start (None:
    the whole output is the answer), fed `text_bytes` (each token's text, special tokens' too);
    the tokens before the answer are skipped. `repaired`: JSON pointers of the values closed so
    far, in order.

    Which value is closed: the innermost string value or array that was already open when the
    repeating tail began (so the whole repetition lies inside it). A string is closed at once; an
    array once the output stands right after one of its complete string / object / array elements
    (so no element is cut: the loop goes on until then); an array of numbers or literals, or a
    repetition whose innermost container is an object, is left alone."""

    def __init__(
        self,
        config: RepetitionConfig,
        token_bytes: list[bytes],
        planner: ClosingPlanner,
        gate: AnswerGate | None = None,
        text_bytes: list[bytes] | None = None,
    ):
        self.config, self.token_bytes, self.planner = config, token_bytes, planner
        self.gate, self.text_bytes = gate, text_bytes if text_bytes is not None else token_bytes
        self.tracker = JsonPointerTracker()
        self.tail = TailRepeats(config)
        self.num_seen = 0  # output tokens fed to the tracker
        self.repaired: list[str] = []
        self._before = self.tracker  # the tracker before the last token
        self._last = b""  # the last token's bytes

    def push(self, token_id: int) -> int | None:
        """Feed one output token. Returns the depth of the value to close now (see `_target`) when
        it ends a degenerate repetition inside a string value or an array (the class docstring),
        else None. Changes no matcher."""
        self._before = self.tracker.copy()
        data = self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else b""
        if self.gate is not None and self.gate.state != "answer":  # the reasoning is not the answer
            text = self.text_bytes[token_id] if 0 <= token_id < len(self.text_bytes) else b""
            answer = self.gate.feed(text)
            data = answer if data else b""  # a special token's text is never JSON
            if self.gate.state != "answer":
                self.num_seen += 1
                return None
        self.tracker.feed(data, self.num_seen)
        self.num_seen += 1
        self._last = data
        unit = self.tail.push(token_id)
        return None if unit is None else self._target(self.num_seen - self.tail.span(unit))

    def feed(self, token_ids: list[int], start: int) -> int | None:
        """`push` the output tokens not seen yet (`token_ids[start:]`: the whole output so far, e.g.
        Request.token_ids after the prompt's `start` tokens); the last one's result."""
        depth = None
        for tok in token_ids[start + self.num_seen :]:
            depth = self.push(tok)
        return depth

    def check(
        self, token_ids: list[int], start: int, state: ConstraintState, left: int
    ) -> tuple[int, list[int]]:
        """`feed`, then when a value is to be closed: find the shortest text closing it, move
        `state` (the request's ConstraintState) onto it and return (tokens to drop from the end of
        the output, tokens to append); else (0, []). Dropping happens when the last token ran past
        the array element where the array is closed (`},` is one token): it is replaced by its part
        up to the element's end (only the last token, which the caller has not emitted yet).
        The value's pointer goes to `repaired`. `left`: output tokens the budget allows after the
        last token; a close needing more than left - 1 (one stays for the model) is not made, nor
        one while a max_tokens_policy "close" path is being followed. Never raises for a grammar
        it cannot close: it returns (0, []) and the request goes on."""
        depth = self.feed(token_ids, start)
        if depth is None or (state.closing is not None and state.closing.plan):
            return 0, []
        drop, tracker, keep = 0, self.tracker, ""
        string = tracker.in_value_string and depth == len(tracker.stack)
        if not string and not tracker.stack[depth].after_element:  # replace the last token
            try:
                keep = self._last[: tracker.boundary[1]].decode()
            except UnicodeDecodeError:
                return 0, []
            drop, tracker = 1, self._before.copy()
            tracker.feed(keep.encode())
        matcher = state.matcher
        if drop:
            matcher.rollback(1)
        ids = self._closing_ids(matcher, tracker, depth, keep)
        if ids and len(ids) <= left - 1 + drop and state.force(ids, left + drop):
            pointer = tracker.pointer(depth)
            self.num_seen -= drop
            self.tracker = self._before if drop else self.tracker
            for t in ids:
                self.push(t)
            self.tail = TailRepeats(self.config)
            self.repaired.append(pointer)
            return drop, ids
        if drop:  # undo: the matcher back on the sampled token
            matcher.accept_token(token_ids[-1])
        return 0, []

    def _target(self, span_start: int) -> int | None:
        """Which value to close now for a repetition starting at output token `span_start`, as a
        depth: len(stack) for the string value being written (closed: out of the string), d for the
        array stack[d] (closed: the stack back to d containers); None: nothing to close now. An
        array is closed where the output stands right after one of its elements, or where the last
        token went on from there with "," and whitespace only (`tracker.boundary`)."""
        t = self.tracker
        if t.in_value_string and t.string_opened < span_start:
            return len(t.stack)  # the string inside the innermost container
        for d in range(len(t.stack) - 1, -1, -1):
            f = t.stack[d]
            if f.opened < span_start:  # the innermost container holding the whole repetition
                if f.is_object or d != len(t.stack) - 1 or t.in_string:
                    return None
                if f.after_element:
                    return d
                b = t.boundary
                rest = self._last[b[1] :] if b is not None and b[0] == d else None
                return d if rest is not None and not rest.strip(b", \t\n\r") else None
        return None

    def _closing_ids(self, matcher, tracker: JsonPointerTracker, depth: int, keep: str) -> list[int]:
        """Tokens of `keep` (text the matcher accepts first) and then of the shortest text found
        that closes the string at stack depth `depth` (when `tracker` is in a string there) or the
        container stack[depth]; the matcher is left unchanged."""
        probe = tracker.copy()
        string = probe.in_string and depth == len(probe.stack)
        planner = self.planner
        kept: list[int] = []
        if keep:
            kept = planner.encode(keep)
            if "".join(planner.token_texts[i] or "\0" for i in kept) != keep:
                return []
            for i, t in enumerate(kept):
                if not matcher.accept_token(t):
                    if i:
                        matcher.rollback(i)
                    return []

        def closed(piece: str) -> bool:
            probe.feed(piece.encode())
            return not probe.in_string if string else len(probe.stack) <= depth

        try:
            path = planner.closing_path(matcher, until=closed)
        finally:
            if kept:
                matcher.rollback(len(kept))
        if path is None or (probe.in_string if string else len(probe.stack) > depth):
            return []
        return kept + path.token_ids


def vocab_bytes(decoded_vocab: list[bytes], special_ids) -> list[bytes]:
    """Each token id's bytes for the tracker (`decoded_vocab`: xgrammar's TokenizerInfo.decoded_vocab);
    special tokens are b"" (they are never JSON text)."""
    special = set(special_ids)
    return [b"" if i in special else bytes(b) for i, b in enumerate(decoded_vocab)]
