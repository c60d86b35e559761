"""Issue 51 items 1 and 3 on the real default model served with Qwen3-4B-Thinking-2507's chat
template (the prompt opens <think>; `thinking_client` in tests/api/conftest.py). logit_bias makes
the model reason in the answer's syntax: three quotes (an odd count, the issue's lone quote) under a
thinking budget of 3, or the tokens of the call marker `<tool_call>`; the checks that read the
answer must not read that reasoning, and the grammar must keep the call marker out of it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

QUOTE, COMMA, BRACKET = 18, 28, 75  # the default model's tokens '"', ',' and '['
MARKER_TOKENS = (44, 19324, 79, 4350, 46)  # '<', 'tool', '_', 'call', '>': "<tool_call>"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
UNIQUE = {"type": "array", "items": {"type": "string"}, "uniqueItems": True, "maxItems": 3}


def _chat(client, bias: dict[int, float], **extra) -> dict:
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "temperature": 0,
        "logit_bias": {str(k): v for k, v in bias.items()},
        **extra,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _json_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}


def test_tokens_are_the_ones_biased(tokenizer):
    assert [tokenizer.encode(t, add_special_tokens=False) for t in '",['] == [[QUOTE], [COMMA], [BRACKET]]
    assert tokenizer.encode("<tool_call>", add_special_tokens=False) == list(MARKER_TOKENS)


def test_unique_items_after_a_reasoning_of_quotes(thinking_client):
    """Quotes then commas favoured: the reasoning is three quotes, the answer would repeat "" and
    is kept distinct. Before the fix: ["", "", ""] (the check read the reasoning's odd quote)."""
    choice = _chat(
        thinking_client,
        {QUOTE: 100, COMMA: 50},
        max_tokens=40,
        thinking_token_budget=3,
        **_json_format(UNIQUE),
    )
    assert choice["message"]["reasoning_content"].startswith('"""'), choice
    assert choice["finish_reason"] == "stop", choice
    items = json.loads(choice["message"]["content"])
    jsonschema.validate(items, UNIQUE)
    assert len(items) >= 2, items  # the bias asked for more than one: the duplicates were refused


def test_runaway_repair_after_a_reasoning_of_quotes(thinking_client):
    """A string value the bias makes loop (" ha" ..., minLength keeps the quote masked) after a
    reasoning of three quotes is repaired at /a. Before the fix the repair's lexer took the answer's
    string for structure and never fired."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "minLength": 100}},
        "required": ["a"],
    }
    ha = 421  # " ha"
    choice = _chat(
        thinking_client,
        {QUOTE: 100, ha: 50},
        max_tokens=120,
        thinking_token_budget=3,
        repetition_repair=True,
        **_json_format(schema),
    )
    assert choice["message"]["reasoning_content"].startswith('"""'), choice
    assert choice.get("agentrt_repaired") == ["/a"], choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


@pytest.mark.parametrize(
    "fields,valid",
    [
        ({"regex": '(yes|no) "[0-9]+"'}, lambda c: re.fullmatch('(yes|no) "[0-9]+"', c)),
        ({"choice": ["red", "green"]}, lambda c: c in ("red", "green")),
        (
            {"grammar": 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+'},
            lambda c: re.fullmatch(r"\[[a-z]+(,[a-z]+)*\]", c),
        ),
        (
            _json_format(
                {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
            ),
            json.loads,
        ),
    ],
    ids=["regex", "choice", "grammar", "json_schema"],
)
def test_every_kind_after_a_reasoning_of_quotes_and_brackets(thinking_client, fields, valid):
    choice = _chat(
        thinking_client,
        {QUOTE: 100, BRACKET: 60},
        max_tokens=40,
        thinking_token_budget=3,
        max_tokens_policy="close",
        **fields,
    )
    assert choice["message"]["reasoning_content"].startswith('"""') and choice["finish_reason"] == "stop"
    assert valid(choice["message"]["content"]), choice


def test_the_call_marker_never_stays_in_the_reasoning(thinking_client):
    """The marker's tokens favoured (+10): the model writes "<tool_call>" over and over. Without a
    grammar the first marker ends the reasoning (it opens the answer); under the grammar the marker
    cannot complete inside the reasoning ("<tool_call_call>" instead), and under "required" the
    budget-closed reasoning is followed by a valid call. Before the fix the reasoning held the
    markers in both cases."""
    bias = dict.fromkeys(MARKER_TOKENS, 10)
    free = _chat(thinking_client, bias, max_tokens=30, tools=[WEATHER], tool_call_constraint=False)
    assert not free["message"].get("reasoning_content"), free
    assert free["message"]["content"].startswith("<tool_call>"), free
    auto = _chat(thinking_client, bias, max_tokens=30, tools=[WEATHER])
    assert auto["message"]["reasoning_content"].startswith("<tool_call"), auto
    assert "<tool_call>" not in auto["message"]["reasoning_content"], auto
    required = _chat(
        thinking_client,
        bias,
        max_tokens=60,
        tools=[WEATHER],
        tool_choice="required",
        thinking_token_budget=6,
        max_tokens_policy="close",
    )
    assert "<tool_call>" not in required["message"]["reasoning_content"], required
    assert required["finish_reason"] == "tool_calls", required
    (tc,) = required["message"]["tool_calls"]
    jsonschema.validate(json.loads(tc["function"]["arguments"]), WEATHER["function"]["parameters"])
