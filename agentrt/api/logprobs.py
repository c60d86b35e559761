"""OpenAI's logprobs shapes from the engine's TokenLogprob lists (runtime/request.py has the definition:
log-softmax after penalties and the grammar's mask, before temperature / top-k / top-p / min-p).

Chat completions (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}], "refusal": null}`. Text completions (`logprobs: k`):
`{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.

Token strings and bytes: `bytes` are the token's own bytes (the tokenizer's byte-level vocabulary,
as xgrammar decodes it), so the bytes of consecutive tokens join into the exact UTF-8 text even
when a character is split across tokens (OpenAI's meaning of the field); `token` is those bytes
decoded with invalid sequences replaced by U+FFFD, which is what vLLM's per-token `decode([id])`
gives (a token holding part of a multi-byte character reads "\ufffd"). Special tokens (the final
end-of-sequence token is reported, as in vLLM, since it counts in usage.completion_tokens) read as
their text, e.g. "<|im_end|>".
"""

from __future__ import annotations

from agentrt.runtime.request import RequestOutput, TokenLogprob


class TokenPieces:
    """Each token id's (text, bytes), from a GrammarBackend's xgrammar TokenizerInfo
    (`decoded_vocab`: raw bytes per id, as long as the logits). Built once per server."""

    def __init__(self, decoded_vocab: list[bytes], special_ids: set[int]):
        self._bytes = [bytes(b) for b in decoded_vocab]
        self._special = special_ids

    @classmethod
    def of_engine(cls, engine) -> TokenPieces:
        """From an AsyncEngine (its `decoded_vocab` and its tokenizer's special ids)."""
        special = set(getattr(engine.tokenizer, "all_special_ids", None) or [])
        return cls(engine.decoded_vocab, special)

    def bytes(self, token_id: int) -> bytes:
        """The token's bytes (b"" for an id outside the vocabulary)."""
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def num_chars(self, token_id: int) -> int:
        """Characters the token adds to the completion text: the UTF-8 lead bytes in it (a
        continuation byte completes an earlier character); 0 for special tokens (not in the text)."""
        if token_id in self._special:
            return 0
        return sum((b & 0xC0) != 0x80 for b in self.bytes(token_id))

    def entry(self, token_id: int, logprob: float) -> dict:
        """One chat `{"token", "logprob", "bytes"}` object."""
        return {"token": self.text(token_id), "logprob": logprob, "bytes": list(self.bytes(token_id))}


def chat_logprobs(pieces: TokenPieces, lps: list[TokenLogprob]) -> dict:
    """The chat completion choice's `logprobs` object for these tokens."""
    content = []
    for lp in lps:
        entry = pieces.entry(lp.token_id, lp.logprob)
        entry["top_logprobs"] = [pieces.entry(t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(pieces: TokenPieces, lps: list[TokenLogprob], text_offset: int = 0) -> dict:
    """The text completion choice's `logprobs` object for these tokens; `text_offset`: where the
    first of them starts in the completion text (characters). A top entry whose text equals a more
    likely one's (two ids reading the same, e.g. partial characters) is left out: the object is
    keyed by text."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in lps:
        tokens.append(pieces.text(lp.token_id))
        values.append(lp.logprob)
        top: dict[str, float] = {}
        for t, v in lp.top:
            top.setdefault(pieces.text(t), v)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += pieces.num_chars(lp.token_id)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class LogprobStream:
    """The logprobs of one streamed choice, chunk by chunk: `pending(out)` is the logprobs object of
    the tokens not sent yet (None when the request asked for none or there are none), `commit(out)`
    marks them sent once a chunk carried them."""

    def __init__(self, pieces: TokenPieces, chat: bool):
        self.pieces, self.chat = pieces, chat
        self.sent = 0
        self.text_offset = 0

    def pending(self, out: RequestOutput) -> dict | None:
        if out.logprobs is None or len(out.logprobs) <= self.sent:
            return None
        new = out.logprobs[self.sent :]
        if self.chat:
            return chat_logprobs(self.pieces, new)
        return completion_logprobs(self.pieces, new, self.text_offset)

    def commit(self, out: RequestOutput) -> None:
        if out.logprobs is None:
            return
        self.text_offset += sum(self.pieces.num_chars(lp.token_id) for lp in out.logprobs[self.sent :])
        self.sent = len(out.logprobs)
