"""Refuse a prompt text that cannot fit the context before tokenizing it.

Tokenizing costs time and memory in proportion to the text (a 12 MB prompt took 12 s and 4.8 GB
before its context-length 400). A token never stands for more prompt bytes than the longest token
text in the vocabulary, so a text of B UTF-8 bytes has at least ceil(B / max_bytes_per_token)
tokens; when that alone reaches the context limit the prompt is refused at once.

The bound holds for tokenizers that never shrink text before splitting it: byte-level BPE (GPT-2
family, SmolLM2, Llama 3, Qwen) and BPE with byte fallback (SentencePiece-style Llama 2, Mistral,
Gemma). A byte with no token of its own is dropped by such a tokenizer (SmolLM2 has none for six
ASCII control bytes and some UTF-8 lead bytes), so the characters holding one are not counted
(`TokenBound.dropped`). For any other tokenizer (normalizers such as NFKC or whitespace collapsing,
WordPiece, unknown-token models, added tokens that strip whitespace) `token_bound` returns None and
prompts are tokenized in full, as before.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from agentrt.errors import ContextLengthError

# pre-tokenizers that split or re-spell text without removing any of it
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}


@dataclass(frozen=True)
class TokenBound:
    """What a tokenizer's vocabulary says about token counts: a token stands for at most
    `max_bytes_per_token` UTF-8 bytes of input, except that one byte of each character matched by
    `dropped` (None: no such characters) may be dropped, with no token at all."""

    max_bytes_per_token: int
    dropped: re.Pattern | None = None

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text` (O(len(text)), no tokenizing)."""
        num_bytes = len(text.encode("utf-8", "surrogatepass"))
        if self.dropped is not None:
            num_bytes -= self.dropped.subn("", text)[1]
        return math.ceil(num_bytes / self.max_bytes_per_token)


def token_bound(tokenizer) -> TokenBound | None:
    """The token-count bound of `tokenizer`, or None when none is known (see the module
    docstring). A token's stored text is never shorter than the input it encodes: byte-level BPE
    stores one character (1-2 bytes) per input byte, '▁' (3 bytes) stands for a space, a
    byte-fallback token '<0x41>' for one byte."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: nothing known about its model
        return None
    normalizer, pre = _spec(backend.normalizer), _spec(backend.pre_tokenizer)
    byte_fallback = bool(getattr(backend.model, "byte_fallback", False))
    if type(backend.model).__name__ != "BPE" or not (byte_fallback or _has_byte_level(pre)):
        return None
    if not _keeps_text(normalizer, _normalizer_keeps) or not _keeps_text(pre, _pre_tokenizer_keeps):
        return None
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None  # such a token also swallows the whitespace around it
    vocab = tokenizer.get_vocab()
    if byte_fallback:
        missing = [b for b in range(256) if f"<0x{b:02X}>" not in vocab]
    else:
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # byte-level BPE's alphabet

        char_of = bytes_to_unicode()
        missing = [b for b in range(256) if char_of[b] not in vocab]
    dropped = _dropped_chars(missing)
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=0)
    if dropped is False or longest == 0:
        return None
    return TokenBound(longest, dropped)


@dataclass(frozen=True)
class PromptBound:
    """Refuses texts that cannot fit `limit` tokens (the engine's context limit) by the tokenizer's
    `tokens` bound (None: never refuses; the text is tokenized in full)."""

    tokens: TokenBound | None
    limit: int

    def check(self, text: str, param: str) -> None:
        """Raises ContextLengthError naming `param` (the engine's message, with "at least") when
        `text` has at least `limit` tokens by the byte bound alone. O(len(text)), no tokenizing."""
        if self.tokens is None or len(text) < self.limit:  # short: tokenizing it is cheap
            return
        n = self.tokens.min_tokens(text)
        if n >= self.limit:
            raise ContextLengthError(
                f"prompt has at least {n} tokens, which leaves no room in the context limit of "
                f"{self.limit} tokens",
                param=param,
                num_prompt_tokens=n,
                limit=self.limit,
            )


def _dropped_chars(missing: list[int]) -> re.Pattern | None | bool:
    """A pattern matching each character one of whose UTF-8 bytes is in `missing` (bytes without a
    token, dropped when encoding): an ASCII byte is its own character, a lead byte starts a range
    of code points. None when no such character exists; False when a continuation byte (0x80-0xBF,
    in many characters) is missing: no pattern then."""
    ranges: list[tuple[int, int]] = []
    for b in missing:
        if b < 0x80:
            ranges.append((b, b))
        elif b < 0xC0:
            return False
        elif 0xC2 <= b <= 0xDF:
            lo = (b & 0x1F) << 6
            ranges.append((lo, lo + 0x3F))
        elif 0xE0 <= b <= 0xEF:
            lo = (b & 0x0F) << 12
            ranges.append((max(lo, 0x800), lo + 0xFFF))
        elif 0xF0 <= b <= 0xF4:
            lo = (b & 0x07) << 18
            ranges.append((max(lo, 0x10000), min(lo + 0x3FFFF, 0x10FFFF)))
        # 0xC0, 0xC1 and 0xF5-0xFF never occur in UTF-8
    if not ranges:
        return None
    return re.compile("[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges) + "]")


def _spec(component) -> dict | None:
    """A normalizer's or pre-tokenizer's settings as the tokenizer.json entry (None: absent)."""
    return None if component is None else json.loads(component.__getstate__())


def _has_byte_level(pre) -> bool:
    if not pre:
        return False
    if pre.get("type") == "Sequence":
        return any(_has_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"


def _keeps_text(component, keeps) -> bool:
    """Whether a normalizer / pre-tokenizer (its JSON) never shortens the text; None keeps it."""
    if component is None:
        return True
    if component.get("type") == "Sequence":
        parts = component.get("normalizers", component.get("pretokenizers", []))
        return all(_keeps_text(p, keeps) for p in parts)
    return keeps(component)


def _normalizer_keeps(n: dict) -> bool:
    if n.get("type") == "Prepend":
        return True
    if n.get("type") == "Replace":
        pattern = n.get("pattern", {}).get("String")
        return pattern is not None and len(n.get("content", "").encode()) >= len(pattern.encode())
    return False  # NFKC, Lowercase, Strip, BertNormalizer, regex replaces... may shrink text


def _pre_tokenizer_keeps(p: dict) -> bool:
    return p.get("type") in _KEEPING_PRE_TOKENIZERS and p.get("behavior") != "Removed"
