"""logprobs on the HTTP API (OpenAI's shapes) over the shared engine on the default model, read by
the official `openai` client: chat (streamed and not), completions (streamed and not), a
constrained request's top_logprobs, tool calls, n > 1, and the 400s."""

from __future__ import annotations

import math

import pytest

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def oai(client):
    """The official openai client over the in-process app (TestClient is an httpx.Client)."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)


def _check_entries(content, k: int) -> None:
    for e in content:
        assert e.logprob <= 0.0 and e.bytes is not None
        assert e.token == bytes(e.bytes).decode("utf-8", errors="replace")
        assert len(e.top_logprobs) == k
        assert e.top_logprobs[0].token == e.token  # greedy: the sampled token is the most likely
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)


def test_chat_logprobs_parsed_by_openai_client(oai):
    resp = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens == 10
    _check_entries(content, 3)
    # the tokens' bytes join into the message's exact text
    assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content


def test_chat_stream_logprobs_match_the_response(oai):
    kwargs = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = oai.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed, text = [], ""
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None:
            streamed += choice.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-5)
    assert b"".join(bytes(e.bytes) for e in streamed).decode() == text
    _check_entries(streamed, 2)


def test_completion_logprobs_parsed_by_openai_client(oai):
    prompt = "The three primary colours are"
    resp = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=4)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(8)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 4 and max(top, key=top.get) == tok and top[tok] == pytest.approx(value)
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=4, stream=True
    ):
        part = chunk.choices[0].logprobs if chunk.choices else None
        if part is not None:
            for key in streamed:
                streamed[key] += getattr(part, key)
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    # the streamed request's prompt comes from the prefix cache, so its forward runs other matmul
    # shapes (oneDNN blocks by row count): the same tokens, logprobs within ~1e-5 (measured 1.04e-5)
    assert streamed["token_logprobs"] == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_constrained_top_logprobs_only_allowed_tokens(oai):
    """A choice constraint: every top entry continues the text so far towards an option (or is the
    end of sequence once an option is complete); their probabilities sum to at most 1."""
    options = ["red", "green", "blue"]
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick a colour."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=20,
        extra_body={"choice": options},
    )
    choice = resp.choices[0]
    assert choice.message.content in options
    so_far = ""
    for e in choice.logprobs.content:
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1.0 + 1e-5
        for t in e.top_logprobs:
            assert any(o.startswith(so_far + t.token) for o in options) or (
                so_far in options and t.token == "<|im_end|>"
            ), (so_far, t.token)
        so_far += e.token if e.token != "<|im_end|>" else ""
    assert choice.logprobs.content[-1].logprob == 0.0  # the end, forced after a complete option


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CALL = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
    "tools": [TOOL],
    "tool_choice": "required",
    "max_tokens": 60,
    "temperature": 0,
    "logprobs": True,
}


def test_tool_call_logprobs_cover_every_generated_token(oai):
    """The calls' tokens are reported under `content` (as vLLM), streamed or not."""
    resp = oai.chat.completions.create(**TOOL_CALL)
    choice = resp.choices[0]
    assert choice.message.tool_calls
    assert len(choice.logprobs.content) == resp.usage.completion_tokens
    assert all(e.top_logprobs == [] for e in choice.logprobs.content)
    streamed, usage, calls = [], None, 0
    for chunk in oai.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **TOOL_CALL
    ):
        usage = chunk.usage or usage
        if chunk.choices:
            calls += bool(chunk.choices[0].delta.tool_calls)
            if chunk.choices[0].logprobs is not None:
                streamed += chunk.choices[0].logprobs.content
    assert calls and len(streamed) == usage.completion_tokens
    assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]


def test_logprobs_per_choice(oai):
    resp = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=1.0, seed=7, n=2, logprobs=True
    )
    assert len(resp.choices) == 2
    assert sum(len(c.logprobs.content) for c in resp.choices) == resp.usage.completion_tokens
    for c in resp.choices:
        assert (
            b"".join(bytes(e.bytes) for e in c.logprobs.content)
            .decode(errors="replace")
            .startswith(c.message.content)
        )


@pytest.mark.parametrize(
    "url,extra,param",
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ],
)
def test_logprobs_validation(client, url, extra, param):
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"messages": MESSAGES} if "chat" in url else {"prompt": "hi"})
    resp = client.post(url, json={**base, **extra})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
