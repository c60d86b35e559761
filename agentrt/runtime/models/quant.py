"""Quantized linear layers (int8 in blocks of 32 or per output channel, int4 group-wise) on our
C++ kernels and torch's packed ops.

CPU kernels: at float32 the int8 layers hold blocks of 32 input columns per scale and run our C++
int8 x int8 kernel (kernels/cpu_int8_linear.cpp, activations quantized on the fly the same way, as
llama.cpp's Q8_0), and the int4 layers llama.cpp's Q4_1 (a scale and a minimum per group, int4
x int8 kernel: kernels/cpu_int4_linear.cpp); otherwise `torch._weight_int8pack_mm` (int8 weights, one scale per output row) and
`torch._weight_int4pack_mm_for_cpu` (4-bit weights packed by `torch._convert_weight_to_int4pack_for_cpu`,
one scale and zero per group of `group_size` input columns, tinygemm's convention
w = (q - 8) * scale + zero). Both run fastest with bf16 activations on x86 (measured: with fp32 activations
they are 10-30x slower than a dense fp32 matmul), so the layers cast activations to `act_dtype` and the
result back. On CUDA the same formats go through torchao's tensor subclasses instead (`quantize_cuda`).

Quantization recipes follow torchao's int8_weight_only (symmetric, per channel, amax / 127) and
int4_weight_only (asymmetric min/max per group, 16 levels; Frantar et al. 2022 discuss why groups
matter). A layer's tensors are plain tensors (registered buffers), so a quantized model's state dict
saves to and loads from safetensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.runtime.models.cpu_linear import OneDNNLinear

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)


INT8_BLOCK = 32  # input columns per scale of the block-wise int8 format (llama.cpp's Q8_0)
HALF_MAX = 65504.0  # the largest finite float16


def group_major(t: torch.Tensor) -> torch.Tensor:
    """Per-block values of the C++ kernels' packed rows, [N, nb] row-major -> [N4, nb] in their order
    (kernels/cpu_int8_linear.cpp): rows padded with zeros to N4, a multiple of 4, and each group of 4
    rows stored block by block ([N4 / 4, nb, 4]: a block's 4 values side by side)."""
    n, nb = t.shape
    n4 = -(-n // 4) * 4
    return F.pad(t, (0, 0, 0, n4 - n)).view(n4 // 4, 4, nb).permute(0, 2, 1).contiguous().view(n4, nb)


def row_major(t: torch.Tensor, n: int) -> torch.Tensor:
    """group_major undone: [N4, nb] -> the first n rows, [n, nb]."""
    return t.view(-1, t.shape[1], 4).permute(0, 2, 1).reshape(-1, t.shape[1])[:n]


def quantize_int8(weight: torch.Tensor, block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8: weight [N, K] float -> (q [N, K] int8, scales fp32) with weight ~ q * scale;
    block 0: one scale per row, scales [N] (torchao's int8_weight_only); block b: one scale per b
    input columns, scales [N, K // b] (llama.cpp's Q8_0 at b = 32). Raises ValueError when b does not
    divide K."""
    w = weight.float()
    n, k = w.shape
    if block:
        if k % block:
            raise ValueError(f"int8 block {block} does not divide the input dimension {k}")
        w = w.reshape(n, k // block, block)
    scales = (w.abs().amax(dim=-1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), scales


def int4_levels(
    weight: torch.Tensor, group_size: int, half_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group of `group_size` input columns: weight [N, K] float ->
    (q [N, K] int32 in 0..15, scales [N, K // group_size] fp32, mins [N, K // group_size] fp32) with
    weight ~ q * scale + min, min and max of a group on the end levels (llama.cpp's Q4_1 at group 32:
    a Q4_1 checkpoint's own values come back exactly). half_scales: the minimum and the scale are
    rounded to float16 values first (Q4_1 stores them as float16) and the levels taken against them,
    so they keep in float16 exactly. Raises ValueError when K is not a multiple of group_size."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 group_size {group_size} does not divide the input dimension {k}")
    w = weight.float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    if half_scales:
        lo = lo.clamp(-HALF_MAX, HALF_MAX).half().float()
        scales = ((hi - lo) / 15.0).clamp(2.0**-24, HALF_MAX).half().float()  # (the least float16 > 0)
    else:
        scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scales, lo


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4_levels in tinygemm's convention: (q [N, K] int32 in 0..15, scales, zeros) with
    weight ~ (q - 8) * scale + zero (zero is the group's midpoint value). Raises as int4_levels."""
    q, scales, lo = int4_levels(weight, group_size)
    return q, scales, lo + 8.0 * scales


class Int8Linear(nn.Module):
    """y = x @ dequant(q)^T + bias. Buffers: `qweight` [out, in] int8, `scales` [out] act_dtype (block
    0: one scale per row) or [out, in // block] float32 (block-wise, Q8_0), `bias` [out] (or None).
    forward(x [..., in]) -> [..., out] in x's dtype.

    Block-wise layers (float32 runs) compute with the C++ int8 x int8 kernel after `pack_for_kernel`
    (formats.load_model, where the CPU kernels are loaded: kernels/cpu_int8_linear.cpp, activations
    quantized per row in blocks of 32 too; `qweight` then holds the kernel's packed layout), else with
    the de-quantized weight (slow; only when the kernels cannot be built). Per-row layers use
    `torch._weight_int8pack_mm` on bf16 activations."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype, block: int = 0
    ):
        super().__init__()
        self.in_features, self.out_features, self.act_dtype = in_features, out_features, act_dtype
        self.block, self.use_kernel = block, False
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        scale_shape = (out_features, in_features // block) if block else (out_features,)
        self.register_buffer("scales", torch.empty(scale_shape, dtype=torch.float32 if block else act_dtype))
        self.register_buffer("bias", torch.empty(out_features, dtype=act_dtype) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, act_dtype: torch.dtype, block: int = 0) -> Int8Linear:
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, act_dtype, block)
        q, scales = quantize_int8(linear.weight.detach(), block)
        m.qweight, m.scales = q.to(linear.weight.device), scales.to(m.scales.dtype)
        if linear.bias is not None:
            m.bias = linear.bias.detach().to(act_dtype)
        return m

    def pack_for_kernel(self) -> None:
        """Use the C++ kernel (loaded, block-wise layer): `qweight` becomes its packed [N4, in] layout
        (rows padded to a multiple of 4, groups of 4 rows block-interleaved), `scales` [N4, in // 32]
        group-major (group_major; padded rows zero). Raises ValueError on a per-row layer."""
        if not self.block:
            raise ValueError("the int8 kernel needs the block-wise layout (float32 activations)")
        if self.use_kernel:
            return
        self.qweight = torch.ops.agentrt_cpu.pack_int8(self.qweight)
        self.scales = group_major(self.scales)
        self.use_kernel = True

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel computes with, [out, in] fp32 (tests and Medusa-style consumers)."""
        if self.use_kernel:  # undo the packing
            k, b = self.in_features, self.block
            q = self.qweight.view(-1, k // b, 4, b).permute(0, 2, 1, 3).reshape(-1, k)[: self.out_features]
            w = (
                q.float().reshape(self.out_features, -1, b)
                * row_major(self.scales, self.out_features)[..., None]
            )
            return w.reshape(self.out_features, k)
        if self.block:
            w = self.qweight.float().reshape(self.out_features, -1, self.block) * self.scales[..., None]
            return w.reshape(self.out_features, self.in_features)
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            if x.dim() == 2:  # the model's [T, in] (per-call Python work adds up at 121 calls a step)
                return torch.ops.agentrt_cpu.int8_linear(
                    x.contiguous(), self.qweight, self.scales, self.bias, self.out_features
                )
            y = torch.ops.agentrt_cpu.int8_linear(
                x.reshape(-1, x.shape[-1]).contiguous(),
                self.qweight,
                self.scales,
                self.bias,
                self.out_features,
            )
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.block:  # no kernel for the block-wise format: the de-quantized weight, float32
            return F.linear(x.float(), self.dequantized(), self.bias).to(x.dtype)
        shape = x.shape
        y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(self.act_dtype), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        fmt = f"int8 blocks of {self.block}" if self.block else "int8 per row"
        act = "int8 (Q8_0 blocks, C++ kernel)" if self.use_kernel else self.act_dtype
        return f"in={self.in_features}, out={self.out_features}, {fmt}, act {act}"


class Int4Linear(nn.Module):
    """y = x @ dequant(q)^T + bias with 4-bit group-wise weights. Buffers: `qweight` [out, in // 2]
    uint8 (torch's CPU int4 packing), `scales_and_zeros` [in // group_size, out, 2] act_dtype,
    `bias` [out] (or None). forward(x [..., in]) -> [..., out] in x's dtype."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, act_dtype: torch.dtype, group_size: int
    ):
        super().__init__()
        if in_features % group_size:
            raise ValueError(f"int4 group_size {group_size} does not divide in_features {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.act_dtype, self.group_size = act_dtype, group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer(
            "scales_and_zeros", torch.empty(in_features // group_size, out_features, 2, dtype=act_dtype)
        )
        self.register_buffer("bias", torch.empty(out_features, dtype=act_dtype) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, act_dtype: torch.dtype, group_size: int) -> Int4Linear:
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, act_dtype, group_size)
        q, scales, zeros = quantize_int4(linear.weight.detach().cpu(), group_size)
        m.qweight = torch._convert_weight_to_int4pack_for_cpu(q, 1).to(linear.weight.device)
        m.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(act_dtype)
        if linear.bias is not None:
            m.bias = linear.bias.detach().to(act_dtype)
        return m

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel computes with, [out, in] fp32, recovered through the kernel itself
        (an identity matrix as input), so it is exact whatever the packed layout."""
        eye = torch.eye(self.in_features, dtype=self.act_dtype, device=self.qweight.device)
        w_t = torch._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, self.scales_and_zeros)
        return w_t.float().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]).to(self.act_dtype), self.qweight, self.group_size, self.scales_and_zeros
        )
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, int4 weight-only group {self.group_size}, "
            f"act {self.act_dtype}"
        )


class Int4BlockLinear(nn.Module):
    """y = x @ dequant(q)^T + bias with 4-bit weights in llama.cpp's Q4_1 layout: groups of
    `group_size` input columns (a multiple of 32), each with a scale and a minimum that are float16
    values, as in Q4_1 (w = q * scale + min). Buffers: `qweight` [out, in // 2] uint8, each block of
    32 columns as 16 bytes (byte j: q[j] low nibble, q[j + 16] high), `scales` and `mins`
    [out, in // group_size] float32 (float16 after `pack_for_kernel`), `bias` [out] float32 (or
    None). forward(x [..., in] float32) -> [..., out] float32.

    The float32 CPU format of `--quantization int4`: after `pack_for_kernel` (formats.load_model, where
    the CPU kernels are loaded) it computes with the C++ kernel (kernels/cpu_int4_linear.cpp,
    activations quantized per row in blocks of 32); else with the de-quantized weight (slow; only
    when the kernels cannot be built or decode is compiled)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int):
        super().__init__()
        if group_size % INT8_BLOCK or in_features % group_size:
            raise ValueError(
                f"int4 blocks need a group size that is a multiple of {INT8_BLOCK} and divides "
                f"in_features {in_features}, got {group_size}"
            )
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.use_kernel = False
        groups = in_features // group_size
        self.register_buffer("qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(out_features, groups))
        self.register_buffer("mins", torch.empty(out_features, groups))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4BlockLinear:
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size)
        q, m.scales, m.mins = int4_levels(linear.weight.detach().cpu(), group_size, half_scales=True)
        q = q.to(torch.uint8).reshape(m.out_features, -1, 2, 16)
        m.qweight = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(m.out_features, -1)
        if linear.bias is not None:
            m.bias = linear.bias.detach().float()
        return m

    def _blocks(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, in // group_size] -> [rows, in // 32]: a group's value repeated for its blocks."""
        return t.repeat_interleave(self.group_size // INT8_BLOCK, dim=1).contiguous()

    def levels(self) -> torch.Tensor:
        """q [out, in] uint8 in 0..15 (before packing)."""
        q = self.qweight.view(self.out_features, -1, 16)
        return torch.stack([q & 0x0F, q >> 4], dim=2).reshape(self.out_features, self.in_features)

    def pack_for_kernel(self) -> None:
        """Use the C++ kernel: `qweight` becomes its packed [N4, in // 2] layout and `scales` and
        `mins` its [N4, in // 32] group-major order in float16 (kernels/cpu_int4_linear.cpp: rows padded
        to a multiple of 4 with zero scales and mins, groups of 4 rows interleaved per block of 32).
        The values are float16 values already (from_linear), so the layer computes the same."""
        if self.use_kernel:
            return
        n4, nb = -(-self.out_features // 4) * 4, self.in_features // INT8_BLOCK
        pad = n4 - self.out_features
        q = F.pad(self.levels(), (0, 0, 0, pad)).view(n4 // 4, 2, 2, nb, INT8_BLOCK)
        pairs = q[:, :, 0] | (q[:, :, 1] << 4)  # [N4 / 4, 2, nb, 32]: rows 2c (low) and 2c + 1 (high)
        self.qweight = pairs.permute(0, 2, 1, 3).contiguous().view(n4, -1)
        self.scales, self.mins = (group_major(self._blocks(t)).half() for t in (self.scales, self.mins))
        self.use_kernel = True

    def dequantized(self) -> torch.Tensor:
        """The weight the layer computes with, [out, in] float32."""
        n, k = self.out_features, self.in_features
        if self.use_kernel:  # undo the packing
            nb = k // INT8_BLOCK
            pairs = self.qweight.view(-1, nb, 2, INT8_BLOCK)
            q = torch.stack([pairs & 0x0F, pairs >> 4], dim=3)  # [N4 / 4, nb, 2, 2, 32]
            q = q.permute(0, 2, 3, 1, 4).reshape(-1, k)[:n]
            scales, mins = row_major(self.scales.float(), n), row_major(self.mins.float(), n)
        else:
            q, scales, mins = self.levels(), self._blocks(self.scales), self._blocks(self.mins)
        w = q.view(n, -1, INT8_BLOCK).float() * scales[..., None] + mins[..., None]
        return w.reshape(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            y = torch.ops.agentrt_cpu.int4_linear(
                flat.contiguous(), self.qweight, self.scales, self.mins, self.bias, self.out_features
            )
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x.float(), self.dequantized(), self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        act = "int8 (Q8_0 blocks, C++ kernel)" if self.use_kernel else "float32"
        return f"in={self.in_features}, out={self.out_features}, int4 blocks (Q4_1) group {self.group_size}, act {act}"


def linear_names(model: nn.Module, include_lm_head: bool) -> list[str]:
    """Qualified names of the nn.Linear modules to quantize: every projection of the decoder layers
    (the experts of a MoE block included), plus `lm_head` when include_lm_head. Embeddings, norms and
    MoE routers (`mlp.gate`: small, and a rounding there flips which experts run, as vLLM keeps them
    dense too) and the shared expert's one-output gate (`mlp.shared_expert_gate`, Qwen3-Next) are
    never quantized."""
    return [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear)
        and (include_lm_head or name != "lm_head")
        and not name.endswith((".mlp.gate", ".mlp.shared_expert_gate"))
    ]


def int8_block(act_dtype: torch.dtype, in_features: int) -> int:
    """The int8 layout of a layer: blocks of INT8_BLOCK columns at float32 activations (the C++
    kernel's Q8_0 format; per-row scales lost 3-5 points of field accuracy on the extraction
    workload, docs/benchmarks.md), one scale per row otherwise (torch's packed bf16 op)."""
    return INT8_BLOCK if act_dtype == torch.float32 and in_features % INT8_BLOCK == 0 else 0


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _quantized_layer(
    name: str, lin: nn.Linear, quantization: str, act_dtype: torch.dtype, group_size: int, empty: bool
) -> nn.Module | None:
    """The quantized replacement of `lin` (empty: shapes only, for a cached state dict), or None to
    leave it dense (an int4 group size that does not divide its input). At float32 activations int4
    is Int4BlockLinear (Q4_1) and a quantized LM head is int8 blocks (Q8_0), as llama.cpp keeps the
    output matrix of its 4-bit files at 8 bits (the default model's GGUF: Q4_1 layers, Q8_0 head)."""
    bias = lin.bias is not None
    if quantization == "int4" and act_dtype == torch.float32 and name == "lm_head":
        quantization = "int8"
    if quantization == "int8":
        block = int8_block(act_dtype, lin.in_features)
        if empty:
            return Int8Linear(lin.in_features, lin.out_features, bias, act_dtype, block)
        return Int8Linear.from_linear(lin, act_dtype, block)
    if act_dtype == torch.float32:
        if group_size % INT8_BLOCK or lin.in_features % group_size:
            return None
        if empty:
            return Int4BlockLinear(lin.in_features, lin.out_features, bias, group_size)
        return Int4BlockLinear.from_linear(lin, group_size)
    if lin.in_features % group_size:
        return None
    if empty:
        return Int4Linear(lin.in_features, lin.out_features, bias, act_dtype, group_size)
    return Int4Linear.from_linear(lin, act_dtype, group_size)


def quantize_cpu(
    model: nn.Module,
    quantization: str,
    act_dtype: torch.dtype,
    group_size: int,
    include_lm_head: bool,
) -> list[str]:
    """Replace the model's linear layers by quantized layers in place (weights on the CPU; the format
    per layer: _quantized_layer). Returns the names of layers left dense (an int4 group size that
    does not divide their input). Raises ValueError for an unknown quantization."""
    if quantization not in ("int8", "int4"):
        raise ValueError(f"quantization must be int8 or int4 here, got {quantization!r}")
    dense: list[str] = []
    for name in linear_names(model, include_lm_head):
        new = _quantized_layer(name, model.get_submodule(name), quantization, act_dtype, group_size, False)
        if new is None:
            dense.append(name)
        else:
            _set_module(model, name, new)
    return dense


def empty_quantized_like(
    model: nn.Module,
    quantization: str,
    act_dtype: torch.dtype,
    group_size: int,
    include_lm_head: bool,
) -> None:
    """Swap the linear layers of a model on the meta device for empty quantized layers of the same
    shapes (to be filled by load_state_dict from a cached quantized checkpoint); the layer choice is
    the same as quantize_cpu's."""
    for name in linear_names(model, include_lm_head):
        new = _quantized_layer(name, model.get_submodule(name), quantization, act_dtype, group_size, True)
        if new is not None:
            _set_module(model, name, new)


def quantize_cuda(model: nn.Module, quantization: str, group_size: int, include_lm_head: bool) -> None:
    """Quantize the linear layers in place with torchao's CUDA kernels (int8 weight-only; int4
    weight-only with `group_size`, tinygemm's tile-packed layout). Raises ValueError when torchao is
    not installed (`pip install 'agentrt[quant]'`). Not measured on the development machine (no GPU)."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ValueError(
            f"--quantization {quantization} on CUDA needs torchao: pip install 'agentrt[quant]'"
        ) from None
    if quantization == "int8":
        config = Int8WeightOnlyConfig()
    else:
        config = Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d")
    names = set(linear_names(model, include_lm_head))
    quantize_(model, config, filter_fn=lambda mod, fqn: fqn in names)


def bytes_by_format(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights grouped by storage format: `int8` / `int4` (quantized layers,
    their scales and zeros included), `float32 oneDNN` (packed dense layers, models/cpu_linear.py) and
    dtype names for dense tensors (non-persistent buffers such as RoPE tables left out; a tied weight
    counted once)."""
    out: dict[str, int] = {}
    seen: set[int] = set()

    def add(key: str, t: torch.Tensor | None) -> None:
        if t is None or id(t) in seen:
            return
        seen.add(id(t))
        out[key] = out.get(key, 0) + t.numel() * t.element_size()

    for mod in model.modules():
        if isinstance(mod, OneDNNLinear):  # its packed weight is an mkldnn tensor without a storage
            out["float32 oneDNN"] = out.get("float32 oneDNN", 0) + mod.nbytes
            add("float32", mod.bias)
            continue
        key = (
            "int8"
            if isinstance(mod, Int8Linear)
            else "int4"
            if isinstance(mod, (Int4Linear, Int4BlockLinear))
            else None
        )
        for name, t in mod.named_parameters(recurse=False):
            add(key or str(t.dtype).removeprefix("torch."), t)
        for name, t in mod.named_buffers(recurse=False):
            if name in mod._non_persistent_buffers_set:
                continue
            add(key or str(t.dtype).removeprefix("torch."), t)
    return out
