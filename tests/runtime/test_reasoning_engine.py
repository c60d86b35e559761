"""A reasoning model's request in the engine (default model, Qwen3's chat template): the reasoning
is free text, a constraint applies to the answer after its end marker, the thinking budget forces
the end marker, and max_tokens_policy "close" still ends with a valid answer within max_tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from agentrt.grammars.reasoning import FORMATS, ReasoningParser
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.request import ReasoningParams, SamplingParams
from tests.support.models import finish_all
from tests.support.paths import shared_path

THINK = FORMATS["think"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def qwen3_prompt(tokenizer):
    """Qwen3's real chat template on the default model's tokenizer: (prompt ids, mode) for a
    request whose generation prompt opens the reasoning (the Thinking-2507 template)."""
    path = shared_path("chat_templates", "Qwen3-4B-Thinking-2507.jinja")
    messages = [{"role": "user", "content": "What is the largest city of France? Answer in JSON."}]
    text = tokenizer.apply_chat_template(
        messages, chat_template=path.read_text(), add_generation_prompt=True, tokenize=False
    )
    assert THINK.mode(text) == "open"
    return tokenizer.encode(text, add_special_tokens=False)


def _spec(mode: str) -> ConstraintSpec:
    plain = ConstraintSpec.json_schema(SCHEMA)
    return ConstraintSpec(plain.kind, plain.value, plain.strict, THINK.as_json(mode))


def _split(text: str, mode: str = "open") -> ReasoningParser:
    parser = ReasoningParser(THINK, mode)
    parser.feed(text)
    parser.finish()
    return parser


def _params(budget, max_tokens, policy="length", temperature=0.0, seed=None):
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        max_tokens=max_tokens,
        max_tokens_policy=policy,
        reasoning=ReasoningParams(THINK.start, THINK.end, "open", budget, "\nTime to answer."),
    )


def test_budget_closes_the_reasoning_and_the_answer_is_valid(engine, qwen3_prompt):
    """A small model never closes its reasoning by itself: the budget forces "</think>" after 24
    reasoning tokens, then the schema holds for the answer, which ends with the model's EOS."""
    (out,) = finish_all(engine, [engine.add_request(qwen3_prompt, _params(24, 200), _spec("open"))])
    assert out.finish_reason == "stop", out.text
    parsed = _split(out.text)
    assert parsed.reasoning and "Time to answer." in parsed.reasoning
    jsonschema.validate(json.loads(parsed.content), SCHEMA)
    close = len(engine.tokenizer.encode("\nTime to answer.</think>", add_special_tokens=False))
    assert 24 <= out.num_reasoning_tokens <= 24 + close


def test_unconstrained_budget_forces_the_end_marker(engine, qwen3_prompt):
    (out,) = finish_all(engine, [engine.add_request(qwen3_prompt, _params(10, 40))])
    assert "</think>" in out.text
    before = out.text.split("</think>")[0]
    # at most the budget's tokens of the model's own, then the close text
    assert len(engine.tokenizer.encode(before, add_special_tokens=False)) <= 10 + 8
    assert out.num_reasoning_tokens >= 10


def test_without_a_budget_the_reasoning_is_free(engine, qwen3_prompt):
    """No budget, no end marker written: the output is reasoning up to max_tokens and the
    constraint never let the model stop (EOS is masked inside the reasoning)."""
    (out,) = finish_all(engine, [engine.add_request(qwen3_prompt, _params(None, 30), _spec("open"))])
    assert out.finish_reason == "length"
    assert "</think>" not in out.text
    assert out.num_reasoning_tokens == len(out.token_ids)


@pytest.mark.parametrize("max_tokens", [40, 64])
def test_close_policy_ends_with_a_valid_answer_within_max_tokens(engine, qwen3_prompt, max_tokens):
    """max_tokens_policy "close" keeps room for "</think>" and the answer's shortest completion:
    a reasoning model under a schema ends with valid JSON inside max_tokens, sampled or greedy."""
    params = [
        _params(None, max_tokens, "close"),
        _params(None, max_tokens, "close", temperature=1.0, seed=7),
    ]
    outs = finish_all(engine, [engine.add_request(qwen3_prompt, p, _spec("open")) for p in params])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert len(out.token_ids) <= max_tokens
        parsed = _split(out.text)
        jsonschema.validate(json.loads(parsed.content), SCHEMA)


def test_optional_mode_allows_an_answer_without_reasoning(engine, tokenizer):
    """Mode "optional" (Qwen3's hybrid template: the model may open <think>): the same grammar
    admits a direct answer; the output is valid either way."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Largest city of France, as JSON."}],
        chat_template=shared_path("chat_templates", "Qwen-Qwen3-0.6B.jinja").read_text(),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert THINK.mode(text) == "optional"
    params = SamplingParams(
        temperature=0,
        max_tokens=120,
        reasoning=ReasoningParams(THINK.start, THINK.end, "optional", 16),
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    (out,) = finish_all(engine, [engine.add_request(ids, params, _spec("optional"))])
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(_split(out.text, "optional").content), SCHEMA)


def test_budget_validation(engine, qwen3_prompt):
    from agentrt.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(qwen3_prompt, _params(-1, 10))
    assert e.value.param == "thinking_token_budget"
