"""The CPU decode-attention kernel (cpu_decode_attention.cpp): built with the system C++ compiler
on first use, cached, loaded as a torch op (`torch.ops.agentrt_cpu.decode_attention`).

Why: the torch path gathers every decoding sequence's K and V rows into a padded copy and then
runs SDPA over it, reading the context three times; at batch 16 and 400 tokens of context that was
43 + 41 ms of a 222 ms step of the default model (2 threads). The kernel reads each K and V row of
the pool once, in place (numbers: docs/benchmarks.md).

Built with `$CXX` (else `c++`/`g++`) `-O3 -march=native -fopenmp` and reassociating math flags
(never -ffast-math: see FLAGS) against torch's
headers and libraries (the same compiler AOTInductor needs) into `<cache_dir>/cpu-kernels/<key>/`,
key = sha256 of the source, the flags, torch's version and this CPU's flags; a concurrent build by
another process is harmless (each writes a temporary file and renames it); a cached library that
fails to load is rebuilt once. Any other failure (no compiler, a build error) is logged once and
`load` returns it: the auto attention backend then takes the torch path and says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode_attention.cpp")
# -fopenmp: at::parallel_for is inline OpenMP code (without it the kernel ran on one thread);
# libgomp.so.1 resolves to the copy torch has already loaded (same soname): one thread pool.
# Not -ffast-math: linking a shared library with it pulls in crtfastmath.o, which sets flush-to-zero
# for the whole process when the library loads (hypothesis noticed: subnormal floats vanished).
# The reassociation flags alone let the reductions vectorize.
FLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math",
    "-fno-signed-zeros", "-fopenmp", "-std=c++17", "-shared", "-fPIC",
)  # fmt: skip
_lock = threading.Lock()
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
    """Where the built kernel for this source, torch and CPU lives under cache_dir."""
    ident = f"{SOURCE.read_text()}\n{torch.__version__}\n{_cpu_flags()}\n{FLAGS}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:20]
    return Path(cache_dir) / "cpu-kernels" / key / "agentrt_cpu_attention.so"


def _build(target: Path) -> None:
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [cxx, *FLAGS]
    cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [str(SOURCE)]
    libs = cpp_extension.library_paths()
    cmd += [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs] + ["-lc10", "-ltorch_cpu"]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([*cmd, "-o", tmp], check=False, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(cache_dir: Path) -> str | None:
    """Build (once per key) and load the kernel; None when `torch.ops.agentrt_cpu.decode_attention`
    is ready, else why it is not (logged once per process)."""
    target = library_path(cache_dir)
    with _lock:
        if str(target) in _loaded:
            return _loaded[str(target)]
        failure = None
        try:
            if hasattr(torch.ops.agentrt_cpu, "decode_attention"):
                pass  # loaded already (another cache dir, same source)
            else:
                if target.is_file():
                    try:
                        torch.ops.load_library(str(target))
                    except OSError as e:  # a damaged cache entry: build it again
                        logger.warning("rebuilding the CPU decode-attention kernel (%s)", e)
                        target.unlink()
                if not target.is_file():
                    logger.info("building the CPU decode-attention kernel -> %s", target)
                    _build(target)
                    torch.ops.load_library(str(target))
        except Exception as e:  # noqa: BLE001 - any failure means the torch path
            failure = f"{type(e).__name__}: {e}"
            logger.warning("the CPU decode-attention kernel is unavailable: %s", failure)
        _loaded[str(target)] = failure
        return failure


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """q [B, H, D] float32, caches [S, Hkv, D] float32, slots [B, L] int64 (padded), lens [B] int64
    -> out [B, H, D] float32: softmax(q k^T / sqrt(D)) v over each sequence's first lens[b] slots
    (grouped-query: query head h reads KV head h // (H / Hkv)). Raises RuntimeError on bad shapes,
    dtypes, a slot outside the pool or a length outside [1, L]."""
    return torch.ops.agentrt_cpu.decode_attention(
        q.contiguous(), k_cache, v_cache, slots, lens, q.shape[-1] ** -0.5
    )
