"""Incremental detokenization: the text of a growing token list without decoding all of it at
every step (vLLM's prefix/read offsets, vllm/transformers_utils/detokenizer_utils.py).

Decoding the whole output every token costs O(output length) per token: 0.4 ms per request at
2000 tokens with the default tokenizer, i.e. 26 ms of host time per step at batch 64. Here each
step decodes only a short window: the tokens since `prefix_offset`, diffed against the window's
already-committed part (decoding a window from an earlier token keeps SentencePiece's leading
space and byte-fallback pieces right). Text is committed only when the window does not end in an
incomplete UTF-8 sequence ("\\ufffd"); until then the complete part is returned uncommitted.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Per-request state. `update(tokenizer, ids)` returns the text of `ids` with any trailing
    incomplete UTF-8 sequence left out: for tokenizers whose decode is local (byte-level BPE,
    SentencePiece) that equals `tokenizer.decode(ids).rstrip("\\ufffd")` (a test holds it). `ids`
    must extend the previous call's list; a list that does not (or a decode that is not
    prefix-stable) makes it fall back to full decodes from then on."""

    def __init__(self, skip_special_tokens: bool = True):
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # committed text of ids[:read_offset]
        self.prefix_offset = 0
        self.read_offset = 0
        self.last_len = 0
        self.full = False  # fallback: decode everything each time

    def update(self, tokenizer, ids: list[int]) -> str:
        skip = self.skip_special_tokens
        if self.full or len(ids) < self.last_len:
            self.full = True
            return tokenizer.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")
        self.last_len = len(ids)
        prefix_text = tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        new_text = tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=skip)
        if not new_text.startswith(prefix_text):
            self.full = True
            return tokenizer.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")
        added = new_text[len(prefix_text) :]
        if added and not added.endswith("\ufffd"):
            self.text += added
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            return self.text
        return self.text + added.rstrip("\ufffd")
