"""What this machine is: the CPU's model and feature flags (/proc/cpuinfo), whether it has native
bf16 arithmetic, its physical cores, whether the torch build has oneDNN's packed linear ops, and
which instruction set the CPU kernels' integer dot products use. The run-configuration policies that
follow from these facts (dtype, threads, attention backend, linear kernel) are runtime/platform.py's.

- kernel ISA: `avx512vnni` (AVX-512 VNNI with VL: vpdpbusd on 256-bit registers), `avxvnni` (the
  VEX-encoded vpdpbusd), `avx2` (maddubs + madd) or `scalar`; the same integers either way and the
  same float accumulation, so the same outputs bit for bit (kernels/cpu_isa.h). $AGENTRT_CPU_ISA
  (`avx2`) forces the AVX2 path on a CPU that has VNNI. The flags are the host kernel's; the path
  that runs is also capped by what the process can execute (kernels/cpu_kernels.py: isa_here).
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


def kernel_isa(info: CpuInfo, forced: str | None = None, runs: str | None = None) -> tuple[str, str]:
    """(ISA, reason) of the CPU kernels' integer dot products on this CPU (one of ISAS). forced: a
    value of $AGENTRT_CPU_ISA (None reads it; "" = unset): a lower path than the CPU has is taken, a
    higher one is a ValueError naming what is missing. runs: the best path the built kernels find
    executable in this process (kernels/cpu_kernels.py: executable_isa; CPUID and the OS's saved
    register state, as the instructions see them), which caps the flags' VNNI paths: /proc/cpuinfo is
    the host kernel's view and can list more (an emulator such as qemu-user shows the host's file)."""
    f = info.flags
    have = ["scalar"]  # the kernels' plain C++ path, built only for a CPU without AVX2 (-march=native)
    if {"avx2", "fma"} <= f:
        have = ["avx2"]
        ceiling = runs if runs in ("avx2", "avxvnni") else None  # below the flags' VNNI paths
        if "avx_vnni" in f and ceiling != "avx2":
            have.append("avxvnni")
        if {"avx512_vnni", "avx512vl"} <= f and ceiling is None:
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


def physical_cores() -> int:
    """Physical CPU cores (psutil, SMT siblings not counted); os.cpu_count() when unknown."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def onednn_usable() -> bool:
    """True when this torch build has oneDNN (mkldnn) and its packed linear ops
    (models/cpu_linear.py's OneDNNLinear)."""
    return bool(
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )
