"""The opt-in `repetition_repair` request field (agentrt/runtime/repetition.py) on chat and text
completions over the fake model runner: a value forced to loop (logit_bias) is closed and reported as
the choice's `agentrt_repaired`; without the field nothing changes and no such key is returned."""

from __future__ import annotations

import json

import jsonschema
import pytest

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
    "required": ["name", "city"],
    "additionalProperties": False,
}


def _body(tokenizer, chat: bool, **extra) -> dict:
    a = tokenizer.encode("a", add_special_tokens=False)[0]
    body = {
        "model": "smollm2-135m-instruct",
        "temperature": 0,
        "max_tokens": 120,
        "logit_bias": {str(a): 100},
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        **extra,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": "Extract."}]
    else:
        body["prompt"] = "Extract."
    return body


@pytest.mark.parametrize("chat", [True, False])
def test_repair_opt_in(fake_client, tokenizer, chat):
    url = "/v1/chat/completions" if chat else "/v1/completions"
    on = fake_client.post(url, json=_body(tokenizer, chat, repetition_repair=True))
    assert on.status_code == 200, on.text
    choice = on.json()["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    assert choice["finish_reason"] == "stop"
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    looped = [f"/{k}" for k in ("name", "city") if "a" * 24 in obj[k]]  # the values that looped
    assert looped and choice["agentrt_repaired"] == looped, text
    off = fake_client.post(url, json=_body(tokenizer, chat)).json()["choices"][0]
    assert off["finish_reason"] == "length" and "agentrt_repaired" not in off


def test_repair_must_be_a_boolean(fake_client, tokenizer):
    r = fake_client.post("/v1/chat/completions", json=_body(tokenizer, True, repetition_repair="yes"))
    assert r.status_code == 400 and "repetition_repair" in r.text


def _stream(client, url: str, body: dict) -> list[dict]:
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    return [json.loads(ln[len("data: ") :]) for ln in lines]


@pytest.mark.parametrize("chat", [True, False])
def test_repair_streamed(fake_client, tokenizer, chat):
    """Streamed, the closing chunk (the one with finish_reason) carries `agentrt_repaired`, equal to
    the non-streamed choice's; other chunks and requests without the field carry no such key."""
    url = "/v1/chat/completions" if chat else "/v1/completions"
    whole = fake_client.post(url, json=_body(tokenizer, chat, repetition_repair=True)).json()["choices"][0]
    chunks = _stream(fake_client, url, _body(tokenizer, chat, repetition_repair=True))
    closing = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(closing) == 1 and closing[0]["finish_reason"] == "stop"
    assert whole["agentrt_repaired"] and closing[0]["agentrt_repaired"] == whole["agentrt_repaired"]
    assert sum("agentrt_repaired" in c["choices"][0] for c in chunks if c["choices"]) == 1
    text = "".join(
        (c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "")
        for c in chunks
        if c["choices"]
    )
    assert text == (whole["message"]["content"] if chat else whole["text"])
    off = _stream(fake_client, url, _body(tokenizer, chat))
    assert not any("agentrt_repaired" in c["choices"][0] for c in off if c["choices"])


@pytest.mark.parametrize("chat", [True, False])
def test_close_policy_reports_a_budget_close(fake_client, tokenizer, chat):
    """max_tokens_policy "close" on a value that loops without repair: the output is closed validly
    within max_tokens and the choice says so (`agentrt_closed_by_budget`, streamed on the closing
    chunk too); a request the model ends itself says false; without the policy there is no key."""
    url = "/v1/chat/completions" if chat else "/v1/completions"
    closed = fake_client.post(url, json=_body(tokenizer, chat, max_tokens_policy="close")).json()["choices"][
        0
    ]
    assert closed["finish_reason"] == "stop" and closed["agentrt_closed_by_budget"] is True
    jsonschema.validate(json.loads(closed["message"]["content"] if chat else closed["text"]), SCHEMA)
    chunks = _stream(fake_client, url, _body(tokenizer, chat, max_tokens_policy="close"))
    flags = [
        c["choices"][0]["agentrt_closed_by_budget"]
        for c in chunks
        if c["choices"] and "agentrt_closed_by_budget" in c["choices"][0]
    ]
    assert flags == [True]
    repaired = _body(tokenizer, chat, max_tokens_policy="close", repetition_repair=True)
    own = fake_client.post(url, json=repaired).json()["choices"][0]
    assert own["finish_reason"] == "stop" and own["agentrt_closed_by_budget"] is False
    off = fake_client.post(url, json=_body(tokenizer, chat)).json()["choices"][0]
    assert "agentrt_closed_by_budget" not in off
