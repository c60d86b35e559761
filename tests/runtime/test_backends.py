"""Each backend says what it supports (runtime/backends/), and a combination it cannot run is refused
at start with the reason named: the allow-lists of the C++ whole-stack op and the compiled decode,
make_backend's names, run_plan's refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig

from agentrt.runtime.backends import choose_layer_ops, cpu_stack, make_backend
from agentrt.runtime.backends import compiled_decode as compiled
from agentrt.runtime.backends.torch_attention import TorchBackend
from agentrt.runtime.config import CacheConfig, ModelConfig
from agentrt.runtime.forward import TORCH_OPS
from agentrt.runtime.models.registry import arch_from_hf_config, build_model
from agentrt.runtime.run_plan import plan_run

SMALL = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}


def llama_arch(**overrides):
    cfg = LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2, **overrides)
    cfg.architectures = ["LlamaForCausalLM"]
    return arch_from_hf_config(cfg)


def gemma_arch():
    cfg = Gemma3TextConfig(
        **SMALL, num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    return arch_from_hf_config(cfg)


def test_the_whole_stack_op_and_the_compiled_decode_take_the_plain_llama_layer():
    arch = llama_arch()
    assert arch.layout_features() == {"mlp:silu"}
    assert not cpu_stack.unsupported(arch) and not compiled.unsupported(arch)
    assert not cpu_stack.unsupported(llama_arch(attention_bias=True))  # Qwen2-style qkv bias is on the list


def test_a_layout_off_the_allow_list_is_named():
    arch = gemma_arch()
    missing = cpu_stack.unsupported(arch)
    assert {"sandwich_norms", "qk_norm", "window", "mlp:gelu_tanh", "embed_scale"} <= missing
    assert compiled.unsupported(arch) == missing  # the same layer in both
    with torch.device("meta"):
        model = build_model(arch, 64)
    with pytest.raises(ValueError, match="whole-stack decode does not implement .*sandwich_norms"):
        cpu_stack.CpuStackBackend(TorchBackend(model, None, torch.device("cpu"), True))


def test_the_whole_stack_op_refuses_dense_projections():
    model = build_model(llama_arch(), 64)  # tiny: built on the CPU
    with pytest.raises(ValueError, match="every projection on a C\\+\\+ int8/int4 kernel"):
        cpu_stack.CpuStackBackend(TorchBackend(model, None, torch.device("cpu"), True))
    assert cpu_stack.stack_weights(model) is None


def test_make_backend_knows_three_names_and_says_which_it_made():
    model = build_model(llama_arch(), 64)  # tiny: built on the CPU
    with pytest.raises(ValueError, match="unknown attention backend 'sdpa' \\(known: torch, cpu, triton\\)"):
        make_backend("sdpa", model, None, torch.device("cpu"))
    b = make_backend("torch", model, None, torch.device("cpu"), reason="requested")
    assert (b.name, b.reason, b.captured_sizes) == ("torch", "requested", ())
    b = make_backend(
        "cpu", model, None, torch.device("cpu")
    )  # dense layers: the torch path with C++ attention
    assert isinstance(b, TorchBackend) and b.name == "cpu" and b.cpu_kernel


def test_layer_ops_follow_the_backend_and_the_linear_kernel():
    assert choose_layer_ops("torch", "aten") is TORCH_OPS
    assert choose_layer_ops("triton", "aten") is TORCH_OPS
    from agentrt.runtime.kernels.cpu_kernels import CPU_OPS

    assert choose_layer_ops("cpu", "onednn") is CPU_OPS


def test_the_plan_refuses_what_cannot_run_and_says_why(tmp_path):
    arch = llama_arch()

    def plan(**model):
        return plan_run(ModelConfig(model="x", device="cpu", **model), CacheConfig(), arch, tmp_path, False)

    with pytest.raises(ValueError, match="attention_backend 'cpu' needs the CPU at float32"):
        plan(dtype="bfloat16", attention_backend="cpu")
    with pytest.raises(ValueError, match="--deterministic: the compiled decode step"):
        plan(dtype="float32", attention_backend="cpu", compile_decode=True, deterministic=True)
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds the model's limit"):
        plan(max_model_len=100000)
    p = plan(dtype="float32", attention_backend="torch", compile_decode=True)
    assert p.compiled and p.ops is TORCH_OPS and "compiled" in p.describe()


def test_the_plan_keeps_the_compiled_decode_off_a_layout_it_does_not_implement(tmp_path):
    p = plan_run(
        ModelConfig(model="x", device="cpu", dtype="float32", attention_backend="torch", compile_decode=True),
        CacheConfig(),
        gemma_arch(),
        tmp_path,
        False,
    )
    assert not p.compiled and "does not implement" in p.decode_reason and "sandwich_norms" in p.decode_reason
