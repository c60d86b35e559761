"""Sampler: penalties, filters and seeds on hand-made logits (no model)."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.request import Request, SamplingParams
from agentrt.runtime.sampler import apply_penalties, sample


def _req(prompt=(0,), output=(), seed=0, **kw) -> Request:
    r = Request("r", list(prompt), SamplingParams(**kw))
    r.output_ids = list(output)
    r.generator = torch.Generator().manual_seed(seed)
    return r


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0]])
    assert sample(logits, [_req(temperature=0)]) == [1]


def test_logit_bias_and_penalties():
    logits = torch.tensor([[1.0, 2.0, -2.0, 0.5]])
    apply_penalties(
        logits,
        [
            _req(
                prompt=[2],
                output=[1, 1],
                logit_bias={3: 5.0},
                repetition_penalty=2.0,
                frequency_penalty=0.5,
                presence_penalty=0.25,
            )
        ],
    )
    # token 1: rep penalty 2.0 / 2 = 1.0, then - 0.5 * 2 - 0.25 = -0.25; token 2 (prompt): -2 * 2 = -4
    assert torch.allclose(logits, torch.tensor([[1.0, -0.25, -4.0, 5.5]]))


@pytest.mark.parametrize(
    "kw,allowed",
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.5}, {0}),
        ({"top_p": 0.8}, {0, 1}),
        ({"min_p": 0.3}, {0, 1}),
    ],
)
def test_filters_restrict_support(kw, allowed):
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    logits = probs.log()[None]
    seen = {sample(logits.clone(), [_req(seed=s, temperature=1.0, **kw)])[0] for s in range(200)}
    assert seen == allowed


def test_seed_reproduces_and_differs_across_seeds():
    logits = torch.zeros(1, 1000)
    a = [sample(logits, [_req(seed=7)])[0] for _ in range(1)]
    b = [sample(logits, [_req(seed=7)])[0] for _ in range(1)]
    draws = {sample(logits, [_req(seed=s)])[0] for s in range(20)}
    assert a == b and len(draws) > 10


def test_sampling_matches_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    r = _req(seed=3, temperature=1.0)
    counts = torch.zeros(3)
    for _ in range(4000):
        counts[sample(probs.log()[None], [r])[0]] += 1
    assert torch.allclose(counts / 4000, probs, atol=0.03)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -5),
        ("min_p", 2.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -9.0),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("seed", -1),
        ("logit_bias", {99999999: 1.0}),
        ("logit_bias", {1: 500.0}),
        ("stop", [""]),
        ("stop", ["x"] * 17),
        ("stop", ["ok", "\ud800"]),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value}).validate(vocab_size=1000)


def test_stop_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"non-empty; stop\[1\] is ''"):
        SamplingParams(stop=["a", ""]).validate(vocab_size=10)
    with pytest.raises(ValueError, match="at most 16 strings, got 17"):
        SamplingParams(stop=["a"] * 17).validate(vocab_size=10)
    with pytest.raises(ValueError, match="lone surrogate"):
        SamplingParams(stop=["\udc80"]).validate(vocab_size=10)


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1e-45},
        {"temperature": 1e-6},
        {"top_p": 1e-50},
        {"temperature": 1.0, "top_p": 1e-300, "min_p": 1.0},
    ],
)
def test_extreme_values_never_yield_nan_or_crash(kw):
    logits = torch.tensor([[1.0, 5.0, 2.0, float("-inf")]])
    SamplingParams(**kw).validate(vocab_size=4)
    assert sample(logits.clone(), [_req(**kw)]) == [1]


def test_all_masked_row_is_reported():
    assert sample(torch.full((1, 4), float("-inf")), [_req()]) == [-1]


def test_broken_rows_stay_their_own_and_greedy_takes_the_first_maximum():
    inf = float("inf")
    logits = torch.tensor(
        [
            [1.0, float("nan"), 3.0, 0.0],  # a broken forward
            [-inf, -inf, -inf, -inf],  # every token masked
            [2.0, 7.0, 7.0, 1.0],  # a tie: the first maximum, as argmax
            [inf, -inf, -inf, -inf],  # sampled with no finite logit: nothing to draw from
            [1.0, 2.0, 3.0, 0.5],  # sampled, healthy
            [float("nan"), -inf, 0.0, 1.0],  # NaN at index 0 of a sampled row
        ]
    )
    greedy, sampled = {"temperature": 0.0}, {"temperature": 1.0}
    reqs = [_req(**kw) for kw in (greedy, greedy, greedy, sampled, sampled, sampled)]
    errors: dict[int, str] = {}
    out = sample(logits, reqs, errors)
    assert out[:4] == [-1, -1, 1, -1] and out[5] == -1 and 0 <= out[4] < 4
    assert errors == {0: "the logits hold NaN", 5: "the logits hold NaN"}
