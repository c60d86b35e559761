"""The CPU kernels' builds across -march values and CPUs: the build flags, a build below the CPU's
integer path, and the outputs of a build for a CPU without AVX-512 (on this CPU, and under an
emulator whose CPU has none) against the native build's, bit for bit."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from agentrt.runtime import hardware
from agentrt.runtime.kernels import cpu_kernels
from tests.support.kernels import needs_kernel, run_fresh


def test_the_build_flags_take_the_march_from_the_environment(monkeypatch, tmp_path):
    """$AGENTRT_CPU_MARCH replaces -march=native (`make test-avx2`), the cache key follows it, and a
    value that is not a plain -march name is refused before any compiler runs."""
    monkeypatch.delenv("AGENTRT_CPU_MARCH", raising=False)
    assert "-march=native" in cpu_kernels.flags()
    native = cpu_kernels.library_path(tmp_path)
    monkeypatch.setenv("AGENTRT_CPU_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in cpu_kernels.flags() and "-march=native" not in cpu_kernels.flags()
    assert cpu_kernels.library_path(tmp_path) != native
    for bad in ("native -O0", "-O0"):
        monkeypatch.setenv("AGENTRT_CPU_MARCH", bad)
        with pytest.raises(ValueError, match="AGENTRT_CPU_MARCH must be a -march name"):
            cpu_kernels.flags()


LOWER_MARCH = """
import sys, torch
from pathlib import Path
from agentrt.runtime.kernels import cpu_kernels as c
from agentrt.runtime.platform import choose_attention_backend
cache = Path(sys.argv[1])
print("load", c.load(cache))
print("auto", choose_attention_backend("auto", torch.device("cpu"), torch.float32, cache))
"""


@pytest.mark.slow  # a full build of the library (~30 s on 2 cores)
@needs_kernel
def test_a_build_without_the_cpus_integer_path_is_a_failure_not_a_crash(tmp_path):
    """Kernels built for a -march below the integer ISA the CPU selects (x86-64-v2: no AVX2 code)
    cannot run it: load names why and auto takes the torch path, where it raised before."""
    out = run_fresh(LOWER_MARCH, tmp_path, AGENTRT_CPU_MARCH="x86-64-v2", AGENTRT_CPU_ISA="")
    assert "load RuntimeError: set_cpu_isa: this CPU (or this build) cannot run" in out, out
    assert "(built with -march=x86-64-v2)" in out and "auto ('torch', " in out, out


ISA_OUTPUTS = """
import sys, torch
from pathlib import Path
from agentrt.runtime.backends.torch_attention import KernelRows
from agentrt.runtime.kernels import cpu_kernels as c
assert c.load(Path(sys.argv[1]) / "cache") is None, "kernels"
ops, gen, out = torch.ops.agentrt_cpu, torch.Generator().manual_seed(0), {}
# inputs from integers scaled by powers of 2: the same bits whatever torch's own vector path (randn's
# differs between CPUs)
def randn(*shape, generator):
    return torch.randint(-(1 << 20), 1 << 20, shape, generator=generator).float() / (1 << 19)
def rand(*shape, generator):
    return torch.randint(0, 1 << 20, shape, generator=generator).float() / (1 << 20)
for heads, kv_heads, dim in ((9, 3, 64), (8, 2, 128), (4, 4, 40)):
    k, v = randn(2600, kv_heads, dim, generator=gen), randn(2600, kv_heads, dim, generator=gen)
    for batch, length in ((1, 400), (3, 1300), (2, 2500)):
        q = randn(batch, heads, dim, generator=gen)
        slots = torch.randint(0, 2600, (batch, length), generator=gen)
        lens = torch.randint(1, length + 1, (batch,), generator=gen)
        lens[0] = length
        out[f"decode {heads} {kv_heads} {dim} {batch} {length}"] = c.decode_attention(q, k, v, slots, lens)
    q = randn(70, heads, dim, generator=gen)  # prefill: 70 rows of one sequence after 900 cached keys
    slots = torch.randint(0, 2600, (1, 970), generator=gen)
    rows = KernelRows(slots, torch.zeros(70, dtype=torch.int64), torch.arange(901, 971))
    out[f"prefill {heads} {kv_heads} {dim}"] = c.attention(q, k, v, rows)
x, w = randn(7, 576, generator=gen), randn(576, generator=gen)
out["rms_norm"] = ops.rms_norm(x, w, 1e-5)
out["add_rms_norm"] = torch.cat(ops.add_rms_norm(x, randn(7, 576, generator=gen), w, 1e-5))
out["rms_norm_tail"] = ops.rms_norm(randn(5, 100, generator=gen), randn(100, generator=gen), 1e-6)
out["silu_mul"] = ops.silu_mul(randn(7, 2 * 1536, generator=gen))
# rotary embedding + the KV write into float32 and int8 pools, then decode attention over the int8
# pool with sinks (cos and sin any values: the op does not need a rotation)
H, Hkv, D = 9, 3, 64
qkv, cos, sin = randn(5, (H + 2 * Hkv) * D, generator=gen), randn(5, 32, generator=gen), randn(5, 32, generator=gen)
kc, vc, k8, v8 = torch.zeros(40, Hkv, D), torch.zeros(40, Hkv, D), torch.zeros(40, Hkv, D, dtype=torch.int8), torch.zeros(40, Hkv, D, dtype=torch.int8)
ks, vs, slots = torch.zeros(40, Hkv), torch.zeros(40, Hkv), torch.tensor([3, 7, 11, 20, 39])
qr, kr = ops.rope_store(qkv, cos, sin, kc, vc, slots, H)
out["rope_store"] = torch.cat([qr.flatten(), kr.flatten(), kc.flatten(), vc.flatten()])
ops.rope_store(qkv, cos, sin, k8, v8, slots, H, ks, vs)
out["rope_store_int8"] = torch.cat([k8.flatten().float(), v8.flatten().float(), ks.flatten(), vs.flatten()])
out["decode_int8_sinks"] = ops.decode_attention(randn(2, H, D, generator=gen), k8, v8, torch.stack([slots, slots.flip(0)]), torch.tensor([5, 3]), 0.125, randn(H, generator=gen), ks, vs)
w8 = ops.pack_int8(torch.randint(-127, 128, (96, 576), dtype=torch.int8, generator=gen))
scales = rand(96, 18, generator=gen)
out["int8_linear"] = ops.int8_linear(x, w8, scales, None, 96)
w4 = torch.randint(0, 256, (96, 288), dtype=torch.uint8, generator=gen)
mins = randn(96, 18, generator=gen).half()
out["int4_linear"] = ops.int4_linear(x, w4, scales.half(), mins, None, 96)
out["int4_gemm"] = ops.int4_linear(randn(20, 576, generator=gen), w4, scales.half(), mins, None, 96)
torch.save(out, Path(sys.argv[1]) / "out.pt")
print("isa", c.active_isa())
"""


@pytest.mark.slow  # four full builds of the library (~25 s each on 2 cores)
@needs_kernel
def test_the_avx2_builds_give_the_bits_of_the_native_build(tmp_path):
    """The kernels built for CPUs without AVX-512 give the native build's outputs bit for bit:
    attention (decode and prefill rows; an int8 pool with sinks), the norms (a row of 100: a partial
    vector), silu_mul, rotary embedding with the KV write (float32 and int8 pools) and both
    integer matmuls (int4 on 7 rows and on 20, its GEMM path). x86-64-v3: 2 (row, head) pairs per K/V
    load where AVX-512 takes 3, 8-lane loops, the integer kernels' AVX2 path and GEMM; znver2 and
    haswell: the same code under another tuning (what -march=native gives on a Zen 2 or a Haswell),
    which must not change an order of arithmetic (it did, for RMSNorm's sum of squares)."""
    native = tmp_path / "native"
    run_fresh(ISA_OUTPUTS, native, AGENTRT_CPU_MARCH="")
    a = torch.load(native / "out.pt")
    assert len(a) == 22
    for march in ("x86-64-v3", "znver2", "haswell"):
        run_fresh(ISA_OUTPUTS, tmp_path / march, AGENTRT_CPU_MARCH=march, AGENTRT_CPU_ISA="avx2")
        b = torch.load(tmp_path / march / "out.pt")
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (march, name)


QEMU = shutil.which("qemu-x86_64")


@pytest.mark.slow  # two builds, and the emulated run: ~3 minutes on 2 cores
@needs_kernel
@pytest.mark.skipif(
    QEMU is None or platform.machine() != "x86_64",
    reason="no qemu-x86_64 (Debian's qemu-user) to emulate a CPU without AVX-512",
)
def test_a_cpu_that_shows_no_avx512_chooses_avx2_and_gives_the_native_bits(tmp_path):
    """Under qemu-user as an AMD EPYC Rome (Zen 2: CPUID shows AVX2 and FMA, no AVX-512 or VNNI, and
    the TCG translator has none, so an AVX-512 instruction left in a path is an illegal
    instruction), the kernels built for it (-march=znver2, what gcc's native gives there; gcc itself
    runs outside the emulator) choose the AVX2 path unforced, though /proc/cpuinfo is the host's and
    may list VNNI, and give the native build's outputs bit for bit; the host's own build (AVX-512
    here) loaded there is a load failure naming the instructions, not an illegal instruction."""
    native, zen2 = tmp_path / "native", tmp_path / "zen2"
    run_fresh(ISA_OUTPUTS, native, AGENTRT_CPU_MARCH="")
    out = run_fresh(
        ISA_OUTPUTS, zen2, runner=(QEMU, "-cpu", "EPYC-Rome-v2"), timeout=1800,
        AGENTRT_CPU_MARCH="znver2", AGENTRT_CPU_ISA="", OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert "isa avx2" in out, out
    # the host's native build, loaded under the emulator: a failure naming what it lacks, no crash
    out = run_fresh(
        LOWER_MARCH, native / "cache", runner=(QEMU, "-cpu", "EPYC-Rome-v2"), timeout=1800,
        AGENTRT_CPU_MARCH="", AGENTRT_CPU_ISA="", OMP_NUM_THREADS="1",
    )  # fmt: skip
    if "avx512f" in hardware.cpu_info().flags:
        assert "built for instructions this CPU does not show this process (avx512f" in out, out
        assert "auto ('torch', " in out, out
    a, b = torch.load(native / "out.pt"), torch.load(zen2 / "out.pt")
    assert a.keys() == b.keys() and len(a) == 22
    for name in a:
        assert torch.equal(a[name], b[name]), name
