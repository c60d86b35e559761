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
