"""Stop strings with a reasoning model apply to the answer only: never to the reasoning, never to
the end marker (written by the model or forced by the thinking budget) nor to the whitespace after
it, so they can neither end the request on the server's own text nor leave a marker fragment in
either field. On the scripted fake model under Qwen3-4B-Thinking-2507's real template (the prompt
opens <think>), on chat completions, Responses and Messages, streamed and not."""

from __future__ import annotations

import json

import pytest

from tests.support.paths import shared_path

CLOSE = " ok"  # the server's close text before the forced end marker (reasoning_budget_message)
THINKING = "thinking " * 40  # a reasoning the model never ends by itself
ANSWER = "The answer is here."
QUESTION = [{"role": "user", "content": "hi"}]
NATURAL = [{"role": "user", "content": "think?"}]  # a reasoning the model ends by itself
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def served(default_model_dir):
    """(TestClient, runner, tokenizer) of the fake model under the Thinking template, with the
    model's scripts: after QUESTION it reasons without end, and once the budget of 8 tokens forced
    CLOSE + "</think>" it answers ANSWER; after NATURAL it closes its reasoning itself."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.runtime.engine import Engine
    from agentrt.testing import FakeModelRunner

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    tok.chat_template = shared_path("chat_templates", "Qwen3-4B-Thinking-2507.jinja").read_text()
    runner = FakeModelRunner(tok, max_model_len=4096, num_kv_slots=16384)
    front = AsyncEngine(engine=Engine(runner=runner))
    with TestClient(create_app(front, "m", reasoning_budget_message=CLOSE)) as client:
        forced = tok.encode(CLOSE + "</think>", add_special_tokens=False)
        for tools in (None, [WEATHER]):
            body = {"model": "m", "messages": QUESTION, "tools": tools}
            prompt = client.post("/tokenize", json=body).json()["tokens"]
            reasoning = runner.script(prompt, THINKING)
            runner.script([*prompt, *reasoning[:8], *forced], f"\n\n{ANSWER}<|im_end|>")
        prompt = client.post("/tokenize", json={"model": "m", "messages": NATURAL}).json()["tokens"]
        runner.script(prompt, "Let me think about it.\n</think>\n\nI think so, yes.<|im_end|>")
        yield client, runner, tok
    front.shutdown()


def _chat(client, messages, stream=False, **extra) -> tuple[str | None, str | None, str]:
    """(reasoning_content, content, finish_reason) of a chat completion, streamed or not."""
    body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 40, "stream": stream, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        return (
            choice["message"].get("reasoning_content"),
            choice["message"]["content"],
            choice["finish_reason"],
        )
    reasoning, content, finish = [], [], None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            delta = choice.get("delta", {})
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
            finish = choice.get("finish_reason") or finish
    return "".join(reasoning) or None, "".join(content) or None, finish


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["plain", "tools-auto"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", ["</think>", "think", "</", ">", "\n"])
def test_chat_stop_never_matches_the_forced_end_marker(served, stop, stream, tools):
    """The issue's request: a thinking budget of 8 forces " ok</think>"; stop strings that occur in
    the reasoning, the forced marker or the newlines after it leave the answer whole (with tools on
    "auto" too, where stop strings apply to the text before a call)."""
    client, _, _ = served
    extra = {"tools": tools} if tools else {}
    reasoning, content, finish = _chat(
        client, QUESTION, stream, thinking_token_budget=8, stop=[stop], **extra
    )
    assert content == ANSWER and finish == "stop"
    assert reasoning.startswith("thinking thinking") and reasoning.endswith("ok"), reasoning


@pytest.mark.parametrize("stream", [False, True])
def test_chat_stop_applies_in_the_answer_after_a_written_marker(served, stream):
    """A multi-token "</think>" the model writes itself: "think" in the reasoning and in the marker
    is not a match, the one in the answer is; "</think>" and "\\n" never match."""
    client, _, _ = served
    assert _chat(client, NATURAL, stream, stop=["think"]) == ("Let me think about it.", "I ", "stop")
    for stop in ("</think>", "\n"):
        assert _chat(client, NATURAL, stream, stop=[stop]) == (
            "Let me think about it.",
            "I think so, yes.",
            "stop",
        )


def test_the_marker_is_the_only_way_the_tracker_ends_the_reasoning():
    """answer_start: after the end marker and the whitespace after it; undecided while only
    whitespace (or a partial separator / header) follows; Harmony's separator and final-channel
    header are not answer text."""
    from agentrt.grammars.reasoning import FORMATS
    from agentrt.runtime.output_processor import answer_start
    from agentrt.runtime.reasoning_budget import ReasoningTracker
    from agentrt.runtime.request import ReasoningParams

    think = FORMATS["think"]
    tracker = ReasoningTracker(ReasoningParams(think.start, think.end, "open"), [])
    for piece in (b"a </thi", b"nk>"):
        tracker.observe(piece)
    assert answer_start(tracker, "a </think>", 7) is None  # the answer has not begun
    assert answer_start(tracker, "a </think>\n\n", 7) is None
    assert answer_start(tracker, "a </think>\n\nHi", 7) == 12
    assert answer_start(tracker, "a \n\nHi", 2) == 4  # the marker left out of the text (a special token)
    assert answer_start(None, "anything", 0) == 0
    harmony = FORMATS["harmony"]
    params = ReasoningParams(
        harmony.start, harmony.end, "optional", None, "", harmony.after_end, harmony.header
    )
    tracker = ReasoningTracker(params, [])
    text = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>Hi"
    tracker.observe(text.encode())
    assert answer_start(tracker, text[:-2], 0) is None
    assert answer_start(tracker, text[:-20], 0) is None  # a partial header
    assert text[answer_start(tracker, text, 0) :] == "Hi"
    tracker = ReasoningTracker(params, [])
    tracker.observe(b"<|channel|>final<|message|>Hi")  # no reasoning: the answer opens with the header
    assert answer_start(tracker, "<|channel|>final<|message|>Hi", 0) == len(harmony.header)


def _responses(client, stream: bool, **extra) -> tuple[str, str, str]:
    """(reasoning text, output text, status) of a Responses request, streamed or not."""
    body = {"model": "m", "input": "hi", "temperature": 0, "max_output_tokens": 40, "stream": stream, **extra}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        body = next(e["response"] for e in events if e["type"] == "response.completed")
    else:
        body = r.json()
    reasoning = "".join(
        c["text"] for item in body["output"] if item["type"] == "reasoning" for c in item.get("content") or []
    )
    text = "".join(c["text"] for item in body["output"] if item["type"] == "message" for c in item["content"])
    return reasoning, text, body["status"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", ["</think>", "think"])
def test_responses_stop_never_matches_the_forced_end_marker(served, stop, stream):
    client, _, _ = served
    reasoning, text, status = _responses(client, stream, thinking_token_budget=8, stop=[stop])
    assert (text, status) == (ANSWER, "completed")
    assert reasoning.endswith("ok") and "</" not in reasoning


def _messages(client, stream: bool, **extra) -> tuple[str, str, str, str | None]:
    """(thinking, text, stop_reason, stop_sequence) of a Messages request, streamed or not."""
    body = {"model": "m", "messages": NATURAL, "max_tokens": 40, "temperature": 0, "stream": stream, **extra}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        body = r.json()
        thinking = "".join(b["thinking"] for b in body["content"] if b["type"] == "thinking")
        text = "".join(b["text"] for b in body["content"] if b["type"] == "text")
        return thinking, text, body["stop_reason"], body["stop_sequence"]
    thinking, text, reason, sequence = [], [], None, None
    for line in r.text.splitlines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        if event["type"] == "content_block_delta":
            thinking.append(event["delta"].get("thinking", ""))
            text.append(event["delta"].get("text", ""))
        elif event["type"] == "message_delta":
            reason, sequence = event["delta"]["stop_reason"], event["delta"]["stop_sequence"]
    return "".join(thinking), "".join(text), reason, sequence


@pytest.mark.parametrize("stream", [False, True])
def test_messages_stop_sequences_apply_to_the_answer(served, stream):
    client, _, _ = served
    assert _messages(client, stream, stop_sequences=["</think>"]) == (
        "Let me think about it.",
        "I think so, yes.",
        "end_turn",
        None,
    )
    assert _messages(client, stream, stop_sequences=["think"]) == (
        "Let me think about it.",
        "I ",
        "stop_sequence",
        "think",
    )


@pytest.mark.parametrize("stop", ["</think>", "think"])
def test_the_issue_request_on_the_real_model(thinking_client, stop):
    """The default model (real weights) under the Thinking template, sampled as in the report:
    the budget forces the end marker after 8 reasoning tokens, and the stop string never ends the
    request there (content null) nor leaves "</" in the reasoning; streamed equals not streamed."""
    body = {
        "model": "smollm2-135m-instruct",
        "messages": QUESTION,
        "max_tokens": 40,
        "thinking_token_budget": 8,
        "stop": [stop],
        "seed": 5,
        "temperature": 1.0,
    }
    r = thinking_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    reasoning, content = choice["message"]["reasoning_content"], choice["message"]["content"]
    assert content, choice
    assert not reasoning.endswith("</") and "</think" not in reasoning, reasoning
    assert r.json()["usage"]["completion_tokens"] > 11
    assert _chat(thinking_client, QUESTION, True, **{k: v for k, v in body.items() if k != "messages"}) == (
        reasoning,
        content,
        choice["finish_reason"],
    )


def test_a_cut_inside_the_end_marker_leaves_no_piece_of_it():
    """max_tokens ending the output inside "</think>": the piece is in neither field, whatever the
    chunking (one character alone stays: it may be the reasoning's own)."""
    from agentrt.grammars.reasoning import FORMATS, ReasoningParser

    for text, reasoning in (("hm </thi", "hm"), ("hm </", "hm"), ("a <", "a <"), ("x </think", "x")):
        for step in (1, 2, len(text)):
            parser = ReasoningParser(FORMATS["think"], "open")
            for i in range(0, len(text), step):
                parser.feed(text[i : i + step])
            parser.finish()
            assert (parser.reasoning, parser.content) == (reasoning, ""), (text, step)
