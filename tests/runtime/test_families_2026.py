"""GLM-4.5 MoE, MiniMax M2 and SmolLM3 beyond their parity (tests/runtime/test_model_families.py):
`agentrt check` on each tiny model with its family's real chat template (the call format and the
reasoning format it implies, the KV bytes, no error), GLM's multi-token-prediction layer in a
checkpoint skipped as transformers skips it, and the layout features the whole-stack op and the
compiled decode do not take."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from agentrt.commands.check import check_model
from agentrt.grammars.reasoning import FORMATS as REASONING_FORMATS
from agentrt.grammars.reasoning import detect_reasoning
from agentrt.runtime.backends import compiled_decode, cpu_stack
from agentrt.runtime.config import CacheConfig, ModelConfig
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.model_runner import ModelRunner
from tests.support.families import save_family
from tests.support.paths import shared_path

# family -> (architecture, its chat template, the call format, the reasoning format, features the
# C++ whole-stack op and the compiled decode lack)
FAMILIES = {
    "glm4_moe": (
        "Glm4MoeForCausalLM",
        "GLM-4.6",
        "glm45",
        "think",
        {"moe", "moe_sigmoid", "moe_shared", "partial_rope", "qk_norm"},
    ),
    "minimax_m2": (
        "MiniMaxM2ForCausalLM",
        "MiniMax-M2",
        "minimax_m2",
        "think",
        {"moe", "moe_sigmoid", "partial_rope", "qk_norm", "qk_norm_full"},
    ),
    # SmolLM3's template (Unsloth's) renders no tools: the generic hermes prompt, as its model writes
    "smollm3": (
        "SmolLM3ForCausalLM",
        "HuggingFaceTB-SmolLM3-3B",
        "hermes",
        "think",
        {"nope", "multi_rope", "o_bias"},
    ),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, default_model_dir):
    return {name: save_family(name, tmp_path_factory.mktemp(name), default_model_dir) for name in FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_check_knows_each_family_and_its_template_formats(dirs, family):
    architecture, template, tool_format, reasoning, _ = FAMILIES[family]
    path = shared_path("chat_templates", f"{template}.jinja")
    report = check_model(
        str(dirs[family]),
        max_model_len=100,
        kv_cache_bytes=1_000_000,
        chat_template=str(path),
        device="cpu",
        dtype="float32",
    )
    assert report.exit_status == 0, report.describe()
    assert report.architecture == architecture and report.family == family
    assert report.tool_format == tool_format
    assert report.reasoning_format == "think tags (<think>...</think>)"
    assert detect_reasoning(path.read_text()) is REASONING_FORMATS[reasoning]  # what serve parses
    # 3 layers of 2 KV heads x 16 at float32, K and V
    assert report.kv.pool_bytes_per_token == 3 * 2 * 2 * 16 * 4


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_stack_op_and_compiled_decode_refuse_the_new_layouts(dirs, family):
    from transformers import AutoConfig

    from agentrt.runtime.models.registry import arch_from_hf_config

    arch = arch_from_hf_config(AutoConfig.from_pretrained(str(dirs[family])))
    lacking = FAMILIES[family][4]
    assert lacking <= cpu_stack.unsupported(arch) and lacking <= compiled_decode.unsupported(arch)


def test_glm_multi_token_prediction_layer_is_skipped(dirs, tmp_path):
    """Released GLM-4.5 checkpoints carry their MTP module as layer num_hidden_layers (46 of the
    Air's 46): transformers ignores it, and so does the load; the logits are those without it."""
    import shutil

    src = dirs["glm4_moe"]
    with_mtp = tmp_path / "glm_mtp"
    shutil.copytree(src, with_mtp)
    gen = torch.Generator().manual_seed(0)
    extra = {
        "model.layers.3.eh_proj.weight": torch.randn(64, 128, generator=gen),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.mlp.gate.e_score_correction_bias": torch.zeros(8),
        "model.layers.3.shared_head.head.weight": torch.randn(49152, 64, generator=gen),
    }
    save_file(extra, str(with_mtp / "mtp.safetensors"))
    ids = list(range(300, 340))
    out = []
    for path in (src, with_mtp):
        runner = ModelRunner(
            ModelConfig(model=str(path), device="cpu", dtype="float32"), CacheConfig(kv_cache_bytes=8 << 20)
        )
        out.append(runner.execute([SeqChunk(ids, 0, runner.kv.allocate(len(ids)))]))
    assert torch.equal(out[0], out[1])


def test_an_eos_id_outside_the_vocabulary_is_not_a_stop_id(dirs, tmp_path):
    """MiniMax M2's config class defaults eos_token_id to 200020; a checkpoint whose tokenizer is
    smaller keeps it in generation_config.json. It is not used as a stop id (a grammar matcher
    refuses one past the vocabulary: every json_schema request failed with a 500), and check warns."""
    import json
    import shutil

    from agentrt.runtime.models.loader import collect_stop_ids
    from agentrt.runtime.models.registry import read_hf_config
    from agentrt.runtime.request import SamplingParams

    path = tmp_path / "m"
    shutil.copytree(dirs["minimax_m2"], path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 200020]}))
    runner = ModelRunner(
        ModelConfig(model=str(path), device="cpu", dtype="float32"), CacheConfig(kv_cache_bytes=8 << 20)
    )
    assert 200020 not in runner.stop_ids and 2 in runner.stop_ids
    assert collect_stop_ids(runner.tokenizer, path, read_hf_config(path)) == runner.stop_ids
    report = check_model(
        str(path), max_model_len=100, kv_cache_bytes=1_000_000, device="cpu", dtype="float32"
    )
    assert "eos ids [200020]" in report.describe() and "outside the vocabulary" in report.describe()
    from agentrt.grammars.spec import ConstraintSpec
    from agentrt.runtime.engine import Engine

    engine = Engine(runner=runner)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    (out,) = engine.generate(
        [(list(range(100, 120)), SamplingParams(max_tokens=20), ConstraintSpec.json_schema(schema))]
    )
    assert out.finish_reason != "error", out.error


def test_the_gemma4_reasoning_format_can_be_named():
    """--reasoning-format gemma4 overrides the template's detection like the other formats."""
    import argparse

    from agentrt.grammars.reasoning import reasoning_format
    from agentrt.server_args import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert p.parse_known_args(["--reasoning-format", "gemma4"])[0].reasoning_format == "gemma4"
    assert reasoning_format("gemma4") is REASONING_FORMATS["gemma4"]
