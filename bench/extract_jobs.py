"""`agentrt extract` three ways, side by side in one run (issue 14's benchmark).

The first N documents of ../shared/testdata/extraction (--schema-field schema_name, greedy, the
job's defaults: runaway repair on, logprobs for confidence) through:

1. `agentrt extract` in-process (the engine in the job's own process);
2. `agentrt serve` + `agentrt extract --server URL` (the same engine behind the HTTP API);
3. llama.cpp's llama-server on the same GGUF + `agentrt extract --server URL` (--llama-server).

Each job runs as its own process. Printed per mode: docs/s, valid rows, valid docs/s, field
accuracy (the job's summary against `gold`), completion tokens/s, prefix-cache hit share, and peak
RSS of the process holding the model (the job itself in-process, the server otherwise: VmHWM read
from /proc before it is stopped) and of the job client with --server.

    OMP_NUM_THREADS=2 python bench/extract_jobs.py --num-docs 60 \\
        --llama-server /path/to/llama-server [--engine-arg=--quantization --engine-arg=int8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentrt.testing import free_port, launch_server

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata" / "extraction"


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (peak resident set) of a live process, MiB (None when /proc has no such process)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_job(argv: list[str], out: Path) -> dict:
    """Run `agentrt extract ARGV --output OUT` as a child process; its summary plus the child's
    peak RSS (MiB, from wait4's rusage) and total seconds (model load included)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "extract", *argv, "--output", str(out)])
    _, status, rusage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"agentrt extract exited with {proc.returncode}")
    d = json.loads(Path(f"{out}.summary.json").read_text())
    d["job_rss_mb"] = rusage.ru_maxrss / 1024
    d["total_s"] = time.perf_counter() - t0
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-docs", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--max-in-flight", type=int, default=16)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--engine-arg", action="append", default=[], help="extra engine flag (job and serve)")
    ap.add_argument("--llama-server", help="a llama.cpp llama-server binary (same GGUF)")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["in-process", "server", "llama-server"],
        help="in-process, server, llama-server, or in-process:FLAGS (an in-process job with extra engine "
        "flags, e.g. in-process:--quantization=int8,--quantize-lm-head)",
    )
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="extract-jobs-"))
    docs = (DATA / "docs.jsonl").read_text().splitlines()[: args.num_docs]
    src = tmp / "docs.jsonl"
    src.write_text("\n".join(docs) + "\n")
    job = ["--input", str(src), "--schema-field", "schema_name", "--schemas", str(DATA / "schemas"),
           "--gold-field", "gold", "--max-tokens", str(args.max_tokens), "--max-in-flight",
           str(args.max_in_flight), "--no-progress", "--allow-failures"]  # fmt: skip
    engine = ["--device", "cpu", "--max-num-seqs", str(args.max_in_flight), *args.engine_arg]
    rows = []
    for mode in args.modes:
        out = tmp / f"{mode.replace('/', '_')}.jsonl"
        if mode.startswith("in-process"):
            extra = [f for f in mode.partition(":")[2].split(",") if f]
            d = run_job([args.model, *job, *engine, *extra], out)
            d["server_rss_mb"] = None
        elif mode in ("server", "llama-server"):
            if mode == "server":
                cmd = [sys.executable, "-m", "agentrt.cli", "serve", args.model, *engine]
            else:
                if not args.llama_server:
                    print("llama-server: skipped (no --llama-server binary given)")
                    continue
                from agentrt.runtime.models.loader import find_registered_gguf

                cmd = [args.llama_server, "-m", str(find_registered_gguf(args.model)),
                       "-t", str(os.cpu_count()), "-np", str(args.max_in_flight),
                       "-c", str(4096 * args.max_in_flight), "--host", "127.0.0.1"]  # fmt: skip
            port = free_port()
            with contextlib.ExitStack() as stack:
                server = stack.enter_context(
                    launch_server(
                        [*cmd, "--port", str(port)], port, timeout_s=300, log_path=tmp / f"{mode}.log"
                    )
                )
                d = run_job([*job, "--server", f"{server.url}/v1", "--model", args.model], out)
                d["server_rss_mb"] = peak_rss_mb(server.proc.pid)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
        d["outputs"] = {
            (row := json.loads(line))["id"]: row["output"]
            for line in out.read_text().splitlines()
            if line.strip()
        }
        rows.append((mode, d))
        print(f"{mode}: done in {d['total_s']:.1f} s", flush=True)

    print(
        f"\n# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, {args.model}, {len(docs)} docs, greedy, "
        f"max_tokens {args.max_tokens}, in flight {args.max_in_flight}, engine args {args.engine_arg or 'none'}"
    )
    print(
        "| mode | docs/s | valid | valid docs/s | field acc | completion tok/s | prefix-cache hits "
        "| model process peak RSS MiB | job client peak RSS MiB | job wall s | outputs identical to the first row |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    first = rows[0][1]["outputs"] if rows else {}
    for mode, d in rows:
        acc = (d.get("field_accuracy") or {}).get("overall")
        hits = d.get("prefix_cache_hit_share")
        model_rss = d["server_rss_mb"] if d["server_rss_mb"] is not None else d["job_rss_mb"]
        client_rss = f"{d['job_rss_mb']:.0f}" if d["server_rss_mb"] is not None else "(same process)"
        print(
            f"| {mode} | {d['docs_per_s']:.3f} | {d['valid']}/{d['rows']} | {d['valid_docs_per_s']:.3f} | "
            f"{(f'{acc:.1%}' if acc is not None else 'n/a')} | {d['completion_tokens_per_s']:.1f} | "
            f"{(f'{hits:.1%}' if hits is not None else 'n/a')} | {model_rss:.0f} | {client_rss} | {d['wall_s']:.1f} | "
            f"{sum(first.get(k) == v for k, v in d['outputs'].items())}/{len(d['outputs'])} |"
        )
    theirs = next((d["valid_docs_per_s"] for mode, d in rows if mode == "llama-server"), None)
    for mode, d in rows:
        if theirs is not None and mode != "llama-server":
            ratio = d["valid_docs_per_s"] / theirs if theirs else float("inf")
            print(
                f"{mode}: valid docs/s {ratio:.2f}x llama-server's at {args.max_in_flight} in flight (issue "
                f"37's target at 16: at least 2.5x: {'met' if ratio >= 2.5 else 'NOT MET'})"
            )


if __name__ == "__main__":
    main()
