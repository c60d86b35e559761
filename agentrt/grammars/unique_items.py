"""`uniqueItems` over free strings, enforced exactly by the matcher at string completion.

No context-free grammar tells distinct unbounded strings apart, so the grammar admits any array of
strings there and this module refuses, token by token, the tokens that would complete an element
equal to an earlier element of the same array (issue 21, "an exact check when a value completes").

- Schema side (`unique_plan`): the normalizer marks such arrays (json_schema/arrays.UNIQUE_STRINGS:
  items exactly `{"type": "string"}`). The plan maps a place in the instance to its subschema by
  object keys (`properties`, else `additionalProperties`), array positions (`prefixItems`, else
  `items`), `$ref`, and `anyOf` branches told apart by container type (an object or an array).
  A marked array reachable any other way (two `anyOf` branches of one container type, under
  `patternProperties` or `contains`) is refused (`UnsupportedSchemaError` naming the keyword and
  its pointer): which subschema an element obeys would be ambiguous there.
- Runtime side (`UniqueItemsMatcher`): wraps the request's xgrammar GrammarMatcher. A byte-level
  JSON lexer (grammars/json_lexer.py) follows the output; each array frame carries its plan node
  and, for a marked array, the frozenset of its elements so far (decoded JSON strings, so `"a"`
  and `"\\u0061"` are equal, as JSON Schema's equality says). `accept_token` rejects a token that
  completes a duplicate; `fill_next_token_bitmask` (and `restrict`, after a batched fill) clears
  the bits of such tokens. Only tokens whose bytes hold a quote can complete a string element,
  and outside a marked array only those that also open an array can: the check simulates those
  (at most about 1,000 of SmolLM2's 49,152 tokens), not the whole vocabulary.

A reasoning model's output (a spec with `reasoning`) is checked from where its answer begins
(grammars/reasoning.py `AnswerGate`, fed each token's text): quotes and brackets in the reasoning
are free text, never the answer's strings (issue 51: a lone `"` in the reasoning let `["a", "a"]`
through; a reasoning quoting `["x", "x"]` had its closing quote masked).

No dead end follows a refused token: the element is a free string, so when its text so far equals
an earlier element the grammar still admits any further character, and the mask keeps those; a
duplicate can only be completed, never forced (jump-forward never forces a free string's text).
Rollback (speculative decoding, the closing-path planner, runaway repair) restores the lexer state
saved per accepted token, so every path that drives the matcher sees the same check.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from agentrt.grammars.json_lexer import JsonPointerTracker, _Frame
from agentrt.grammars.json_schema.arrays import UNIQUE_STRINGS
from agentrt.grammars.json_schema.errors import UnsupportedSchemaError
from agentrt.grammars.reasoning import AnswerGate

_AMBIGUOUS = (
    "unique strings are checked only where the array's subschema is decided by keys, positions "
    "and container types; this array lies under {where}"
)


# ---- schema side ---------------------------------------------------------------------------------
def _mark(s) -> str | None:
    """The `uniqueItems` pointer of a marked array schema, else None. A marker is the key beside
    `"type": "array"` with a string value: a property that happens to have the marker's name has a
    schema (a dict) as its value and lives in a `properties` map."""
    if isinstance(s, dict) and s.get("type") == "array" and isinstance(s.get(UNIQUE_STRINGS), str):
        return s[UNIQUE_STRINGS]
    return None


def has_marks(schema) -> bool:
    """Whether a normalized schema holds a UNIQUE_STRINGS marker."""
    if isinstance(schema, dict):
        return _mark(schema) is not None or any(
            has_marks(v) for k, v in schema.items() if k not in ("enum", "const")
        )
    return isinstance(schema, list) and any(has_marks(v) for v in schema)


def strip_marks(schema):
    """A copy of `schema` without UNIQUE_STRINGS markers (the grammar's schema)."""
    if isinstance(schema, dict):
        mark = _mark(schema) is not None
        return {
            k: v if k in ("enum", "const") else strip_marks(v)
            for k, v in schema.items()
            if not (mark and k == UNIQUE_STRINGS)
        }
    if isinstance(schema, list):
        return [strip_marks(v) for v in schema]
    return schema


def unique_plan(schema: dict, best_effort: bool = False, not_enforced: list[str] | None = None) -> list[dict]:
    """The plan of a normalized schema with markers: a list of nodes (node 0: the root), each
    `{"object": {"p": {key: node}, "a": node}, "array": {"pi": [node], "i": node, "u": pointer}}`
    (either part absent: that container type is not followed; a node value None: not followed).
    Raises UnsupportedSchemaError for a marker in an ambiguous place, or under `best_effort`
    drops it and appends "uniqueItems at pointer" to `not_enforced`. JSON-serializable."""
    planner = _Planner(schema.get("$defs", {}) if isinstance(schema, dict) else {})
    planner.node(schema)
    for pointer, where in planner.ambiguous:
        if not best_effort:
            raise UnsupportedSchemaError("uniqueItems", pointer, _AMBIGUOUS.format(where=where))
        if not_enforced is not None:
            not_enforced.append(f"uniqueItems at {pointer} ({where})")
    return planner.nodes  # under best effort the ambiguous places are not followed (not checked)


class _Planner:
    """Builds unique_plan's nodes over one normalized schema; collects the markers it finds in
    ambiguous places as (marker pointer, where)."""

    def __init__(self, defs: dict):
        self.defs = defs
        self.nodes: list[dict | None] = []
        self.memo: dict[int, int] = {}  # id(subschema) -> its node
        self.ambiguous: list[tuple[str, str]] = []  # (marker pointer, where)

    def resolve(self, s, seen=()):
        """`s` with its local $refs followed (a cycle resolves to {})."""
        while isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#/$defs/"):
            name = s["$ref"][len("#/$defs/") :]
            if name in seen:
                return {}
            seen = (*seen, name)
            s = self.defs.get(name, {})
        return s

    def check(self, s, where: str, visited: set[int]) -> None:
        """Record every marker reachable from `s` (any keyword) as ambiguous."""
        s = self.resolve(s)
        if isinstance(s, list):
            for x in s:
                self.check(x, where, visited)
            return
        if not isinstance(s, dict) or id(s) in visited:
            return
        visited.add(id(s))
        if (mark := _mark(s)) is not None:
            self.ambiguous.append((mark, where))
        for k, v in s.items():
            if k not in ("enum", "const") and isinstance(v, (dict, list)):
                self.check(v, where, visited)

    def node(self, s) -> int | None:
        """The index of the node of subschema `s` (added, with the nodes below it, on first sight), or
        None where values are not followed."""
        s = self.resolve(s)
        if not isinstance(s, dict):
            return None
        if id(s) in self.memo:
            return self.memo[id(s)]
        idx = self.memo[id(s)] = len(self.nodes)
        self.nodes.append(None)
        branches = [self.resolve(b) for b in s["anyOf"]] if "anyOf" in s else [s]
        entry: dict = {}
        for kind in ("object", "array"):
            mine = [b for b in branches if _may_be(b, kind)]
            if len(mine) == 1 and mine[0].get("type") == kind:
                entry[kind] = self._object(mine[0]) if kind == "object" else self._array(mine[0])
            else:  # which branch a value obeys is not decided by its container type
                for b in mine:
                    self.check(b, "anyOf branches of one container type", set())
        self.nodes[idx] = entry
        return idx

    def _object(self, b: dict) -> dict:
        """The object part of a node: its properties' nodes and additionalProperties' node."""
        props = {k: self.node(v) for k, v in b.get("properties", {}).items()}
        addl = b.get("additionalProperties", {})
        if "patternProperties" in b:  # a key's subschema depends on which pattern it matches
            for v in b["patternProperties"].values():
                self.check(v, "patternProperties", set())
            self.check(addl, "additionalProperties beside patternProperties", set())
            return {"p": props, "a": None}
        return {"p": props, "a": self.node(addl)}

    def _array(self, b: dict) -> dict:
        """The array part of a node: prefixItems' and items' nodes, the marker's pointer if any."""
        if "contains" in b:
            self.check(b["contains"], "contains", set())
        out = {"pi": [self.node(x) for x in b.get("prefixItems", [])], "i": self.node(b.get("items", {}))}
        if (mark := _mark(b)) is not None:
            out["u"] = mark
        return out


def _may_be(s, kind: str) -> bool:
    """Whether subschema `s` (normalized, resolved) may accept a value of container type `kind`."""
    if not isinstance(s, dict):
        return s is not False
    if "type" in s:
        return s["type"] == kind
    if "enum" in s:
        want = dict if kind == "object" else list
        return any(isinstance(v, want) for v in s["enum"])
    if "anyOf" in s:
        return any(_may_be(b, kind) for b in s["anyOf"])
    return True


# ---- runtime side --------------------------------------------------------------------------------
class UniqueStringsTracker(JsonPointerTracker):
    """The JSON lexer with each container's plan node and each marked array's elements.
    `duplicate`: a string element equal to an earlier one completed (the text is refused)."""

    def __init__(self, plan: list[dict]):
        super().__init__()
        self.plan = plan
        self.duplicate = False

    def _opened(self, frame: _Frame, parent: _Frame | None) -> None:
        if parent is None:
            ref = 0 if self.plan else None
        elif parent.node is None:
            ref = None
        elif parent.is_object:
            ref = parent.node["p"].get(parent.where, parent.node["a"])
        else:
            prefix, i = parent.node["pi"], parent.where
            ref = prefix[i] if i < len(prefix) else parent.node["i"]
        entry = self.plan[ref] if ref is not None else None
        frame.node = None if entry is None else entry.get("object" if frame.is_object else "array")
        if frame.node is not None and not frame.is_object and "u" in frame.node:
            frame.seen = frozenset()

    def _keeps(self, frame: _Frame) -> bool:
        return frame.seen is not None

    def _element(self, frame: _Frame, raw: bytes) -> None:
        try:
            value = json.loads(b'"' + raw + b'"')
        except ValueError:  # not a complete JSON string (cannot happen under the grammar)
            value = raw
        if value in frame.seen:
            self.duplicate = True
        else:
            frame.seen = frame.seen | {value}

    @property
    def in_unique_array(self) -> bool:
        return bool(self.stack) and self.stack[-1].seen is not None


class VocabBytes:
    """Per-tokenizer tables for the check (built once per GrammarBackend): each token id's bytes (b""
    for special tokens; `text_bytes`: with special tokens' text, what a reasoning gate reads) and,
    as int64 arrays, the ids whose bytes hold a quote (`quote_ids`), two
    or more (`multi_quote_ids`: the only ones that can open and complete a string), one after a
    backslash (`escaped_quote_ids`), and of the multi-quote ones those holding `[`
    (`open_quote_ids`: the only ones that can complete an element of an array they open).
    `closing`: for the other one-quote tokens, the bytes before the quote -> their ids (inside a
    string element, the token completes exactly the current text plus those bytes)."""

    def __init__(self, decoded_vocab, special_ids):
        special = set(special_ids)
        self.text_bytes = [bytes(b) for b in decoded_vocab]
        self.token_bytes = [b"" if i in special else b for i, b in enumerate(self.text_bytes)]
        quote = [i for i, b in enumerate(self.token_bytes) if b'"' in b]
        multi = [i for i in quote if self.token_bytes[i].count(b'"') > 1]
        single = [i for i in quote if self.token_bytes[i].count(b'"') == 1]
        escaped = [i for i in single if b"\\" in self.token_bytes[i].split(b'"')[0]]
        closing: dict[bytes, list[int]] = {}
        for i in set(single) - set(escaped):
            closing.setdefault(self.token_bytes[i].split(b'"')[0], []).append(i)
        self.quote_ids = np.array(quote, dtype=np.int64)
        self.multi_quote_ids = np.array(multi, dtype=np.int64)
        self.escaped_quote_ids = np.array(escaped, dtype=np.int64)
        self.multi_or_escaped_ids = np.concatenate([self.multi_quote_ids, self.escaped_quote_ids])
        self.open_quote_ids = np.array([i for i in multi if b"[" in self.token_bytes[i]], dtype=np.int64)
        self.closing = {k: np.array(v, dtype=np.int64) for k, v in closing.items()}


class UniqueItemsMatcher:
    """An xgrammar GrammarMatcher (`inner`) plus the unique-strings check (module docstring). Drop-in
    for the methods the engine uses; anything else is the inner matcher's. `gate`: a reasoning
    model's AnswerGate (grammars/reasoning.py; None: the whole output is the answer), in its state
    at the output's start."""

    def __init__(self, inner, plan: list[dict], vocab: VocabBytes, gate: AnswerGate | None = None):
        self.inner, self.plan, self.vocab = inner, plan, vocab
        self.tracker = UniqueStringsTracker(plan)
        self._gate0 = gate
        self.gate = None if gate is None else gate.copy()
        # (tracker, gate) before each accepted token
        self._history: list[tuple[UniqueStringsTracker, AnswerGate | None]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _after(
        self, data: bytes, text: bytes | None = None
    ) -> tuple[UniqueStringsTracker, AnswerGate | None] | None:
        """The (tracker, gate) after a token whose answer bytes are `data` and whose text is `text`
        (default `data`; they differ for a special token: b"" and its text), or None when it
        completes a duplicate element. While the gate is short of the answer it reads `text`, and the tracker only the
        answer's part of it (none of a special token's)."""
        gate = self.gate
        if gate is not None and gate.state != "answer":
            gate = gate.copy()
            answer = gate.feed(data if text is None else text)
            data = answer if data else b""
        t = self.tracker.copy()
        t.feed(data)
        return None if t.duplicate else (t, gate)

    def _after_token(self, token_id: int) -> tuple[UniqueStringsTracker, AnswerGate | None] | None:
        v = self.vocab
        if 0 <= token_id < len(v.token_bytes):
            return self._after(v.token_bytes[token_id], v.text_bytes[token_id])
        return self._after(b"", b"")

    def _take(self, after) -> None:
        self._history.append((self.tracker, self.gate))
        self.tracker, self.gate = after

    def accept_token(self, token_id: int, *, debug_print: bool = False) -> bool:
        after = self._after_token(token_id)
        if after is None or not self.inner.accept_token(token_id):
            return False
        self._take(after)
        return True

    def accept_string(self, text: str, *, debug_print: bool = False) -> bool:
        """Accept a whole text at once (conformance checks, jump-forward's step-by-step search);
        one rollback step, as for xgrammar's matcher."""
        after = self._after(text.encode())
        if after is None or not self.inner.accept_string(text):
            return False
        self._take(after)
        return True

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        for _ in range(num_tokens):
            self.tracker, self.gate = self._history.pop()

    def reset(self) -> None:
        self.inner.reset()
        self.tracker, self._history = UniqueStringsTracker(self.plan), []
        self.gate = None if self._gate0 is None else self._gate0.copy()

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0, *, debug_print: bool = False):
        self.inner.fill_next_token_bitmask(bitmask, index)
        self.restrict(bitmask, index)

    def restrict(self, bitmask: torch.Tensor, row: int) -> int:
        """Clear, in `bitmask` [B, ceil(V / 32)] int32 row `row` (filled from the inner matcher), the
        bits of tokens that complete a duplicate element. Returns how many were cleared.

        Which tokens are simulated (VocabBytes): outside a marked array only multi-quote tokens
        holding `[`; inside one, between elements, the multi-quote tokens; inside an element string
        whose text so far decodes, the one-quote tokens are looked up (the earlier elements that
        extend the text name the bytes that would complete them) and only the multi-quote and
        escaped-quote tokens simulated; otherwise (an escape or a UTF-8 sequence split at the token
        boundary) every quote token."""
        v, t = self.vocab, self.tracker
        refuse: list[np.ndarray] = []
        if not t.in_unique_array:
            sim = v.open_quote_ids
        elif not t.in_value_string:
            sim = v.multi_quote_ids
        else:
            seen, so_far = t.stack[-1].seen, None
            # a text longer than 12 bytes per character of every earlier element cannot equal one
            # (JSON spells a character in at most 12 bytes: a surrogate pair's two \u escapes)
            longest = max((len(e) for e in seen if isinstance(e, str)), default=-1)
            if t.string_len > 12 * longest:
                sim = v.multi_or_escaped_ids
            else:
                if not t.escape:
                    try:
                        so_far = json.loads(b'"' + t.key_bytes + b'"')
                    except ValueError:
                        pass
                if so_far is None:
                    sim = v.quote_ids
                else:
                    sim = v.multi_or_escaped_ids
                    for e in seen:
                        if isinstance(e, str) and e.startswith(so_far):
                            # surrogatepass: a lone surrogate (valid JSON, "\ud800") has no UTF-8;
                            # no token spells it raw, so the lookup simply misses
                            ids = v.closing.get(e[len(so_far) :].encode("utf-8", "surrogatepass"))
                            if ids is not None:
                                refuse.append(ids)
        words = bitmask[row].numpy().view(np.uint32)  # a view: writes go to the bitmask (no autograd)

        def allowed(ids: np.ndarray) -> list[int]:
            return ids[((words[ids >> 5] >> (ids & 31)) & 1).astype(bool)].tolist() if len(ids) else []

        out = [x for ids in refuse for x in allowed(ids)]
        out += [x for x in allowed(sim) if self._after(v.token_bytes[x], v.text_bytes[x]) is None]
        for x in out:
            words[x >> 5] &= np.uint32(~(1 << (x & 31)) & 0xFFFFFFFF)
        return len(out)
