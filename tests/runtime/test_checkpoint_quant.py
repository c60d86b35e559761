"""Quantized checkpoints as released (runtime/models/checkpoint_quant.py): MXFP4 experts (gpt-oss) and
block-FP8 weights (DeepSeek V3 / Qwen3 FP8) de-quantized at load, against transformers' own
de-quantization bit for bit, then run against transformers on the same checkpoint; every other
quantization_config refused, by serve's engine and by `agentrt check`, from the config alone.

The checkpoints are written in the test in the released layouts: gpt-oss's experts as uint8 blocks
[E, rows, cols / 32, 16] with e8m0 scales, Qwen3's projections as float8_e4m3fn with a float32
`weight_scale_inv` per 128x128 block (shapes that 128 does not divide, so every edge block is partial).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrt.commands.check import check_model
from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.models.checkpoint_quant import (
    CheckpointQuant,
    checkpoint_quant,
    dequantize_fp8_blocks,
    dequantize_mxfp4,
)
from agentrt.runtime.request import SamplingParams
from tests.support.families import COMMON, family_config
from tests.support.models import chunked_logits_error, make_tiny_model

CPU = {"device": "cpu", "dtype": "float32"}
BLOCK = (128, 128)
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
FP8_CONFIG = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}


def _bits_equal(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Same shape, dtype and bits (signed zeros included; NaN where the other has NaN)."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[ours.element_size()]
    nan = ours.isnan()
    assert torch.equal(nan, ref.isnan())
    assert torch.equal(ours.contiguous().view(ints)[~nan], ref.contiguous().view(ints)[~nan])


def fp8_quantize(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [..., ceil(rows / br), ceil(cols / bc)]): DeepSeek V3's
    block quantization (a block's max |w| maps to 448), edge blocks partial."""
    br, bc = block
    rows, cols = w.shape[-2:]
    gr, gc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(*w.shape[:-2], gr * br, gc * bc)
    padded[..., :rows, :cols] = w
    amax = padded.unflatten(-1, (gc, bc)).unflatten(-3, (gr, br)).abs().amax(dim=(-3, -1))
    scale = (amax / 448.0).clamp(min=1e-12)
    full = scale.repeat_interleave(br, -2)[..., :rows, :].repeat_interleave(bc, -1)[..., :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


# ---- the formats, bit for bit --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mxfp4_equals_transformers_bit_for_bit(dtype):
    """Every byte of blocks and every e8m0 scale (255 included: inf / NaN as transformers computes it)
    against transformers' `convert_moe_packed_tensors`, in each run dtype."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=g)
    blocks[0, 0, :, :] = torch.arange(64, dtype=torch.uint8).view(4, 16) * 4 + 1
    scales = (torch.arange(3 * 40 * 4) % 256).to(torch.uint8).view(3, 40, 4)
    ref = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 4 * 32, 40)  # [E, cols, rows]: gpt-oss's x @ W layout
    _bits_equal(ours, ref)


def test_mxfp4_nibble_order_and_scale_by_hand():
    """Byte 0x71 of a block holds value 2j (low nibble 1 = 0.5) and 2j + 1 (high nibble 7 = 6.0);
    code 0xA (sign + 2) is -1.0; scale byte 127 + k multiplies by 2 ** k."""
    blocks = torch.zeros(1, 2, 1, 16, dtype=torch.uint8)
    blocks[0, :, 0, 0], blocks[0, :, 0, 15] = 0x71, 0xA0
    scales = torch.tensor([[[127], [130]]], dtype=torch.uint8)
    w = dequantize_mxfp4(blocks, scales, torch.float32)  # [1, 32, 2]
    assert w[0, :2, 0].tolist() == [0.5, 6.0] and w[0, 30:, 0].tolist() == [0.0, -1.0]
    assert w[0, :2, 1].tolist() == [4.0, 48.0] and w[0, 31, 1].item() == -8.0
    assert w[0, 2:30].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(256, 384), (3, 256, 128)], ids=["matrix", "stacked"])
def test_fp8_blocks_equal_transformers_load_bit_for_bit(shape, dtype):
    """Shapes 128 divides: transformers' Fp8Dequantize (its load path), with float32 scales and with
    e8m0 (uint8) ones."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    torch.manual_seed(0)
    w, scale = fp8_quantize(torch.randn(shape))
    dequant = fp8.Fp8Dequantize(None)
    _bits_equal(dequantize_fp8_blocks(w, scale, BLOCK, dtype), dequant._dequantize_one(w, scale, dtype))
    e8m0 = torch.randint(100, 140, scale.shape, dtype=torch.uint8)
    _bits_equal(dequantize_fp8_blocks(w, e8m0, BLOCK, dtype), dequant._dequantize_one(w, e8m0, dtype))


@pytest.mark.parametrize("shape", [(200, 300), (576, 384), (2, 130, 260), (7, 5)])
def test_fp8_edge_blocks_equal_transformers_block_dequantization(shape):
    """Shapes 128 does not divide (DeepSeek V3's kv_a_proj_with_mqa has 576 rows): the edge blocks
    cover the remainder, as transformers' block-aware `_dequantize_fp8_weight` reads them (its load
    path derives the block from the scale grid and refuses or misreads these shapes)."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    torch.manual_seed(0)
    w, scale = fp8_quantize(torch.randn(shape))
    ref = fp8._dequantize_fp8_weight(w, scale, list(BLOCK), torch.float32)
    _bits_equal(dequantize_fp8_blocks(w, scale, BLOCK, torch.float32), ref)
    by_element = (
        w.float()
        * scale.repeat_interleave(128, -2)[..., : shape[-2], :].repeat_interleave(128, -1)[..., : shape[-1]]
    )
    _bits_equal(dequantize_fp8_blocks(w, scale, BLOCK, torch.float32), by_element)


def test_a_scale_grid_that_does_not_fit_is_refused():
    w, scale = fp8_quantize(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"needs a scale grid \[2, 3\], its scale is \[1, 3\]"):
        dequantize_fp8_blocks(w, scale[:1], BLOCK, torch.float32)
    with pytest.raises(ValueError, match=r"MXFP4 blocks \[2, 8, 1, 8\] with scales \[2, 8, 1\]"):
        dequantize_mxfp4(torch.zeros(2, 8, 1, 8, dtype=torch.uint8), torch.zeros(2, 8, 1), torch.float32)


# ---- gpt-oss as released ---------------------------------------------------------------------------


def _tokenizer(model_dir: Path, path: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(model_dir)).save_pretrained(str(path))


def _write(path: Path, tensors: dict, config: dict) -> Path:
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(default_model_dir, tmp_path_factory) -> Path:
    """The tiny gpt-oss of the family tests, its experts in the released MXFP4 layout: random blocks
    (every e2m1 code) and e8m0 scales 119..123 (values up to 6 / 16)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    cls, overrides = family_config("gpt_oss")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**COMMON, **overrides}), dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0, 1.0)
    model.save_pretrained(str(path))
    _tokenizer(default_model_dir, path)
    tensors = model.state_dict()
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(name).shape  # [E, in, out]
        tensors[f"{name}_blocks"] = torch.randint(
            0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g
        )
        tensors[f"{name}_scales"] = torch.randint(
            119, 124, (experts, rows, cols // 32), dtype=torch.uint8, generator=g
        )
    config = json.loads((path / "config.json").read_text())
    return _write(path, tensors, {**config, "quantization_config": MXFP4_CONFIG})


def _hf_mxfp4(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="eager", quantization_config=Mxfp4Config(dequantize=True)
    ).eval()


def _greedy(engine: Engine, prompts: list[list[int]], new: int) -> list[list[int]]:
    no_eos = {t: -100.0 for t in engine.stop_ids}
    params = SamplingParams(temperature=0, max_tokens=new, logit_bias=no_eos)
    return [o.token_ids for o in engine.generate([(ids, params, None) for ids in prompts])]


def _hf_greedy(hf, prompts: list[list[int]], new: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        with torch.no_grad():
            seq = hf.generate(
                torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )
        out.append(seq[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_mxfp4_experts_load_as_transformers_loads_them(gpt_oss_mxfp4, dtype):
    """Each expert's weights in agentrt's model, bit for bit, as transformers' MXFP4 de-quantization
    (Mxfp4Config(dequantize=True)) puts them into its GptOssExperts, in float32 and bfloat16."""
    from transformers import AutoConfig

    from agentrt.runtime.models.formats import _build_dense
    from agentrt.runtime.models.gpt_oss import GptOssForCausalLM
    from agentrt.runtime.models.registry import arch_from_hf_config
    from agentrt.runtime.models.weights import load_weights

    arch = arch_from_hf_config(AutoConfig.from_pretrained(str(gpt_oss_mxfp4)))
    assert arch.checkpoint_quant == CheckpointQuant("mxfp4")
    ours = dict(_build_dense(arch, 64, dtype, "cpu", load_weights(gpt_oss_mxfp4)).named_parameters())
    hf = _hf_mxfp4(gpt_oss_mxfp4, dtype)
    compared = 0
    for name, value in hf.state_dict().items():
        split = GptOssForCausalLM.split_experts(name.removeprefix("model."), value)
        for expert_name, expected in split or ():
            if expert_name.endswith(".weight"):
                _bits_equal(ours[expert_name].detach(), expected)
                compared += 1
    assert compared == 3 * 2 * 4  # layers x (gate_up, down) x experts


def test_gpt_oss_mxfp4_checkpoint_runs_as_transformers(gpt_oss_mxfp4):
    """The released layout served: logits within 1e-4 of transformers' model on its own
    de-quantization of the same files (prefill, a chunk, decodes), greedy tokens identical."""
    hf = _hf_mxfp4(gpt_oss_mxfp4)
    runner = ModelRunner(
        ModelConfig(model=str(gpt_oss_mxfp4), attention_backend="torch", **CPU),
        CacheConfig(kv_cache_bytes=8 << 20),
    )
    torch.manual_seed(1)
    ids = torch.randint(0, 49152, (140 + 8,)).tolist()
    assert chunked_logits_error(runner, hf, ids, 100, 140) < 1e-4
    prompts = [torch.randint(0, 49152, (n,)).tolist() for n in (40, 27)]
    engine = Engine(
        EngineConfig(
            model=ModelConfig(model=str(gpt_oss_mxfp4), **CPU), cache=CacheConfig(kv_cache_bytes=16 << 20)
        )
    )
    assert _greedy(engine, prompts, 16) == _hf_greedy(hf, prompts, 16)


# ---- block-FP8 (Qwen3) as released ---------------------------------------------------------------

QWEN3_FP8 = {  # projections of 96, 160, 192 and 288 rows / columns: partial edge blocks everywhere
    "hidden_size": 160,
    "intermediate_size": 288,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 48,
}


@pytest.fixture(scope="module")
def qwen3_fp8(default_model_dir, tmp_path_factory) -> tuple[Path, dict]:
    """(directory of a tiny Qwen3 whose every projection is block-FP8 with float32 weight_scale_inv,
    the state dict transformers' block de-quantization makes of it)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    path = tmp_path_factory.mktemp("qwen3-fp8")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**{**COMMON, **QWEN3_FP8}), dtype=torch.float32)
    model.save_pretrained(str(path))
    _tokenizer(default_model_dir, path)
    tensors, dequantized = {}, {}
    for name, value in model.state_dict().items():
        if name.endswith("_proj.weight"):
            w, scale = fp8_quantize(value)
            tensors[name], tensors[name + "_scale_inv"] = w, scale
            dequantized[name] = fp8._dequantize_fp8_weight(w, scale, list(BLOCK), torch.float32)
        else:
            tensors[name] = dequantized[name] = value
    config = json.loads((path / "config.json").read_text())
    return _write(path, tensors, {**config, "quantization_config": FP8_CONFIG}), dequantized


def test_qwen3_fp8_checkpoint_runs_as_transformers_on_its_dequantized_weights(qwen3_fp8):
    from transformers import AutoConfig, AutoModelForCausalLM

    path, dequantized = qwen3_fp8
    config = AutoConfig.from_pretrained(str(path))
    del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    hf.load_state_dict(dequantized)
    runner = ModelRunner(
        ModelConfig(model=str(path), attention_backend="torch", **CPU), CacheConfig(kv_cache_bytes=8 << 20)
    )
    assert runner.arch.checkpoint_quant == CheckpointQuant("fp8", BLOCK)
    torch.manual_seed(1)
    ids = torch.randint(0, 49152, (148,)).tolist()
    assert chunked_logits_error(runner, hf, ids, 100, 140) < 1e-4
    prompts = [torch.randint(0, 49152, (n,)).tolist() for n in (40, 27)]
    engine = Engine(
        EngineConfig(model=ModelConfig(model=str(path), **CPU), cache=CacheConfig(kv_cache_bytes=16 << 20))
    )
    assert _greedy(engine, prompts, 16) == _hf_greedy(hf, prompts, 16)


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_fp8_moe_experts_load_per_expert_and_stacked(layout):
    """Qwen3-MoE with FP8 experts as released (per-expert `experts.{e}.gate_proj.weight` + scale) and
    as transformers 5 stacks them (`experts.gate_up_proj` [E, 2I, H] + `gate_up_proj_scale_inv`
    [E, rows / br, cols / bc]), blocks of 24 x 40 (edges everywhere): the loaded model equals the one
    loaded from transformers' block de-quantization of the same tensors, bit for bit."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers import AutoModelForCausalLM

    from agentrt.runtime.models.formats import _build_dense
    from agentrt.runtime.models.registry import arch_from_hf_config

    block = (24, 40)
    cls, overrides = family_config("qwen3_moe")
    config = cls(**{**COMMON, **overrides})
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict()
    if layout == "per_expert":
        for name in [n for n in state if n.endswith("experts.gate_up_proj")]:
            base, stacked = name.removesuffix(".gate_up_proj"), state.pop(name)
            down = state.pop(f"{base}.down_proj")
            for e in range(stacked.shape[0]):
                gate, up = stacked[e].chunk(2)
                state[f"{base}.{e}.gate_proj.weight"], state[f"{base}.{e}.up_proj.weight"] = gate, up
                state[f"{base}.{e}.down_proj.weight"] = down[e]
    quantized, dequantized = {}, {}
    for name, value in state.items():
        if value.dim() >= 2 and ("_proj" in name or "experts" in name):
            w, scale = fp8_quantize(value, block)
            quantized[name], quantized[name + "_scale_inv"] = w, scale
            dequantized[name] = fp8._dequantize_fp8_weight(w, scale, list(block), torch.float32)
        else:
            quantized[name] = dequantized[name] = value
    config.quantization_config = {**FP8_CONFIG, "weight_block_size": list(block)}
    arch = arch_from_hf_config(config)
    ours = _build_dense(arch, 64, torch.float32, "cpu", quantized).state_dict()
    expected = _build_dense(arch, 64, torch.float32, "cpu", dequantized).state_dict()
    assert ours.keys() == expected.keys()
    for name in ours:
        _bits_equal(ours[name], expected[name])


# ---- refusals --------------------------------------------------------------------------------------

REFUSED = [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "quant_method 'awq' (AWQ"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "quant_method 'gptq' (GPTQ"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes' (bitsandbytes"),
    ({"load_in_8bit": True}, "quant_method 'bitsandbytes' (bitsandbytes"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "'compressed-tensors' (compressed"),
    ({"quant_method": "quip#"}, "quant_method 'quip#' is not known"),
    ({"bits": 4}, "names no quant_method"),
    ({"quant_method": "mxfp4"}, "quant_method 'mxfp4' on a model without gpt-oss's MoE experts"),
    ({**FP8_CONFIG, "weight_block_size": None}, "weight_block_size None: a [rows, columns] pair"),
    ({**FP8_CONFIG, "weight_block_size": [128]}, "weight_block_size [128]: a [rows, columns] pair"),
    ({**FP8_CONFIG, "weight_block_size": [0, 128]}, "weight_block_size [0, 128]: a [rows, columns] pair"),
    ({**FP8_CONFIG, "weight_block_size": [128, 1.5]}, "weight_block_size [128, 1.5]"),
    ({**FP8_CONFIG, "activation_scheme": "static"}, "activation_scheme 'static' ('dynamic' is read)"),
    ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt 'e5m2' ('e4m3' is read)"),
]


def test_refusal_names_the_method_and_what_is_read():
    with pytest.raises(ValueError) as e:
        checkpoint_quant({"quant_method": "awq"}, "LlamaForCausalLM", False)
    assert str(e.value) == (
        "LlamaForCausalLM: quantization_config quant_method 'awq' (AWQ (packed int4 with zero points per "
        "group)) is not read; agentrt de-quantizes at load 'mxfp4' (gpt-oss's MoE experts) and 'fp8' "
        "with a weight_block_size (DeepSeek V3, Qwen3 FP8) only: use the model's unquantized (bf16) "
        "release, or a GGUF; agentrt quantizes weights itself with --quantization int8/int4"
    )


@pytest.fixture(scope="module")
def tiny_llama(default_model_dir, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama") / "m", default_model_dir, "llama")


def _serve_refuses(model_dir: Path) -> str:
    with pytest.raises(ValueError) as e:
        Engine(EngineConfig(model=ModelConfig(model=str(model_dir), **CPU)))
    return str(e.value)


def _hollow(path: Path) -> None:
    """Zero every tensor byte of model.safetensors (header kept): a refusal that reads no weight data
    says the same."""
    import struct

    f = path / "model.safetensors"
    n = struct.unpack("<Q", f.read_bytes()[:8])[0]
    size = f.stat().st_size
    with open(f, "r+b") as out:
        out.truncate(8 + n)
        out.truncate(size)


@pytest.mark.parametrize("qc,message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_serve_and_check_refuse_other_quantizations_from_the_config(tiny_llama, tmp_path, qc, message):
    d = shutil.copytree(tiny_llama, tmp_path / "m")
    _hollow(d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    refused = _serve_refuses(d)
    assert message in refused and "agentrt de-quantizes at load 'mxfp4'" in refused
    report = check_model(str(d), max_model_len=64, **CPU)
    assert [(e.topic, e.message) for e in report.errors] == [("architecture", refused)]


def _edited(src: Path, dst: Path, edit) -> Path:
    d = shutil.copytree(src, dst)
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    _hollow(d)
    return d


def test_mxfp4_blocks_off_the_experts_are_refused(gpt_oss_mxfp4, tmp_path):
    def edit(t):
        w = t.pop("model.layers.0.self_attn.q_proj.weight")
        t["model.layers.0.self_attn.q_proj.weight_blocks"] = torch.zeros(
            w.shape[0], w.shape[1] // 32, 16, dtype=torch.uint8
        )
        t["model.layers.0.self_attn.q_proj.weight_scales"] = torch.zeros(
            w.shape[0], w.shape[1] // 32, dtype=torch.uint8
        )

    d = _edited(gpt_oss_mxfp4, tmp_path / "m", edit)
    refused = _serve_refuses(d)
    assert "MXFP4 blocks 'model.layers.0.self_attn.q_proj.weight_blocks' are not an expert's" in refused
    report = check_model(str(d), max_model_len=64, **CPU)
    assert [(e.topic, e.message) for e in report.errors] == [
        ("weights", f"serve would refuse them at load: {refused}")
    ]


def test_fp8_scale_grid_and_missing_scale_are_refused(qwen3_fp8, tmp_path):
    path, _ = qwen3_fp8
    name = "model.layers.1.mlp.down_proj.weight"

    def cut(t):
        t[name + "_scale_inv"] = t[name + "_scale_inv"][:1].clone()

    d = _edited(path, tmp_path / "grid", cut)
    refused = _serve_refuses(d)
    assert (
        f"weight '{name}': block-FP8 weight [160, 288] with weight_block_size [128, 128] needs a scale grid [2, 3], its scale is [1, 3]"
        in refused
    )
    report = check_model(str(d), max_model_len=64, **CPU)
    assert [(e.topic, e.message) for e in report.errors] == [
        ("weights", f"serve would refuse them at load: {refused}")
    ]

    d = _edited(path, tmp_path / "noscale", lambda t: t.pop(name + "_scale_inv"))
    refused = _serve_refuses(d)
    assert f"FP8 weight '{name}' has no scale ('{name}_scale_inv')" in refused
    report = check_model(str(d), max_model_len=64, **CPU)  # told by the header's dtype
    assert [(e.topic, e.message) for e in report.errors] == [
        ("weights", f"serve would refuse them at load: {refused}")
    ]
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    d = shutil.copytree(path, tmp_path / "noconfig")
    _hollow(d)
    (d / "config.json").write_text(json.dumps(config))
    refused = _serve_refuses(d)
    assert "is float8_e4m3fn but config.json's quantization_config does not declare" in refused
    report = check_model(str(d), max_model_len=64, **CPU)
    assert [(e.topic, e.message) for e in report.errors] == [
        ("weights", f"serve would refuse them at load: {refused}")
    ]


def test_check_says_how_the_checkpoint_is_read(gpt_oss_mxfp4, qwen3_fp8):
    mx = check_model(str(gpt_oss_mxfp4), max_model_len=64, **CPU)
    assert mx.exit_status == 0, mx.errors
    assert "MXFP4 experts (e2m1 values, an e8m0 scale per 32), de-quantized at load" in " ".join(
        f.message for f in mx.of("weights")
    )
    fp = check_model(str(qwen3_fp8[0]), max_model_len=64, **CPU)
    assert fp.exit_status == 0, fp.errors
    assert "block-FP8 weights (128x128 blocks), de-quantized at load" in " ".join(
        f.message for f in fp.of("weights")
    )


def _family_names() -> list[str]:
    from tests.support.families import _families

    return sorted(_families())


@pytest.mark.parametrize("family", _family_names())
def test_fp8_loads_bit_equal_in_every_family(family, tmp_path):
    """Every family's tiny model as save_pretrained writes it (the checkpoint names), each projection
    and stacked expert tensor block-FP8 (blocks of 24 x 40, so edges everywhere): agentrt's model
    loaded from it equals the one loaded from transformers' block de-quantization, bit for bit."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    from transformers import AutoModelForCausalLM

    from agentrt.runtime.models.formats import _build_dense
    from agentrt.runtime.models.registry import arch_from_hf_config, read_hf_config

    block = (24, 40)
    cls, overrides = family_config(family)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cls(**{**COMMON, **overrides}), dtype=torch.float32).save_pretrained(
        str(tmp_path)
    )
    state = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    quantized, dequantized = {}, {}
    for name, value in state.items():
        if value.dim() >= 2 and name.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj")):
            w, scale = fp8_quantize(value, block)
            quantized[name], quantized[name + "_scale_inv"] = w, scale
            dequantized[name] = fp8._dequantize_fp8_weight(w, scale, list(block), torch.float32)
        else:
            quantized[name] = dequantized[name] = value
    assert len(quantized) > len(state), "no tensor was quantized"
    config = read_hf_config(tmp_path)
    config.quantization_config = {**FP8_CONFIG, "weight_block_size": list(block)}
    arch = arch_from_hf_config(config)
    ours = _build_dense(arch, 64, torch.float32, "cpu", quantized).state_dict()
    expected = _build_dense(arch, 64, torch.float32, "cpu", dequantized).state_dict()
    assert ours.keys() == expected.keys()
    for name in ours:
        _bits_equal(ours[name], expected[name])
