"""Quantized checkpoints as released, de-quantized at load: which `quantization_config` agentrt reads
(`checkpoint_quant`, refusing every other before a weight is read), the de-quantization of each format
(`dequantize_mxfp4`, `dequantize_fp8_blocks`), and the one seam where the loader meets them
(`checkpoint_tensors`: the raw checkpoint tensors seen as the de-quantized ones the family's names
expect, before any family code reads them, for every family and for stacked and per-expert weights
alike).

- `mxfp4` (gpt-oss as released): the MoE experts' `gate_up_proj_blocks` / `down_proj_blocks` uint8
  [E, rows, cols / 32, 16] (two e2m1 values a byte, the low nibble first) with `_scales` uint8
  [E, rows, cols / 32] (e8m0: 2 ** (byte - 127) per 32 values); OCP Microscaling Formats v1.0;
  transformers `integrations/mxfp4.py` `convert_moe_packed_tensors`, whose [E, cols, rows] layout
  (gpt-oss's stacked `x @ W`) `dequantize_mxfp4` returns, bit for bit.
- `fp8` with `weight_block_size` [br, bc] (DeepSeek V3, Qwen3 FP8 releases): float8 `X` with
  `X_scale_inv` float32 [..., ceil(rows / br), ceil(cols / bc)], the value being X * scale_inv of its
  block; edge blocks cover the remainder (DeepSeek V3 `inference/kernel.py` `weight_dequant`,
  transformers `integrations/finegrained_fp8.py`, vLLM `fp8_utils.py`).

The product is formed in float32 (exact: an e2m1 or e4m3 value times a power of two or a float32
scale) and rounded once to the run dtype, as transformers does at load. The de-quantized weights then
take `--quantization` like any other (models/quant.py): memory and speed are those of the run dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 FP4 (e2m1: sign, 2 exponent bits, 1 mantissa bit) values by code."""
E8M0_BIAS = 127
"""An e8m0 scale byte b means 2 ** (b - 127). 255 is NaN in the OCP spec; here, as transformers'
`torch.ldexp` computes it, a value times 2 ** 128 (0 stays 0, 0.5 becomes 2 ** 127, the rest inf)."""
MXFP4_BLOCK = 32
MXFP4_EXPERT = re.compile(r"(.*\.mlp\.experts\.(?:gate_up_proj|down_proj))_blocks")
SUPPORTED = "'mxfp4' (gpt-oss's MoE experts) and 'fp8' with a weight_block_size (DeepSeek V3, Qwen3 FP8)"
WHY_NOT = (
    "use the model's unquantized (bf16) release, or a GGUF; agentrt quantizes weights itself with "
    "--quantization int8/int4"
)
REFUSED_METHODS = {  # quant_method -> what it is, for the refusal
    "awq": "AWQ (packed int4 with zero points per group)",
    "gptq": "GPTQ (packed int4 with zero points per group)",
    "bitsandbytes": "bitsandbytes (NF4/FP4 or LLM.int8 with its quantization state)",
    "compressed-tensors": "compressed-tensors (llm-compressor's schemes)",
}


@dataclass(frozen=True)
class CheckpointQuant:
    """How a checkpoint stores its weights (config.json's `quantization_config`): `method` "mxfp4" or
    "fp8"; `block_size` (rows, columns) of the weights one fp8 scale covers (None for mxfp4, whose
    blocks are 32 values of a row)."""

    method: str
    block_size: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.method == "mxfp4":
            return "MXFP4 experts (e2m1 values, an e8m0 scale per 32), de-quantized at load"
        return f"block-FP8 weights ({self.block_size[0]}x{self.block_size[1]} blocks), de-quantized at load"


def _refuse(architecture: str, what: str) -> ValueError:
    return ValueError(
        f"{architecture}: quantization_config {what}; agentrt de-quantizes at load {SUPPORTED} only: "
        + WHY_NOT
    )


def checkpoint_quant(qc: object, architecture: str, mxfp4_experts: bool) -> CheckpointQuant | None:
    """The CheckpointQuant of config.json's `quantization_config` `qc` (a dict, or None: not quantized).
    `mxfp4_experts`: the family's stacked experts are the layout MXFP4 blocks de-quantize into (gpt-oss,
    as transformers' Mxfp4GptOssExperts). Raises ValueError naming the method and what is read, before
    any weight is: another quant_method (awq, gptq, bitsandbytes, compressed-tensors, unknown ones),
    mxfp4 on another family, fp8 without a [rows, cols] weight_block_size of positive integers, fp8
    with static activation scales or another format than e4m3."""
    if qc is None:
        return None
    if hasattr(qc, "to_dict"):  # a transformers QuantizationConfig object
        qc = qc.to_dict()
    if not isinstance(qc, dict):
        raise _refuse(architecture, f"is not an object (got {type(qc).__name__})")
    method = qc.get("quant_method")
    if method is None and (qc.get("load_in_4bit") or qc.get("load_in_8bit")):
        method = "bitsandbytes"
    shown = repr(method) if len(repr(method)) <= 64 else repr(method)[:64] + "..."
    if method == "mxfp4":
        if not mxfp4_experts:
            raise _refuse(
                architecture,
                "quant_method 'mxfp4' on a model without gpt-oss's MoE experts (MXFP4 is read only for "
                "gpt-oss's experts, as transformers reads it)",
            )
        return CheckpointQuant("mxfp4")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (
            isinstance(block, (list, tuple))
            and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise _refuse(
                architecture,
                f"quant_method 'fp8' with weight_block_size {block!r}: a [rows, columns] pair of positive "
                "integers is read (block-FP8; per-tensor FP8 scales are not)",
            )
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in (None, "dynamic"):
            raise _refuse(
                architecture, f"quant_method 'fp8' with activation_scheme {scheme!r} ('dynamic' is read)"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt not in (None, "e4m3"):
            raise _refuse(architecture, f"quant_method 'fp8' with fmt {fmt!r} ('e4m3' is read)")
        return CheckpointQuant("fp8", (block[0], block[1]))
    what = REFUSED_METHODS.get(method) if isinstance(method, str) else None
    if method is None:
        raise _refuse(architecture, "names no quant_method")
    raise _refuse(
        architecture, f"quant_method {shown}" + (f" ({what}) is not read" if what else " is not known")
    )


# ---- de-quantization -------------------------------------------------------------------------------


def _e2m1_pairs(dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: a byte -> (value of its low nibble, value of its high nibble)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    return torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=1).to(dtype)


def _e8m0_values(dtype: torch.dtype, top: float = 2.0**128) -> torch.Tensor:
    """[256, 1]: an e8m0 byte -> 2 ** (byte - 127), exact (byte 255 -> `top`)."""
    values = [2.0 ** (b - E8M0_BIAS) for b in range(255)] + [top]
    return torch.tensor(values, dtype=torch.float32).to(dtype)[:, None]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 stacked expert weights -> [E, cols, rows] in `dtype` (a transposed view: gpt-oss's
    `x @ W` layout, equal bit for bit to transformers' `convert_moe_packed_tensors(blocks, scales,
    dtype=dtype)`). blocks uint8 [E, rows, cols / 32, 16]: value 2j of a block is the low nibble of
    byte j, value 2j + 1 its high nibble; scales uint8 [E, rows, cols / 32] (e8m0). Computed one
    expert at a time (temporaries of one expert). On the meta device only the shape is formed.
    Raises ValueError when the shapes or dtypes are not that layout."""
    if (
        blocks.dim() != 4
        or blocks.shape[-1] != MXFP4_BLOCK // 2
        or tuple(scales.shape) != tuple(blocks.shape[:-1])
    ):
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} with scales {list(scales.shape)}: expected blocks "
            f"[experts, rows, columns / {MXFP4_BLOCK}, {MXFP4_BLOCK // 2}] and scales [experts, rows, columns / {MXFP4_BLOCK}]"
        )
    num_experts, rows, groups, _ = blocks.shape
    if blocks.is_meta or scales.is_meta:
        return torch.empty(num_experts, rows, groups * MXFP4_BLOCK, dtype=dtype, device="meta").transpose(
            1, 2
        )
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    # bf16 and float32 hold every product exactly before rounding; float16 cannot hold the scales
    compute = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    # 2 ** 128 is not a float32: byte 255 multiplies by 2 ** 127, then by 2 (ldexp's result, rounded once)
    pairs = _e2m1_pairs(compute).to(blocks.device)
    powers = _e8m0_values(compute, top=2.0**127).to(blocks.device)
    out = torch.empty(num_experts, rows, groups * MXFP4_BLOCK, dtype=dtype, device=blocks.device)
    for e in range(num_experts):
        values = F.embedding(blocks[e].int(), pairs).view(rows, groups, MXFP4_BLOCK)
        values.mul_(F.embedding(scales[e].int(), powers))
        top = scales[e] == 255
        if bool(top.any()):
            values[top] *= 2
        out[e] = values.view(rows, groups * MXFP4_BLOCK)
    return out.transpose(1, 2)


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """Block-FP8 weight [..., rows, cols] (float8) with scale_inv [..., ceil(rows / br),
    ceil(cols / bc)] (float32 or bf16; uint8 read as e8m0) -> weight * its block's scale in `dtype`
    [..., rows, cols], formed in float32 and rounded once (transformers' Fp8Dequantize at load, bit
    for bit where the block divides the shape). Edge blocks cover the remainder rows / columns.
    Leading dimensions (stacked experts) are kept. On the meta device only the shape is formed.
    Raises ValueError when the scale grid does not fit the shape and block size."""
    br, bc = block_size
    rows, cols = weight.shape[-2:] if weight.dim() >= 2 else (None, None)
    grid = None if rows is None else (*weight.shape[:-2], math.ceil(rows / br), math.ceil(cols / bc))
    if grid is None or tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"block-FP8 weight {list(weight.shape)} with weight_block_size [{br}, {bc}] needs a scale grid "
            f"{list(grid) if grid else '[..., rows / block, columns / block]'}, its scale is {list(scale_inv.shape)}"
        )
    if weight.is_meta or scale_inv.is_meta:
        return torch.empty(weight.shape, dtype=dtype, device="meta")
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"block-FP8 weight must be float8, got {weight.dtype}")
    if scale_inv.dtype == torch.uint8:
        scale = F.embedding(scale_inv.int(), _e8m0_values(torch.float32).to(scale_inv.device))[..., 0]
    else:
        scale = scale_inv.float()
    out = weight.float()
    full_cols, rest = divmod(cols, bc)
    scale = scale.repeat_interleave(br, dim=-2)[..., :rows, :]  # [..., rows, grid cols]: small
    out[..., : full_cols * bc].unflatten(-1, (full_cols, bc)).mul_(scale[..., :full_cols, None])
    if rest:
        out[..., full_cols * bc :].mul_(scale[..., full_cols:])
    return out if dtype == torch.float32 else out.to(dtype)


# ---- the loader's seam -----------------------------------------------------------------------------


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors as the families load them (read-only): each quantized tensor
    de-quantized to `dtype` under its unquantized name (MXFP4 `...experts.gate_up_proj_blocks` +
    `_scales` -> `...experts.gate_up_proj` [E, H, 2I]; FP8 `X` + `X_scale_inv` -> `X`, `.weight` and
    stacked expert tensors alike) every time it is read, never kept: a loader that reads each once
    and drops it holds one de-quantized tensor at a time. The scales are not among the names. Reading
    raises ValueError naming the tensor when its shapes do not fit its format."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], quant: CheckpointQuant, dtype: torch.dtype):
        self.raw, self.quant, self.dtype = tensors, quant, dtype
        scale_suffix = "_scales" if quant.method == "mxfp4" else "_scale_inv"
        self.names: dict[str, str] = {}  # name -> raw name
        for name in tensors:
            if name.endswith(scale_suffix):
                continue  # read with its weight
            if quant.method == "mxfp4" and name.endswith("_blocks"):
                self.names[name.removesuffix("_blocks")] = name
            else:
                self.names[name] = name

    def __getitem__(self, name: str) -> torch.Tensor:
        raw = self.names[name]
        value = self.raw[raw]
        try:
            if raw != name:  # MXFP4 blocks
                return dequantize_mxfp4(value, self.raw[name + "_scales"], self.dtype)
            if self.quant.method == "fp8" and name + "_scale_inv" in self.raw:
                scale = self.raw[name + "_scale_inv"]
                return dequantize_fp8_blocks(value, scale, self.quant.block_size, self.dtype)
        except ValueError as e:
            raise ValueError(f"weight '{name}': {e}") from None
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def checkpoint_tensors(
    tensors: Mapping[str, torch.Tensor], quant: CheckpointQuant | None, dtype: torch.dtype
) -> Mapping[str, torch.Tensor]:
    """`tensors` (name -> tensor, as read from the checkpoint) as the family loads them: a
    CheckpointTensors view with `quant`, `tensors` itself without (or when it is one already).
    Raises ValueError, before any tensor is de-quantized, for a scale without its weight or a weight
    without its scale, MXFP4 blocks on a tensor that is not an expert's gate_up_proj / down_proj, or
    a float8 tensor in a checkpoint that does not declare fp8."""
    if isinstance(tensors, CheckpointTensors):
        return tensors
    method = quant.method if quant else None
    for name, value in tensors.items():
        _check_partners(name, value, tensors, method)
    return tensors if quant is None else CheckpointTensors(tensors, quant, dtype)


def _check_partners(name: str, value: torch.Tensor, tensors: dict, method: str | None) -> None:
    """Raises ValueError when tensor `name` of the checkpoint lacks its partner (scale or weight), is
    MXFP4 blocks off the experts, or is float8 where the config does not declare fp8."""
    is_fp8 = value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if is_fp8 and method != "fp8":
        raise ValueError(
            f"weight '{name}' is {str(value.dtype).removeprefix('torch.')} but config.json's "
            "quantization_config does not declare quant_method 'fp8' with its block size"
        )
    partner = None
    if method == "mxfp4" and name.endswith("_blocks"):
        if not MXFP4_EXPERT.fullmatch(name):
            raise ValueError(
                f"MXFP4 blocks '{name}' are not an expert's gate_up_proj / down_proj: agentrt "
                "de-quantizes MXFP4 only for gpt-oss's MoE experts"
            )
        partner = ("MXFP4 blocks", "scales", name.removesuffix("_blocks") + "_scales")
    elif method == "mxfp4" and name.endswith("_scales"):
        partner = ("MXFP4 scales", "blocks", name.removesuffix("_scales") + "_blocks")
    elif method == "fp8" and name.endswith("_scale_inv"):
        partner = ("FP8 scale", "weight", name.removesuffix("_scale_inv"))
    elif is_fp8:
        partner = ("FP8 weight", "scale", name + "_scale_inv")
    if partner is not None and partner[2] not in tensors:
        raise ValueError(f"{partner[0]} '{name}' has no {partner[1]} ('{partner[2]}')")


def loaded_elements(name: str, shape: tuple[int, ...], quant: CheckpointQuant | None) -> int:
    """How many weight values the stored tensor `name` of `shape` becomes at load: twice its bytes for
    MXFP4 blocks, none for a scale (folded into its weight), else its elements."""
    n = math.prod(shape)
    if quant is not None and quant.method == "mxfp4" and name.endswith("_blocks"):
        return 2 * n
    if quant is not None and name.endswith("_scales" if quant.method == "mxfp4" else "_scale_inv"):
        return 0
    return n
