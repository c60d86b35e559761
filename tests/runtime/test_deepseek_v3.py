"""DeepSeek V3 / Kimi K2 beyond the shared family tests (test_model_families.py runs deepseek_v3's
parity, batched / cached / chunked / speculated greedy tokens): the variant without a q LoRA and with
rotate-half RoPE, the KV bytes per token (the latent, against full K/V) on the start line and in
`agentrt check`, DeepSeek V3's real shape, the multi-token-prediction layer a released checkpoint
carries, Kimi K2's config.json (model_type kimi_k2), the backends that cannot run latent attention,
and the tool-call and reasoning formats of the families' real chat templates."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from agentrt.runtime.config import CacheConfig, ModelConfig
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.model_runner import ModelRunner
from tests.support.families import save_family
from tests.support.models import chunked_logits_error
from tests.support.paths import shared_path

CPU = {"device": "cpu", "dtype": "float32"}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, default_model_dir):
    return {
        name: save_family(name, tmp_path_factory.mktemp(name), default_model_dir)
        for name in ("deepseek_v3", "deepseek_v3_q_proj")
    }


def _runner(path, **kw) -> ModelRunner:
    return ModelRunner(ModelConfig(model=str(path), **CPU, **kw), CacheConfig(kv_cache_bytes=8 << 20))


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def test_without_q_lora_and_interleave_the_logits_match_transformers(dirs):
    path = dirs["deepseek_v3_q_proj"]
    runner = _runner(path, attention_backend="torch")
    assert runner.arch.mla.q_lora_rank is None and not runner.arch.mla.rope_interleave
    torch.manual_seed(1)
    ids = torch.randint(0, 49152, (100,)).tolist()
    assert chunked_logits_error(runner, _hf(path), ids, 50, 70) < 1e-4


def test_the_pool_holds_the_latent_and_says_so(dirs, caplog):
    """3 layers x (8 RoPE + 32 latent) x 4 bytes = 480 bytes per token, where full K/V would take
    3 x 4 heads x (24 + 12) x 4 = 1,728; the start line and `agentrt check` say both."""
    from agentrt.commands.check import check_model

    with caplog.at_level(logging.INFO, logger="agentrt.runtime.model_runner"):
        runner = _runner(dirs["deepseek_v3"])
    assert runner.kv.bytes_per_token == 480
    assert [tuple(k.shape[1:]) for k in runner.kv.k] == [(1, 40)] * 3
    assert all(v.shape[-1] == 0 for v in runner.kv.v)
    note = "40 values per token and layer (kv_lora_rank 32 + RoPE key 8), 480 bytes/token; full K/V would take 1,728"
    assert any(note in r.getMessage() and "x 480 bytes/token" in r.getMessage() for r in caplog.records)
    report = check_model(str(dirs["deepseek_v3"]), max_model_len=100, kv_cache_bytes=1_000_000, **CPU)
    [shape] = [f.message for f in report.of("architecture")]
    assert "4 heads x 24 over one latent KV row (kv_lora_rank 32 + RoPE key 8)" in shape
    [kv] = [f.message for f in report.of("kv cache")]
    assert "480 bytes/token" in kv and note in kv, kv
    assert not report.errors, report.errors


def test_deepseek_v3_real_shape_caches_70_kb_per_token_in_bf16():
    """DeepSeek V3's config (transformers' defaults: 61 layers, 128 heads, kv_lora_rank 512, RoPE key
    64, keys 192 and values 128 per head): 61 x 576 x 2 = 70,272 bytes per token in bfloat16, against
    61 x 128 x (192 + 128) x 2 = 4,997,120 for full K/V (71.1x)."""
    from transformers import DeepseekV3Config

    from agentrt.runtime.kv_cache import KVPool
    from agentrt.runtime.models.registry import arch_from_hf_config

    cfg = DeepseekV3Config()
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    arch = arch_from_hf_config(cfg)
    specs, caches = arch.kv_layout()
    assert KVPool.bytes_per_token_of(specs, torch.bfloat16) == 70_272
    assert "70,272 bytes/token; full K/V would take 4,997,120 (71.1x)" in arch.mla.describe_kv(
        arch.num_layers, arch.num_heads, torch.bfloat16
    )
    assert caches == tuple(range(61))
    assert arch.moe_layers == (False,) * 3 + (True,) * 58  # first_k_dense_replace 3
    assert (arch.moe_groups, arch.moe_topk_groups, arch.routed_scaling_factor) == (8, 4, 2.5)
    assert arch.shared_expert_intermediate_size == 2048


def test_the_multi_token_prediction_layer_is_skipped(dirs):
    """A released checkpoint carries layer num_hidden_layers (DeepSeek V3's layer 61: the MTP module,
    its own embedding, norms and projection), which transformers skips; so does the loader. Any
    other unknown weight is still refused."""
    from safetensors.torch import load_file

    from agentrt.runtime.models.registry import build_model

    runner = _runner(dirs["deepseek_v3"])
    tensors = load_file(str(dirs["deepseek_v3"] / "model.safetensors"))
    mtp = {
        "model.layers.3.eh_proj.weight": torch.zeros(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.self_attn.kv_b_proj.weight": torch.zeros(4 * 28, 32),
        "model.layers.3.shared_head.head.weight": torch.zeros(49152, 64),
    }
    model = build_model(runner.arch, 64)
    model.load_hf_state_dict({**tensors, **mtp})
    assert torch.equal(
        model.layers[0].self_attn.kv_b_proj.weight, tensors["model.layers.0.self_attn.kv_b_proj.weight"]
    )
    with pytest.raises(ValueError, match="unexpected weight 'layers.2.eh_proj.weight'"):
        model.load_hf_state_dict({**tensors, "model.layers.2.eh_proj.weight": torch.zeros(64, 128)})


def test_kimi_k2_config_is_read_as_deepseek_v3(dirs, tmp_path):
    """Kimi K2's config.json says model_type kimi_k2 and points at its own Python (auto_map), which
    transformers cannot read without running it; agentrt reads it as the DeepSeek V3 config it is
    and runs the same weights to the same logits."""
    kimi = tmp_path / "kimi"
    shutil.copytree(dirs["deepseek_v3"], kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    cfg["auto_map"] = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    }
    (kimi / "config.json").write_text(json.dumps(cfg))
    ids = list(range(300, 340))
    out = []
    for path in (dirs["deepseek_v3"], kimi):
        runner = _runner(path)
        assert runner.arch.architecture == "DeepseekV3ForCausalLM"
        out.append(runner.execute([SeqChunk(ids, 0, runner.kv.allocate(len(ids)))]))
    assert torch.equal(out[0], out[1])


def test_latent_attention_backends(dirs, monkeypatch):
    """The Triton backend runs the latent attention (kernels/mla_attention.py; its logits against
    transformers: test_model_families' triton case) and `auto` on CUDA keeps it; the C++ whole-stack
    op and the compiled decode leave the model (their allow-lists lack mla), and the cpu backend
    says its C++ attention kernel does not attend the latent; --deterministic refuses the model on
    every backend (gather + SDPA, or the absorbed projections' einsums, are not batch-invariant)."""
    from agentrt.runtime import run_plan
    from agentrt.runtime.backends import compiled_decode, cpu_stack
    from agentrt.runtime.kernels import triton_usable
    from agentrt.runtime.models.registry import arch_from_hf_config, read_hf_config

    arch = arch_from_hf_config(read_hf_config(dirs["deepseek_v3"]))
    assert "mla" in cpu_stack.unsupported(arch) and "mla" in compiled_decode.unsupported(arch)
    if triton_usable(torch.device("cpu")):
        assert _runner(dirs["deepseek_v3"], attention_backend="triton").attention_backend == "triton"
        with pytest.raises(
            ValueError, match="--deterministic: .* absorbed projections .* not batch-invariant"
        ):
            _runner(dirs["deepseek_v3"], attention_backend="triton", deterministic=True)
    runner = _runner(dirs["deepseek_v3"], attention_backend="cpu")
    assert "latent attention by gather + SDPA" in runner.plan.backend_reason
    assert "mla" in runner.decode  # layer by layer: the stack op does not implement mla
    with pytest.raises(
        ValueError, match="--deterministic: multi-head latent attention .* not batch-invariant"
    ):
        _runner(dirs["deepseek_v3"], deterministic=True)
    monkeypatch.setattr(run_plan, "choose_attention_backend", lambda *a: ("triton", "auto: CUDA"))
    plan = run_plan.plan_run(
        ModelConfig(model=str(dirs["deepseek_v3"]), **CPU), CacheConfig(), arch, dirs["deepseek_v3"]
    )
    assert (plan.backend, plan.backend_reason) == ("triton", "auto: CUDA")


# (template, tool-call format, reasoning format of grammars/reasoning.py, where a default prompt
# leaves the reasoning); `agentrt check` names the same reasoning format
TEMPLATES = [
    ("deepseek-ai-DeepSeek-V3.1", "deepseek_v3_1", "think", "off"),  # thinking off unless asked
    ("DeepSeek-V3.2", "deepseek_v3_2", "think", "open"),
    ("moonshotai-Kimi-K2", "kimi_k2", None, None),
    ("moonshotai-Kimi-K2-Thinking", "kimi_k2", "think", "optional"),
]


@pytest.mark.parametrize("name,tool_format,reasoning,mode", TEMPLATES)
def test_the_families_chat_templates_are_detected(name, tool_format, reasoning, mode):
    from transformers.utils.chat_template_utils import render_jinja_template

    from agentrt.api.tools.detection import detect
    from agentrt.grammars.reasoning import detect_reasoning
    from agentrt.runtime.models.check import reasoning_format

    template = shared_path("chat_templates", f"{name}.jinja").read_text()
    found = detect(template)
    assert (found.name, found.native, found.unsupported) == (tool_format, True, None)
    fmt = detect_reasoning(template)
    assert (fmt and fmt.name) == reasoning
    assert reasoning_format(template) == ("think tags (<think>...</think>)" if reasoning else "none")
    if fmt is not None:
        (prompt,), _ = render_jinja_template(
            [[{"role": "user", "content": "hi"}]], chat_template=template, add_generation_prompt=True
        )
        assert fmt.mode(prompt) == mode


def test_a_block_fp8_checkpoint_loads_as_its_dequantized_weights(dirs, tmp_path):
    """DeepSeek V3's release format: every projection (the latent attention's kv_b_proj included)
    float8 e4m3 with a float32 scale_inv per 8 x 8 block here (128 x 128 as released); the model
    built from it computes the same logits, bit for bit, as one built from the de-quantized weights."""
    from safetensors.torch import load_file, save_file

    from agentrt.runtime.models.checkpoint_quant import dequantize_fp8_blocks

    src = dirs["deepseek_v3"]
    fp8, plain = tmp_path / "fp8", tmp_path / "plain"
    shutil.copytree(src, fp8)
    shutil.copytree(src, plain)
    quantized, dequantized = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not (name.endswith("_proj.weight") and w.dim() == 2):
            quantized[name] = dequantized[name] = w
            continue
        blocks = w.unflatten(0, (-1, 8)).unflatten(-1, (-1, 8))  # [rows / 8, 8, cols / 8, 8]
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        q = (w / scale.repeat_interleave(8, 0).repeat_interleave(8, 1)).to(torch.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = q, scale
        dequantized[name] = dequantize_fp8_blocks(q, scale, (8, 8), torch.float32)
    assert "model.layers.0.self_attn.kv_b_proj.weight_scale_inv" in quantized
    save_file(quantized, str(fp8 / "model.safetensors"))
    save_file(dequantized, str(plain / "model.safetensors"))
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [8, 8],
    }
    (fp8 / "config.json").write_text(json.dumps(cfg))
    ids = list(range(500, 530))
    out = []
    for path in (fp8, plain):
        runner = _runner(path)
        out.append(runner.execute([SeqChunk(ids, 0, runner.kv.allocate(len(ids)))]))
    assert torch.equal(out[0], out[1])
    assert not torch.equal(
        dequantized["model.layers.0.self_attn.kv_b_proj.weight"],
        load_file(str(src / "model.safetensors"))["model.layers.0.self_attn.kv_b_proj.weight"],
    )  # it was rounded
