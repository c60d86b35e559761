"""The CPU kernels: attention over the KV pool for decode and prefill alike (cpu_decode_attention.cpp),
the fused element-wise ops of a decoder layer (cpu_layer_ops.cpp: RMSNorm, residual add + RMSNorm,
rotary embedding + KV write, SiLU-and-mul), the int8 x int8 and int4 x int8 matmuls of
`--quantization int8/int4` at float32 (cpu_int8_linear.cpp, cpu_int4_linear.cpp; AVX2 or VNNI, chosen
at load: cpu_isa.h) and a decode step's whole decoder stack in one op (cpu_decode_layers.cpp), one
library built with the system C++ compiler on first use, cached, loaded as torch ops
(`torch.ops.agentrt_cpu.*`).

Why the attention kernel: the torch path gathers every sequence's K and V rows into a padded copy and
runs SDPA over it, reading the context three times, and SDPA's blocking depends on the batch, so a
row's output depended on what it was batched with and on whether its prefix came from the cache. The
kernel reads each K and V row of the pool in place and computes every query row in an order fixed by
that row alone (batch-invariant). Why the layer ops: a layer written in PyTorch makes ~70 op calls,
each ~5-15 us of dispatch on this CPU, which at batch 1 cost more than the matmuls; fused, a layer
makes ~10 (numbers: docs/benchmarks.md).

Built with `$CXX` (else `c++`/`g++`) `-O3 -march=native -fopenmp` and reassociating math flags
(never -ffast-math: see FLAGS; `$AGENTRT_CPU_MARCH` replaces `native`, e.g. `x86-64-v3` builds the
AVX2-only code a CPU without AVX-512 runs: `make test-avx2`) against torch's
headers and libraries (the same compiler AOTInductor needs) into `<cache_dir>/cpu-kernels/<key>/`,
key = sha256 of the sources, the flags, torch's version and this CPU's flags; a concurrent build by
another process is harmless (each writes a temporary file and renames it); a cached library that
fails to load is rebuilt once. Any other failure (no compiler, a build error) is logged once and
`load` returns it: the auto attention backend then takes the torch path and says why.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from agentrt.runtime.forward import LayerOps
from agentrt.runtime.hardware import cpu_info, kernel_isa
from agentrt.runtime.kv_cache import QuantizedKV

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(n)
    for n in (
        "cpu_decode_attention.cpp",
        "cpu_layer_ops.cpp",
        "cpu_int8_linear.cpp",
        "cpu_int4_linear.cpp",
        "cpu_decode_layers.cpp",
    )
)
HEADERS = tuple(
    Path(__file__).with_name(n) for n in ("cpu_kernels.h", "cpu_isa.h", "cpu_vec8.h")
)  # shared declarations
OPS = (
    "attention", "decode_attention", "rms_norm", "add_rms_norm", "rope_store", "silu_mul", "int8_linear", "pack_int8",
    "int4_linear", "decode_layers", "set_cpu_isa", "get_cpu_isa", "best_cpu_isa",
)  # fmt: skip
# arguments an op's schema must name (a library built before them registers the op without them)
OP_ARGS = {
    "attention": ("sinks", "k_scale"),
    "decode_attention": ("sinks", "k_scale"),
    "rope_store": ("k_scale",),
    "decode_layers": ("k_scales",),
}
# -fopenmp: at::parallel_for is inline OpenMP code (without it the kernel ran on one thread);
# libgomp.so.1 resolves to the copy torch has already loaded (same soname): one thread pool.
# Not -ffast-math: linking a shared library with it pulls in crtfastmath.o, which sets flush-to-zero
# for the whole process when the library loads (hypothesis noticed: subnormal floats vanished).
# The reassociation flags alone let the reductions vectorize.
# -ffp-contract=off: a multiply and an add fuse only where the source says so (an FMA intrinsic,
# std::fma). gcc's own contraction follows the -march tuning (znver2 fused less than native or
# x86-64-v3), so another CPU's build gave other bits; for the same reason every float reduction is
# written out in its order (tests/runtime/test_cpu_builds.py compares builds for other CPUs).
FLAGS = (
    "-O3", "-march=", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
    "-fno-signed-zeros", "-fopenmp", "-std=c++17", "-shared", "-fPIC",
)  # fmt: skip
_lock = threading.Lock()
_MARCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def march() -> str:
    """The kernels' -march: $AGENTRT_CPU_MARCH (unset or empty: native); ValueError for a value that
    is not a plain name."""
    name = os.environ.get("AGENTRT_CPU_MARCH") or "native"
    if not _MARCH.fullmatch(name):
        raise ValueError(f"AGENTRT_CPU_MARCH must be a -march name such as x86-64-v3, got {name!r}")
    return name


def flags() -> tuple[str, ...]:
    """FLAGS with -march= march()."""
    return tuple(f + march() if f == "-march=" else f for f in FLAGS)


_loaded: dict[str, str | None] = {}  # library path -> None when loaded, else the failure


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(cache_dir: Path) -> Path:
    """Where the built kernels for these sources, torch and CPU live under cache_dir."""
    sources = "\n".join(p.read_text() for p in (*SOURCES, *HEADERS))
    ident = f"{sources}\n{torch.__version__}\n{_cpu_flags()}\n{flags()}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    return Path(cache_dir) / "cpu-kernels" / key / "agentrt_cpu_kernels.so"


def _build(target: Path) -> None:
    """Compile the sources to objects in parallel (one compiler process each: ~55 s serially on 2
    cores), link them into `target`; RuntimeError with the compiler's message on failure."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    build_flags = flags()
    compile_flags = [f for f in build_flags if f != "-shared"]
    compile_flags += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]
    compile_flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    link = [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs] + ["-lc10", "-ltorch_cpu"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as work:
        objects = [Path(work) / f"{src.stem}.o" for src in SOURCES]
        procs = [
            subprocess.Popen(
                [cxx, *compile_flags, "-c", str(src), "-o", str(obj)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for src, obj in zip(SOURCES, objects)
        ]
        for proc, src in zip(procs, SOURCES):
            _, err = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"{cxx} failed on {src.name} ({proc.returncode}): {err.strip()[-2000:]}")
        tmp = Path(work) / target.name
        proc = subprocess.run(
            [cxx, *build_flags, *map(str, objects), *link, "-o", str(tmp)],
            check=False,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed to link ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)


def load(cache_dir: Path) -> str | None:
    """Build (once per key) and load the kernels; None when the ops `torch.ops.agentrt_cpu.*` (OPS)
    are ready, else why they are not (logged once per process). Selects the integer kernels' ISA
    (hardware.kernel_isa: $AGENTRT_CPU_ISA, else the CPU's best) on every call; raises ValueError
    for an AGENTRT_CPU_ISA this CPU cannot run or an AGENTRT_CPU_MARCH that is not a name. A build for
    an AGENTRT_CPU_MARCH below that ISA (e.g. x86-64-v2: no AVX2 code) is a failure, not the kernels.
    AGENTRT_CPU_MARCH decides the compiled code only; the integer kernels' ISA is AGENTRT_CPU_ISA's."""
    kernel_isa(cpu_info())  # a bad $AGENTRT_CPU_ISA fails before any build
    failure = _load(cache_dir)
    if failure is None:
        try:
            select_isa(isa_here())
        except RuntimeError as e:  # this build has no code for the ISA, or cannot run here at all
            failure = f"RuntimeError: {e} (built with -march={march()})"
            _warn_once("the CPU kernels are unavailable: %s", failure)
    return failure


def executable_isa() -> str:
    """The best integer-kernel path the loaded library can run in this process: its build's code and
    the CPU as CPUID and the OS's saved register state show it (__builtin_cpu_supports), which an
    emulator can make lower than /proc/cpuinfo's flags. RuntimeError when the library's own -march
    uses instructions this process cannot run (a build for the host, loaded under an emulator)."""
    return torch.ops.agentrt_cpu.best_cpu_isa()


def isa_here(forced: str | None = None) -> str:
    """hardware.kernel_isa for this CPU, capped by executable_isa (the kernels must be loaded); warns
    once when the cap lowers the flags' choice. Raises ValueError as kernel_isa does."""
    info = cpu_info()
    runs = executable_isa()
    isa, flagged = kernel_isa(info, forced, runs)[0], kernel_isa(info, forced)[0]
    if flagged != isa:
        _warn_once(
            "/proc/cpuinfo lists the %s instructions but this process cannot run them (CPUID: %s at "
            "best): the integer kernels take %s", flagged, runs, isa,
        )  # fmt: skip
    return isa


@functools.cache
def _warn_once(message: str, *args: str) -> None:
    logger.warning(message, *args)


def select_isa(isa: str) -> str:
    """Make `isa` (hardware.ISAS) the integer kernels' path, after checking on random inputs that it
    gives the AVX2 path's outputs bit for bit (the VNNI paths compute the same int32 sums); a path
    that does not is refused with a warning and AVX2 kept. Returns the active ISA. The kernels must
    be loaded."""
    ops = torch.ops.agentrt_cpu
    active = ops.set_cpu_isa(isa)
    if active in ("avx2", "scalar"):
        return active
    gen = torch.Generator().manual_seed(0)
    # 9 blocks: the VNNI paths' steps of 2 blocks and a block after them; 5 rows: 4 together, then 1
    x = torch.randn(5, 288, generator=gen)
    w8 = ops.pack_int8(torch.randint(-127, 128, (12, 288), dtype=torch.int8, generator=gen))
    s8 = torch.rand(12, 9, generator=gen)
    w4 = torch.randint(0, 256, (12, 144), dtype=torch.uint8, generator=gen)
    m4 = torch.randn(12, 9, generator=gen)

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        return ops.int8_linear(x, w8, s8, None, 10), ops.int4_linear(x, w4, s8.half(), m4.half(), None, 10)

    fast = outputs()
    ops.set_cpu_isa("avx2")
    reference = outputs()
    if all(torch.equal(a, b) for a, b in zip(fast, reference)):
        return ops.set_cpu_isa(isa)
    logger.warning("the CPU kernels' %s path disagrees with AVX2 on a self-check: using AVX2", isa)
    return "avx2"


def active_isa() -> str:
    """The integer kernels' active ISA (the kernels must be loaded)."""
    return torch.ops.agentrt_cpu.get_cpu_isa()


def _registered(op: str) -> bool:
    """Whether torch.ops.agentrt_cpu registers `op` with every argument OP_ARGS names for it."""
    if not hasattr(torch.ops.agentrt_cpu, op):
        return False
    names = {a.name for a in getattr(torch.ops.agentrt_cpu, op).default._schema.arguments}
    return all(a in names for a in OP_ARGS.get(op, ()))


def _load(cache_dir: Path) -> str | None:
    target = library_path(cache_dir)
    with _lock:
        if str(target) in _loaded:
            return _loaded[str(target)]
        failure = None
        try:
            if all(_registered(op) for op in OPS):
                pass  # loaded already (another cache dir, same source)
            else:
                if target.is_file():
                    try:
                        torch.ops.load_library(str(target))
                    except OSError as e:  # a damaged cache entry: build it again
                        logger.warning("rebuilding the CPU kernels (%s)", e)
                        target.unlink()
                if not target.is_file():
                    logger.info("building the CPU kernels -> %s", target)
                    _build(target)
                    torch.ops.load_library(str(target))
                missing = [op for op in OPS if not _registered(op)]
                if missing:  # a library that loads but is not ours (or an older build)
                    raise RuntimeError(
                        f"{target} does not register {', '.join(missing)} (or an older schema): delete it to rebuild"
                    )
        except Exception as e:  # noqa: BLE001 - any failure means the torch path
            failure = f"{type(e).__name__}: {e}"
            logger.warning("the CPU kernels are unavailable: %s", failure)
        _loaded[str(target)] = failure
        return failure


def _pool(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(K data, V data, K scales, V scales) of one layer's caches: float32 tensors (no scales) or an
    int8 pool's QuantizedKV pair (kv_cache.py). Raises ValueError when one is quantized and the other not."""
    kq, vq = isinstance(k_cache, QuantizedKV), isinstance(v_cache, QuantizedKV)
    if kq != vq:
        raise ValueError("the K and V caches must both be int8 (QuantizedKV) or both plain tensors")
    if kq:
        return k_cache.data, v_cache.data, k_cache.scale, v_cache.scale
    return k_cache, v_cache, None, None


def decode_attention(
    q: torch.Tensor,
    k_cache,
    v_cache,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D] float32, caches [S, Hkv, D] float32 (or an int8 pool's kv_cache.QuantizedKV: int8
    data, [S, Hkv] float32 scales, read in place), slots [B, L] int64 (padded), lens [B] int64
    -> out [B, H, D] float32: softmax(q k^T * scale) v over each sequence's first lens[b] slots
    (grouped-query: query head h reads KV head h // (H / Hkv)); D a multiple of 8, at most 256.

    scale: the softmax scale, None for D ** -0.5. sinks: None, or [H] float32 (contiguous, CPU)
    learned attention-sink logits (gpt-oss; transformers' GptOssAttention eager path): head h's
    softmax gets one more logit sinks[h] with no value row, so the weights of the real keys sum to
    less than 1 (out = sum_l exp(s_l - m) v_l / (sum_l exp(s_l - m) + exp(sinks[h] - m)),
    m = max(max_l s_l, sinks[h])). Raises RuntimeError on bad shapes, dtypes, a slot outside the
    pool, a length outside [1, L], or sinks of the wrong dtype, shape or layout."""
    k, v, ks, vs = _pool(k_cache, v_cache)
    return torch.ops.agentrt_cpu.decode_attention(
        q.contiguous(),
        k,
        v,
        slots,
        lens,
        max(q.shape[-1], 1) ** -0.5 if scale is None else scale,
        sinks,
        ks,
        vs,
    )


def attention(
    q: torch.Tensor,
    k_cache,
    v_cache,
    rows,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] float32, caches [S, Hkv, D] float32 (or an int8 pool's kv_cache.QuantizedKV, read in
    place, the scales applied on load), rows: attention.KernelRows (slots [R, L],
    seq [T], lens [T] int64) -> out [T, H, D] float32: for each new token t, softmax(q k^T * scale) v
    over the first lens[t] slots of its slot row, in an order that depends on that token alone
    (batch-invariant: kernels/cpu_decode_attention.cpp); D a multiple of 8, at most 256.

    scale: the softmax scale, None for D ** -0.5. sinks: None, or [H] float32 (contiguous, CPU)
    attention-sink logits, one per query head, as in `decode_attention`. Raises RuntimeError on bad
    shapes, dtypes, a slot outside the pool, a length outside [1, L], or sinks of the wrong dtype,
    shape or layout."""
    k, v, ks, vs = _pool(k_cache, v_cache)
    return torch.ops.agentrt_cpu.attention(
        q.contiguous(),
        k,
        v,
        rows.slots,
        rows.seq,
        rows.lens,
        max(q.shape[-1], 1) ** -0.5 if scale is None else scale,
        sinks,
        ks,
        vs,
    )


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache,
    v_cache,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 Hkv) D] float32, cos / sin [T, D/2] float32, caches [S, Hkv, D] float32 or an int8
    pool's QuantizedKV pair, slot_mapping [T] int64 -> (q [T, H, D], k [T, Hkv, D]) rotated; k and v
    are written to the pool (quantized per token and KV head into an int8 pool, bit for bit as
    kv_cache.quantize_kv on the same float32 rows). RuntimeError on bad shapes or dtypes
    (kernels/cpu_layer_ops.cpp)."""
    k, v, ks, vs = _pool(k_cache, v_cache)
    return torch.ops.agentrt_cpu.rope_store(qkv, cos, sin, k, v, slot_mapping, num_heads, ks, vs)


def stack_caches(caches) -> bool:
    """Whether `decode_layers` can take these per-layer caches: all float32 tensors, all float16
    tensors or all int8 pools."""
    return all(isinstance(c, QuantizedKV) for c in caches) or any(
        all(isinstance(c, torch.Tensor) and c.dtype == dtype for c in caches)
        for dtype in (torch.float32, torch.float16)
    )


def decode_layers(x: torch.Tensor, weights, k_caches, v_caches, *args) -> torch.Tensor:
    """`torch.ops.agentrt_cpu.decode_layers` (kernels/cpu_decode_layers.cpp: its arguments after the
    caches, in order) over per-layer caches that are float32 tensors or int8 pools (QuantizedKV: their
    data and scale lists go to the op separately)."""
    if k_caches and isinstance(k_caches[0], QuantizedKV):
        return torch.ops.agentrt_cpu.decode_layers(
            x,
            weights,
            [c.data for c in k_caches],
            [c.data for c in v_caches],
            *args,
            [c.scale for c in k_caches],
            [c.scale for c in v_caches],
        )
    return torch.ops.agentrt_cpu.decode_layers(x, weights, k_caches, v_caches, *args, [], [])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_last: bool = False) -> torch.Tensor:
    return torch.ops.agentrt_cpu.rms_norm(x.contiguous(), weight, eps)  # float32: cast_last changes nothing


def _add_rms_norm(x, residual, weight, eps, cast_last=False):
    if residual is None:
        return x, torch.ops.agentrt_cpu.rms_norm(x, weight, eps)
    return torch.ops.agentrt_cpu.add_rms_norm(residual, x, weight, eps)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return torch.ops.agentrt_cpu.silu_mul(gate_up)


# the element-wise ops of kernels/cpu_layer_ops.cpp (float32 on the CPU, the library loaded)
CPU_OPS = LayerOps("C++ layer ops", _rms_norm, _add_rms_norm, _silu_mul)
