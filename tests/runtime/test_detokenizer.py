"""Incremental detokenization equals the full decode (trailing incomplete UTF-8 left out) after
every token, for the byte-level BPE default tokenizer and a SentencePiece (byte-fallback) one."""

from __future__ import annotations

import random

import pytest

from agentrt.runtime.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! Ça va? Tiếng Việt có dấu. 日本語のテキスト 🙂👍🏽 end.",
    '{"name": "Zoë", "city": "Hà Nội", "tags": ["a", "b"]}\n  indented  text\t tab',
    "  leading spaces, then ... punctuation ; and \"quotes\" 's 're n't",
]


@pytest.mark.parametrize("which", ["bpe", "sentencepiece"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_equals_full_decode(which, skip_special_tokens, request):
    tok = request.getfixturevalue("tokenizer" if which == "bpe" else "sentencepiece_tokenizer")
    rng = random.Random(0)
    vocab = len(tok)
    sequences = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    sequences += [[rng.randrange(vocab) for _ in range(60)] for _ in range(3)]  # random ids, specials too
    for ids in sequences:
        det = IncrementalDetokenizer(skip_special_tokens)
        for n in range(1, len(ids) + 1):
            want = tok.decode(ids[:n], skip_special_tokens=skip_special_tokens).rstrip("\ufffd")
            assert det.update(tok, ids[:n]) == want, (which, n, ids[:n])
        assert not det.full  # no fallback was needed
        step = 1 + rng.randrange(4)  # several tokens at once (jump-forward)
        det2 = IncrementalDetokenizer(skip_special_tokens)
        for n in range(step, len(ids) + 1, step):
            assert det2.update(tok, ids[:n]) == tok.decode(
                ids[:n], skip_special_tokens=skip_special_tokens
            ).rstrip("\ufffd")
