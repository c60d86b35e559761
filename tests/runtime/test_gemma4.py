"""Gemma 4 beyond the family parity of test_model_families.py (models/gemma4.py): a checkpoint as
released, `Gemma4ForConditionalGeneration` with its vision and audio towers, runs its text model
against transformers' own class; `agentrt check` counts its KV caches (two shapes, two layers reading
an earlier layer's); the variants agentrt does not run are refused naming their config field."""

from __future__ import annotations

import pytest
import torch

from agentrt.commands.check import check_model
from agentrt.runtime.config import CacheConfig, ModelConfig
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.models.registry import arch_from_hf_config
from tests.support.families import COMMON, GEMMA4, WINDOW, save_family
from tests.support.models import chunked_logits_error


@pytest.fixture(scope="module")
def multimodal_dir(default_model_dir, tmp_path_factory):
    """A tiny Gemma4ForConditionalGeneration (the text model of tests/support/families.GEMMA4, one-layer
    vision and audio towers) with the default model's tokenizer."""
    from transformers import (
        AutoTokenizer,
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4VisionConfig,
    )

    vision = Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    audio = Gemma4AudioConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        output_proj_dims=32,
        subsampling_conv_channels=[8, 4],
    )
    cfg = Gemma4Config(text_config={**COMMON, **GEMMA4}, vision_config=vision, audio_config=audio)
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(cfg)
    with torch.no_grad():  # ones at init: drawn so that a dropped scale shows
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "language_model" in name and name.endswith(("norm.weight", "layer_scalar")):
                t.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("gemma4_mm")
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(default_model_dir)).save_pretrained(str(path))
    return path


def test_conditional_generation_checkpoint_matches_transformers(multimodal_dir):
    from transformers import Gemma4ForConditionalGeneration

    hf = Gemma4ForConditionalGeneration.from_pretrained(
        str(multimodal_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    runner = ModelRunner(
        ModelConfig(model=str(multimodal_dir), device="cpu", dtype="float32", attention_backend="torch"),
        CacheConfig(kv_cache_bytes=8 << 20),
    )
    # one cache per writing layer: the sliding layer's 2 KV heads x 16, the full layer's 1 x 32
    assert [tuple(k.shape[1:]) for k in runner.kv.k] == [(2, 16), (1, 32)]
    assert runner.model.layer_cache == (0, 1, 0, 1)
    torch.manual_seed(1)
    ids = torch.randint(0, 49152, (100,)).tolist()
    err = chunked_logits_error(runner, hf, ids, 50, 80)
    assert err < 1e-4, f"max logit error {err}"


def test_check_counts_the_kv_caches_not_the_layers(multimodal_dir):
    report = check_model(
        str(multimodal_dir), max_model_len=100, kv_cache_bytes=1_000_000, device="cpu", dtype="float32"
    )
    assert report.exit_status == 0, report.describe()
    assert (report.architecture, report.family) == ("Gemma4ForConditionalGeneration", "gemma4")
    text = report.describe()
    assert "2 KV caches (1 of 2 x 16, 1 of 1 x 32), 2 layers reading an earlier layer's" in text
    kv = report.kv
    # float32 K + V per token: the sliding cache 2 x 2 x 16 x 4 = 256, the full one 2 x 1 x 32 x 4 = 256
    assert kv.pool_bytes_per_token == 512
    assert kv.sequence_bytes(100) == 256 * 100 + 256 * WINDOW
    assert report.capacity.pool_sequences == 1_000_000 // (512 * 100)


@pytest.mark.parametrize(
    "override,field",
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"num_kv_shared_layers": 4}, "num_kv_shared_layers"),
        ({"vocab_size_per_layer_input": 1000}, "vocab_size_per_layer_input"),
    ],
)
def test_unsupported_variants_are_refused_naming_the_field(override, field):
    from transformers import Gemma4TextConfig

    cfg = Gemma4TextConfig(**{**COMMON, **GEMMA4, **override})
    with pytest.raises(ValueError, match=field):
        arch_from_hf_config(cfg)


def test_vision_bidirectional_mode_is_causal_over_text():
    """`use_bidirectional_attention: "vision"` (image tokens attend both ways) changes nothing for a
    text-only prompt: the config runs."""
    from transformers import Gemma4TextConfig

    arch = arch_from_hf_config(
        Gemma4TextConfig(**{**COMMON, **GEMMA4, "use_bidirectional_attention": "vision"})
    )
    assert arch.layer_kv == ("own", "k_eq_v", "shared", "shared")


def test_expert_load_counts_the_moe_beside_the_mlp(default_model_dir, tmp_path):
    """Gemma 4's MoE block sits beside the dense MLP (`layer.moe`): its per-expert token counts reach
    the runner's expert_load (the /metrics rows), top 2 of 4 experts per token in each of 3 layers."""
    from agentrt.runtime.forward import SeqChunk

    path = save_family("gemma4_moe", tmp_path / "gemma4_moe", default_model_dir)
    runner = ModelRunner(
        ModelConfig(model=str(path), device="cpu", dtype="float32"), CacheConfig(kv_cache_bytes=8 << 20)
    )
    ids = list(range(100, 130))
    runner.execute([SeqChunk(ids, 0, runner.kv.allocate(len(ids)))])
    load = runner.expert_load()
    assert [i for i, _ in load] == [0, 1, 2]
    assert all(len(counts) == 4 and sum(counts) == 2 * len(ids) for _, counts in load)
