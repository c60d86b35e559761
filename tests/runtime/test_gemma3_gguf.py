"""The real Gemma 3 270M GGUF (Q4_K_M, installed by `make install` as the registered model
`gemma3-270m`) end to end: served by `agentrt serve` through the openai client, and its greedy
output on a prompt longer than its 512-token sliding window against transformers on the same
de-quantized weights. Slow: the first start converts the GGUF (~50-100 s on 2 cores)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from agentrt.testing import free_port, launch_server

pytestmark = pytest.mark.slow

TEMPLATE = (
    Path(__file__).resolve().parents[3]
    / "shared"
    / "testdata"
    / "chat_templates"
    / "vllm-tool_chat_template_gemma3_pythonic.jinja"
)
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    from agentrt.runtime.models.loader import find_registered_gguf

    try:
        return find_registered_gguf("gemma3-270m")
    except ValueError as e:
        pytest.skip(f"{e} (`make test` installs them)")


def test_served_json_schema_request_is_valid_json(gemma_gguf, tmp_path):
    if not TEMPLATE.is_file():
        pytest.skip(f"{TEMPLATE} is not here (../shared/testdata): the GGUF has no chat template of its own")
    from openai import OpenAI

    port = free_port()
    cmd = [sys.executable, "-m", "agentrt.cli", "serve", "gemma3-270m", "--quantization", "auto"]
    cmd += ["--chat-template", str(TEMPLATE), "--port", str(port)]
    with launch_server(cmd, port, timeout_s=600, log_path=tmp_path / "log") as srv:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        resp = client.chat.completions.create(
            model="gemma3-270m",
            messages=[
                {"role": "user", "content": "Paris has 2.1 million people. Give its city and population."}
            ],
            temperature=0,
            max_tokens=100,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
            # a 270M pretrained model may run on in a number: the budget closes the JSON validly
            extra_body={"max_tokens_policy": "close"},
        )
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_prompt_past_the_window_matches_transformers(gemma_gguf):
    from transformers import AutoModelForCausalLM

    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from agentrt.runtime.engine import Engine
    from agentrt.runtime.kv_window import SlidingWindowKVPool
    from agentrt.runtime.request import SamplingParams

    def engine_of(cache, **scheduler):
        return Engine(
            EngineConfig(
                model=ModelConfig(model="gemma3-270m", dtype="float32"),
                cache=CacheConfig(**cache),
                scheduler=SchedulerConfig(**scheduler),
            )
        )

    engine = engine_of({"kv_cache_bytes": 64 << 20, "disable_hybrid_swa_memory": True})
    # the sliding-window pool with fewer window rows than the prompt has tokens (758: 3,033 slots)
    window_engine = engine_of(
        {"kv_cache_bytes": 40 << 20, "swa_full_tokens_ratio": 0.25}, max_num_batched_tokens=128
    )
    assert isinstance(window_engine.runner.kv, SlidingWindowKVPool)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()[:3000]
    ids = engine.tokenizer("Here is a document:\n" + readme + "\n\nSummary of the document in one sentence:")[
        "input_ids"
    ]
    assert len(ids) > 3 * 512 // 2  # well past the 512-token window of the local layers
    out = engine.generate([(ids, SamplingParams(temperature=0, max_tokens=24), None)])[0].token_ids
    assert window_engine.runner.kv.num_window_slots < len(ids)
    windowed = window_engine.generate([(ids, SamplingParams(temperature=0, max_tokens=24), None)])
    assert windowed[0].token_ids == out
    hf = AutoModelForCausalLM.from_pretrained(
        str(engine.runner.model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=len(out), do_sample=False)[
            0, len(ids) :
        ].tolist()
    assert out == ref, (engine.tokenizer.decode(out), engine.tokenizer.decode(ref))
    text = engine.tokenizer.decode(out)
    assert len(set(text.split())) >= 5, text  # words, not one token repeated
