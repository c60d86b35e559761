"""api/prompt_limit.py: the bytes-per-token bound is sound (never refuses a prompt that would fit)
on the fake byte tokenizer and on the real byte-level BPE and SentencePiece tokenizers, and is
withheld for tokenizers that can shrink text."""

from __future__ import annotations

import math
import random

import pytest
from tokenizers import normalizers, pre_tokenizers

from agentrt.api.prompt_limit import PromptBound, TokenBound, token_bound
from agentrt.errors import ContextLengthError
from agentrt.testing import byte_tokenizer

SAMPLES = [
    " " * 5000,
    "\n" * 3000,
    "\t \n" * 1000,
    "a" * 4000,
    "=" * 3000,
    "é" * 2000,
    "日本語のテキスト" * 300,
    "🙂" * 800,
    "<|im_start|>" * 200,
    "<|endoftext|>" * 200,
    "def f(x):\n    return x\n" * 200,
    "ＡＢＣ" * 500,  # fullwidth: NFKC would shrink it
    "\x04\x06\x13" * 1000 + "hi",  # control bytes SmolLM2 has no token for (dropped)
    chr(0x40000) * 500,  # its UTF-8 lead byte 0xF1 has no token in SmolLM2 either
]


def _random_texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = [" ", "  ", "\n", "a", "the", "▁", "é", "日", "🙂", "\u0301", "<|im_end|>", "0", "{}", "\x04"]
    alphabet += [chr(0x40000), chr(0x80), "\x7f"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 800))) for _ in range(n)]


def _assert_sound(tokenizer) -> TokenBound:
    bound = token_bound(tokenizer)
    assert bound is not None
    for text in SAMPLES + _random_texts(0, 40):
        n = len(tokenizer.encode(text, add_special_tokens=False))
        assert n >= bound.min_tokens(text), (text[:40], n, bound)
    return bound


def test_bound_of_the_fake_byte_tokenizer():
    bound = _assert_sound(byte_tokenizer())
    assert bound == TokenBound(len("<|endoftext|>"), None)
    assert bound.min_tokens("x" * 130) == 10


def test_bound_is_sound_on_the_default_model_tokenizer(tokenizer):
    bound = _assert_sound(tokenizer)
    assert bound.max_bytes_per_token < 200 and bound.dropped is not None
    # the characters it has no byte token for do not count
    assert bound.min_tokens("\x04" * 10_000) == 0
    assert bound.min_tokens(chr(0x40000) * 100) == math.ceil(300 / bound.max_bytes_per_token)


def test_bound_is_sound_on_a_sentencepiece_tokenizer(sentencepiece_tokenizer):
    bound = _assert_sound(sentencepiece_tokenizer)
    assert bound.max_bytes_per_token < 200 and bound.dropped is None


@pytest.mark.parametrize(
    "normalizer",
    [
        normalizers.NFKC(),
        normalizers.Lowercase(),
        normalizers.Replace("  ", " "),
        normalizers.Sequence([normalizers.Replace(" ", "▁"), normalizers.NFC()]),
    ],
    ids=["nfkc", "lowercase", "collapse-spaces", "sequence-with-nfc"],
)
def test_no_bound_when_the_normalizer_may_shrink_text(normalizer):
    tok = byte_tokenizer()
    tok.backend_tokenizer.normalizer = normalizer
    assert token_bound(tok) is None


def test_bound_kept_when_the_normalizer_only_grows_text():
    tok = byte_tokenizer()
    tok.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    assert token_bound(tok) == TokenBound(len("<|endoftext|>"), None)


def test_no_bound_when_the_pre_tokenizer_drops_text():
    tok = byte_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert token_bound(tok) is None


def test_check_refuses_only_what_cannot_fit():
    bound = PromptBound(TokenBound(4), limit=100)
    bound.check("x" * 396, "prompt")  # at least 99 tokens: may fit
    with pytest.raises(ContextLengthError) as e:
        bound.check("x" * 397, "messages")  # at least 100: no room left
    assert (e.value.param, e.value.num_prompt_tokens, e.value.limit) == ("messages", 100, 100)
    assert str(e.value.message) == (
        "prompt has at least 100 tokens, which leaves no room in the context limit of 100 tokens"
    )
    PromptBound(None, 100).check("x" * 10**6, "prompt")  # no bound: never refuses
