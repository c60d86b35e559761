"""int8 KV cache: accuracy against a float32 pool, where the error comes from, and the C++ attention
kernel's speed on each pool (issue 38's tables in docs/benchmarks.md; issue 51 item 8).

Part `accuracy`: the default model (SmolLM2-135M), 4 chat prompts, teacher-forced: the float32-pool
run's greedy continuation (--positions tokens) is fed to both runs, and at every position the
log-probabilities of the tokens the float32 run gives p > 1e-3 are compared (worst absolute change)
along with the top-1 token. Rows: float32 weights on the C++ kernels (attention_backend cpu), on the
torch reference path (attention_backend torch), and `make run`'s int4 weights (quantization auto).

Part `sources`: the same measure on a float32 pool (torch path, float32 weights) whose K and/or V
rows are rounded through int8 as they are stored and as a prefill chunk attends its own
(kv_cache.quantize_kv on each head's row, or on groups of 32 or 16 features with a scale each), to
see which of K and V carries the error.

Part `speed`: the C++ attention kernel the CPU backend runs for decode (`cpu_kernels.attention`,
one slot row per sequence; the default model's layer: 9 query heads, 3 KV heads of 64) on a float32
and an int8 pool, --repeats calls per shape at each of --threads: at 1 thread the median CPU time of
the calling thread (where the kernel runs: a shared box's other processes do not count), at more
threads the fastest wall time.

    OMP_NUM_THREADS=2 .venv/bin/python bench/kv_int8.py [--part accuracy|sources|speed|all]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from agentrt.runtime.backends import torch_attention as attention_mod
from agentrt.runtime.backends.torch_attention import KernelRows
from agentrt.runtime.config import CacheConfig, ModelConfig, default_cache_dir
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kernels import cpu_kernels
from agentrt.runtime.kv_cache import QuantizedKV, dequantize_kv, quantize_kv, store_kv
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.models.loader import resolve_model_dir

QUESTIONS = [  # the prompts of tests/runtime/test_kv_int8.py
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works, step by step.",
    "List five capitals in Europe and one fact about each.",
    "What is the difference between TCP and UDP?",
]
SPEED_SHAPES = [(1, 2000), (16, 500), (16, 2000), (4, 8000)]  # (batch, context)


def prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def teacher_forced(runners: dict[str, ModelRunner], prompt: list[int], n: int) -> dict[str, torch.Tensor]:
    """name -> [n, vocab] log-probabilities at the last prompt position and the n - 1 next ones, the
    continuation being the first runner's greedy tokens (fed to every runner)."""
    ids, out = list(prompt), {}
    for name, r in runners.items():
        slots = r.kv.allocate(len(prompt) + n)
        rows = [r.execute([SeqChunk(prompt, 0, slots[: len(prompt)])])[0]]
        for i in range(len(prompt), len(prompt) + n - 1):
            if len(ids) <= i:
                ids.append(int(rows[-1].argmax()))
            rows.append(r.execute([SeqChunk(ids[i : i + 1], i, slots[: i + 1])])[0])
        r.kv.free(slots)
        out[name] = torch.stack(rows).log_softmax(-1)
    return out


def compare(runners: dict[str, ModelRunner], ps: list[list[int]], n: int) -> tuple[float, int, int]:
    """(worst |d logprob| over tokens the reference gives p > 1e-3, top-1 agreements, positions):
    the second runner against the first."""
    worst, agree, total = 0.0, 0, 0
    ref_name, name = list(runners)
    for p in ps:
        lp = teacher_forced(runners, p, n)
        a, b = lp[ref_name], lp[name]
        worst = max(worst, (a - b).abs()[a.exp() > 1e-3].max().item())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    return worst, agree, total


def runner(model_dir: Path, quantization: str, backend: str, kv: str) -> ModelRunner:
    return ModelRunner(
        ModelConfig(
            model=str(model_dir),
            device="cpu",
            dtype="float32",
            quantization=quantization,
            attention_backend=backend,
        ),
        CacheConfig(kv_cache_bytes=32 << 20, kv_cache_dtype=kv),
    )


def part_accuracy(model_dir: Path, n: int) -> None:
    ps = prompts(model_dir)
    print(f"\n## int8 KV vs a float32 pool, teacher-forced ({len(ps)} prompts x {n} positions)\n")
    print("| weights, attention | worst abs log-prob change | top-1 agreement |\n|---|---|---|")
    for label, quant, backend in [
        ("none (float32), C++ kernels", "none", "cpu"),
        ("none, torch reference", "none", "torch"),
        ("int4 (`make run`: auto), C++ kernels", "auto", "cpu"),
    ]:
        rs = {
            "float32": runner(model_dir, quant, backend, "float32"),
            "int8": runner(model_dir, quant, backend, "int8"),
        }
        assert rs["int8"].attention_backend == backend, rs["int8"].attention_backend
        worst, agree, total = compare(rs, ps, n)
        print(f"| {label} | {worst:.2f} | {agree}/{total} ({100 * agree / total:.1f}%) |", flush=True)


def rounded(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x [T, Hkv, D] rounded through int8: one scale per head row (group None) or per `group` features."""
    shape = x.shape
    if group is not None:
        x = x.reshape(*shape[:-1], shape[-1] // group, group)
    return dequantize_kv(*quantize_kv(x)).reshape(shape).to(x.dtype)


def part_sources(model_dir: Path, n: int) -> None:
    ps = prompts(model_dir)
    print(
        f"\n## Where the error comes from: a float32 pool, K and/or V rounded through int8 on store (torch path, {n} positions)\n"
    )
    print("| rounded | scale per | worst abs log-prob change | top-1 agreement |\n|---|---|---|---|")
    ref = runner(model_dir, "none", "torch", "float32")
    test = runner(model_dir, "none", "torch", "float32")
    plain, plain_own = attention_mod.store_kv, attention_mod.as_stored
    for label, which, group in [
        ("K and V", "kv", None),
        ("K only", "k", None),
        ("V only", "v", None),
        ("K and V", "kv", 32),
        ("K and V", "kv", 16),
    ]:

        def chosen(cache, which=which) -> bool:
            return ("k" in which and any(cache is c for c in test.kv.k)) or (
                "v" in which and any(cache is c for c in test.kv.v)
            )

        def store(cache, slots, x, group=group):
            store_kv(cache, slots, rounded(x, group) if chosen(cache) else x)

        def own(x, cache, group=group):  # a prefill chunk attends its own K/V as the pool holds them
            return rounded(x, group) if chosen(cache) else plain_own(x, cache)

        attention_mod.store_kv, attention_mod.as_stored = store, own
        try:
            worst, agree, total = compare({"float32": ref, "rounded": test}, ps, n)
        finally:
            attention_mod.store_kv, attention_mod.as_stored = plain, plain_own
        per = "head (64 features)" if group is None else f"{group} features"
        print(
            f"| {label if which != 'kv' else 'K and V'} | {per} | {worst:.2f} | {agree}/{total} |", flush=True
        )


def time_calls(fn, repeats: int, threads: int) -> float:
    """ms of one call: at 1 thread the median CPU time of the calling thread (the kernel runs in it;
    on a shared box this leaves out other processes' time slices), else the fastest wall time."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        times.append(time.thread_time() - c if threads == 1 else time.perf_counter() - t)
    return 1000 * (statistics.median(times) if threads == 1 else min(times))


def part_speed(repeats: int, thread_counts: list[int]) -> None:
    failure = cpu_kernels.load(default_cache_dir())
    if failure:
        raise SystemExit(f"the C++ kernels did not load: {failure}")
    heads, kv_heads, dim = 9, 3, 64
    print(
        f"\n## C++ attention per layer ({heads} query / {kv_heads} KV heads of {dim}), {repeats} calls: "
        "1 thread median CPU ms, more threads fastest wall ms\n"
    )
    print("| batch | context | threads | float32 ms | int8 ms | speed-up |\n|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for batch, ctx in SPEED_SHAPES:
        slots_n = batch * ctx
        k = torch.randn(slots_n, kv_heads, dim, generator=gen)
        v = torch.randn(slots_n, kv_heads, dim, generator=gen)
        pools = {"float32": (k, v), "int8": (QuantizedKV(*quantize_kv(k)), QuantizedKV(*quantize_kv(v)))}
        q = torch.randn(batch, heads, dim, generator=gen)
        slots = torch.arange(slots_n).view(batch, ctx)  # ascending slots, as the engine allocates
        rows = KernelRows(slots, torch.empty(0, dtype=torch.int64), torch.full((batch,), ctx))
        for threads in thread_counts:
            torch.set_num_threads(threads)
            ms = {
                name: time_calls(
                    lambda kc=kc, vc=vc, q=q, rows=rows: cpu_kernels.attention(q, kc, vc, rows),
                    repeats,
                    threads,
                )
                for name, (kc, vc) in pools.items()
            }
            print(
                f"| {batch} | {ctx:,} | {threads} | {ms['float32']:.3f} | {ms['int8']:.3f} "
                f"| {ms['float32'] / ms['int8']:.2f}x |",
                flush=True,
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["accuracy", "sources", "speed", "all"], default="all")
    p.add_argument("--positions", type=int, default=64, help="teacher-forced positions per prompt")
    p.add_argument("--repeats", type=int, default=15, help="kernel calls per shape (speed)")
    p.add_argument(
        "--threads", default="1", help="torch thread counts, comma-separated (speed; 2 only on an idle box)"
    )
    args = p.parse_args()
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch {torch.__version__}"
    )
    model_dir = resolve_model_dir("smollm2-135m-instruct", default_cache_dir())
    if args.part in ("accuracy", "all"):
        part_accuracy(model_dir, args.positions)
    if args.part in ("sources", "all"):
        part_sources(model_dir, args.positions)
    if args.part in ("speed", "all"):
        part_speed(args.repeats, [int(t) for t in args.threads.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
