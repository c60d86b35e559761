"""Per-field confidence of a JSON output: the probability the model gave each leaf value.

For every leaf value of the output (a string, number, true/false or null; arrays and objects are
not leaves, so an empty one gets no entry), keyed by its RFC 6901 JSON pointer ("/customer/name",
"/line_items/0/quantity"), the confidence is

    p = exp(sum of the logprobs of the tokens whose characters overlap the value's text span)

with each token's logprob taken from the distribution it was sampled from: the engine reports the
log-softmax of the logits after the grammar's mask (renormalised over the tokens the grammar
allowed), before temperature. Tokens the grammar forced (jump-forward, a one-option enum) have
logprob 0, so a forced value has confidence 1.0.

The span of a value, in characters of the output text:
- a string: from its opening quote through its closing quote, both included: the opening quote is
  where the model chooses a string (over null or a number, when the schema allows both) and the
  closing quote is where it decides the value ends;
- a number: its digits plus the next non-whitespace character after it (",", "}" or "]"), which is
  where the model decides the number ends (61 vs 613);
- true / false / null: the literal.
A token whose text straddles two values (e.g. `","` closing one string and opening the next key,
or `1,` ending a number) counts in every value it overlaps. A token that decodes to no character
of its own (the first bytes of a multi-byte UTF-8 character) is counted with the character it
begins. Keys and punctuation outside the spans are not counted.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Sequence
from typing import Any

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WS = " \t\n\r"


def escape_pointer_token(token: str) -> str:
    """One RFC 6901 reference token: "~" -> "~0", "/" -> "~1"."""
    return token.replace("~", "~0").replace("/", "~1")


def leaf_spans(text: str) -> dict[str, tuple[int, int]]:
    """JSON pointer -> (start, end) character span of every leaf value of the JSON document `text`
    (spans as in the module docstring). Raises ValueError when `text` is not one JSON value."""
    spans: dict[str, tuple[int, int]] = {}

    def skip(i: int) -> int:
        while i < len(text) and text[i] in _WS:
            i += 1
        return i

    def value(i: int, pointer: str) -> int:
        i = skip(i)
        if i >= len(text):
            raise ValueError("unexpected end of JSON")
        c = text[i]
        if c == "{":
            i = skip(i + 1)
            if text[i : i + 1] == "}":
                return i + 1
            while True:
                i = skip(i)
                if text[i : i + 1] != '"':
                    raise ValueError(f"expected a key at character {i}")
                key, i = json.decoder.scanstring(text, i + 1)
                i = skip(i)
                if text[i : i + 1] != ":":
                    raise ValueError(f"expected ':' at character {i}")
                i = skip(value(i + 1, f"{pointer}/{escape_pointer_token(key)}"))
                if text[i : i + 1] == ",":
                    i += 1
                elif text[i : i + 1] == "}":
                    return i + 1
                else:
                    raise ValueError(f"expected ',' or '}}' at character {i}")
        if c == "[":
            i = skip(i + 1)
            if text[i : i + 1] == "]":
                return i + 1
            k = 0
            while True:
                i = skip(value(i, f"{pointer}/{k}"))
                k += 1
                if text[i : i + 1] == ",":
                    i += 1
                elif text[i : i + 1] == "]":
                    return i + 1
                else:
                    raise ValueError(f"expected ',' or ']' at character {i}")
        if c == '"':
            _, end = json.decoder.scanstring(text, i + 1)
            spans[pointer] = (i, end)
            return end
        for literal in ("true", "false", "null"):
            if text.startswith(literal, i):
                spans[pointer] = (i, i + len(literal))
                return i + len(literal)
        m = _NUMBER.match(text, i)
        if m is None:
            raise ValueError(f"unexpected character {c!r} at {i}")
        after = skip(m.end())
        spans[pointer] = (i, after + 1 if after < len(text) else m.end())
        return m.end()

    end = skip(value(0, ""))
    if end != len(text):
        raise ValueError(f"extra data after the JSON value at character {end}")
    return spans


def token_spans(token_ends: Sequence[int]) -> list[tuple[int, int]]:
    """Each token's character span from the text length after each token (`token_ends[i]`: the
    length of the decoded text of tokens 0..i, a trailing incomplete character left out). A token
    adding no character gets the one character it begins."""
    spans, start = [], 0
    for end in token_ends:
        spans.append((start, end) if end > start else (start, start + 1))
        start = max(start, end)
    return spans


def field_confidence(text: str, token_ends: Sequence[int], logprobs: Sequence[float]) -> dict[str, float]:
    """JSON pointer -> probability of each leaf value of the JSON `text` (module docstring).
    token_ends: per output token, the decoded text length through it (see `token_spans`);
    logprobs: per output token, its logprob (natural log). Raises ValueError when the two lengths
    differ or `text` is not JSON."""
    if len(token_ends) != len(logprobs):
        raise ValueError(f"{len(token_ends)} token offsets but {len(logprobs)} logprobs")
    tokens = token_spans(token_ends)
    result = {}
    for pointer, (s, e) in leaf_spans(text).items():
        total = sum(lp for (a, b), lp in zip(tokens, logprobs) if a < e and b > s)
        result[pointer] = math.exp(total)
    return result


def token_ends_from_ids(tokenizer: Any, token_ids: Sequence[int]) -> list[int]:
    """Decoded text length after each token id (special tokens skipped), by incremental decoding
    (agentrt/runtime/detokenizer.py), O(output length) decodes of short windows."""
    from agentrt.runtime.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(skip_special_tokens=True)
    ids = list(token_ids)
    return [len(detok.update(tokenizer, ids[: i + 1])) for i in range(len(ids))]


def token_ends_from_bytes(token_bytes: Sequence[bytes]) -> list[int]:
    """Decoded text length after each token given its UTF-8 bytes (OpenAI's logprobs `bytes`)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    ends, n = [], 0
    for b in token_bytes:
        n += len(decoder.decode(bytes(b)))
        ends.append(n)
    return ends


def below(confidence: dict[str, float] | None, threshold: float | None) -> bool | None:
    """Whether some field's confidence is below `threshold` (None without a threshold; True when
    a threshold is set but there is no confidence to check it against: review it)."""
    if threshold is None:
        return None
    if confidence is None:
        return True
    return any(p < threshold for p in confidence.values())
