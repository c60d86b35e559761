"""The rest of the chat/completions surface clients send (issue 20), on the default model in-process
and through the openai client against a real server: `n` > 1, `stop` beside tools and constraints,
vLLM's and SGLang's constraint fields, a named tool_choice, and vLLM's utility routes."""

from __future__ import annotations

import json
import re
import uuid

import jsonschema
import pytest

MODEL = "smollm2-135m-instruct"

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TIME_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"The current time in a city ({what}).",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    for name, what in (("get_time", "24-hour clock"), ("get_local_time", "local clock"))
]


def _chat(client, **kw):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "temperature": 0,
        "max_tokens": 30,
        "max_tokens_policy": "close",  # a constrained output is closed validly within max_tokens
    }
    body.update(kw)
    return client.post("/v1/chat/completions", json=body)


def _ok(resp) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def _metric(client, name: str) -> float:
    text = client.get("/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def _schema_format(schema: dict, strict: bool | None = None) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": strict}}


OPEN_PERSON = {k: v for k, v in PERSON.items() if k != "additionalProperties"}


# ---- n -------------------------------------------------------------------------------------------


def test_n_choices_are_valid_share_the_prompt_kv_and_follow_seed_plus_index(client):
    prompt = f"Describe a person as JSON. Ticket {uuid.uuid4().hex}."  # a prompt the cache has not seen
    messages = [{"role": "user", "content": prompt}]
    computed = _metric(client, "agentrt_computed_prefill_tokens_total")
    body = _ok(
        _chat(
            client,
            messages=messages,
            n=3,
            temperature=1.0,
            seed=11,
            response_format=_schema_format(PERSON),
        )
    )
    computed = _metric(client, "agentrt_computed_prefill_tokens_total") - computed
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for c in body["choices"]:
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
    usage = body["usage"]
    prompt_tokens = usage["prompt_tokens"]
    # the prompt's KV is computed once: the other two choices recompute at most its last token
    assert computed <= prompt_tokens + 2 < 2 * prompt_tokens, (computed, prompt_tokens)
    single = [
        _ok(
            _chat(
                client,
                messages=messages,
                temperature=1.0,
                seed=11 + i,
                response_format=_schema_format(PERSON),
            )
        )
        for i in range(3)
    ]
    # choice i samples as a one-choice request with seed + i does
    assert [c["message"]["content"] for c in body["choices"]] == [
        s["choices"][0]["message"]["content"] for s in single
    ]
    assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in single)
    assert usage["total_tokens"] == prompt_tokens + usage["completion_tokens"]


def test_n_streamed_interleaves_choices_that_match_the_unstreamed_ones(client):
    kw = {"n": 3, "temperature": 1.0, "seed": 5, "response_format": _schema_format(PERSON)}
    body = _ok(_chat(client, **kw))
    texts, finishes, usage = {}, {}, None
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Describe a person as JSON."}],
            "max_tokens": 30,
            "max_tokens_policy": "close",
            "stream": True,
            "stream_options": {"include_usage": True},
            **kw,
        },
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
                if c["finish_reason"]:
                    finishes[c["index"]] = c["finish_reason"]
    assert texts == {c["index"]: c["message"]["content"] for c in body["choices"]}
    assert finishes == {c["index"]: c["finish_reason"] for c in body["choices"]}
    assert usage["completion_tokens"] == body["usage"]["completion_tokens"]


def test_n_with_text_completions_and_with_forced_tools(client):
    resp = _ok(
        client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Paris is", "n": 2, "max_tokens": 5, "temperature": 0},
        )
    )
    assert [c["index"] for c in resp["choices"]] == [0, 1]
    assert resp["choices"][0]["text"] == resp["choices"][1]["text"]  # greedy: the same text twice
    body = _ok(
        _chat(
            client,
            messages=[{"role": "user", "content": "What time is it in Oslo?"}],
            tools=TIME_TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            n=2,
            temperature=1.0,
            seed=3,
            max_tokens=40,
        )
    )
    for c in body["choices"]:
        assert c["finish_reason"] == "tool_calls"
        (call,) = c["message"]["tool_calls"]
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), TIME_TOOLS[0]["function"]["parameters"]
        )


# ---- stop beside tools and constraints -----------------------------------------------------------


def test_stop_never_cuts_a_schema_constrained_output_or_a_call(client):
    # '"' and ':' occur in every output of these constraints: a stop string there would cut them
    body = _ok(_chat(client, stop=['"', ":"], response_format=_schema_format(PERSON)))
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)
    body = _ok(_chat(client, stop=["\n"], regex=r"[a-z]{1,6}\n[a-z]{1,6}", max_tokens=20))
    assert re.fullmatch(r"[a-z]{1,6}\n[a-z]{1,6}", body["choices"][0]["message"]["content"])
    body = _ok(
        _chat(
            client,
            messages=[{"role": "user", "content": "What time is it in Oslo?"}],
            tools=TIME_TOOLS,
            tool_choice="required",
            stop=['"', "\n", "<tool_call>"],
            max_tokens=40,
        )
    )
    (call,) = body["choices"][0]["message"]["tool_calls"]
    json.loads(call["function"]["arguments"])


def test_stop_applies_to_free_text_before_a_call_with_tool_choice_auto(client):
    messages = [{"role": "user", "content": "Say hello to Anna, then stop."}]
    free = _ok(_chat(client, messages=messages, tools=TIME_TOOLS, tool_choice="auto", max_tokens=20))
    text = free["choices"][0]["message"]["content"]
    assert text and not free["choices"][0]["message"].get("tool_calls"), free  # free text, no call
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = _ok(
        _chat(client, messages=messages, tools=TIME_TOOLS, tool_choice="auto", max_tokens=20, stop=[stop])
    )
    assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


# ---- vLLM / SGLang constraint fields ---------------------------------------------------------------

EBNF = 'root ::= "yes" | "no" | "maybe"'
LARK = 'start: "yes" | "no" | "maybe"'
# vLLM's and SGLang's schema fields close objects (their xgrammar backends do): strict true here
ALIASES = [
    ({"response_format": _schema_format(OPEN_PERSON, strict=True)}, {"guided_json": OPEN_PERSON}),
    (
        {"response_format": _schema_format(OPEN_PERSON, strict=True)},
        {"structured_outputs": {"json": OPEN_PERSON}},
    ),
    ({"response_format": _schema_format(OPEN_PERSON, strict=True)}, {"json_schema": json.dumps(OPEN_PERSON)}),
    ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}),
    ({"regex": r"[A-Z][a-z]{2,8}"}, {"guided_regex": r"[A-Z][a-z]{2,8}"}),
    ({"regex": r"[A-Z][a-z]{2,8}"}, {"structured_outputs": {"regex": r"[A-Z][a-z]{2,8}"}}),
    ({"choice": ["red", "green"]}, {"guided_choice": ["red", "green"]}),
    ({"choice": ["red", "green"]}, {"structured_outputs": {"choice": ["red", "green"]}}),
    ({"grammar": EBNF}, {"guided_grammar": EBNF}),
    ({"grammar": EBNF}, {"ebnf": EBNF}),
    ({"grammar": EBNF}, {"structured_outputs": {"grammar": EBNF}}),
    ({"lark": LARK}, {"guided_grammar": LARK}),
    (
        {"response_format": _schema_format(PERSON, strict=True)},
        {"guided_json": PERSON, "guided_whitespace_pattern": r"[ ]?", "guided_decoding_backend": "xgrammar"},
    ),
]


@pytest.mark.parametrize("native,alias", ALIASES, ids=lambda v: next(iter(v)))
def test_vllm_and_sglang_fields_give_the_native_output(client, native, alias):
    expected = _ok(_chat(client, **native))["choices"][0]["message"]["content"]
    assert _ok(_chat(client, **alias))["choices"][0]["message"]["content"] == expected
    completion = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Answer:", "max_tokens": 30, "temperature": 0, **alias},
    )
    native_completion = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Answer:", "max_tokens": 30, "temperature": 0, **native},
    )
    assert _ok(completion)["choices"][0]["text"] == _ok(native_completion)["choices"][0]["text"]


@pytest.mark.parametrize(
    "fields,param,pattern",
    [
        ({"guided_json": PERSON, "regex": "a+"}, "guided_json", "regex, guided_json"),
        ({"guided_regex": "a+", "ebnf": EBNF}, "ebnf", "guided_regex, ebnf"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs.regex",
            "response_format, structured_outputs.regex",
        ),
        (
            {"guided_json": PERSON, "guided_whitespace_pattern": r"\n"},
            "guided_whitespace_pattern",
            "must match",
        ),
        (
            {"guided_json": PERSON, "guided_whitespace_pattern": "("},
            "guided_whitespace_pattern",
            "not a valid",
        ),
        # nested counted repeats: compiling this takes gigabytes, so it is refused before compiling
        (
            {"guided_json": PERSON, "guided_whitespace_pattern": "(((x?){200}){200}){200}"},
            "guided_whitespace_pattern",
            "without counted repetition",
        ),
        ({"n": 3, "seed": 2**63 - 2}, "seed", r"seed \+ n - 1 must be below 2\^63"),
        ({"tools": TIME_TOOLS * 65}, "tools", "at most 128 tools"),
        ({"tools": TIME_TOOLS, "regex": "[a-z]+"}, "regex", "^regex cannot be combined with tools"),
        ({"guided_json": {"type": "nope"}}, "guided_json", "not a valid JSON Schema"),
        ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
        ({"structured_outputs": {"json": PERSON, "bogus": 1}}, "structured_outputs.bogus", "Extra inputs"),
    ],
)
def test_constraint_field_errors_name_the_fields(client, fields, param, pattern):
    resp = _chat(client, **fields)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and re.search(pattern, err["message"]), err


# ---- named tool_choice ---------------------------------------------------------------------------


@pytest.mark.parametrize("parallel", [None, True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_gives_exactly_one_call(client, parallel, stream):
    # the prompt leans to the other tool; the default model once called the named one twice here
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the local time in Oslo and in Lima?"}],
        "tools": TIME_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "temperature": 0,
        "max_tokens": 80,
        "stream": stream,
    }
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    if not stream:
        message = _ok(client.post("/v1/chat/completions", json=body))["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    else:
        calls = {}
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        for tc in c["delta"].get("tool_calls") or []:
                            name, args = calls.get(tc["index"], (None, ""))
                            calls[tc["index"]] = (
                                name or tc["function"].get("name"),
                                args + tc["function"]["arguments"],
                            )
        calls = list(calls.values())
    assert len(calls) == 1 and calls[0][0] == "get_time", calls
    json.loads(calls[0][1])


# ---- utility routes ------------------------------------------------------------------------------


def test_tokenize_detokenize_version_and_models(client, tokenizer):
    text = "Hello, agentrt!"
    tok = _ok(client.post("/tokenize", json={"model": MODEL, "prompt": text}))
    assert tok["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
    assert _ok(client.post("/detokenize", json={"tokens": tok["tokens"]}))["prompt"] == text
    messages = [{"role": "user", "content": "Hi"}]
    chat = _ok(client.post("/tokenize", json={"messages": messages}))
    # the same ids a chat request's prompt has: the usage of that request counts them
    usage = _ok(_chat(client, messages=messages, max_tokens=1))["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", client.get("/version").json()["version"])
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == tok["max_model_len"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_utility_route_errors_name_the_field(client, path, body, param):
    resp = client.post(path, json=body)
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param


# ---- through the openai client against a real server ---------------------------------------------


def test_openai_client_n_choices_with_a_schema(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="none")
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        "n": 3,
        "seed": 21,
        "temperature": 1.0,
        "max_tokens": 30,
        "extra_body": {"max_tokens_policy": "close"},
    }
    first = client.chat.completions.create(**kw)
    assert len(first.choices) == 3
    for c in first.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]


@pytest.mark.parametrize(
    "fields",
    [{"guided_json": OPEN_PERSON}, {"structured_outputs": {"json": OPEN_PERSON}}, {"json_schema": "{}"}],
    ids=lambda v: next(iter(v)),
)
def test_vllm_and_sglang_schemas_close_objects_as_their_backends_do(fields):
    from agentrt.api.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **fields}
    )
    assert req.constraint(req.response_format).spec.strict is True
    plain = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "response_format": _schema_format(PERSON),
        }
    )
    assert plain.constraint(plain.response_format).spec.strict is None


def test_responses_text_format_with_tools_is_a_call_or_a_valid_answer(client):
    """What the Agents SDK sends for an agent with both an output_type and tools (issue 51 item 5;
    was a 400 naming text.format): on the real model, the output is calls whose arguments satisfy
    their tool, or a message valid against the schema (tests/api/test_tools_with_schema.py scripts
    both)."""
    tool = TIME_TOOLS[0]["function"]
    for question in ("What time is it in Oslo?", "Describe a person as JSON."):
        body = _ok(
            client.post(
                "/v1/responses",
                json={
                    "model": MODEL,
                    "input": question,
                    "tools": [{"type": "function", **tool}],
                    "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON}},
                    "temperature": 0,
                    "max_output_tokens": 40,
                    "max_tokens_policy": "close",
                },
            )
        )
        assert body["output"], body
        for item in body["output"]:
            if item["type"] == "function_call":
                assert item["name"] == tool["name"]
                jsonschema.validate(json.loads(item["arguments"]), tool["parameters"])
            else:
                assert item["type"] == "message", item
                jsonschema.validate(json.loads(item["content"][0]["text"]), PERSON)


@pytest.mark.parametrize("part", ["image_url", "input_audio", "file"])
def test_non_text_content_parts_are_a_400_naming_the_part(client, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": part, part: {}}]}]
    resp = _chat(client, messages=messages)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "messages[0].content[1]" and f'"{part}" parts are not supported' in err["message"]
