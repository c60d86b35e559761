"""Jump-forward over grammar-forced text: same greedy outputs as token-by-token decoding, fewer
sampled tokens, forced tokens counted."""

from __future__ import annotations

import json

import pytest

from agentrt.extract.prompt import extraction_messages
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.runtime.request import SamplingParams
from tests.support.models import chat_ids
from tests.support.paths import shared_path


@pytest.fixture(scope="module")
def engine_no_jf(default_model_dir):
    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
    from agentrt.runtime.engine import Engine

    return Engine(
        EngineConfig(
            model=ModelConfig(model=str(default_model_dir), device="cpu", dtype="float32"),
            cache=CacheConfig(kv_cache_bytes=128 << 20),
            grammar=GrammarConfig(jump_forward=False),
        )
    )


def _requests(tokenizer, n_per_schema: int):
    docs = [json.loads(line) for line in shared_path("extraction", "docs.jsonl").read_text().splitlines()]
    seen: dict[str, int] = {}
    reqs = []
    for d in docs:
        if seen.get(d["schema_name"], 0) >= n_per_schema:
            continue
        seen[d["schema_name"]] = seen.get(d["schema_name"], 0) + 1
        schema = json.loads(shared_path("extraction", "schemas", f"{d['schema_name']}.json").read_text())
        reqs.append(
            (
                chat_ids(tokenizer, extraction_messages(d["text"], schema)),
                SamplingParams(temperature=0, max_tokens=160),
                ConstraintSpec.json_schema(schema),
            )
        )
    return reqs


@pytest.mark.slow  # minutes on 2 CPU cores: `make test-slow`
def test_jump_forward_keeps_greedy_outputs(engine, engine_no_jf, tokenizer):
    """Identical greedy text with and without jump-forward, with one documented exception: decoding
    token by token the model may spell forced text with a non-canonical split (`Ġ[` + `{"` where
    the tokenizer gives `Ġ[{` + `"`); jump-forward always uses the canonical split, and the two
    runs may then continue differently. Every divergence must be exactly that: same text up to
    the point, one token's text a proper prefix of the other's."""
    reqs = _requests(tokenizer, 1)
    before = engine.stats.num_jump_forward_tokens
    with_jf = engine.generate(reqs)
    forced = engine.stats.num_jump_forward_tokens - before
    without = engine_no_jf.generate(reqs)
    assert engine_no_jf.stats.num_jump_forward_tokens == 0
    assert forced > 0
    identical = 0
    for a, b in zip(with_jf, without):
        if a.text == b.text:
            identical += 1
            continue
        p = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
        assert tokenizer.decode(a.token_ids[:p]) == tokenizer.decode(b.token_ids[:p])
        ta, tb = tokenizer.decode(a.token_ids[p : p + 1]), tokenizer.decode(b.token_ids[p : p + 1])
        assert ta != tb and (ta.startswith(tb) or tb.startswith(ta)), (ta, tb)
    assert identical >= 1
    total = sum(len(o.token_ids) for o in with_jf)
    print(
        f"\njump-forward: {forced} of {total} output tokens forced ({forced / total:.1%}); "
        f"{identical}/{len(reqs)} outputs identical to token-by-token decoding"
    )
