"""Per-field confidence arithmetic (agentrt/extract/confidence.py) on synthetic tokens and logprobs."""

from __future__ import annotations

import math

import pytest

from agentrt.extract.confidence import (
    below,
    field_confidence,
    leaf_spans,
    token_ends_from_bytes,
    token_ends_from_ids,
    token_spans,
)


def ends_of(pieces: list[str]) -> list[int]:
    out, n = [], 0
    for p in pieces:
        n += len(p)
        out.append(n)
    return out


PIECES = [
    '{"',
    "a",
    '":"',
    "x",
    "y",
    '","',
    "b",
    '":[',
    "1",
    ',{"',
    "c",
    '":',
    "null",
    "}]",
    ',"d":',
    "true",
    "}",
]
TEXT = "".join(PIECES)


def test_leaf_spans_cover_quotes_number_terminators_and_nested_pointers():
    spans = leaf_spans(TEXT)
    assert set(spans) == {"/a", "/b/0", "/b/1/c", "/d"}
    assert TEXT[slice(*spans["/a"])] == '"xy"'  # both quotes belong to a string's span
    assert TEXT[slice(*spans["/b/0"])] == "1,"  # a number ends where the next character decides it
    assert TEXT[slice(*spans["/b/1/c"])] == "null"
    assert TEXT[slice(*spans["/d"])] == "true"


def test_confidence_is_exp_of_the_overlapping_tokens_logprobs():
    lps = [-0.01 * (i + 1) for i in range(len(PIECES))]
    conf = field_confidence(TEXT, ends_of(PIECES), lps)
    # /a: '":"' (opening quote), 'x', 'y', '","' (closing quote; it also opens key "b": counted here)
    assert conf["/a"] == pytest.approx(math.exp(lps[2] + lps[3] + lps[4] + lps[5]))
    # /b/0: '1' and ',{"' (the comma that ends the number)
    assert conf["/b/0"] == pytest.approx(math.exp(lps[8] + lps[9]))
    assert conf["/b/1/c"] == pytest.approx(math.exp(lps[12]))
    assert conf["/d"] == pytest.approx(math.exp(lps[15]))
    assert all(0.0 < p < 1.0 for p in conf.values())


def test_forced_values_have_confidence_one():
    lps = [-0.5] * len(PIECES)
    for i in (12, 15):  # 'null' and 'true' forced (logprob 0.0)
        lps[i] = 0.0
    conf = field_confidence(TEXT, ends_of(PIECES), lps)
    assert conf["/b/1/c"] == 1.0 and conf["/d"] == 1.0
    assert conf["/a"] < 1.0


def test_a_token_straddling_two_values_counts_in_both():
    pieces = ["[", '"a', '","', 'b"', "]"]  # '","' closes "a" and opens "b"
    lps = [0.0, -0.1, -0.2, -0.3, 0.0]
    conf = field_confidence("".join(pieces), ends_of(pieces), lps)
    assert conf["/0"] == pytest.approx(math.exp(-0.1 - 0.2))
    assert conf["/1"] == pytest.approx(math.exp(-0.2 - 0.3))


def test_pointer_escaping_arrays_and_empty_containers():
    text = '{"a/b~c": [[], {}, [2.5e3]], "e": {}}'
    spans = leaf_spans(text)
    assert set(spans) == {"/a~1b~0c/2/0"}  # empty arrays and objects are not leaves
    assert text[slice(*spans["/a~1b~0c/2/0"])] == "2.5e3]"


def test_top_level_scalar_and_whitespace():
    assert leaf_spans(' "x" ') == {"": (1, 4)}
    assert leaf_spans("12") == {"": (0, 2)}
    text = '{ "n" : 7 }'
    assert text[slice(*leaf_spans(text)["/n"])] == "7 }"


def test_multibyte_characters_split_across_tokens():
    pieces = [b'"', b"\xc3", b"\xa9", b'"']  # "é" with its two UTF-8 bytes in two tokens
    ends = token_ends_from_bytes(pieces)
    assert ends == [1, 1, 2, 3]
    assert token_spans(ends) == [(0, 1), (1, 2), (1, 2), (2, 3)]  # the first byte counts with é
    conf = field_confidence('"é"', ends, [-0.1, -0.2, -0.3, -0.4])
    assert conf[""] == pytest.approx(math.exp(-1.0))


def test_errors_and_review_threshold():
    with pytest.raises(ValueError, match="2 token offsets but 1 logprobs"):
        field_confidence("{}", [1, 2], [0.0])
    with pytest.raises(ValueError):
        leaf_spans('{"a": }')
    with pytest.raises(ValueError, match="extra data"):
        leaf_spans("1 2")
    assert below({"/a": 0.5}, None) is None
    assert below({"/a": 0.5, "/b": 0.9}, 0.6) is True
    assert below({"/a": 0.7}, 0.6) is False
    assert below(None, 0.6) is True  # no confidence to check: review it


def test_token_ends_from_ids_match_decoding(tokenizer):
    text = '{"name": "Nguyễn Văn An", "age": 31}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    ends = token_ends_from_ids(tokenizer, ids)
    assert ends[-1] == len(text)
    for i, e in enumerate(ends):
        assert e == len(tokenizer.decode(ids[: i + 1]).rstrip("\ufffd"))
    conf = field_confidence(text, ends, [0.0] * len(ids))
    assert conf == {"/name": 1.0, "/age": 1.0}
