"""What this machine is and the policies that follow from it: the run dtype, torch's threads, and
which instruction set the CPU kernels' integer dot products use.

- dtype `auto`: bf16 on CUDA. On the CPU, float32 wherever the C++ kernels' vector path runs (x86
  with AVX2 and FMA: every CPU this project runs on), because there `--quantization auto` puts the
  linear layers on the int4/int8 kernels, which need float32 activations and are both faster than
  torch's bf16 path (measured on AMD Zen 5 with native bf16: 91.1 vs 33.5 tok/s single stream,
  docs/benchmarks.md) and batch-invariant (the same tokens whatever the batch, the prefix cache or
  the chunking), which bf16 through oneDNN is not. Without AVX2: bf16 where the CPU has native bf16
  arithmetic (avx512_bf16 / amx_bf16 flags, or torch's CPU capability AVX512_BF16 / AMX), else
  float32.
- kernel ISA: `avx512vnni` (AVX-512 VNNI with VL: vpdpbusd on 256-bit registers), `avxvnni` (the
  VEX-encoded vpdpbusd), `avx2` (maddubs + madd) or `scalar`; the same integers either way and the
  same float accumulation, so the same outputs bit for bit (kernels/cpu_isa.h). $AGENTRT_CPU_ISA
  (`avx2`) forces the AVX2 path on a CPU that has VNNI.
- threads: an explicit value, else $OMP_NUM_THREADS, else the physical cores (psutil; SMT siblings
  share a core's FPUs and slow a matmul down).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

ISAS = ("avx512vnni", "avxvnni", "avx2", "scalar")


@dataclass(frozen=True)
class CpuInfo:
    """model: the CPU's model name; flags: the feature flags of /proc/cpuinfo's first processor."""

    model: str
    flags: frozenset[str]

    def describe(self) -> str:
        """One line: the model and the flags that decide the kernels and the dtype."""
        shown = sorted(self.flags & {"avx2", "fma", "avx512f", "avx512vl", "avx512_vnni", "avx_vnni",
                                     "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"})  # fmt: skip
        return f"{self.model or platform.machine()} ({' '.join(shown) or 'no AVX2'})"


def cpu_info(cpuinfo: str | None = None) -> CpuInfo:
    """Parse /proc/cpuinfo (or the given text, for tests): the first processor's model name and flags.
    An unreadable file gives an empty model and no flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = "", frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuInfo(model, flags)


def kernel_isa(info: CpuInfo, forced: str | None = None) -> tuple[str, str]:
    """(ISA, reason) of the CPU kernels' integer dot products on this CPU (one of ISAS). forced: a
    value of $AGENTRT_CPU_ISA (None reads it; "" = unset): a lower path than the CPU has is taken, a
    higher one is a ValueError naming what is missing."""
    f = info.flags
    have = ["scalar"]  # the kernels' plain C++ path, built only for a CPU without AVX2 (-march=native)
    if {"avx2", "fma"} <= f:
        have = ["avx2"]
        if "avx_vnni" in f:
            have.append("avxvnni")
        if {"avx512_vnni", "avx512vl"} <= f:
            have.append("avx512vnni")
    best = have[-1]
    if forced is None:
        forced = os.environ.get("AGENTRT_CPU_ISA", "")
    if not forced:
        return best, "auto: the CPU's best"
    if forced not in ISAS:
        raise ValueError(f"AGENTRT_CPU_ISA must be one of {', '.join(ISAS)}, got {forced!r}")
    if forced not in have:
        raise ValueError(
            f"AGENTRT_CPU_ISA={forced} is not available on this CPU (available: {', '.join(have)})"
        )
    return forced, "AGENTRT_CPU_ISA"


def cpu_native_bf16(cpuinfo: str | None = None, capability: str | None = None) -> tuple[bool, str]:
    """(has native bf16, evidence). Reads /proc/cpuinfo's flags (avx512_bf16, amx_bf16) and torch's
    CPU capability (torch.backends.cpu.get_cpu_capability(): AVX512_BF16 or AMX* count); the
    arguments override both (tests)."""
    if capability is None:
        capability = torch.backends.cpu.get_cpu_capability()
    found = sorted(cpu_info(cpuinfo).flags & {"avx512_bf16", "amx_bf16"})
    if found:
        return True, f"CPU flags {', '.join(found)}"
    if capability.upper().startswith(("AVX512_BF16", "AMX")):
        return True, f"torch CPU capability {capability}"
    return False, f"no avx512_bf16/amx_bf16 (torch CPU capability {capability})"


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
    info = cpu_info(cpuinfo)
    if {"avx2", "fma"} <= info.flags:
        isa = kernel_isa(info)[0]  # $AGENTRT_CPU_ISA included: the path that will run
        return torch.float32, (
            f"auto: the CPU kernels' {isa} path runs at float32 (faster than bf16 and batch-invariant)"
        )
    native, evidence = cpu_native_bf16(cpuinfo, capability)
    if native:
        return torch.bfloat16, f"auto: no AVX2 for the CPU kernels, native bf16 ({evidence})"
    return torch.float32, f"auto: {evidence}"


def physical_cores() -> int:
    """Physical CPU cores (psutil, SMT siblings not counted); os.cpu_count() when unknown."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


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
    return physical_cores(), "physical cores"


def deterministic_problem(
    device: torch.device, dtype: torch.dtype, attention_backend: str, compiled: bool, quantization: str
) -> str | None:
    """Why a configuration's greedy tokens could depend on the batch, the prefix cache or the chunk
    size (what --deterministic refuses), or None. The invariant paths: the C++ kernels on the CPU
    (attention backend `cpu`, float32, decode not compiled); the Triton attention with the dense
    (unquantized) layers on the batch-invariant Triton matmul (cpu_linear.choose_linear_kernel)."""
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
