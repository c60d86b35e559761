"""The machine (runtime/hardware.py) and its policies (runtime/platform.py) on a table of simulated CPUs: the run dtype `auto`
picks and the CPU kernels' instruction set, with the forcing switch."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime import hardware, platform


def cpuinfo(model: str, flags: str) -> str:
    return f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: fpu sse sse2 {flags}\n\nprocessor\t: 1\n"


ZEN1 = cpuinfo("AMD EPYC 7551 32-Core Processor", "avx avx2 fma f16c")
ZEN5 = cpuinfo(
    "AMD EPYC 9B45",
    "avx avx2 fma avx512f avx512vl avx512_vnni avx_vnni avx512_bf16",
)
SAPPHIRE_RAPIDS = cpuinfo(
    "Intel(R) Xeon(R) Platinum 8480+",
    "avx2 fma avx512f avx512vl avx512_vnni avx_vnni avx512_bf16 amx_bf16 amx_int8 amx_tile",
)
ALDER_LAKE = cpuinfo("12th Gen Intel(R) Core(TM) i7-12700", "avx2 fma avx_vnni")
CASCADE_LAKE = cpuinfo("Intel(R) Xeon(R) Gold 6230", "avx2 fma avx512f avx512vl avx512_vnni")
NO_AVX2_BF16 = cpuinfo("a CPU with bf16 and no AVX2", "avx512_bf16")
OLD = cpuinfo("Intel(R) Xeon(R) E5-2670", "avx")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_forced_isa(monkeypatch):
    """The simulated CPUs are judged unforced (a run under AGENTRT_CPU_ISA=avx2 forces the real one)."""
    monkeypatch.delenv("AGENTRT_CPU_ISA", raising=False)


@pytest.mark.parametrize(
    ("text", "dtype", "isa"),
    [
        (ZEN1, torch.float32, "avx2"),
        (ZEN5, torch.float32, "avx512vnni"),  # native bf16, but the kernel path is faster and invariant
        (SAPPHIRE_RAPIDS, torch.float32, "avx512vnni"),
        (ALDER_LAKE, torch.float32, "avxvnni"),
        (CASCADE_LAKE, torch.float32, "avx512vnni"),
        (NO_AVX2_BF16, torch.bfloat16, "scalar"),
        (OLD, torch.float32, "scalar"),
        ("", torch.float32, "scalar"),  # /proc/cpuinfo unreadable
    ],
)
def test_auto_dtype_and_kernel_isa_on_simulated_cpus(text, dtype, isa):
    chosen, reason = platform.choose_dtype(CPU, "auto", cpuinfo=text, capability="DEFAULT")
    assert chosen == dtype, reason
    assert reason.startswith("auto: ")
    assert hardware.kernel_isa(hardware.cpu_info(text), forced="") == (isa, "auto: the CPU's best")
    if dtype == torch.float32 and isa != "scalar":
        assert f"the CPU kernels' {isa} path" in reason


def test_explicit_and_cuda_dtypes_and_bad_names():
    assert platform.choose_dtype(CPU, "bfloat16", cpuinfo=ZEN1) == (torch.bfloat16, "requested")
    assert platform.choose_dtype(torch.device("cuda"), "auto", cpuinfo=ZEN5) == (torch.bfloat16, "auto: CUDA")
    with pytest.raises(ValueError, match="dtype 'fp8' is not one of auto"):
        platform.choose_dtype(CPU, "fp8")
    # torch's capability alone also counts as native bf16 where there is no AVX2
    assert platform.choose_dtype(CPU, "auto", cpuinfo=OLD, capability="AVX512_BF16")[0] == torch.bfloat16
    assert hardware.cpu_native_bf16(SAPPHIRE_RAPIDS, "AVX512") == (True, "CPU flags amx_bf16, avx512_bf16")
    assert hardware.cpu_native_bf16(ZEN1, "AVX2") == (
        False,
        "no avx512_bf16/amx_bf16 (torch CPU capability AVX2)",
    )


def test_forcing_a_lower_isa_and_refusing_a_missing_one(monkeypatch):
    zen5 = hardware.cpu_info(ZEN5)
    assert hardware.kernel_isa(zen5, forced="avx2") == ("avx2", "AGENTRT_CPU_ISA")
    monkeypatch.setenv("AGENTRT_CPU_ISA", "avxvnni")
    assert hardware.kernel_isa(zen5) == ("avxvnni", "AGENTRT_CPU_ISA")
    assert (
        "the CPU kernels' avxvnni path" in platform.choose_dtype(CPU, "auto", cpuinfo=ZEN5)[1]
    )  # the one that runs
    with pytest.raises(ValueError, match="AGENTRT_CPU_ISA=avx512vnni is not available on this CPU"):
        hardware.kernel_isa(hardware.cpu_info(ZEN1), forced="avx512vnni")
    with pytest.raises(ValueError, match="AGENTRT_CPU_ISA must be one of"):
        hardware.kernel_isa(zen5, forced="sse4")
    with pytest.raises(
        ValueError, match=r"AGENTRT_CPU_ISA=scalar is not available on this CPU \(available: avx2, avxvnni"
    ):
        hardware.kernel_isa(zen5, forced="scalar")  # the plain path is built only without AVX2
    assert hardware.kernel_isa(hardware.cpu_info(OLD), forced="scalar") == ("scalar", "AGENTRT_CPU_ISA")


@pytest.mark.parametrize(
    ("text", "runs", "isa", "available"),
    [
        (ZEN5, "avx2", "avx2", ["avx2"]),  # qemu-user: the host's /proc/cpuinfo, an AVX2 CPUID
        (ZEN5, "avxvnni", "avxvnni", ["avx2", "avxvnni"]),
        (ZEN5, "avx512vnni", "avx512vnni", ["avx2", "avxvnni", "avx512vnni"]),
        (ZEN1, "avx512vnni", "avx2", ["avx2"]),  # the flags' choice when they say less
        (ZEN5, "scalar", "avx512vnni", ["avx2", "avxvnni", "avx512vnni"]),  # a build without AVX2: load fails
    ],
)
def test_what_executes_caps_the_flags_vnni_paths(text, runs, isa, available):
    info = hardware.cpu_info(text)
    assert hardware.kernel_isa(info, forced="", runs=runs)[0] == isa
    for name in ("avx2", "avxvnni", "avx512vnni"):
        if name in available:
            assert hardware.kernel_isa(info, forced=name, runs=runs) == (name, "AGENTRT_CPU_ISA")
        else:
            with pytest.raises(ValueError, match=f"AGENTRT_CPU_ISA={name} is not available on this CPU"):
                hardware.kernel_isa(info, forced=name, runs=runs)


def test_cpu_info_reads_the_first_processor_and_describes_it():
    info = hardware.cpu_info(ZEN5)
    assert info.model == "AMD EPYC 9B45"
    assert "avx512_bf16" in info.flags
    assert info.describe() == "AMD EPYC 9B45 (avx2 avx512_bf16 avx512_vnni avx512f avx512vl avx_vnni fma)"
    here = hardware.cpu_info()  # this machine: parses without error
    assert isinstance(here.flags, frozenset)


def test_deterministic_problem_names_what_is_not_invariant():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert platform.deterministic_problem(cpu, torch.float32, "cpu", False, "int4") is None
    assert platform.deterministic_problem(cuda, torch.bfloat16, "triton", False, "none") is None
    assert "only float32" in platform.deterministic_problem(cpu, torch.bfloat16, "torch", False, "none")
    assert "attention backend torch" in platform.deterministic_problem(
        cpu, torch.float32, "torch", False, "none"
    )
    assert "--compile" in platform.deterministic_problem(cpu, torch.float32, "cpu", True, "none")
    assert "torchao" in platform.deterministic_problem(cuda, torch.bfloat16, "triton", False, "int8")
    assert "attention backend torch" in platform.deterministic_problem(
        cuda, torch.bfloat16, "torch", False, "none"
    )
