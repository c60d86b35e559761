"""Our Llama-family forward against transformers on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.request import SamplingParams
from tests.support.models import chat_ids, chunked_logits_error, make_tiny_model

PROMPTS = [  # three prompt lengths: batched decode over sequences of different lengths
    "What is the capital of France?",
    "List three prime numbers.",
    "Explain what a hash table is in one sentence.",
]
NEW_TOKENS = 32
DECODE_STEPS = 32  # single-token decodes compared after the prefill and the chunk (issue 35)


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_default_model_greedy_tokens_and_logits_match_transformers(engine, tokenizer, default_model_dir):
    hf = _hf_model(default_model_dir)
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    # all decoded together: batched decode over sequences of different lengths; EOS is biased
    # away as transformers' min_new_tokens does, so every sequence runs the full NEW_TOKENS
    no_eos = {t: -100.0 for t in engine.stop_ids}
    outs = engine.generate(
        [
            (ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logit_bias=no_eos), None)
            for ids in prompts
        ]
    )
    runner = engine.runner
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        assert out.token_ids == ref[0, len(ids) :].tolist()
        # logits of every position of prompt + generated text, one prefill through our runner
        full = ids + out.token_ids
        slots = runner.kv.allocate(len(full))
        try:
            ours = torch.cat(
                [
                    runner.execute([SeqChunk(full[: i + 1], 0, slots[: i + 1])])
                    for i in (len(ids) - 1, len(full) - 1)
                ]
            )
        finally:
            runner.kv.free(slots)
        with torch.no_grad():
            hf_logits = hf(torch.tensor([full])).logits[0]
        theirs = hf_logits[[len(ids) - 1, len(full) - 1]]
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()


@pytest.mark.parametrize(
    "arch,overrides",
    [
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "num_key_value_heads": 4}),
        ("qwen2", {"num_key_value_heads": 1}),
        ("mistral", {"sliding_window": None}),
    ],
)
def test_tiny_architectures_match_transformers(tmp_path, default_model_dir, arch, overrides):
    path = make_tiny_model(tmp_path / arch, default_model_dir, arch, **overrides)
    hf = _hf_model(path)
    runner = ModelRunner(
        ModelConfig(model=str(path), device="cpu", dtype="float32"), CacheConfig(kv_cache_bytes=8 << 20)
    )
    torch.manual_seed(1)
    ids = torch.randint(0, 49152, (140 + DECODE_STEPS,)).tolist()
    # prefill 100 tokens, then a 40-token chunk on top of the cache, then 32 single-token decodes
    err = chunked_logits_error(runner, hf, ids, 100, 140)
    assert err <= 1e-4, err


def test_unsupported_architecture_is_named(tmp_path, default_model_dir):
    import json

    path = make_tiny_model(tmp_path / "m", default_model_dir, "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelRunner(ModelConfig(model=str(path), device="cpu"), CacheConfig(kv_cache_bytes=1 << 20))


def test_tokenizer_larger_than_embedding_is_refused(tmp_path, default_model_dir):
    path = make_tiny_model(tmp_path / "m", default_model_dir, "llama", vocab_size=32000)
    with pytest.raises(ValueError, match="tokenizer and model do not match"):
        ModelRunner(ModelConfig(model=str(path), device="cpu"), CacheConfig(kv_cache_bytes=1 << 20))


def test_stop_ids_include_generation_config_and_template_end(tmp_path, default_model_dir):
    import json

    path = make_tiny_model(tmp_path / "m", default_model_dir, "llama")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    engine = Engine(
        EngineConfig(
            model=ModelConfig(model=str(path), device="cpu"), cache=CacheConfig(kv_cache_bytes=1 << 20)
        )
    )
    assert {2, 7} <= set(engine.stop_ids)


def test_missing_model_is_a_clear_offline_error(tmp_path):
    with pytest.raises(ValueError, match="never downloads"):
        ModelRunner(ModelConfig(model="some-org/not-here-model", cache_dir=tmp_path), CacheConfig())
