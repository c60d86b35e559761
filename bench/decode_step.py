"""The batch-1 decode step of `make run`'s configuration, split per stage (issue 52 item 7), for one
checkout or side by side for several (A/B: each round runs every checkout once, alternating, each in
its own process with the same OMP_NUM_THREADS).

    python bench/decode_step.py [--repo PATH ...] [--rounds 3] [--steps 64] [--prompt-tokens 100]

--repo: a checkout whose `agentrt` is imported (PATH goes first on sys.path; default: this script's
checkout); give it twice or more to compare, e.g. `--repo /tmp/wt-before --repo /work/main`.

What it drives are seams that stay put when the forward's internals move: the engine configuration
of `agentrt serve` with its defaults and `--quantization auto` (agentrt.engine_args), `Engine.add_request`
and `Engine.step`, `runner.execute`, the model and its `lm_head` as torch modules (forward hooks),
and torch.profiler's op names. Each engine stage gets a torch.profiler.record_function label (the
engine has no profiling seam of its own): `_schedule`, `_prepare`, `_forward`, `_sample`, `_process`
and the output processor's `update`/`emit` are wrapped on the instance; a missing one is a row
marked n/a, never an error.

One request of --prompt-tokens tokens (greedy, ignore_eos) is prefilled, --warmup decode steps run
untimed, --steps steps are timed without the profiler (the step's wall time, perf_counter), --steps
more under perf (below), then --steps more under torch.profiler. Per profiled step: each label's
wall time, and the ops directly under a label (not inside another op) summed by kind: matmul (the
C++ int4/int8 linear ops, aten mm/addmm/linear/..), attention, the C++ whole-stack op
(`decode_layers`: every layer's matmuls, attention and element-wise ops in one call, which the
profiler cannot split), element-wise (norms, rope, silu_mul, adds), other ops (embedding, indexing,
copies). Python/dispatch is the model forward's wall minus its ops. Rows are medians over the steps
(then the median over rounds), in ms and as a share of the profiled step (the profiler inflates
the Python time, not the kernels': compare the unprofiled step). The perf pass splits the main
thread's on-CPU time by shared object and symbol (matmul, attention, element-wise kernels, OpenMP,
Python, torch dispatch, ...), inside the whole-stack op too; its "outside matmuls and attention" is
the one to compare before and after (skipped without perf: --no-perf). perf's 4 kHz sampling slows
the step itself (5.8 -> 7.3 ms on a Zen 4, 2 threads): compare its shares, and its pass between
checkouts, not its ms against the unprofiled step. The weight-read bound: the bytes a step reads (every weight but the embedding table,
unless the LM head is that table) over the read bandwidth (a 1 GiB float32 sum, best of 5, on 4 KiB
and on 2 MiB pages, the larger; taken once per process before warm-up), as bench/same_answer.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from bisect import bisect_right
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
LABEL = "ds:"  # prefix of this script's record_function labels
# op kinds by the op's name after its namespace (torch.profiler's event names)
MATMUL = {"int4_linear", "int8_linear", "mm", "addmm", "linear", "matmul", "bmm", "mkldnn_linear"}
ELEMENTWISE = {"add", "add_", "mul", "mul_", "sub", "div", "neg", "rsqrt", "pow", "mean", "silu", "sigmoid",
               "tanh", "exp", "cos", "sin", "gelu", "silu_mul", "rms_norm", "add_rms_norm", "rope_store",
               "softmax", "_softmax"}  # fmt: skip
ROWS = (  # (key, label, indent)
    ("step", "engine step (wall, profiled)", 0),
    ("schedule", "scheduler (Engine._schedule)", 1),
    ("prepare", "batch layout (Engine._prepare)", 1),
    ("forward", "forward stage (Engine._forward)", 1),
    ("execute", "runner.execute (wall)", 2),
    ("exec.matmul", "matmul kernels (LM head's not included)", 3),
    ("exec.attention", "attention kernels", 3),
    ("exec.stack", "C++ whole-stack op (decode_layers)", 3),
    ("exec.elementwise", "element-wise ops", 3),
    ("exec.other", "other ops (embedding, indexing, copies)", 3),
    ("exec.python", "Python/dispatch and metadata (execute - LM head - ops)", 3),
    ("prep", "metadata/input preparation (execute - model - LM head)", 4),
    ("model", "model module's forward (wall; n/a: not called)", 4),
    ("model.python", "Python/dispatch inside it (its wall - its ops)", 4),
    ("lm_head", "LM head", 3),
    ("sample", "sampling (Engine._sample)", 1),
    ("process", "token processing (Engine._process)", 1),
    ("detok", "detokenize/stop checks/output", 2),
    ("rest", "rest of the step", 1),
)


def kind(name: str) -> str:
    """The op kind of a torch.profiler op name ("agentrt_cpu::int4_linear" -> "matmul")."""
    op = name.rsplit("::", 1)[-1]
    if op == "decode_layers":
        return "stack"
    if op in MATMUL or op.endswith("pack_mm") or "pack_mm_" in op:
        return "matmul"
    if "attention" in op:
        return "attention"
    if op in ELEMENTWISE or "norm" in op or "rope" in op:
        return "elementwise"
    return "other"


# ---- the child: one checkout, one process -------------------------------------------------------


def label_method(obj, name: str, label: str) -> bool:
    """Wrap obj.<name> (on the instance) in a record_function label; False when obj has no such
    attribute."""
    from torch.profiler import record_function

    fn = getattr(obj, name, None)
    if fn is None:
        return False

    def wrapped(*a, **k):
        with record_function(LABEL + label):
            return fn(*a, **k)

    setattr(obj, name, wrapped)
    return True


def label_module(module, label: str) -> None:
    """A record_function label around every call of a torch module (forward pre-hook and hook)."""
    from torch.profiler import record_function

    open_ = []

    def pre(mod, args):
        rf = record_function(LABEL + label)
        rf.__enter__()
        open_.append(rf)

    def post(mod, args, out):
        open_.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def engine_of_serve_defaults(model: str | None):
    """The Engine `agentrt serve --quantization auto [MODEL]` builds (make run)."""
    from agentrt.engine_args import add_engine_args, engine_config
    from agentrt.runtime.engine import Engine

    p = argparse.ArgumentParser()
    add_engine_args(p)
    argv = ["--quantization", "auto"] + ([model] if model else [])
    return Engine(engine_config(p.parse_args(argv)))


def read_bound_ms(runner) -> tuple[float, float]:
    """(weight-read bound of a step in ms, read bandwidth in GB/s), as bench/same_answer.py."""
    import torch

    def best(t) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            t.sum()
            times.append(time.perf_counter() - start)
        return t.numel() * 4 / min(times)

    bandwidth = best(torch.ones(256 << 20, dtype=torch.float32))
    try:
        from agentrt.runtime.hugepages import hugepage_buffer

        buf = hugepage_buffer(1 << 30)
        if buf is not None:
            bandwidth = max(bandwidth, best(buf.view(torch.float32).fill_(1.0)))
            del buf
    except ImportError:
        pass
    model = runner.model
    nbytes = runner.weights_bytes
    embed = model.embed_tokens.weight
    if getattr(model.lm_head, "weight", None) is not embed:
        nbytes -= embed.numel() * embed.element_size()
    return nbytes / bandwidth * 1e3, bandwidth / 1e9


def per_step(events, steps: int) -> dict[str, list[float]]:
    """Per profiled step (ms): each label's wall time and, per label region, the ops directly under
    it summed by kind ("model.matmul", "lm_head.matmul", ...)."""
    step_events = sorted((e for e in events if e.name == LABEL + "step"), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in step_events]
    rows: list[dict[str, float]] = [{} for _ in step_events]
    for e in events:
        i = bisect_right(starts, e.time_range.start) - 1
        if i < 0 or e.time_range.end > step_events[i].time_range.end:
            continue
        row = rows[i]
        ms = (e.time_range.end - e.time_range.start) / 1e3
        if e.name.startswith(LABEL):
            key = e.name[len(LABEL) :]
            row[key] = row.get(key, 0.0) + ms
            continue
        parent = e.cpu_parent
        if parent is None or not parent.name.startswith(LABEL):
            continue  # inside another op (counted there) or outside every label
        key = f"{parent.name[len(LABEL) :]}.{kind(e.name)}"
        row[key] = row.get(key, 0.0) + ms
        row[f"{parent.name[len(LABEL) :]}.ops"] = row.get(f"{parent.name[len(LABEL) :]}.ops", 0.0) + ms
    for row in rows[-steps:]:
        g = row.get
        for k in ("matmul", "attention", "stack", "elementwise", "other", "ops"):
            if f"execute.{k}" in row or f"model.{k}" in row:
                row[f"exec.{k}"] = g(f"execute.{k}", 0.0) + g(f"model.{k}", 0.0)
        row["exec.python"] = g("execute", 0.0) - g("lm_head", 0.0) - g("exec.ops", 0.0)
        if "model" in row:  # the model module is called (its forward hooks ran): the split inside
            row["prep"] = g("execute", 0.0) - g("model", 0.0) - g("lm_head", 0.0)
            row["model.python"] = g("model", 0.0) - g("model.ops", 0.0)
        stages = ("schedule", "prepare", "forward", "sample", "process")
        row["rest"] = g("step", 0.0) - sum(g(s, 0.0) for s in stages)
        kernels = 0.0
        for k, v in row.items():
            if k.endswith((".matmul", ".attention", ".stack")) and not k.startswith("exec."):  # (sums)
                kernels += v
        row["kernels"] = kernels
        row["outside"] = g("step", 0.0) - kernels
    keys = {k for row in rows[-steps:] for k in row}  # a kind absent from a step counts 0 there
    return {k: [row.get(k, 0.0) for row in rows[-steps:]] for k in keys}


PERF_KINDS = (  # the perf split's rows, in order
    "matmul",
    "attention",
    "element-wise (norms, rope, silu_mul)",
    "other C++ kernel code (agentrt_cpu)",
    "OpenMP runtime (fork, barrier, spin)",
    "Python interpreter",
    "torch dispatch and ATen (libtorch, libc10)",
    "other (libc, kernel, other libraries)",
)
SOURCE_KINDS = (("int4_linear", 0), ("int8_linear", 0), ("attention", 1), ("layer_ops", 2))  # file -> kind
LAYER_OPS = ("rms_norm", "add_rms_norm", "rope_store", "silu_mul")  # cpu_layer_ops.cpp's ops
DEFINITION = re.compile(r"^[ \t]*(?:template\s*<[^>]*>\s*)?(?:[\w:<>,*&]+[ \t]+)+(\w+)\s*\(", re.MULTILINE)


def kernel_functions(kernels_dir: Path) -> dict[str, str]:
    """Function name -> perf kind of every function defined in the C++ kernels' sources (the file
    says the kind: cpu_int4_linear.cpp a matmul, ...), so the anonymous-namespace helpers the kernels
    inline into (e.g. int4's item_avx512vnni, attention's span_scores) count where they belong."""
    kinds: dict[str, str] = {}
    for src in sorted(kernels_dir.glob("*.cpp")):
        kind = next((PERF_KINDS[k] for part, k in SOURCE_KINDS if part in src.stem), PERF_KINDS[3])
        text = re.sub(
            r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)", "", src.read_text()
        )  # target("avx512vnni") ...
        for name in DEFINITION.findall(text):
            kinds.setdefault(name, kind)
    return kinds


def perf_kind(dso: str, sym: str, functions: dict[str, str]) -> str:
    """The PERF_KINDS row of a sample in shared object `dso`, symbol `sym` (demangled)."""
    if "agentrt_cpu" in dso or "agentrt_cpu" in sym:
        bare = sym.replace("(anonymous namespace)::", "")
        while re.search(r"<[^<>]*>", bare):  # template arguments, innermost first
            bare = re.sub(r"<[^<>]*>", "", bare)
        name = bare.split("(")[0].rsplit("::", 1)[-1].strip()  # "invoke_parallel" for an op's lambda
        kind = functions.get(name)
        if kind is not None and name not in ("decode_layers", "linear"):
            return kind
        for part, k in SOURCE_KINDS:  # an op's own body, or the parallel_for lambda of one
            if f"agentrt_cpu::{part}" in sym or (
                k == 2 and any(f"agentrt_cpu::{op}" in sym for op in LAYER_OPS)
            ):
                return PERF_KINDS[k]
        return PERF_KINDS[3]
    if "gemm" in sym or "dnnl" in dso or "mkl" in dso:
        return PERF_KINDS[0]
    if "omp" in dso:
        return PERF_KINDS[4]
    if "python" in dso:
        return PERF_KINDS[5]
    if "libtorch" in dso or "libc10" in dso:
        return PERF_KINDS[6]
    return PERF_KINDS[7]


def perf_split(step, steps: int, functions: dict[str, str]) -> dict[str, float] | None:
    """The main thread's on-CPU time of `steps` calls of step() by shared object and symbol
    (`perf record -e cpu-clock -t`, 4 kHz), summed by PERF_KINDS, as ms per step (each kind's
    share of the samples times the loop's wall time over steps). The main thread runs every serial
    part and its share of each parallel loop, so its split is the step's, inside the whole-stack op
    too. None where perf is missing or records nothing (perf_event_paranoid)."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    with tempfile.TemporaryDirectory(prefix="decode-step-perf-") as d:
        data = f"{d}/perf.data"
        tid = str(threading.get_native_id())
        cmd = [perf, "record", "-q", "-e", "cpu-clock", "-F", "4000", "-t", tid, "-o", data]
        rec = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # perf attaches (the main thread sleeps: no samples)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) * 1e3 / steps
        rec.send_signal(signal.SIGINT)
        rec.wait(timeout=60)
        report = subprocess.run(
            [perf, "report", "-i", data, "--stdio", "--no-children", "--sort", "dso,sym", "-t", "\t"],
            capture_output=True,
            text=True,
            check=False,
        )
    shares: dict[str, float] = {}
    for line in report.stdout.splitlines():
        parts = [part.strip() for part in line.split("\t")]
        if line.startswith("#") or len(parts) < 3 or not parts[0].endswith("%"):
            continue
        dso, sym = parts[1], parts[2].removeprefix("[.] ").removeprefix("[k] ")
        name = perf_kind(dso, sym, functions)
        shares[name] = shares.get(name, 0.0) + float(parts[0].rstrip("%")) / 100
    if not shares:
        return None
    return {k: v * wall for k, v in shares.items()} | {"wall": wall}


def child(args) -> dict:
    """Run the measurement in this process on the agentrt of args.repo[0]; returns the result."""
    repo = Path(args.repo[0]).resolve()
    sys.path.insert(0, str(repo))
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import agentrt
    from agentrt.runtime.request import SamplingParams

    if not Path(agentrt.__file__).resolve().is_relative_to(repo):
        raise SystemExit(f"agentrt imported from {agentrt.__file__}, not from {repo}")
    engine = engine_of_serve_defaults(args.model)
    runner = engine.runner
    bound, bandwidth = read_bound_ms(runner)
    labelled = {
        n: label_method(engine, f"_{n}", n) for n in ("schedule", "prepare", "forward", "sample", "process")
    }
    labelled["execute"] = label_method(runner, "execute", "execute")
    labelled["detok"] = label_method(engine.output, "update", "detok") and label_method(
        engine.output, "emit", "detok"
    )
    label_module(runner.model, "model")
    label_module(runner.model.lm_head, "lm_head")
    tok = engine.tokenizer
    words = " ".join(["The lighthouse keeper wrote down the weather every evening."] * args.prompt_tokens)
    prompt = tok.encode(words, add_special_tokens=False)[: args.prompt_tokens]
    n = args.warmup + 3 * args.steps + 8
    params = SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True)
    engine.add_request(prompt, params)
    done = 0

    def step(label: bool = False) -> None:
        nonlocal done
        if label:
            with record_function(LABEL + "step"):
                outs = engine.step()
        else:
            outs = engine.step()
        done += sum(o.finished for o in outs)

    with torch.inference_mode():
        for _ in range(1 + args.warmup):  # the prefill, then untimed decode steps
            step()
        wall = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            wall.append((time.perf_counter() - t) * 1e3)
        functions = kernel_functions(Path(agentrt.__file__).parent / "runtime" / "kernels")
        split = perf_split(step, args.steps, functions) if args.perf else None
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps + 2):  # the first two: the profiler's own start-up
                step(label=True)
    if done:
        raise SystemExit("the request finished before the last measured step")
    rows = per_step(prof.events(), args.steps)
    rows["wall"] = wall
    fmt = getattr(runner, "weight_format", None)
    commit = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"], check=False, capture_output=True, text=True)  # fmt: skip
    return {
        "repo": str(repo),
        "commit": commit.stdout.strip(),
        "weights": fmt.describe() if fmt is not None else "?",
        "threads": torch.get_num_threads(),
        "bound_ms": bound,
        "read_gbps": bandwidth,
        "missing": [k for k, ok in labelled.items() if not ok],
        "medians": {k: statistics.median(v) for k, v in rows.items()},
        "perf": split,
    }


# ---- the parent: rounds over checkouts, the table ------------------------------------------------


def run_child(repo: str, args, env: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--child", "--repo", repo, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--prompt-tokens", str(args.prompt_tokens),
           "--temperature", str(args.temperature)] + (["--model", args.model] if args.model else [])  # fmt: skip
    cmd += [] if args.perf else ["--no-perf"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/", check=False)
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{repo}: the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def print_table(results: dict[str, list[dict]]) -> None:
    """Medians over rounds of each checkout's per-step medians, ms and share of the profiled step."""
    cols = {}
    for repo, runs in results.items():
        med = {k: statistics.median(r["medians"].get(k, 0.0) for r in runs) for k in runs[0]["medians"]}
        med["bound"] = statistics.median(r["bound_ms"] for r in runs)
        cols[repo] = (runs[0], med)
    for repo, (first, _) in cols.items():
        print(f"{repo} @ {first['commit']}: {first['weights']}; {first['threads']} threads; "
              f"{len(results[repo])} rounds; labels missing: {', '.join(first['missing']) or 'none'}")  # fmt: skip
    head = f"{'stage (median per step)':64}" + "".join(f"{Path(r).name[:18]:>22}" for r in cols)
    print(head)
    print("-" * len(head))

    def line(label: str, key: str, share: bool = True) -> None:
        cells = ""
        for _, med in cols.values():
            v = med.get(key)
            if v is None:
                cells += f"{'n/a':>22}"
            else:
                pct = f" {100 * v / med['step']:5.1f}%" if share and med.get("step") else "       "
                cells += f"{v:>13.3f} ms{pct}"
        print(f"{label:64}{cells}")

    line("engine step (wall, no profiler)", "wall")
    for key, label, indent in ROWS:
        line("  " * indent + label, key)
    line("LM head's matmul (in the LM head above)", "lm_head.matmul")
    line("outside matmuls, attention and the stack op (profiled)", "outside")
    line("weight-read bound (bytes / read bandwidth)", "bound", share=False)
    print_perf(results)
    for repo, (first, med) in cols.items():
        print(f"{Path(repo).name}: step / read bound {med['wall'] / med['bound']:.2f}x "
              f"(read {first['read_gbps']:.1f} GB/s in round 1)")  # fmt: skip


def print_perf(results: dict[str, list[dict]]) -> None:
    """The perf split (perf_split) of each checkout: medians over rounds, ms per step and share."""
    splits = {r: [x["perf"] for x in runs if x.get("perf")] for r, runs in results.items()}
    if not any(splits.values()):
        print("perf split: not measured (--no-perf, no perf, or it recorded nothing)")
        return
    print("main thread's on-CPU time by code (perf, a separate pass of the same steps; the whole-stack "
          "op's inside included):")  # fmt: skip
    meds = {}
    for repo, runs in splits.items():
        keys = {k for r in runs for k in r}
        meds[repo] = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys} if runs else {}
        if runs:
            m = meds[repo]
            m["outside"] = m["wall"] - m.get("matmul", 0.0) - m.get("attention", 0.0)
    for key, label in (
        [("wall", "step (wall, under perf)")]
        + [(k, "  " + k) for k in PERF_KINDS]
        + [("outside", "outside matmuls and attention")]
    ):
        cells = ""
        for m in meds.values():
            v = m.get(key)
            cells += f"{'n/a':>22}" if v is None else f"{v:>13.3f} ms {100 * v / m['wall']:5.1f}%"
        print(f"{label:64}{cells}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", action="append", help="a checkout to import agentrt from (repeat to compare)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every checkout once (default 3)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed and profiled (default 64)")
    p.add_argument("--warmup", type=int, default=16, help="untimed decode steps first (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default=None, help="serve's MODEL argument (default: serve's default)")
    p.add_argument("--no-perf", dest="perf", action="store_false", help="skip the perf split of the step")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.repo = args.repo or [str(HERE)]
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    print(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}; load before: {os.getloadavg()[0]:.2f}", flush=True)
    # a checkout named twice gets a column each ("PATH #2"): an A/A run shows the noise
    names = [
        r if args.repo.count(r) == 1 else f"{r} #{args.repo[: i + 1].count(r)}"
        for i, r in enumerate(args.repo)
    ]
    results: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(args.rounds):
        for repo, name in zip(args.repo, names):
            r = run_child(repo, args, env)
            results[name].append(r)
            print(f"round {i + 1} {repo}: step {r['medians']['wall']:.3f} ms (no profiler), "
                  f"{r['medians']['step']:.3f} ms profiled", flush=True)  # fmt: skip
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
