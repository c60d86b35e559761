"""The fused CPU layer ops (kernels/cpu_layer_ops.cpp) and the int8 x int8 matmul
(kernels/cpu_int8_linear.cpp) against their torch definitions, their refusals, and the int8 layers
that use the matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrt.runtime.backends.cpu_stack import CpuStackBackend, decode_stack
from agentrt.runtime.config import CacheConfig, ModelConfig, default_cache_dir
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kernels import cpu_kernels
from agentrt.runtime.kernels.cpu_kernels import CPU_OPS
from agentrt.runtime.layers.norm import RMSNorm
from agentrt.runtime.layers.rotary import apply_rope
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.models.quant import (
    Int4BlockLinear,
    Int8Linear,
    group_major,
    int4_levels,
    quantize_int8,
    row_major,
)
from tests.support.models import make_tiny_model

FAILURE = cpu_kernels.load(default_cache_dir())
pytestmark = pytest.mark.skipif(FAILURE is not None, reason=f"the C++ kernels are unavailable: {FAILURE}")
ops = torch.ops.agentrt_cpu


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (33, 100)])
def test_rms_norm_and_the_fused_residual_add_match_torch(rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    x, delta = torch.randn(rows, dim, generator=gen) * 4, torch.randn(rows, dim, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-6)
    total, normed = ops.add_rms_norm(x, delta, norm.weight, 1e-5)
    assert torch.equal(total, x + delta)  # the residual stream itself is exact
    torch.testing.assert_close(normed, norm(x + delta), rtol=1e-5, atol=1e-6)
    fused = RMSNorm(dim, 1e-5, ops=CPU_OPS)  # the module on the C++ ops
    fused.load_state_dict(norm.state_dict())
    with torch.no_grad():  # the module's own entry point, fused or not
        assert torch.equal(norm.add_forward(delta, x)[0], x + delta)
        torch.testing.assert_close(fused.add_forward(delta, x)[1], norm(x + delta), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="weight must be float32 \\[D\\]"):
        ops.rms_norm(x, torch.ones(dim + 1), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous float32 \\[T, D\\]"):
        ops.rms_norm(x.repeat(1, 2)[:, ::2], norm.weight, 1e-5)  # strided rows
    with pytest.raises(RuntimeError, match="delta must be a contiguous float32 tensor shaped like x"):
        ops.add_rms_norm(x, delta[:, 1:].contiguous(), norm.weight, 1e-5)


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (5, 4, 4, 16), (12, 8, 2, 32)])
def test_rope_store_rotates_and_writes_the_pool_like_the_torch_path(tokens, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens + heads)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    k_cache, v_cache = torch.zeros(50, kv_heads, head_dim), torch.zeros(50, kv_heads, head_dim)
    slots = torch.randperm(50, generator=gen)[:tokens]
    q, k = ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads)
    q_ref, k_ref, v_ref = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_ref = apply_rope(q_ref.reshape(tokens, heads, head_dim), cos, sin)
    k_ref = apply_rope(k_ref.reshape(tokens, kv_heads, head_dim), cos, sin)
    torch.testing.assert_close(q, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(k_cache[slots], k)
    assert torch.equal(v_cache[slots], v_ref.reshape(tokens, kv_heads, head_dim))
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        ops.rope_store(qkv, cos, sin, k_cache, v_cache, torch.full((tokens,), 50), heads)
    with pytest.raises(RuntimeError, match="is not \\(H \\+ 2 Hkv\\) D"):
        ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads + 1)
    with pytest.raises(RuntimeError, match="slot_mapping must be int64 \\[T\\]"):
        ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots.int(), heads)


def test_silu_mul_is_bit_identical_to_torch():
    gate_up = torch.randn(9, 2 * 1536) * 3
    gate, up = gate_up.split(1536, dim=-1)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate) * up)
    with pytest.raises(RuntimeError, match="gate_up must be \\[T, 2 I\\]"):
        ops.silu_mul(torch.zeros(2, 7))


def q8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias=None) -> torch.Tensor:
    """The int8 x int8 matmul in float64: activations quantized per row in blocks of 32 (Q8_0), the
    weights' block scales [N, K // 32] applied."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    xq = torch.round(blocks * inv)
    w = (q.double().reshape(q.shape[0], k // 32, 32) * scales.double()[..., None]).reshape(q.shape)
    y = (xq.double() * d.double()).reshape(m, k) @ w.t()
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize("rows,out,inp", [(1, 576, 576), (16, 963, 1536), (3, 5, 64), (0, 8, 32)])
def test_int8_linear_is_the_q8_0_matmul(rows, out, inp):
    gen = torch.Generator().manual_seed(rows + out)
    weight = torch.randn(out, inp, generator=gen) * 0.05
    q, scales = quantize_int8(weight, 32)
    assert scales.shape == (out, inp // 32)
    x = torch.randn(rows, inp, generator=gen) * 2
    if rows:
        x[0, :32] = 0  # an all-zero activation block (scale 0)
        x[-1, 40] = 60.0  # an outlier: only its own block loses precision
    bias = torch.randn(out, generator=gen)
    packed = ops.pack_int8(q)
    n4 = -(-out // 4) * 4
    unpacked = packed.view(n4 // 4, inp // 32, 4, 32).permute(0, 2, 1, 3).reshape(n4, inp)
    assert torch.equal(unpacked[:out], q) and not unpacked[out:].any()  # padded to groups of 4 rows
    scales4 = group_major(scales)  # the kernel's order: padded, 4 rows' scales of a block side by side
    assert scales4.shape == (n4, inp // 32) and torch.equal(row_major(scales4, out), scales)
    got = ops.int8_linear(x, packed, scales4, bias, out)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got, q8_reference(x, q, scales, bias), rtol=1e-5, atol=1e-4)
    if rows:  # and close to the float32 matmul of the de-quantized weight
        exact = x @ weight.t() + bias
        assert (got - exact).abs().max() < 0.02 * exact.abs().max()
    torch.testing.assert_close(
        ops.int8_linear(x, packed, scales4, None, out), got - bias, rtol=1e-5, atol=1e-4
    )


def test_activation_quantization_is_its_definition_bit_for_bit():
    """The kernels' Q8_0 quantization of the activations (cpu_kernels.h: quantize_row, 8 floats at a
    time), read back through int8_linear with one-hot weight rows and unit scales (y[k] = q[k] * d in
    one rounding): d = amax / 127 and q = round-half-even(x * (1 / d)) in float32, as torch computes
    them, on ties, zero and subnormal blocks, and a block whose largest magnitude is negative."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=gen) * 3
    x[0, :32] = torch.arange(-16, 16) + 0.5  # amax 16.5: an inverse that is not a power of 2
    x[0, 32:64] = torch.arange(32) - 15.5
    x[0, 63] = -127.0  # amax 127 (negative), d = 1: exact ties -15.5 .. 14.5 round to even
    x[1, 64:96] = 0.0
    x[1, 96:128] = 1e-39  # subnormal: its scale's inverse would overflow, so zeros
    x[2, 128:160] *= -1e4
    packed = ops.pack_int8(torch.eye(256, dtype=torch.int8))
    got = ops.int8_linear(x, packed, torch.ones(256, 8), None, 256)
    blocks = x.view(3, 8, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d >= torch.finfo(torch.float32).tiny, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv)
    assert q.abs().max() <= 127
    assert torch.equal(got, (q * d).view(3, 256))


def test_int8_linear_keeps_nan_visible_and_refuses_minus_128():
    q, s = quantize_int8(torch.randn(8, 64), 32)
    x = torch.randn(2, 64)
    x[0, 5] = float("nan")
    y = ops.int8_linear(x, ops.pack_int8(q), group_major(s), None, 8)
    assert y[0].isnan().all() and y[1].isfinite().all()
    tiny = ops.int8_linear(x[1:] * 1e-38, ops.pack_int8(q), group_major(s), None, 8)  # subnormal scales
    assert torch.equal(tiny, torch.zeros(1, 8))
    with pytest.raises(RuntimeError, match=r"weights must be in \[-127, 127\]"):
        ops.pack_int8(torch.full((4, 32), -128, dtype=torch.int8))


def test_int8_linear_refuses_bad_shapes():
    q, s = torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 2)
    with pytest.raises(RuntimeError, match="K = 48 is not a multiple of 32"):
        ops.int8_linear(torch.zeros(1, 48), torch.zeros(4, 48, dtype=torch.int8), s, None, 4)
    with pytest.raises(RuntimeError, match="x has 32 columns, qweight 64"):
        ops.int8_linear(torch.zeros(1, 32), q, s, None, 4)
    with pytest.raises(RuntimeError, match="scales must be float32 \\[N4, K / 32\\]"):
        ops.int8_linear(torch.zeros(1, 64), q, torch.ones(4), None, 4)
    with pytest.raises(RuntimeError, match="qweight must be a contiguous int8"):
        ops.int8_linear(torch.zeros(1, 64), q.float(), s, None, 4)
    with pytest.raises(RuntimeError, match="4 packed rows do not hold N = 9 rows"):
        ops.int8_linear(torch.zeros(1, 64), q, s, None, 9)
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        ops.pack_int8(torch.zeros(3, 40, dtype=torch.int8))


def test_int8_layer_uses_the_kernel_and_falls_back_without_it():
    lin = torch.nn.Linear(64, 24, bias=True)
    layer = Int8Linear.from_linear(lin, torch.float32, 32)
    x = torch.randn(2, 3, 64)
    fallback = layer(x)  # the de-quantized weight
    plain_weight = layer.dequantized()
    layer.pack_for_kernel()
    assert layer.qweight.shape == (24, 64) and torch.equal(layer.dequantized(), plain_weight)
    fused = layer(x)
    assert fused.shape == fallback.shape == (2, 3, 24) and fused.dtype == torch.float32
    exact = F.linear(x, layer.dequantized(), lin.bias)
    assert (fused - exact).abs().max() < 0.02 * exact.abs().max()
    torch.testing.assert_close(fallback, exact)
    assert "int8 blocks of 32, act int8 (Q8_0 blocks" in layer.extra_repr()
    per_row = Int8Linear.from_linear(lin, torch.bfloat16)  # torch's packed op on bf16 activations
    assert (
        per_row.scales.shape == (24,) and (per_row(x) - F.linear(x, lin.weight, lin.bias)).abs().max() < 0.05
    )
    with pytest.raises(ValueError, match="needs the block-wise layout"):
        per_row.pack_for_kernel()


def test_int8_model_on_float32_runs_the_kernel_and_says_so(default_model_dir, tmp_path):
    tiny = make_tiny_model(tmp_path / "m", default_model_dir, "llama", hidden_size=128)

    def runner(**kw) -> ModelRunner:
        cfg = ModelConfig(model=str(tiny), device="cpu", dtype="float32", cache_dir=tmp_path / "c", **kw)
        return ModelRunner(cfg, CacheConfig(kv_cache_bytes=1 << 20))

    fused = runner(quantization="int8", quantize_lm_head=True)
    layers = [m for m in fused.model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.use_kernel and m.block == 32 for m in layers)
    assert "activations int8 per block of 32 (C++ kernel)" in fused.weight_format.describe()
    aten = runner(quantization="int8", linear_kernel="aten")  # the dense layers' kernel is another choice
    assert all(m.use_kernel for m in aten.model.modules() if isinstance(m, Int8Linear))
    plain = runner(quantization="int8", quantize_lm_head=True, attention_backend="torch")
    assert not any(m.use_kernel for m in plain.model.modules() if isinstance(m, Int8Linear))
    auto = runner(quantization="auto")  # where the kernel runs: int8 with the LM head
    assert isinstance(auto.model.lm_head, Int8Linear) and auto.model.lm_head.use_kernel
    assert "quantization int8 (auto: the CPU int8 kernel (the weights are not 4-bit))" in (
        auto.weight_format.describe()
    )
    auto_torch = runner(quantization="auto", attention_backend="torch")  # no kernels: exact weights
    assert auto_torch.weight_format.quantization == "none"
    assert (
        "kernels need the CPU at float32 with attention backend cpu, decode not compiled (here cpu, float32, attention torch)"
        in (auto_torch.weight_format.describe())
    )
    dense = runner()
    ids = list(range(100, 130))
    logits = {}
    for name, r in (("fused", fused), ("plain", plain), ("dense", dense)):
        slots = r.kv.allocate(len(ids))
        logits[name] = r.execute([SeqChunk(ids, 0, slots)])
        r.kv.free(slots)
    # both int8 paths stay within quantization noise of the float32 model
    spread = logits["dense"].std().item()
    assert (logits["fused"] - logits["dense"]).abs().max() < 0.5 * spread
    assert (logits["plain"] - logits["dense"]).abs().max() < 0.5 * spread


@pytest.mark.parametrize(
    "arch,quantization", [("llama", "int8"), ("qwen2", "int8"), ("llama", "int4"), ("qwen2", "int4")]
)  # qwen2: biased q/k/v projections
def test_decode_layers_is_the_layer_by_layer_step_in_one_op(
    arch, quantization, default_model_dir, tmp_path, monkeypatch
):
    tiny = make_tiny_model(tmp_path / "m", default_model_dir, arch, hidden_size=128)
    cfg = ModelConfig(
        model=str(tiny),
        device="cpu",
        dtype="float32",
        quantization=quantization,
        cache_dir=tmp_path / "c",
    )
    r = ModelRunner(cfg, CacheConfig(kv_cache_bytes=1 << 20))
    model = r.model
    assert isinstance(r.backend, CpuStackBackend)
    prompts = [list(range(100, 117)), list(range(300, 305))]

    def run(steps: int = 3):
        """Prefill both prompts, then `steps` decode steps of both: (decode logits, K and V written)."""
        slots = [r.kv.allocate(len(p) + steps) for p in prompts]
        r.execute([SeqChunk(p, 0, s[: len(p)]) for p, s in zip(prompts, slots)])
        out = []
        for i in range(steps):
            chunks = [SeqChunk([7 + i], len(p) + i, s[: len(p) + i + 1]) for p, s in zip(prompts, slots)]
            out.append(r.execute(chunks))
        flat = torch.tensor([x for s in slots for x in s])
        pools = [torch.stack([k[flat] for k in r.kv.k]), torch.stack([v[flat] for v in r.kv.v])]
        for s in slots:
            r.kv.free(s)
        return torch.stack(out), pools

    with torch.autograd.profiler.profile() as prof:
        one_op, pools = run()
    assert sum(e.name == "agentrt_cpu::decode_layers" for e in prof.function_events) == 3
    monkeypatch.setattr(r, "backend", r.backend.eager)  # the layer-by-layer C++ ops
    with torch.autograd.profiler.profile() as prof:
        layers, layer_pools = run()
    assert not any(e.name == "agentrt_cpu::decode_layers" for e in prof.function_events)
    assert torch.equal(one_op, layers)  # the same kernels in the same order: bit-identical
    assert all(torch.equal(a, b) for a, b in zip(pools, layer_pools))
    monkeypatch.undo()

    # a self-draft's early exit (num_layers) runs the first layers only, in the op too
    from agentrt.runtime.backends.torch_attention import build_torch_metadata

    slots = r.kv.allocate(8)
    r.execute([SeqChunk(list(range(50, 57)), 0, slots[:7])])
    batch = build_torch_metadata([SeqChunk([9], 7, slots[:8])], torch.device("cpu"), cpu_kernel=True)
    with torch.no_grad():
        early = decode_stack(model, batch, r.kv.k, r.kv.v, r.backend.stack, num_layers=1)
        early_layers = model(batch.input_ids, batch.positions, r.kv.k, r.kv.v, batch.meta, num_layers=1)
    assert torch.equal(early, early_layers)


def test_decode_layers_refuses_a_miscounted_weight_list():
    x = torch.randn(1, 64)
    pool = torch.zeros(8, 2, 16)
    with pytest.raises(RuntimeError, match="layer 1's K/V pools are not shaped like layer 0's"):
        cpu_kernels.decode_layers(
            x, [torch.ones(64)] * 36, [pool, pool[:4].clone()], [pool.clone(), pool.clone()], torch.ones(1, 8),
            torch.zeros(1, 8), torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), torch.ones(64),
            [64, 64, 64, 64], 4, 1e-5, 0.25,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="13 weights for 1 layers \\(18 each\\)"):
        cpu_kernels.decode_layers(
            x, [torch.ones(64)] * 13, [pool], [pool.clone()], torch.ones(1, 8), torch.zeros(1, 8),
            torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), torch.ones(64), [64, 64, 64, 64], 4, 1e-5, 0.25,
        )  # fmt: skip


def q4_reference(x: torch.Tensor, layer: Int4BlockLinear, bias=None) -> torch.Tensor:
    """The int4 x int8 matmul in float64: activations quantized per row in blocks of 32 (Q8_0), the
    layer's de-quantized Q4_1 weight."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(blocks * torch.where(d != 0, 1 / d, torch.zeros_like(d))) * d
    y = xq.reshape(m, k).double() @ layer.dequantized().double().t()
    return (y if bias is None else y + bias.double()).float()


@pytest.mark.parametrize(
    "rows,out,inp,group",
    [(1, 576, 576, 32), (16, 963, 1536, 32), (3, 5, 64, 32), (2, 10, 256, 128), (0, 8, 32, 32)],
)
def test_int4_linear_is_the_q4_1_matmul(rows, out, inp, group):
    gen = torch.Generator().manual_seed(rows + out)
    lin = torch.nn.Linear(inp, out, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out, inp, generator=gen) * 0.05)
    layer = Int4BlockLinear.from_linear(lin, group)
    assert layer.qweight.shape == (out, inp // 2) and layer.scales.shape == (out, inp // group)
    x = torch.randn(rows, inp, generator=gen) * 2
    if rows:
        x[0, :32] = 0  # an all-zero activation block (scale 0)
        x[-1, 40] = 60.0  # an outlier: only its own block loses precision
    before = layer.dequantized()
    fallback = layer(x)  # the de-quantized weight, float32 activations
    layer.pack_for_kernel()
    assert torch.equal(layer.dequantized(), before)  # packing moves values, never changes them
    got = layer(x)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got, q4_reference(x, layer, lin.bias), rtol=1e-5, atol=1e-4)
    if rows:  # and close to the float32 matmul of the de-quantized weight
        assert (got - fallback).abs().max() < 0.02 * fallback.abs().max()
    torch.testing.assert_close(
        ops.int4_linear(x, layer.qweight, layer.scales, layer.mins, None, out),
        got - lin.bias,
        rtol=1e-5,
        atol=1e-4,
    )
    assert "int4 blocks (Q4_1) group" in layer.extra_repr() and "C++ kernel" in layer.extra_repr()


def test_int4_levels_give_a_q4_1_weight_back_exactly():
    """The default model's weights are a Q4_1 GGUF's: its blocks' levels, scales and minimums come
    back, so the int4 format computes with the checkpoint's own values."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (8, 64), generator=gen)
    q[:, ::32], q[:, 1::32] = 0, 15  # llama.cpp's Q4_1 puts a block's min and max on the end levels
    d, low = torch.rand(8, 2, generator=gen) + 0.01, torch.randn(8, 2, generator=gen)
    d, low = d.half().float(), low.half().float()  # Q4_1 stores them as float16
    w = (q.float().reshape(8, 2, 32) * d[..., None] + low[..., None]).reshape(8, 64)
    levels, scales, mins = int4_levels(w, 32)
    assert torch.equal(levels, q) and torch.equal(mins, low)
    torch.testing.assert_close(scales, d, rtol=1e-6, atol=0)
    levels, scales, mins = int4_levels(w, 32, half_scales=True)  # the file's own float16 values
    assert torch.equal(levels, q) and torch.equal(mins, low) and torch.equal(scales, d)
    lin = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    layer = Int4BlockLinear.from_linear(lin, 32)
    torch.testing.assert_close(layer.dequantized(), w, rtol=0, atol=1e-5)
    layer.pack_for_kernel()  # float16 scales and mins in the kernel's layout: the same weight
    assert layer.scales.dtype == layer.mins.dtype == torch.float16
    torch.testing.assert_close(layer.dequantized(), w, rtol=0, atol=1e-5)


def test_int4_levels_on_float16_scales_stay_finite_and_on_the_grid():
    """half_scales on blocks float16 cannot hold as they are: a constant block (scale 0 -> the least
    float16 scale), huge and tiny ranges; levels in 0..15 and the weight within a step of the grid."""
    w = torch.cat(
        [torch.full((1, 32), 0.3), torch.randn(1, 32) * 1e-9, torch.randn(1, 32) * 3e4, torch.randn(1, 32)]
    )
    q, scales, mins = int4_levels(w, 32, half_scales=True)
    assert torch.equal(scales, scales.half().float()) and torch.equal(mins, mins.half().float())
    assert scales.isfinite().all() and (scales > 0).all() and 0 <= q.min() and q.max() <= 15
    back = q.view(4, 1, 32) * scales[..., None] + mins[..., None]
    assert ((back.view(4, 32) - w).abs() <= scales + w.abs() * 1e-3).all()


def test_int4_linear_keeps_nan_visible_and_refuses_bad_shapes():
    layer = Int4BlockLinear.from_linear(torch.nn.Linear(64, 8, bias=False), 32)
    layer.pack_for_kernel()
    q, s, m = layer.qweight, layer.scales, layer.mins
    x = torch.randn(2, 64)
    x[0, 5] = float("nan")
    y = ops.int4_linear(x, q, s, m, None, 8)
    assert y[0].isnan().all() and y[1].isfinite().all()
    with pytest.raises(RuntimeError, match="K = 48 is not a multiple of 32"):
        ops.int4_linear(torch.zeros(1, 48), torch.zeros(8, 24, dtype=torch.uint8), s, m, None, 8)
    with pytest.raises(RuntimeError, match="x has 32 columns, qweight holds 64"):
        ops.int4_linear(torch.zeros(1, 32), q, s, m, None, 8)
    with pytest.raises(RuntimeError, match="scales and mins must be float16 \\[N4, K / 32\\]"):
        ops.int4_linear(torch.zeros(1, 64), q, s, m[:, :1].contiguous(), None, 8)
    with pytest.raises(RuntimeError, match="qweight must be a contiguous uint8"):
        ops.int4_linear(torch.zeros(1, 64), q.to(torch.int8), s, m, None, 8)
    with pytest.raises(RuntimeError, match="8 packed rows do not hold N = 3 rows"):
        ops.int4_linear(torch.zeros(1, 64), q, s, m, None, 3)
    with pytest.raises(ValueError, match="multiple of 32 and divides in_features 64, got 48"):
        Int4BlockLinear(64, 8, False, 48)


def test_auto_takes_int4_where_the_weights_are_4_bit_already(default_model_dir, tmp_path):
    """A checkpoint whose layers hold Q4_1 values (the default model's GGUF, de-quantized) runs
    int4 under `auto`: the same numbers at 0.75 bytes a weight, its LM head int8."""
    from safetensors.torch import load_file, save_file

    from agentrt.runtime.models.formats import four_bit_layers

    tiny = make_tiny_model(tmp_path / "m", default_model_dir, "llama", hidden_size=128)
    assert not four_bit_layers(tiny)  # random float32 weights
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "model.safetensors").write_bytes(b"not a safetensors file")
    assert not four_bit_layers(odd)  # unreadable: not 4-bit, no exception
    save_file(
        {"model.layers.0.self_attn.q_proj.weight": torch.full((8, 64), float("nan"))},
        str(odd / "model.safetensors"),
    )
    assert not four_bit_layers(odd)  # NaN compares false with any bound: refused explicitly
    (path,) = tiny.glob("*.safetensors")
    state = load_file(str(path))
    for name, w in state.items():
        if name.endswith("proj.weight"):  # round every projection through Q4_1 blocks of 32
            q, scales, mins = int4_levels(w, 32)
            state[name] = (q.view(w.shape[0], -1, 32) * scales[..., None] + mins[..., None]).view_as(w)
    save_file(state, str(path), metadata={"format": "pt"})
    assert four_bit_layers(tiny)
    cfg = ModelConfig(
        model=str(tiny), device="cpu", dtype="float32", quantization="auto", cache_dir=tmp_path / "c"
    )
    r = ModelRunner(cfg, CacheConfig(kv_cache_bytes=1 << 20))
    assert r.weight_format.quantization == "int4" and r.weight_format.group_size == 32
    assert isinstance(r.model.layers[0].self_attn.qkv_proj, Int4BlockLinear) and isinstance(
        r.backend, CpuStackBackend
    )
    assert isinstance(r.model.lm_head, Int8Linear) and r.model.lm_head.use_kernel
    text = r.weight_format.describe()
    assert "(LM head int8" in text and "the layers' weights are 4-bit already" in text
    dense = ModelRunner(
        ModelConfig(model=str(tiny), device="cpu", dtype="float32", cache_dir=tmp_path / "c"),
        CacheConfig(kv_cache_bytes=1 << 20),
    )
    ids = list(range(100, 130))
    logits = {}
    for name, runner in (("int4", r), ("dense", dense)):
        slots = runner.kv.allocate(len(ids))
        logits[name] = runner.execute([SeqChunk(ids, 0, slots)])
        runner.kv.free(slots)
    # the layers' weights are exact: what is left is the activations' int8 blocks and the int8 head
    assert (logits["int4"] - logits["dense"]).abs().max() < 0.1 * logits["dense"].std()
