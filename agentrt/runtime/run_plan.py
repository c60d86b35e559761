"""How a run will go, decided once before anything is loaded: `plan_run` turns the requested options
and the machine into a `RunPlan` (device, dtype, threads, attention backend, compiled decode or not,
weight quantization with `auto`'s policy, the dense linear kernel, the layers' element-wise ops, the
KV dtype), each choice with its reason, and refuses with ValueError what `--deterministic` or the
model cannot take. `serve` builds exactly this plan (model_runner.ModelRunner) and `agentrt check`
prints it.

It sits above runtime/platform.py (the single `choose_*` policies, which models/loader.py uses too)
because the `auto` quantization reads the checkpoint (models/formats.four_bit_layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from agentrt.runtime.backends import choose_layer_ops
from agentrt.runtime.backends.compiled_decode import unsupported as compiled_unsupported
from agentrt.runtime.config import CacheConfig, ModelConfig
from agentrt.runtime.forward import TORCH_OPS, LayerOps
from agentrt.runtime.kv_cache import kv_dtype_name, resolve_kv_dtype
from agentrt.runtime.models.config import ModelArch, default_max_model_len
from agentrt.runtime.models.formats import four_bit_layers
from agentrt.runtime.models.loader import resolve_device_dtype
from agentrt.runtime.platform import (
    choose_attention_backend,
    choose_dtype,
    choose_linear_kernel,
    choose_threads,
    deterministic_problem,
)


@dataclass(frozen=True)
class RunPlan:
    """Every decision of a run with its reason. quantization / quantize_lm_head / group_size are what
    loads (`auto` resolved); compiled: decode through the AOTInductor graphs (CPU); cpu_kernels: the
    C++ int8/int4 kernels run the quantized layers; ops: the element-wise ops the model is built with
    (torch's with `compiled`: the graphs trace the layers as built)."""

    device: torch.device
    dtype: torch.dtype
    dtype_reason: str
    threads: int
    threads_reason: str
    backend: str
    backend_reason: str
    compiled: bool
    decode_reason: str
    quantization: str
    quantize_lm_head: bool
    group_size: int
    quant_reason: str
    linear_kernel: str
    linear_reason: str
    kv_dtype: torch.dtype
    ops: LayerOps
    max_model_len: int
    recurrent: str = ""  # how a hybrid model's recurrent layers run ("" without them)
    recurrent_reason: str = ""

    @property
    def cpu_kernels(self) -> bool:
        return self.backend == "cpu" and not self.compiled

    def describe(self) -> str:
        """The plan in one line per decision (what `agentrt check` prints)."""
        return "\n".join(
            f"  {name}: {value} ({why})"
            for name, value, why in (
                ("device", f"{self.device}, {str(self.dtype).removeprefix('torch.')}", self.dtype_reason),
                ("threads", self.threads, self.threads_reason),
                ("attention", self.backend, self.backend_reason),
                ("decode", "compiled" if self.compiled else "eager", self.decode_reason),
                ("weights", self._weights(), self.quant_reason),
                ("linear kernel", self.linear_kernel, self.linear_reason),
                ("layer ops", self.ops.name, "chosen with the attention backend and the linear kernel"),
                ("KV cache", kv_dtype_name(self.kv_dtype), f"context {self.max_model_len} tokens"),
                *([("recurrent layers", self.recurrent, self.recurrent_reason)] if self.recurrent else ()),
            )
        )

    def _weights(self) -> str:
        if self.quantization == "none":
            return "unquantized"
        group = f", groups of {self.group_size}" if self.quantization == "int4" else ""
        return f"{self.quantization}{group}{', LM head too' if self.quantize_lm_head else ''}"


def _layout_backend(requested: str, backend: str, reason: str, arch: ModelArch) -> tuple[str, str]:
    """(backend, reason) for the model's layout: `auto`'s Triton becomes torch where the Triton
    attention does not implement a layer (backends/triton.py `unsupported`); with `cpu`, latent
    attention layers are attended by gather + SDPA (the C++ kernel reads K and V of one width).
    Raises ValueError naming the layer when `triton` was requested for such a model."""
    if backend == "triton":  # chosen only where triton imports
        from agentrt.runtime.backends.triton import unsupported as triton_unsupported

        missing = triton_unsupported(arch)
        if missing and requested == "triton":
            raise ValueError(
                f"attention_backend 'triton' does not implement {', '.join(sorted(missing))} of "
                f"{arch.architecture}: use torch"
            )
        if missing:
            return "torch", f"auto: the Triton attention does not implement {', '.join(sorted(missing))}"
    if backend == "cpu" and arch.mla is not None:
        reason += "; latent attention by gather + SDPA (the C++ kernel reads K and V of one width)"
    return backend, reason


def _recurrent_plan(model_config: ModelConfig, backend: str, device: torch.device, arch: ModelArch):
    """(how the recurrent layers run, why), ("", "") for a model without them: on the Triton backend
    by its kernels per mixer kind (backends/triton_recurrent.py), decode without CUDA graphs; on
    torch / cpu by the mixers' torch scans."""
    kinds = sorted({arch.layer_mixers[i] for i in arch.recurrent_layers})
    if not kinds:
        return "", ""
    if backend != "triton":
        return (
            "torch scans (chunked prefill, batched decode step)",
            f"attention {backend}: the recurrent kernels are the Triton backend's",
        )
    from agentrt.runtime.backends import GRAPHS_SKIP_RECURRENT
    from agentrt.runtime.backends.triton_recurrent import DESCRIPTIONS

    how = "; ".join(DESCRIPTIONS.get(k, f"{k} by its torch scan") for k in kinds)
    graphs = device.type == "cuda" and not model_config.enforce_eager
    return how, f"attention triton{'; decode eager: ' + GRAPHS_SKIP_RECURRENT if graphs else ''}"


def _decode_plan(model_config: ModelConfig, backend: str, device: torch.device, arch: ModelArch):
    """(compiled, reason): the AOTInductor decode graphs with --compile on the CPU (torch or cpu
    attention) where they implement the model's layout."""
    if not model_config.compile_decode:
        return False, "--compile not requested"
    if model_config.enforce_eager:
        return False, "enforce_eager"
    if backend not in ("torch", "cpu") or device.type != "cpu":
        return False, f"the compiled decode is a CPU path (attention {backend} on {device})"
    missing = compiled_unsupported(arch)
    if missing:
        return (
            False,
            f"the compiled decode does not implement {', '.join(sorted(missing))} of {arch.architecture}",
        )
    return True, "--compile"


def _quant_plan(
    model_config: ModelConfig,
    plan_kernels: bool,
    four_bit: bool | None,
    model_dir: Path,
    device,
    dtype,
    backend,
    compiled,
):
    """(quantization, quantize_lm_head, group_size, reason): `auto` takes the CPU kernels' formats where
    they run (int4 when the weights are 4-bit already: `four_bit`, or read from `model_dir` when it is
    None), else exact weights."""
    q, lm_head, group = (
        model_config.quantization,
        model_config.quantize_lm_head,
        model_config.quant_group_size,
    )
    if q != "auto":
        return q, lm_head, group, f"--quantization {q}"
    if plan_kernels and (four_bit_layers(model_dir) if four_bit is None else four_bit):
        why = "the layers' weights are 4-bit already (Q4_1 blocks of 32 give them back): the CPU int4 kernel, the LM head int8"
        return "int4", True, 32, f"auto: {why}"
    if plan_kernels:
        return "int8", True, group, "auto: the CPU int8 kernel (the weights are not 4-bit)"
    why = (
        "the CPU int8 and int4 kernels need the CPU at float32 with attention backend cpu, decode not "
        f"compiled (here {device}, {str(dtype).removeprefix('torch.')}, attention {backend}"
        f"{', compiled' if compiled else ''})"
    )
    return "none", lm_head, group, f"auto: {why}"


def plan_run(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    arch: ModelArch,
    model_dir: Path,
    four_bit: bool | None = None,
) -> RunPlan:
    """The RunPlan of `model_config` / `cache_config` for a model of `arch` in `model_dir` on this
    machine. four_bit: whether the layers' weights are 4-bit already (what `auto` quantization asks);
    None = read it from the first layer's tensors in `model_dir` (formats.four_bit_layers, only when
    `auto` can take the CPU kernels), as serve does; `agentrt check` gives a GGUF's answer from its
    tensor types (gguf_meta.gguf_four_bit_layers), never converting it. Raises ValueError naming the
    problem: a device or dtype that cannot run, max_model_len over the model's limit, a requested
    backend or kernel that cannot run here, a configuration `--deterministic` refuses."""
    device, dtype = resolve_device_dtype(model_config.device, model_config.dtype)
    dtype_reason = choose_dtype(device, model_config.dtype)[1]
    threads, threads_reason = choose_threads(model_config.threads)
    limit = arch.max_position_embeddings
    max_model_len = model_config.max_model_len or default_max_model_len(limit)
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit of {limit} tokens")
    backend, backend_reason = choose_attention_backend(
        model_config.attention_backend, device, dtype, model_config.cache_dir
    )
    backend, backend_reason = _layout_backend(model_config.attention_backend, backend, backend_reason, arch)
    compiled, decode_reason = _decode_plan(model_config, backend, device, arch)
    quantization, lm_head, group, quant_reason = _quant_plan(
        model_config, backend == "cpu" and not compiled, four_bit, model_dir, device, dtype, backend, compiled
    )
    kv_dtype = resolve_kv_dtype(cache_config.kv_cache_dtype, dtype, device)
    if model_config.deterministic:
        problem = deterministic_problem(device, dtype, backend, compiled, quantization)
        if (
            problem is None
            and backend == "cpu"
            and kv_dtype not in (torch.float32, torch.float16, torch.int8)
        ):
            problem = (
                f"the CPU attention kernel reads float32, float16 or int8 KV, not {kv_dtype_name(kv_dtype)} "
                "(--kv-cache-dtype)"
            )
        if problem is None and arch.mla is not None:
            problem = (
                "multi-head latent attention's absorbed projections (torch einsums) are not batch-invariant"
                if backend == "triton"
                else "multi-head latent attention is attended by gather + SDPA, which is not batch-invariant"
            )
        if problem is not None:
            raise ValueError(f"--deterministic: {problem}")
    kernel, kernel_reason = choose_linear_kernel(
        model_config.linear_kernel, device, dtype, compiled, model_config.deterministic, backend
    )
    return RunPlan(
        device, dtype, dtype_reason, threads, threads_reason, backend, backend_reason, compiled, decode_reason,
        quantization, lm_head, group, quant_reason, kernel, kernel_reason, kv_dtype,
        TORCH_OPS if compiled else choose_layer_ops(backend, kernel), max_model_len,
        *_recurrent_plan(model_config, backend, device, arch),
    )  # fmt: skip
