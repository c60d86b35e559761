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
deepseek2 (DeepSeek V3, Kimi K2), qwen3next, gemma4, granitehybrid, nemotron_h(_moe). Before this, a `qwen35` file
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
from agentrt.runtime.models.gguf_renamed import RENAMED_GGUF_ARCHS
from agentrt.runtime.models.loader import resolve_model_dir
from tests.support.families import HYBRID, HYBRID_MOE, family_config
from tests.support.gguf import tiny_vocab
from tests.support.gguf_families import header_gguf, write_family_gguf
from tests.support.models import chunked_logits_error
from tests.support.paths import ROOT

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


def _from_families(name: str, **changes):
    """tests/support/families.py's config of `name` without its special-token ids, with `changes`
    (None: the key removed)."""
    cls, overrides = family_config(name)
    overrides = {k: v for k, v in {**overrides, **changes}.items() if v is not None}
    return lambda: (cls, {k: v for k, v in overrides.items() if not k.endswith("token_id")})


# family -> ((transformers config class name, overrides) | factory, architecture agentrt runs it as)
FAMILIES = {
    "qwen3_5": (("Qwen3_5TextConfig", QWEN35), "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": (
        ("Qwen3_5MoeTextConfig", {**QWEN35, **HYBRID_MOE, "num_experts_per_tok": 2}),
        "Qwen3_5MoeForCausalLM",
    ),
    "minimax_m2": (_from_families("minimax_m2"), "MiniMaxM2ForCausalLM"),
    # llama.cpp fixes SmolLM3's NoPE layers at every 4th (transformers' default interval): 4 layers
    "smollm3": (_from_families("smollm3", num_hidden_layers=4, no_rope_layers=None), "SmolLM3ForCausalLM"),
    "gpt_oss": (_from_families("gpt_oss"), "GptOssForCausalLM"),
    "glm4_moe": (_from_families("glm4_moe"), "Glm4MoeForCausalLM"),
}
# families transformers' GGUF readers cannot read (gguf_renamed.py): their quantized files are
# compared with the float model rounded as the file stores it
RENAMED = {"smollm3", "gpt_oss", "glm4_moe"}
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
                elif n.endswith("sinks"):
                    t.normal_(0, 1.0)
                elif name == "gpt_oss" and n.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    t.copy_(_mxfp4_round(t))
        path = root / name
        path.mkdir()
        return model, path

    return build


def _mxfp4_round(t: torch.Tensor) -> torch.Tensor:
    """A transformers gpt-oss expert stack ([E, H, 2I] / [E, I, H]) rounded to MXFP4 in blocks of 32
    along its input dimension, as the released checkpoints hold it and as its GGUF stores it."""
    import gguf

    mx = gguf.GGMLQuantizationType.MXFP4
    rows = t.transpose(1, 2).contiguous().numpy()  # [E, out, in]
    rounded = gguf.quants.dequantize(gguf.quants.quantize(rows, mx), mx).reshape(rows.shape)
    return torch.from_numpy(rounded).transpose(1, 2)


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


def _prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    state = runner.kv.states.allocate() if runner.kv.states is not None else None
    chunk = SeqChunk(ids, 0, runner.kv.allocate(len(ids)), num_logits=len(ids), state_slot=state)
    return runner.execute([chunk])


def _rounded_as_stored(model, name: str):
    """A copy of `model` with every weight its Q8_0 GGUF stores as Q8_0 rounded through the gguf
    package's Q8_0 (blocks of 32 along each row: a row permutation, a concatenation of rows or a
    transpose of a stack's last two axes, all the converter does, leave those blocks whole); the
    converter keeps vectors, biases and routers in F32, and gpt-oss's experts are MXFP4 already."""
    import copy

    import gguf

    q8 = gguf.GGMLQuantizationType.Q8_0
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for n, t in rounded.state_dict().items():
            f32 = (
                n.endswith(("bias", "mlp.gate.weight", "mlp.router.weight"))
                or ".experts." in n
                and name == "gpt_oss"
            )
            if t.ndim >= 2 and t.shape[-1] % 32 == 0 and not f32:
                t.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), q8), q8)))
    return rounded


@pytest.mark.parametrize("name", sorted(RENAMED))
def test_q8_0_gguf_of_a_renamed_family_is_the_model_rounded_as_stored(family, vocab, name):
    """transformers cannot read these files, so the quantized conversion is held to the float model
    rounded as the file stores it: every converted weight equal to it, and agentrt's logits too."""
    from safetensors.torch import load_file

    model, _ = family(name)
    path = _gguf(family, vocab, name, "Q8_0")
    expected = _rounded_as_stored(model, name)
    converted = load_file(str(resolve_model_dir(str(path), path.parent / "cache") / "model.safetensors"))
    weight_err = max((converted[k] - v).abs().max().item() for k, v in expected.state_dict().items())
    ids = _prompt(2)
    ours = _prefill_logits(_runner(path), ids)
    with torch.no_grad():
        ref, exact = (m(torch.tensor([ids])).logits[0] for m in (expected, model))
    err = (ours - ref).abs().max().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    q_err = (ours - exact).abs().max().item()
    print(
        f"{name} Q8_0: weights {weight_err:.1e}, vs the rounded model {err:.2e} (top-1 {agree:.2f}), vs the float one {q_err:.3f}"
    )
    assert weight_err == 0.0, (
        f"{name} Q8_0: a converted weight differs by {weight_err} from its Q8_0 rounding"
    )
    assert err < 1e-4 and agree == 1.0, f"{name} Q8_0: {err} / {agree}"


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - RENAMED))
def test_q8_0_gguf_matches_transformers_on_the_same_file(family, vocab, name):
    from transformers import AutoModelForCausalLM, GgufConfig

    path = _gguf(family, vocab, name, "Q8_0")
    runner = _runner(path)
    ids = _prompt(2)
    ours = _prefill_logits(runner, ids)
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
    assert set(report.weight_bytes) == {"F32", "Q8_0"} | ({"MXFP4"} if name == "gpt_oss" else set())


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


@pytest.mark.parametrize(
    ("drop", "extra", "message"),
    [
        (
            ("blk.1.ffn_down.weight",),
            {},
            r"holds no tensor for 1 weights \(model.layers.1.mlp.down_proj.weight\)",
        ),
        (
            (),
            {"blk.0.attn_gate.weight": "zeros"},
            r"1 tensors have no place in the model \(blk.0.attn_gate.weight\)",
        ),
    ],
)
def test_renamed_conversion_refuses_a_missing_or_unknown_tensor(
    family, vocab, tmp_path, drop, extra, message
):
    """agentrt's own conversion (gguf_renamed.py) neither leaves a weight at random nor drops a tensor
    it does not know: either names it, and nothing is cached."""
    import numpy as np

    model, _ = family("smollm3")
    added = {name: np.zeros((64, 64), dtype=np.float32) for name in extra}
    path = write_family_gguf(model, tmp_path / "broken.gguf", vocab, drop=drop, extra=added)
    with pytest.raises(ValueError, match=message):
        resolve_model_dir(str(path), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("gguf-*"))


def test_readme_lists_every_gguf_architecture_read_or_refused():
    """The README's GGUF table names every architecture agentrt reads itself or refuses, and the
    Qwen3.5 ones transformers' newer reader reads."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("**GGUF files by family.**")
    section = readme[start : readme.index("\n**", start + 1)]
    for arch in (*REFUSED_GGUF_ARCHS, *RENAMED_GGUF_ARCHS, "qwen35", "qwen35moe", "minimax-m2"):
        assert f"`{arch}`" in section, arch
    for arch in REFUSED_GGUF_ARCHS:
        assert re.search(rf"\| refused: [^|]*`{arch}`", section), arch
