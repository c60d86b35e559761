"""Granite 4 (GraniteMoeHybridForCausalLM, models/granite4.py) beyond the parity every family passes
(tests/runtime/test_model_families.py): the dense NoPE layout, each multiplier shown to matter, a
prefix hit between two state snapshots in the engine, `agentrt check`, and the configs refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.models.granite4 import GraniteMoeHybridForCausalLM
from agentrt.runtime.request import SamplingParams
from tests.support.families import GRANITE4, save_family
from tests.support.models import chunked_logits_error

CPU = {"device": "cpu", "dtype": "float32"}
NEW = 24


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, default_model_dir):
    return {
        name: save_family(name, tmp_path_factory.mktemp(name), default_model_dir)
        for name in ("granite4", "granite4_dense")
    }


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _logits_error(path, backend="torch") -> float:
    runner = ModelRunner(
        ModelConfig(model=str(path), attention_backend=backend, **CPU), CacheConfig(kv_cache_bytes=8 << 20)
    )
    torch.manual_seed(1)
    ids = torch.randint(0, 49152, (100,)).tolist()
    return chunked_logits_error(runner, _hf(path), ids, 50, 70)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_dense_nope_layout_matches_transformers(dirs, backend):
    """No experts (the shared MLP is the layer's MLP), no position embedding, attention first:
    prefill 50 + chunk 20 + 30 decodes (measured 2.9e-6 on logits up to ~9)."""
    assert _logits_error(dirs["granite4_dense"], backend) < 1e-4


MUTATIONS = {  # what leaving one multiplier out does to the logits of the tiny model
    "residual_multiplier": lambda arch: dataclasses.replace(arch, residual_multiplier=1.0),
    "logits_scaling": lambda arch: dataclasses.replace(arch, logits_scaling=1.0),
    "embedding_multiplier": lambda arch: dataclasses.replace(arch, embed_scale=None),
    "attention_multiplier": lambda arch: dataclasses.replace(arch, attn_scale=None),
}


@pytest.mark.parametrize("multiplier", sorted(MUTATIONS))
def test_each_multiplier_matters(dirs, monkeypatch, multiplier):
    """The parity bound can fail: with any one of the four multipliers ignored the logits are off
    by far more than 1e-4 (the tiny model sets every one away from 1)."""
    original = GraniteMoeHybridForCausalLM.arch_from_config.__func__

    def mutated(cls, cfg, architecture):
        return MUTATIONS[multiplier](original(cls, cfg, architecture))

    monkeypatch.setattr(GraniteMoeHybridForCausalLM, "arch_from_config", classmethod(mutated))
    assert _logits_error(dirs["granite4"]) > 1e-2


def test_a_hit_between_two_snapshots_gives_transformers_tokens(dirs):
    """Snapshots every 16 tokens: a prompt sharing 40 tokens with a cached one resumes from the
    Mamba-2 states at 32 and the attention KV of those 32 (cached_tokens 32), computes the rest in
    7-token chunks, and writes transformers' greedy tokens."""
    path = dirs["granite4"]
    hf = _hf(path)
    engine = Engine(
        EngineConfig(
            model=ModelConfig(model=str(path), **CPU),
            cache=CacheConfig(kv_cache_bytes=16 << 20, state_snapshot_interval=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=7),
        )
    )
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(0, 49152, (50,), generator=gen).tolist()
    second = first[:40] + torch.randint(0, 49152, (20,), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=NEW, logit_bias={t: -100.0 for t in engine.stop_ids})
    outs = []
    for ids in (first, second):
        (out,) = engine.generate([(ids, params, None)])
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0
            )
        outs.append((out.num_cached_tokens, out.token_ids == ref[0, len(ids) :].tolist()))
    assert outs == [(0, True), (32, True)]


def test_agentrt_check_reads_the_family(dirs):
    from agentrt.commands.check import check_model

    report = check_model(str(dirs["granite4"]), max_model_len=100, kv_cache_bytes=1_000_000, **CPU)
    assert report.exit_status == 0, report.describe()
    assert "GraniteMoeHybridForCausalLM (family granite4): 3 layers" in report.describe()
    # one attention layer keeps K/V (2 x 2 KV heads x 16 x 4 bytes); the Mamba-2 layers keep none
    assert (report.kv.pool_bytes_per_token, report.kv.full_layers) == (256, 1)
    assert "all 44 tensors have the names and shapes the model loads" in report.describe()


def test_the_mamba_layers_run_on_the_triton_backend(dirs, monkeypatch):
    """The Triton backend runs the Mamba-2 layers (backends/triton_recurrent.py: its decode kernels
    over the state pool; d72cff3 refused a requested triton naming the recurrent layers), `auto` on
    CUDA takes it for a hybrid too, and the plan says how the recurrent layers run."""
    from agentrt.runtime import run_plan
    from agentrt.runtime.kernels import triton_usable
    from agentrt.runtime.models.registry import arch_from_hf_config, read_hf_config

    path = dirs["granite4"]
    if not triton_usable(torch.device("cpu")) and not torch.cuda.is_available():
        pytest.skip("needs triton (TRITON_INTERPRET=1 on CPU)")
    runner = ModelRunner(ModelConfig(model=str(path), attention_backend="triton", **CPU), CacheConfig())
    assert runner.attention_backend == "triton"
    arch = arch_from_hf_config(read_hf_config(path))
    plan = run_plan.plan_run(
        ModelConfig(model=str(path), attention_backend="triton", **CPU), CacheConfig(), arch, path
    )
    assert (plan.recurrent, plan.recurrent_reason) == (
        "Mamba-2 decode by the Triton kernels, its prefill by the torch SSD scan",
        "attention triton",
    )
    monkeypatch.setattr(run_plan, "choose_attention_backend", lambda *a: ("triton", "auto: CUDA"))
    plan = run_plan.plan_run(ModelConfig(model=str(path), **CPU), CacheConfig(), arch, path)
    assert (plan.backend, plan.backend_reason) == ("triton", "auto: CUDA")


def _config(**overrides):
    from transformers import GraniteMoeHybridConfig

    from tests.support.families import COMMON

    cfg = GraniteMoeHybridConfig(**{**COMMON, **GRANITE4})
    cfg.architectures = ["GraniteMoeHybridForCausalLM"]
    for name, value in overrides.items():
        setattr(cfg, name, value)
    return cfg


def test_the_arch_reads_the_config():
    from agentrt.runtime.models.registry import arch_from_hf_config

    arch = arch_from_hf_config(_config())
    assert arch.layer_mixers == ("mamba2", "attention", "mamba2")
    assert (arch.attn_scale, arch.embed_scale, arch.residual_multiplier, arch.logits_scaling) == (
        0.0625,
        12.0,
        0.22,
        0.5,
    )
    assert (arch.moe_routing, arch.moe_intermediate_size, arch.shared_expert_intermediate_size) == (
        "topk_softmax",
        32,
        48,
    )
    assert not any(r.identity for r in arch.ropes)
    nope = arch_from_hf_config(_config(position_embedding_type="nope"))
    assert all(r.identity for r in nope.ropes)


@pytest.mark.parametrize(
    "overrides,error",
    [
        ({"layer_types": ["mamba", "cross_attention", "mamba"]}, "layer_types must name 3 layers"),
        ({"logits_scaling": 0.0}, "logits_scaling must not be 0"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_configs_it_cannot_run_are_refused(overrides, error):
    from agentrt.runtime.models.registry import arch_from_hf_config

    with pytest.raises(ValueError, match=error):
        arch_from_hf_config(_config(**overrides))
