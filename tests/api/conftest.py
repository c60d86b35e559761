"""Fixtures of the API tests that more than one module uses: `thinking_client`, the default model
served with a reasoning model's real chat template."""

from __future__ import annotations

import pytest

from tests.support.paths import shared_path

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def thinking_client(default_model_dir):
    """The default model with Qwen3-4B-Thinking-2507's template (its generation prompt opens
    <think>), in-process; a spent thinking budget closes with "\\nTime to answer."."""
    from fastapi.testclient import TestClient

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
    from agentrt.runtime.engine import Engine

    template = shared_path("chat_templates", "Qwen3-4B-Thinking-2507.jinja")
    engine = Engine(
        EngineConfig(
            model=ModelConfig(
                model=str(default_model_dir), device="cpu", dtype="float32", chat_template=str(template)
            ),
            cache=CacheConfig(kv_cache_bytes=128 << 20),
        )
    )
    front = AsyncEngine(engine=engine)
    with TestClient(create_app(front, MODEL, reasoning_budget_message="\nTime to answer.")) as c:
        yield c
    front.shutdown()


@pytest.fixture(scope="module")
def schema_server(default_model_dir):
    """tests/api/test_tools_with_schema*.py: (URL, Scripts) of a real server over the fake model; the default model's tokenizer and template (no tool support: the generic
    hermes format)."""
    from transformers import AutoTokenizer

    from tests.support.tools_schema import serve

    served, scripts, front = serve(AutoTokenizer.from_pretrained(str(default_model_dir)), None)
    with served as url:
        yield url, scripts
    front.shutdown()


@pytest.fixture(scope="module")
def schema_thinking_server(default_model_dir):
    """As schema_server, with Qwen3-4B-Thinking-2507's template (the prompt opens <think>; hermes calls)."""
    from transformers import AutoTokenizer

    from tests.support.tools_schema import serve

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    served, scripts, front = serve(tok, "Qwen3-4B-Thinking-2507")
    with served as url:
        yield url, scripts
    front.shutdown()
