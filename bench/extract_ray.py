"""`agentrt extract --ray` with 1 vs 2 engine actors on a local Ray cluster.

Runs the first N documents of ../shared/testdata/extraction (greedy, --schema-field schema_name)
through `agentrt extract --ray --num-workers W` for each W, and prints docs/s, valid rows, field
accuracy and wall time (the job's summary: from the first row read to the last row written, so the
actors' model loading is included), plus the in-process job for reference (--in-process).

    OMP_NUM_THREADS=1 python bench/extract_ray.py --num-docs 6 --workers 1 2 --in-process

On a 2-core machine two actors of one thread each do not give 2x: the point is that the same job
runs unchanged on a cluster, and what the Ray overhead is.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from agentrt.commands.extract import run_extract

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata" / "extraction"


def run(argv: list[str], out: Path) -> dict:
    t0 = time.perf_counter()
    rc = run_extract([*argv, "--output", str(out)])
    if not Path(f"{out}.summary.json").exists():
        raise SystemExit(f"agentrt extract {' '.join(argv[-3:])} exited with {rc} and wrote no summary")
    d = json.loads(Path(f"{out}.summary.json").read_text())
    d["rc"], d["total_s"] = rc, time.perf_counter() - t0
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-docs", type=int, default=6)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--model", default=None, help="engine model (default: the default model)")
    ap.add_argument("--in-process", action="store_true", help="also run the job without Ray")
    args = ap.parse_args()

    import ray

    ray.init(
        "local", num_cpus=2, object_store_memory=500 << 20, include_dashboard=False, logging_level="WARNING"
    )
    tmp = Path(tempfile.mkdtemp(prefix="extract-ray-"))
    docs = (DATA / "docs.jsonl").read_text().splitlines()[: args.num_docs]
    src = tmp / "docs.jsonl"
    src.write_text("\n".join(docs) + "\n")
    common = [*([args.model] if args.model else []), "--input", str(src), "--schema-field", "schema_name",
              "--schemas", str(DATA / "schemas"), "--gold-field", "gold", "--max-tokens", str(args.max_tokens),
              "--device", "cpu", "--max-model-len", "2048", "--no-progress", "--allow-failures"]  # fmt: skip
    runs = []
    if args.in_process:
        runs.append(("in-process", run(common, tmp / "local.jsonl")))
    for w in args.workers:
        runs.append(
            (f"ray {w} worker(s)", run([*common, "--ray", "--num-workers", str(w)], tmp / f"ray{w}.jsonl"))
        )
    ray.shutdown()
    print(f"\n{args.num_docs} docs, max_tokens {args.max_tokens}, greedy, 2 CPU cores")
    print(f"{'mode':<18} {'docs/s':>7} {'valid':>7} {'field acc':>9} {'job wall s':>10} {'total s':>8}")
    for name, d in runs:
        acc = d.get("field_accuracy", {}).get("overall")
        print(
            f"{name:<18} {d['docs_per_s']:>7.3f} {d['valid']:>3}/{d['rows']:<3} "
            f"{(f'{acc:.1%}' if acc is not None else 'n/a'):>9} {d['wall_s']:>10.1f} {d['total_s']:>8.1f}"
        )


if __name__ == "__main__":
    main()
