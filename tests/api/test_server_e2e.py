"""A real `agentrt serve` subprocess driven by the official `openai` client on the extraction workload."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from agentrt.extract.prompt import extraction_messages
from tests.support.paths import shared_path

MODEL = "smollm2-135m-instruct"
NUM_DOCS = 12


def test_extraction_schemas_with_openai_client(server):
    """One document per schema (the default suite; the 12-document run is slow-marked). Measured
    greedy lengths at 300 tokens: event 142 and invoice 144 (stop), ticket 300 (length): a 200-token
    budget gives the same outcomes in two thirds of the decode steps."""
    _extraction_with_openai_client(server, one_per_schema=True, max_tokens=200)


@pytest.mark.slow  # ~4 min on 2 CPU cores: `make test-slow`
def test_extraction_schemas_with_openai_client_12_docs(server):
    _extraction_with_openai_client(server, one_per_schema=False, max_tokens=300)


def _extraction_with_openai_client(server, one_per_schema: bool, max_tokens: int):
    from openai import OpenAI

    docs = [json.loads(line) for line in shared_path("extraction", "docs.jsonl").read_text().splitlines()]
    schemas = {p.stem: json.loads(p.read_text()) for p in shared_path("extraction", "schemas").glob("*.json")}
    # the first NUM_DOCS documents cover every schema
    docs = docs[:NUM_DOCS]
    assert {d["schema_name"] for d in docs} == set(schemas)
    if one_per_schema:
        docs = list({d["schema_name"]: d for d in reversed(docs)}.values())
    client = OpenAI(base_url=f"{server}/v1", api_key="none")
    checker = jsonschema.FormatChecker()

    def run(doc, stream: bool) -> tuple[str, str]:
        schema = schemas[doc["schema_name"]]
        kwargs = {
            "model": MODEL,
            "messages": extraction_messages(doc["text"], schema),
            "temperature": 0,
            "max_tokens": max_tokens,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": doc["schema_name"], "schema": schema, "strict": True},
            },
        }
        if not stream:
            resp = client.chat.completions.create(**kwargs)
            return resp.choices[0].message.content, resp.choices[0].finish_reason
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    # plain and streamed requests at once (one batch: greedy output does not depend on the batch)
    with ThreadPoolExecutor(min(2 * len(docs), 16)) as pool:
        plain_futures = [pool.submit(run, d, False) for d in docs]
        streamed_futures = [pool.submit(run, d, True) for d in docs]
        plain = [f.result() for f in plain_futures]
        streamed = [f.result() for f in streamed_futures]
    hit_length = []
    for doc, (text, finish), (s_text, s_finish) in zip(docs, plain, streamed):
        assert (s_text, s_finish) == (text, finish), doc["id"]
        if finish == "stop":
            jsonschema.validate(json.loads(text), schemas[doc["schema_name"]], format_checker=checker)
        else:
            assert finish == "length"
            hit_length.append(doc["id"])
    print(
        f"\n{len(docs) - len(hit_length)}/{len(docs)} finished with stop and validated; "
        f"hit max_tokens: {hit_length}"
    )
    assert len(hit_length) < len(docs)


def test_sigterm_ends_streams_in_flight_and_exits(default_model_dir, tmp_path):
    """SIGTERM while a stream runs: the stream ends with an error event and [DONE], the process
    exits 0 within seconds (it used to wait on the open stream until a 10 s join gave up). The start
    line names the KV dtype."""
    import signal
    import time

    import httpx

    from agentrt.testing import agentrt_server

    with agentrt_server(MODEL, log_path=tmp_path / "server.log") as srv:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        lines = []
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                lines.append(line)
                if len(lines) == 6:  # generation is under way
                    t0 = time.monotonic()
                    srv.proc.send_signal(signal.SIGTERM)
        assert any('"error"' in x and "shutting down" in x for x in lines), lines[-3:]
        assert lines[-1] == "" or lines[-1] == "data: [DONE]"
        assert "data: [DONE]" in lines
        assert srv.proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 15
    # the start line names the KV pool's dtype beside the attention backend
    assert re.search(
        r"attention \w+, decode [^,]+, KV float32, CUDA graphs off;", (tmp_path / "server.log").read_text()
    )


def test_start_line_says_where_a_kv_dtype_takes_attention_off_the_kernel():
    """A bfloat16 pool on the cpu backend runs torch's attention (the kernel reads float32, float16
    and int8 pools): the start line says so; the kernel's own dtypes are named plainly."""
    import torch

    from agentrt.runtime.backends import describe_attention

    assert describe_attention("cpu", torch.float32) == ("cpu", "float32")
    assert describe_attention("cpu", torch.int8) == ("cpu", "int8")
    attention, kv = describe_attention("cpu", torch.bfloat16)
    assert kv == "bfloat16" and attention.startswith("cpu (torch's path") and "bfloat16 pool" in attention
    assert describe_attention("triton", torch.bfloat16) == ("triton", "bfloat16")
