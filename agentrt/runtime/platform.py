"""The run-configuration policies: from the machine (runtime/hardware.py) and the requested
options, which dtype, how many torch threads, which attention backend and which kernel for the
dense linear layers a run takes, each with the reason printed at start, and why a configuration
could not be batch-invariant (what --deterministic refuses). Each `choose_*` returns (choice,
reason) and raises ValueError naming why when a requested choice cannot run here.

- dtype `auto`: bf16 on CUDA. On the CPU, float32 wherever the C++ kernels' vector path runs (x86
  with AVX2 and FMA: every CPU this project runs on), because there `--quantization auto` puts the
  linear layers on the int4/int8 kernels, which need float32 activations and are both faster than
  torch's bf16 path (docs/benchmarks.md) and batch-invariant (the same tokens whatever the batch,
  the prefix cache or the chunking), which bf16 through oneDNN is not. Without AVX2: bf16 where the
  CPU has native bf16 arithmetic (avx512_bf16 / amx_bf16 flags, or torch's CPU capability
  AVX512_BF16 / AMX), else float32.
- threads: an explicit value, else $OMP_NUM_THREADS, else the physical cores (psutil; SMT siblings
  share a core's FPUs and slow a matmul down).
"""

from __future__ import annotations

import os

import torch

from agentrt.runtime import hardware
from agentrt.runtime.kernels import triton_usable

LINEAR_KERNELS = ("auto", "onednn", "aten", "triton")


def choose_dtype(
    device: torch.device, dtype: str, cpuinfo: str | None = None, capability: str | None = None
) -> tuple[torch.dtype, str]:
    """The run dtype and why (the module docstring's rule); cpuinfo / capability simulate another CPU
    (tests). Raises ValueError for a dtype other than auto / float32 / bfloat16 / float16."""
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype != "auto":
        if dtype not in names:
            raise ValueError(f"dtype '{dtype}' is not one of auto, {', '.join(names)}")
        return names[dtype], "requested"
    if device.type == "cuda":
        return torch.bfloat16, "auto: CUDA"
    info = hardware.cpu_info(cpuinfo)
    if {"avx2", "fma"} <= info.flags:
        isa = hardware.kernel_isa(info)[0]  # $AGENTRT_CPU_ISA included: the path that will run
        return torch.float32, (
            f"auto: the CPU kernels' {isa} path runs at float32 (faster than bf16 and batch-invariant)"
        )
    native, evidence = hardware.cpu_native_bf16(cpuinfo, capability)
    if native:
        return torch.bfloat16, f"auto: no AVX2 for the CPU kernels, native bf16 ({evidence})"
    return torch.float32, f"auto: {evidence}"


def choose_threads(threads: int | None) -> tuple[int, str]:
    """torch intra-op threads and why: an explicit value, else $OMP_NUM_THREADS when set (several
    engines sharing a machine each get their share), else the physical cores. Raises ValueError for
    a value below 1 or an OMP_NUM_THREADS that is not a positive integer."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        return threads, "requested"
    env = os.environ.get("OMP_NUM_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {env!r}")
        return int(env), "OMP_NUM_THREADS"
    return hardware.physical_cores(), "physical cores"


def choose_linear_kernel(
    kernel: str,
    device: torch.device,
    dtype: torch.dtype,
    compile_decode: bool,
    deterministic: bool = False,
    attention_backend: str = "auto",
) -> tuple[str, str]:
    """(kernel, reason) for the dense linear layers. `auto` picks oneDNN on the CPU at float32 when
    the build has it and the decode step is not compiled (the compiled graphs take the weights as
    plain tensors); with `deterministic` and the Triton attention the batch-invariant Triton matmul
    (models/triton_linear.py). `onednn` or `triton` where impossible, or `aten` with
    `deterministic` (cuBLAS and MKL choose their kernel by the batch's shape), raise ValueError
    naming why."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, got {kernel!r}")
    if kernel == "aten":
        if deterministic:
            raise ValueError(
                "linear_kernel aten is not batch-invariant (cuBLAS and MKL choose their kernel by the batch's "
                "shape): leave it auto with --deterministic"
            )
        return "aten", "requested"
    if kernel == "triton" or (kernel == "auto" and deterministic and attention_backend == "triton"):
        if not triton_usable(device):
            raise ValueError(
                "linear_kernel triton needs a CUDA device (or TRITON_INTERPRET=1 on CPU) and the triton package"
            )
        return (
            "triton",
            "requested" if kernel == "triton" else "auto: --deterministic with Triton attention",
        )
    why_not = None
    if device.type != "cpu":
        why_not = f"oneDNN packed linear layers are a CPU path (device {device})"
    elif dtype != torch.float32:
        why_not = f"oneDNN packed linear layers are float32 only (dtype {str(dtype).removeprefix('torch.')})"
    elif compile_decode:
        why_not = "the compiled decode step takes the weights as plain tensors"
    elif not hardware.onednn_usable():
        why_not = "this torch build has no oneDNN (mkldnn)"
    if why_not is None:
        return "onednn", "requested" if kernel == "onednn" else "auto: CPU float32"
    if kernel == "onednn":
        raise ValueError(f"linear_kernel onednn is not available: {why_not}")
    return "aten", f"auto: {why_not}"


def choose_attention_backend(
    requested: str, device: torch.device, dtype: torch.dtype, cache_dir
) -> tuple[str, str]:
    """(backend, reason). auto: `triton` on CUDA (with triton), `cpu` on the CPU at float32 when
    the C++ kernels build and load (kernels/cpu_kernels.py: decode attention and the fused layer
    ops), else `torch`. Raises
    ValueError when a requested backend cannot run here, naming why."""
    if requested == "triton" and not triton_usable(device):
        raise ValueError(
            "attention_backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU) and the triton package"
        )
    if requested == "auto" and device.type == "cuda" and triton_usable(device):
        return "triton", "auto: CUDA"
    if requested in ("triton", "torch"):
        return requested, "requested"
    if device.type != "cpu" or dtype != torch.float32:  # auto or cpu, where the kernel cannot run
        if requested == "cpu":
            raise ValueError(f"attention_backend 'cpu' needs the CPU at float32 (here {device}, {dtype})")
        return "torch", "auto"
    from agentrt.runtime.kernels import cpu_kernels

    failure = cpu_kernels.load(cache_dir)
    if failure is None:
        how = f"C++ attention kernel (decode and prefill), fused layer ops, int kernels {cpu_kernels.active_isa()}"
        return "cpu", f"{'requested' if requested == 'cpu' else 'auto'}: {how}"
    if requested == "cpu":
        raise ValueError(f"attention_backend 'cpu': the C++ kernels are unavailable: {failure}")
    return "torch", f"auto: the C++ kernels are unavailable: {failure}"


def deterministic_problem(
    device: torch.device, dtype: torch.dtype, attention_backend: str, compiled: bool, quantization: str
) -> str | None:
    """Why a configuration's greedy tokens could depend on the batch, the prefix cache or the chunk
    size (what --deterministic refuses), or None. The invariant paths: the C++ kernels on the CPU
    (attention backend `cpu`, float32, decode not compiled); the Triton attention with the dense
    (unquantized) layers on the batch-invariant Triton matmul (choose_linear_kernel)."""
    if attention_backend == "triton":
        if quantization != "none":
            return f"quantization {quantization} on {device} runs torchao's kernels, which are not batch-invariant"
        return None
    if device.type == "cpu" and dtype != torch.float32:
        return f"on the CPU only float32 is batch-invariant (dtype {str(dtype).removeprefix('torch.')})"
    if attention_backend != "cpu":
        return f"attention backend {attention_backend} is not batch-invariant (cpu on the CPU, triton on CUDA are)"
    if compiled:
        return "the compiled decode step (--compile) runs aten matmuls, which are not batch-invariant"
    return None
