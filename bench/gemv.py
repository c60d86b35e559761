"""Decode-sized int8 / int4 matmuls of the CPU kernels (kernels/cpu_int8_linear.cpp,
cpu_int4_linear.cpp) against the machine's read bandwidth: a baseline revision's kernels and the
working tree's side by side, in one process, their calls interleaved.

    python bench/gemv.py                          # HEAD's kernels vs the working tree's
    python bench/gemv.py --baseline REV --calls 60 --isa avx512vnni avx2

The baseline's sources are built with their op namespace renamed (`torch.ops.agentrt_cpu_base`), so
both libraries load in one process; each measurement alternates the variants call by call (the
machine is shared: a slow spell hits all alike), with a third: `read`, torch's amax over the same
packed weight (a plain read of its bytes at memory speed: the bound a call can reach, measured at the
same moments). The weights of a shape are repeated in copies that together exceed the L3 cache
(--working-set MB), each call taking the next copy, so every call reads its weights from memory, as a
decode step does (the default model's weights do not fit in L3). GB/s: the packed weights, scales
and mins one call reads (read: the packed weights) over the median call. Also printed: the read
bandwidth of a sum over a 1 GB float32 tensor (best of 3, before each shape). A small call also pays
the Python dispatch around it (the `overhead` row: a 4 x 32 call; decode_layers calls the kernels
from C++).

Shapes: Gemma 3's LM head (262144 x 640), SmolLM2's LM head (49152 x 576) and MLP (1536 x 576 and
576 x 1536), batch 1 and 4; threads: --threads (2, as the engine on this machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from agentrt.runtime import config
from agentrt.runtime.kernels import cpu_kernels
from agentrt.runtime.models.quant import group_major

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "gemma-head": (262144, 640),
    "smol-head": (49152, 576),
    "smol-up": (1536, 576),
    "smol-down": (576, 1536),
}
BASE_NS = "agentrt_cpu_base"


def read_bandwidth() -> float:
    """Bytes per second of a sum over a 1 GB float32 tensor (read only; best of 3)."""
    x = torch.ones(256 << 20, dtype=torch.float32)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def load_baseline(rev: str, cache_dir: Path):
    """The CPU kernels of git revision `rev`, built (cached like the working tree's) with their
    namespace renamed BASE_NS so that they load beside the working tree's: torch.ops.agentrt_cpu_base."""
    work = Path(tempfile.mkdtemp(prefix="agentrt-kernels-"))
    for p in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
        rel = p.relative_to(ROOT)
        text = subprocess.run(
            ["git", "show", f"{rev}:{rel}"], cwd=ROOT, check=True, capture_output=True, text=True
        )
        (work / p.name).write_text(text.stdout.replace("agentrt_cpu", BASE_NS))
    saved = cpu_kernels.SOURCES, cpu_kernels.HEADERS
    cpu_kernels.SOURCES = tuple(work / p.name for p in saved[0])
    cpu_kernels.HEADERS = tuple(work / p.name for p in saved[1])
    try:
        target = cpu_kernels.library_path(cache_dir)
        if not target.is_file():
            print(f"building {rev}'s kernels -> {target}", flush=True)
            cpu_kernels._build(target)
    finally:
        cpu_kernels.SOURCES, cpu_kernels.HEADERS = saved
    torch.ops.load_library(str(target))
    return getattr(torch.ops, BASE_NS)


def weights(fmt: str, n: int, k: int, gen) -> tuple[tuple, int]:
    """One copy of a packed weight: (the call's arguments after x, bytes a call reads)."""
    ops = torch.ops.agentrt_cpu
    n4 = -(-n // 4) * 4
    scales = group_major(torch.rand(n, k // 32, generator=gen) / 100)
    if fmt == "int8":
        w = ops.pack_int8(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen))
        return (w, scales, None, n), w.numel() + scales.numel() * 4
    w = torch.randint(0, 256, (n4, k // 2), dtype=torch.uint8, generator=gen)
    mins = group_major(torch.randn(n, k // 32, generator=gen) / 10).half()
    return (w, scales.half(), mins, None, n), w.numel() + 4 * scales.numel()  # float16 scales and mins


def read(x: torch.Tensor, w: torch.Tensor, *rest) -> torch.Tensor:
    """A plain read of the packed weight (torch's amax: vectorized, memory speed)."""
    return w.amax()


def time_interleaved(fns: list, copies: list, x, calls: int) -> list[list[float]]:
    """Seconds of each call per variant, the variants alternating call by call, each call on the next
    weight copy (so that no call finds the weights another one just read in the cache)."""
    times: list[list[float]] = [[] for _ in fns]
    c = 0
    for i in range(calls + 2):
        for j in range(len(fns)) if i % 2 else reversed(range(len(fns))):
            args = copies[c % len(copies)]
            c += 1
            t = time.perf_counter()
            fns[j](x, *args)
            if i >= 2:
                times[j].append(time.perf_counter() - t)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default="HEAD", help="git revision of the baseline kernels ('' = none)")
    p.add_argument(
        "--calls", type=int, default=40, help="calls per variant and measurement (at least one per copy)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", nargs="+", default=["avx512vnni", "avx2"])
    p.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batch", nargs="+", type=int, default=[1, 4])
    p.add_argument("--working-set", type=int, default=96, help="MB of weight copies per shape (> L3)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    failure = cpu_kernels.load(config.default_cache_dir())
    if failure:
        raise SystemExit(failure)
    variants = {"current": torch.ops.agentrt_cpu}
    if args.baseline:
        variants = {
            f"base {args.baseline}": load_baseline(args.baseline, config.default_cache_dir()),
            **variants,
        }
    names = list(variants)
    flags = cpu_kernels._cpu_flags().split()
    shown = [f for f in flags if f.startswith(("avx512", "avx_vnni", "amx")) or f in ("avx2", "fma")]
    print(f"CPU flags: {' '.join(shown)}; threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}")
    gen = torch.Generator().manual_seed(0)
    reads, rows = [], []
    for isa in args.isa:
        for ns in variants.values():
            ns.set_cpu_isa(isa)
        for fmt in args.formats:
            fns = [read] + [getattr(ns, f"{fmt}_linear") for ns in variants.values()]
            tiny = weights(fmt, 4, 32, gen)[0]
            times = time_interleaved(fns, [tiny], torch.randn(1, 32), 200)
            rows.append((isa, fmt, "overhead", 1, times, 0, 0))
            for name in args.shapes:
                n, k = SHAPES[name]
                first, nbytes = weights(fmt, n, k, gen)
                extra = args.working_set * 2**20 // nbytes
                copies = [first] + [weights(fmt, n, k, gen)[0] for _ in range(extra)]
                reads.append(read_bandwidth())
                for batch in args.batch:
                    x = torch.randn(batch, k, generator=gen)
                    times = time_interleaved(fns, copies, x, max(args.calls, len(copies)))
                    rows.append((isa, fmt, name, batch, times, nbytes, first[0].numel()))
                    print(
                        f"{isa} {fmt} {name} b{batch}: "
                        + ", ".join(
                            f"{v} {statistics.median(t) * 1e3:.3f} ms"
                            for v, t in zip(["read", *names], times)
                        ),
                        flush=True,
                    )
                del copies, first
    print(
        f"\nread bandwidth (1 GB float32 sum, before each shape): median {statistics.median(reads) / 1e9:.1f} GB/s "
        f"(min {min(reads) / 1e9:.1f}, max {max(reads) / 1e9:.1f}); load {os.getloadavg()[0]:.2f}"
    )
    print(
        "(ms: the median call; GB/s: bytes read over it; read: amax of the same weights, between the calls)"
    )
    print(
        "| isa | format | shape | batch | read GB/s | "
        + " | ".join(f"{v} ms | GB/s" for v in names)
        + " | speed-up | current / read |"
    )
    print("| --- | --- | --- | --- | --- | " + " | ".join("--- | ---" for _ in names) + " | --- | --- |")
    for isa, fmt, name, batch, times, nbytes, wbytes in rows:
        med = [statistics.median(t) for t in times]
        cells = [f"{m * 1e3:.3f} | {nbytes / m / 1e9:.1f}" for m in med[1:]]
        ratio = f"{nbytes / med[-1] / (wbytes / med[0]):.2f}" if nbytes else "-"
        bound = f"{wbytes / med[0] / 1e9:.1f}" if nbytes else "-"
        print(
            f"| {isa} | {fmt} | {name} | {batch} | {bound} | {' | '.join(cells)} "
            f"| {med[1] / med[-1]:.2f}x | {ratio} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
