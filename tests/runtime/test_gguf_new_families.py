"""GGUF files of the 2026 families (issue 53 item 6): the ones agentrt reads, proven against the model
each was written from, and the ones it refuses, refused before any tensor is read.

A tiny random-weight model per family (transformers' own config and model classes, float32, a
384-token byte-level BPE cut out of the default model's tokenizer) is written as llama.cpp's
converter writes it (tests/support/gguf_families.py follows each family's `conversion/*.py`), goes
through the path `agentrt serve file.gguf` takes (loader.resolve_model_dir, into a cache of the
test's own) and:

1. F32: the converted config is the family's architecture and agentrt's logits equal the original
   transformers model's within 1e-4 over a 40-token prefill, a 12-token chunk and 32 decodes;
2. Q8_0: agentrt's logits on all 60 positions equal transformers' on the same file (its GGUF loader
   de-quantizes) within 1e-4, every top-1 the same;
3. `agentrt check file.gguf` names the family with no error.

Read: Qwen3.5 dense and MoE (transformers 5's newer GGUF reader: value heads tiled back to grouped,
`1 + w` norms and ssm_a = -exp(A_log) undone; 2 key heads of 4 value heads, so the reorder shows),
MiniMax M2 (its legacy reader; the correction bias drawn so that it steers the routing).

Refused, each with a GGUF whose header names the architecture (gguf_meta.REFUSED_GGUF_ARCHS):
deepseek2 (DeepSeek V3, Kimi K2), qwen3next, gemma4, granitehybrid. Before this, a `qwen35` file
failed with "unsupported architecture 'qwen35'", and the refused ones with transformers' "not one
transformers can read" or, for gemma4, a conversion that went ahead.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
import torch

from agentrt.commands.check import check_model
from agentrt.runtime.config import CacheConfig, ModelConfig
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.models.gguf_meta import REFUSED_GGUF_ARCHS
from agentrt.runtime.models.loader import resolve_model_dir
from tests.support.families import HYBRID, HYBRID_MOE, family_config
from tests.support.gguf import tiny_vocab
from tests.support.gguf_families import header_gguf, write_family_gguf
from tests.support.models import chunked_logits_error

VOCAB = 384
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
    "pad_token_id": None,
}
# Qwen3.5 as its GGUF can state it: full attention every 2nd layer (the file keeps an interval, not
# layer_types), a quarter of the head rotated (llama.cpp's converter reads the factor from the top
# level of the config, 0.25 when absent), mrope sections over the 4 rotated pairs
QWEN35 = {
    **HYBRID,
    "head_dim": 32,
    "full_attention_interval": 2,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}


def _minimax_m2():
    cls, overrides = family_config("minimax_m2")
    return cls, {k: v for k, v in overrides.items() if not k.endswith("token_id")}


# family -> ((transformers config class name | factory, overrides), architecture agentrt runs it as)
FAMILIES = {
    "qwen3_5": (("Qwen3_5TextConfig", QWEN35), "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": (
        ("Qwen3_5MoeTextConfig", {**QWEN35, **HYBRID_MOE, "num_experts_per_tok": 2}),
        "Qwen3_5MoeForCausalLM",
    ),
    "minimax_m2": (_minimax_m2, "MiniMaxM2ForCausalLM"),
}
DECODE_STEPS = 32


@pytest.fixture(scope="module")
def vocab(default_model_dir):
    return tiny_vocab(default_model_dir, VOCAB)


@pytest.fixture(scope="module")
def family(tmp_path_factory, vocab):
    """family name -> (original transformers model, its directory); built on first use, with the
    weights transformers initialises to constants drawn at random: norms (a `1 + w` norm stored
    with the 1 added must come back), correction biases (they steer the routing)."""
    import transformers

    root = tmp_path_factory.mktemp("gguf-new-families")

    @cache
    def build(name: str):
        spec = FAMILIES[name][0]
        cls, overrides = spec() if callable(spec) else (getattr(transformers, spec[0]), spec[1])
        ids = {"bos_token_id": vocab.bos_id, "eos_token_id": vocab.eos_id}
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            cls(**{**COMMON, **ids, **overrides}), dtype=torch.float32
        ).eval()
        with torch.no_grad():
            for n, t in [*model.named_parameters(), *model.named_buffers()]:
                if n.endswith("norm.weight"):
                    t.uniform_(0.5, 1.5)
                elif n.endswith("e_score_correction_bias"):
                    t.normal_(0, 0.5)
        path = root / name
        path.mkdir()
        return model, path

    return build


def _gguf(family, vocab, name: str, qtype: str = "F32") -> Path:
    model, path = family(name)
    out = path / f"{name}-{qtype}.gguf"
    if not out.exists():
        write_family_gguf(model, out, vocab, qtype)
    return out


def _runner(gguf_path: Path) -> ModelRunner:
    """agentrt's model from the GGUF as `agentrt serve file.gguf` builds it: converted into a cache of
    the test's own (every run converts), then loaded."""
    converted = resolve_model_dir(str(gguf_path), gguf_path.parent / "cache")
    return ModelRunner(
        ModelConfig(model=str(converted), device="cpu", dtype="float32"), CacheConfig(kv_cache_bytes=8 << 20)
    )


def _prompt(seed: int, n: int = 60) -> list[int]:
    torch.manual_seed(seed)
    return torch.randint(0, VOCAB, (n,)).tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_f32_gguf_converts_to_the_family_and_matches_the_original_model(family, vocab, name):
    """Every converted weight is the original's (within the float32 rounding of what llama.cpp's
    converter computed: a `1 + w` norm stored with the 1 added, ssm_a = -exp(A_log); 2.5e-7 of
    max(1, |w|)), and agentrt's logits over prefill, chunk and decodes are the original
    model's within 1e-4 of the largest logit (the tiny random hybrids turn a 1e-7 change of a norm
    into ~1e-4 of a logit: measured 1.4e-4 of 6.1 on Qwen3.5-MoE)."""
    from safetensors.torch import load_file

    model, _ = family(name)
    path = _gguf(family, vocab, name)
    converted = load_file(str(resolve_model_dir(str(path), path.parent / "cache") / "model.safetensors"))
    original = model.state_dict()
    assert set(converted) == set(original)
    weight_err = max(
        ((converted[k] - original[k]).abs() / original[k].abs().clamp(min=1)).max().item() for k in original
    )
    runner = _runner(path)
    assert runner.arch.architecture == FAMILIES[name][1]
    ids = _prompt(1, 52 + DECODE_STEPS)
    err = chunked_logits_error(runner, model, ids, 40, 52)
    with torch.no_grad():
        scale = model(torch.tensor([ids])).logits.abs().max().item()
    print(
        f"{name} F32: max weight error {weight_err:.1e}, max logit error {err:.2e} of logits up to {scale:.1f}"
    )
    assert weight_err <= 2.5e-7, f"{name}: a weight differs from the original by {weight_err}"
    assert err < 1e-4 * max(1.0, scale), f"{name}: F32 GGUF max logit error {err}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_q8_0_gguf_matches_transformers_on_the_same_file(family, vocab, name):
    from transformers import AutoModelForCausalLM, GgufConfig

    path = _gguf(family, vocab, name, "Q8_0")
    runner = _runner(path)
    ids = _prompt(2)
    ours = runner.execute(
        [
            SeqChunk(
                ids,
                0,
                runner.kv.allocate(len(ids)),
                num_logits=len(ids),
                state_slot=runner.kv.states.allocate() if runner.kv.states is not None else None,
            )
        ]
    )
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        config=family(name)[0].config,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    err = (ours - expected).abs().max().item()
    agree = (ours.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"{name} Q8_0: vs transformers on the file {err:.2e} (top-1 {agree:.2f})")
    assert err < 1e-4 and agree == 1.0, f"{name} Q8_0: {err} / {agree}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_check_names_the_family_of_the_gguf(family, vocab, name):
    path = _gguf(family, vocab, name, "Q8_0")
    report = check_model(str(path), max_model_len=256, kv_cache_bytes=1 << 20, device="cpu", dtype="float32")
    assert report.exit_status == 0 and not report.errors, report.describe()
    assert report.architecture == FAMILIES[name][1]
    assert set(report.weight_bytes) == {"F32", "Q8_0"}


@pytest.mark.parametrize("arch", list(REFUSED_GGUF_ARCHS))
def test_refused_gguf_says_why_before_reading_tensors(vocab, arch, tmp_path):
    """serve (the conversion) and check refuse the file from its header: the message names the
    architecture, the family and the safetensors checkpoint; nothing is cached or converted."""
    family, why = REFUSED_GGUF_ARCHS[arch]
    path = header_gguf(tmp_path / f"{arch}.gguf", arch, vocab)
    message = f"GGUF architecture '{arch}' (family {family}) is not supported: {why}, use the safetensors checkpoint"
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_model_dir(str(path), tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    report = check_model(str(path), device="cpu", dtype="float32")
    assert report.exit_status == 1 and any(e.message == message for e in report.errors), report.describe()
