"""Plain helpers and constants shared by the tests (fixtures live in tests/conftest.py).

Import as `from tests.helpers import ...`: pytest puts the repository root on sys.path
(`pythonpath = ["."]` in pyproject.toml), so `pytest` and `python -m pytest` both work.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrt.testing import free_port

__all__ = [
    "ROOT",
    "SHARED",
    "chat_ids",
    "finish_all",
    "free_port",
    "load_case",
    "make_tiny_model",
    "shared_path",
    "sse_chunks",
]

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "testdata"


def shared_path(*parts: str) -> Path:
    """A path under ../shared/testdata, or skip the test when the shared data is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (the shared test data sits beside the repo in CI)")
    return path


def load_case(case_id: str) -> dict:
    """One case of ../shared/testdata/cases/cases.jsonl by id (KeyError when absent)."""
    for line in shared_path("cases", "cases.jsonl").read_text().splitlines():
        case = json.loads(line)
        if case["id"] == case_id:
            return case
    raise KeyError(case_id)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template (generation prompt added)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def make_tiny_model(path: Path, tokenizer_dir: Path, arch: str, **overrides) -> Path:
    """Save a random-weight 2-layer model of `arch` (llama | qwen2 | mistral) with the default
    model's tokenizer into `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    kwargs = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    }
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**kwargs), dtype=torch.float32)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path


def sse_chunks(client, body: dict, url: str = "/v1/chat/completions"):
    """POST a streaming request with `client` (TestClient/httpx) and yield each parsed SSE chunk
    (not [DONE]); asserts a 200 and no error event."""
    with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            yield chunk


def finish_all(engine, requests) -> list:
    """Step `engine` until every one of `requests` has finished; their final outputs, in order."""
    final = {}
    while len(final) < len(requests):
        final.update({out.request_id: out for out in engine.step() if out.finished})
    return [final[req.request_id] for req in requests]


def start_local_ray(module: str, tries: int = 3, object_store_bytes: int = 500 << 20):
    """A local Ray cluster of 2 CPUs (no dashboard), or a skip naming why: Ray or `module` (e.g.
    "ray.data", "ray.serve") missing, or the raylet not up after `tries` starts (on a loaded 2-core
    machine its agents can miss the raylet's fixed 15 s start-up window)."""
    ray = pytest.importorskip("ray", reason='Ray is not installed: pip install "agentrt[ray]"')
    pytest.importorskip(module, reason=f'{module} is not installed: pip install "agentrt[ray]"')
    errors = []
    for _ in range(tries):
        try:
            ray.init(
                num_cpus=2,
                object_store_memory=object_store_bytes,
                include_dashboard=False,
                logging_level="WARNING",
            )
            return ray
        except Exception as e:  # noqa: BLE001 (Ray raises a bare Exception when its node times out)
            errors.append(str(e))
            ray.shutdown()
    pytest.skip(f"the local Ray cluster did not start in {tries} tries: {errors[-1]}")
