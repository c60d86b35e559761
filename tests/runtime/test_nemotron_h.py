"""Nemotron-H (NemotronHForCausalLM, models/nemotron_h.py) beyond the parity every family passes
(tests/runtime/test_model_families.py): one block per layer (the mixer-less blocks keep no KV and no
state), a prefix hit between two state snapshots in the engine, `agentrt check` with the Nemotron
Nano v2 template, and the configs refused."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import SamplingParams
from tests.support.families import COMMON, NEMOTRON_H, save_family
from tests.support.paths import shared_path

CPU = {"device": "cpu", "dtype": "float32"}
NEW = 24
TEMPLATE = "NVIDIA-Nemotron-Nano-v2"


@pytest.fixture(scope="module")
def path(tmp_path_factory, default_model_dir):
    return save_family("nemotron_h", tmp_path_factory.mktemp("nemotron_h"), default_model_dir)


def _config(**overrides):
    from transformers import NemotronHConfig

    cfg = NemotronHConfig(**{**COMMON, **NEMOTRON_H, **overrides})
    cfg.architectures = ["NemotronHForCausalLM"]
    return cfg


def test_each_block_is_one_mixer_or_one_mlp():
    """M, E, *, -, M: two Mamba-2 states, one KV cache (the attention block's), the MoE and MLP
    blocks neither; the model's blocks hold exactly one module each."""
    from agentrt.runtime.models.nemotron_h import NemotronHForCausalLM
    from agentrt.runtime.models.registry import arch_from_hf_config

    arch = arch_from_hf_config(_config())
    assert arch.layer_mixers == ("mamba2", "none", "attention", "none", "mamba2")
    assert arch.recurrent_layers == (0, 4) and arch.moe_layers == (False, True, False, False, False)
    assert arch.kv_layout()[1] == (None, None, 0, None, None)
    assert all(r.identity for r in arch.ropes)  # no position embedding
    with torch.device("meta"):
        model = NemotronHForCausalLM(arch, 64)
    held = [[m for m in ("linear_attn", "self_attn", "mlp") if hasattr(layer, m)] for layer in model.layers]
    assert held == [["linear_attn"], ["mlp"], ["self_attn"], ["mlp"], ["linear_attn"]]
    assert type(model.layers[3].mlp).__name__ == "MLP" and type(model.layers[1].mlp).__name__ == "SparseMoE"


def test_a_hit_between_two_snapshots_gives_transformers_tokens(path):
    """Snapshots every 16 tokens: a prompt sharing 40 tokens with a cached one resumes from the
    Mamba-2 states at 32 and the attention block's KV of those 32 (cached_tokens 32), computes the
    rest in 7-token chunks, and writes transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
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


def test_agentrt_check_reads_the_family_and_its_template(path):
    """The Nano v2 template's `<TOOLCALL>[...]</TOOLCALL>` calls are the nemotron_json format (the
    template renders the tools and earlier calls itself); its reasoning is `<think>` tags, opened by
    the generation prompt unless /no_think closes them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from agentrt.api.tools.detection import detect
    from agentrt.commands.check import check_model
    from agentrt.grammars.reasoning import FORMATS, detect_reasoning

    template = shared_path("chat_templates", f"{TEMPLATE}.jinja")
    report = check_model(
        str(path), max_model_len=100, kv_cache_bytes=1_000_000, chat_template=str(template), **CPU
    )
    assert report.exit_status == 0, report.describe()
    assert report.architecture == "NemotronHForCausalLM" and report.family == "nemotron_h"
    assert "5 layers" in report.describe()
    # the one attention block keeps K/V: 2 KV heads x 16 x 2 (K and V) x 4 bytes
    assert (report.kv.pool_bytes_per_token, report.kv.full_layers) == (256, 1)
    assert report.tool_format == "nemotron_json"
    assert report.reasoning_format == "think tags (<think>...</think>)"
    assert "tool calls nemotron_json (the template renders tools)" in report.describe()
    found = detect(template.read_text())
    assert (found.name, found.native, found.unsupported) == ("nemotron_json", True, None)
    fmt = detect_reasoning(template.read_text())
    assert fmt is FORMATS["think"]
    modes = []
    for text in ("hi", "hi /no_think"):
        (prompt,), _ = render_jinja_template(
            [[{"role": "user", "content": text}]],
            chat_template=template.read_text(),
            add_generation_prompt=True,
        )
        modes.append(fmt.mode(prompt))
    assert modes == ["open", "off"]


@pytest.mark.parametrize(
    "overrides,error",
    [
        ({"layers_block_type": ["linear_attention", "cross"]}, "layers_block_type must name every block"),
        ({"moe_latent_size": 16}, "moe_latent_size .* is not supported"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias with MoE blocks is not supported"),
    ],
)
def test_configs_it_cannot_run_are_refused(overrides, error):
    from agentrt.runtime.models.registry import arch_from_hf_config

    cfg = _config()
    for name, value in overrides.items():
        setattr(cfg, name, value)
    with pytest.raises(ValueError, match=error):
        arch_from_hf_config(cfg)
