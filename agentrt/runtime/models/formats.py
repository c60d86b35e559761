"""Weight formats: build the model in its format, cache quantized weights.

- the run dtype and threads are chosen by runtime/platform.py (`choose_dtype`, `choose_threads`); the
  dtype's reason is kept in `WeightFormat.reason` and printed at start.
- quantization `int8` / `int4`: the decoder's linear layers (and the LM head when asked);
  embeddings and norms stay in the run dtype. CPU at float32: llama.cpp's block formats on our C++
  kernels (int8 Q8_0, int4 Q4_1 with an int8 LM head; activations quantized to int8 blocks per call);
  at bf16: torch's packed weight-only ops (quant.py). Computed once from
  the dense weights and cached as safetensors under `<cache_dir>/quant-<key>/` (key: the source
  weights' path, size and mtime, the format, torch's version), so later starts read the quantized
  file. CUDA: torchao's kernels, quantized at each start (not cached; not measurable here).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrt.runtime.forward import TORCH_OPS, LayerOps
from agentrt.runtime.hugepages import move_to_hugepages
from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.checkpoint_quant import checkpoint_tensors
from agentrt.runtime.models.config import ModelArch
from agentrt.runtime.models.cpu_linear import pack_linears
from agentrt.runtime.models.quant import (
    INT4_GROUP_SIZES,
    QUANTIZATIONS,
    Int4BlockLinear,
    Int4Linear,
    Int8Linear,
    bytes_by_format,
    empty_quantized_like,
    int4_levels,
    quantize_cpu,
    quantize_cuda,
)
from agentrt.runtime.models.registry import build_model
from agentrt.runtime.models.weights import atomic_cache_dir, load_weights

logger = logging.getLogger(__name__)

QUANT_CACHE_VERSION = 5  # 3: int8 at float32 in blocks of 32 (the C++ int8 kernel's layout); 4: int4 at
# float32 in Q4_1 blocks (the C++ int4 kernel's), its LM head int8; 5: int4 scales and mins float16 values
"""Bumped when the cached layout changes (old entries are then ignored, never misread)."""


@dataclass(frozen=True)
class WeightFormat:
    """What the weights were loaded as. dtype: the run dtype (activations, KV cache, dense weights);
    quantization: none / int8 / int4; act_dtype: activations of the quantized matmuls; lm_head:
    whether the LM head is quantized; dense_layers: linear layers left dense; from_cache: the
    quantized weights were read from the cache; bytes: weight bytes per storage format."""

    dtype: torch.dtype
    reason: str
    quantization: str = "none"
    group_size: int = 0
    act_dtype: torch.dtype | None = None
    lm_head: bool = False
    dense_layers: tuple[str, ...] = ()
    from_cache: bool = False
    bytes: tuple[tuple[str, int], ...] = ()
    linear_kernel: str = "aten"
    linear_reason: str = ""
    act_int8: bool = False  # int8 layers quantize their activations (C++ kernel, Q8_0 blocks of 32)
    quant_reason: str = ""  # why this quantization, when it was chosen by `auto`

    def describe(self) -> str:
        text = f"{str(self.dtype).removeprefix('torch.')} ({self.reason})"
        if self.quantization != "none":
            group = f" group {self.group_size}" if self.quantization == "int4" else ""
            text += (
                f", {self.quantization}{group} {'' if self.act_int8 else 'weight-only '}linear layers"
                f" (LM head {self.head_format()}"
                + (
                    ", activations int8 per block of 32 (C++ kernel)"
                    if self.act_int8
                    else f", activations {str(self.act_dtype).removeprefix('torch.')}"
                    if self.act_dtype
                    else ""
                )
                + (", from cache" if self.from_cache else "")
                + ")"
            )
        if self.quant_reason:
            text += f", quantization {self.quantization} ({self.quant_reason})"
        if self.linear_kernel == "onednn":
            text += f", dense linear layers oneDNN packed ({self.linear_reason})"
        elif self.linear_kernel == "triton":
            text += f", linear layers and norms on the batch-invariant Triton kernels ({self.linear_reason})"
        return text

    def head_format(self) -> str:
        """The LM head's storage: dense, or its quantization (int8 for int4 at float32 activations:
        quant._quantized_layer)."""
        if not self.lm_head:
            return "dense"
        return (
            "int8" if self.quantization == "int4" and self.act_dtype == torch.float32 else self.quantization
        )

    def describe_bytes(self) -> str:
        return ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in self.bytes)


def four_bit_layers(model_dir: Path, group_size: int = 32) -> bool:
    """Whether the checkpoint's decoder layers hold 4-bit values already (a 4-bit GGUF de-quantized on
    conversion, as the default model's Q4_1 file): every projection weight of the first layer comes
    back from int4_levels (a scale and a minimum per `group_size` input columns, 16 levels) within
    float32 rounding (max error <= 1e-5 of the tensor's largest magnitude). Reads those few tensors
    only; False when there are none, one is not finite, or a file cannot be read."""
    from safetensors import safe_open

    found = 0
    try:
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if ".layers.0." not in f".{name}" or not name.endswith("proj.weight"):
                        continue
                    w = st.get_tensor(name).float()
                    if w.dim() != 2 or w.shape[1] % group_size or not bool(torch.isfinite(w).all()):
                        return False
                    q, scales, mins = int4_levels(w, group_size)
                    back = q.view(w.shape[0], -1, group_size) * scales[..., None] + mins[..., None]
                    if (back.view_as(w) - w).abs().max() > 1e-5 * w.abs().max():
                        return False
                    found += 1
    except Exception:  # noqa: BLE001 - a damaged file (safetensors' own SafetensorError): not 4-bit
        return False
    return found > 0


def quant_cache_dir(
    cache_dir: Path, model_dir: Path, dtype: torch.dtype, quantization: str, group_size: int, lm_head: bool
) -> Path:
    """`<cache_dir>/quant-<key>`: key over the source weights (resolved paths, sizes, mtimes), the
    format, torch's version (its packed layouts may change) and QUANT_CACHE_VERSION."""
    files = sorted(Path(model_dir).resolve().glob("*.safetensors"))
    ident = {
        "files": [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files],
        "dtype": str(dtype),
        "quantization": quantization,
        "group_size": group_size if quantization == "int4" else 0,
        "lm_head": lm_head,
        "torch": torch.__version__,
        "version": QUANT_CACHE_VERSION,
    }
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"quant-{key}"


def _build_dense(
    arch: ModelArch, max_positions: int, dtype: torch.dtype, device, tensors, ops: LayerOps = TORCH_OPS
) -> DecoderModel:
    with torch.device("meta"):
        model = build_model(arch, max_positions, ops)
    model = model.to(dtype).to_empty(device=device)  # dtype on meta: no copy
    # quantized checkpoints read de-quantized, also by families that rework the tensors first
    model.load_hf_state_dict(checkpoint_tensors(tensors, arch.checkpoint_quant, dtype))
    return model


def _save_quantized(model: DecoderModel, target: Path) -> None:
    """Write the quantized state dict (tied weights once) atomically: a temporary directory renamed."""
    from safetensors.torch import save_file

    with atomic_cache_dir(target) as tmp:
        state = model.state_dict()
        if isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight is model.embed_tokens.weight:
            state.pop("lm_head.weight")  # tied: safetensors stores a tensor once
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))


def _load_quantized(
    arch: ModelArch, max_positions: int, dtype, act_dtype, quantization, group_size, lm_head, path: Path, ops
) -> DecoderModel:
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = build_model(arch, max_positions, ops)
        model = model.to(dtype)
        empty_quantized_like(model, quantization, act_dtype, group_size, lm_head)
    model = model.to_empty(device="cpu")
    try:
        state = load_file(str(path / "model.safetensors"))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"quantized cache {path} cannot be read: delete it to rebuild ({e})") from e
    tied = arch.tie_word_embeddings and not lm_head
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    expected = model.state_dict()
    for key, t in state.items():  # load_state_dict would cast another layout's dtypes silently
        if key in expected and t.dtype != expected[key].dtype:
            raise ValueError(
                f"quantized cache {path} holds {key} as {t.dtype}, this layout needs "
                f"{expected[key].dtype}: delete it to rebuild"
            )
    try:
        model.load_state_dict(state, strict=not tied, assign=False)
    except RuntimeError as e:  # shapes of another layout
        raise ValueError(f"quantized cache {path} does not fit this model: delete it to rebuild ({e})") from e
    missing = set(model.state_dict()) - set(state) - ({"lm_head.weight"} if tied else set())
    if missing:
        raise ValueError(f"quantized cache {path} lacks {sorted(missing)[:3]}: delete it to rebuild")
    return model


def _bind_kernels(model, fmt: WeightFormat, linear_kernel: tuple[str, str], cpu_kernels: bool):
    """(format, kernel, reason) after packing the loaded model's layers for their kernels: the C++
    int8/int4 kernels with cpu_kernels, oneDNN or the batch-invariant Triton matmul for the dense
    float32 layers as `linear_kernel` (kernel, reason) says."""
    kernel, kernel_reason = linear_kernel
    if cpu_kernels:  # the CPU kernels are loaded (float32, decode not compiled): the int8 and int4
        # kernels too, whatever --linear-kernel says about the dense layers (block-wise layers exist
        # only at float32)
        packed = [
            mod.pack_for_kernel()
            for mod in model.modules()
            if isinstance(mod, Int4BlockLinear) or (isinstance(mod, Int8Linear) and mod.block)
        ]
        fmt = dataclasses.replace(fmt, act_int8=bool(packed))
    if kernel == "onednn" and not pack_linears(model):
        kernel, kernel_reason = "aten", "no float32 linear layer to pack"
    if kernel == "triton":
        from agentrt.runtime.models.triton_linear import use_batch_invariant_kernels

        if not use_batch_invariant_kernels(model):
            kernel_reason += " (norms only: no dense linear layer)"
    return fmt, kernel, kernel_reason


def load_model(
    arch: ModelArch,
    max_positions: int,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    reason: str,
    quantization: str,
    group_size: int,
    quantize_lm_head: bool,
    cache_dir: Path,
    linear_kernel: tuple[str, str] = ("aten", "requested"),
    cpu_kernels: bool = False,
    ops: LayerOps = TORCH_OPS,
) -> tuple[DecoderModel, WeightFormat]:
    """Build the model with its weights in the chosen format (see the module docstring) and RoPE
    tables initialised; returns (model in eval mode, its WeightFormat). linear_kernel: (kernel,
    reason) from platform.choose_linear_kernel; with `onednn` the float32 linear layers left dense
    are packed for oneDNN after loading (the quantized cache keeps plain tensors), and with
    cpu_kernels too (kernels/cpu_kernels.py loaded) int8 layers run the C++ int8 x int8 kernel. ops: the
    layers' element-wise ops (backends.choose_layer_ops). Raises ValueError
    for an unknown quantization or int4 group size, or (CUDA) torchao missing."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if quantization == "none":
        model = _build_dense(arch, max_positions, dtype, device, load_weights(model_dir, device), ops)
        fmt = WeightFormat(dtype, reason)
    elif device.type == "cuda":
        model = _build_dense(arch, max_positions, dtype, device, load_weights(model_dir, device), ops)
        quantize_cuda(model, quantization, group_size, quantize_lm_head)
        fmt = WeightFormat(dtype, reason, quantization, group_size, None, quantize_lm_head)
    else:
        # float32 runs keep float32 activations (the C++ int8 x int8 and int4 x int8 kernels where the
        # CPU kernels load); else bf16, the packed torch kernels' fast path (see quant.py)
        act = torch.float32 if dtype == torch.float32 else torch.bfloat16
        target = quant_cache_dir(cache_dir, model_dir, dtype, quantization, group_size, quantize_lm_head)
        from_cache = (target / "model.safetensors").is_file()
        if from_cache:
            model = _load_quantized(
                arch, max_positions, dtype, act, quantization, group_size, quantize_lm_head, target, ops
            )
        else:
            logger.info("quantizing weights to %s (first start only) -> %s", quantization, target)
            # quantized from the fp32 source weights, then the dense rest cast to the run dtype
            model = _build_dense(
                arch, max_positions, torch.float32, "cpu", load_weights(model_dir, "cpu"), ops
            )
            quantize_cpu(model, quantization, act, group_size, quantize_lm_head)
            for mod in model.modules():
                if not isinstance(mod, (Int8Linear, Int4Linear, Int4BlockLinear)):
                    for p in mod.parameters(recurse=False):
                        p.data = p.data.to(dtype)
            _save_quantized(model, target)
        dense = tuple(
            n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
        )
        fmt = WeightFormat(dtype, reason, quantization, group_size, act, quantize_lm_head, dense, from_cache)
    model.init_rope()
    model.eval()
    fmt, kernel, kernel_reason = _bind_kernels(model, fmt, linear_kernel, cpu_kernels)
    if device.type == "cpu":
        move_to_hugepages(model)  # after every repacking: the tensors a step reads, as they stay
    sizes = tuple(sorted(bytes_by_format(model).items(), key=lambda kv: -kv[1]))
    return model, WeightFormat(
        **{**fmt.__dict__, "bytes": sizes, "linear_kernel": kernel, "linear_reason": kernel_reason}
    )
