"""The sliding-window KV pool (issue 35) on Gemma 3 270M: the agent trace of bench/kv_tiers.py with
the plain pool (every layer's K/V for every token) against the sliding-window pool at the same byte
budget, and an unbounded plain pool for reference. Each configuration runs in its own subprocess.

Reports per configuration: token slots and window rows, prefix-cache hit share, TTFT p50/p95,
completion tokens/s, wall time, preemptions, window rows reclaimed, peak RSS; and the memory one
sequence takes at 1k / 4k / 8k / 32k tokens in each pool.

    .venv/bin/python bench/window_kv.py                                   # the documented run
    .venv/bin/python bench/window_kv.py --agents 3 --turns 2 --system-tokens 300   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_tiers import make_agents, run_turns, summarize

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine

TEMPLATE = (
    Path(__file__).resolve().parents[2]
    / "shared/testdata/chat_templates/vllm-tool_chat_template_gemma3_pythonic.jinja"
)
CONFIGS = {
    "plain pool": {"disable_hybrid_swa_memory": True},
    "sliding-window pool": {},
    "sliding-window pool (ratio 0.4)": {"swa_full_tokens_ratio": 0.4},
    "unbounded plain pool": {"disable_hybrid_swa_memory": True, "unbounded": True},
}
LAYER_BYTES = 2 * 256 * 4  # Gemma 3 270M: K + V of one token in one layer (1 KV head x 256, float32)


def one(args) -> dict:
    cfg = CONFIGS[args.one]
    agents, order = make_agents(args)
    rows: list[dict] = []

    def record(a, turn, ttft, out):
        rows.append(
            {
                "ttft": ttft,
                "prompt": out.num_prompt_tokens,
                "cached": out.num_cached_tokens,
                "tiers": {},
                "completion": len(out.token_ids),
            }
        )

    engine = Engine(
        EngineConfig(
            model=ModelConfig(model="gemma3-270m", quantization="auto", chat_template=str(TEMPLATE)),
            cache=CacheConfig(
                kv_cache_bytes=4 << 30 if cfg.get("unbounded") else args.pool_bytes,
                disable_hybrid_swa_memory=cfg.get("disable_hybrid_swa_memory", False),
                swa_full_tokens_ratio=cfg.get("swa_full_tokens_ratio"),
            ),
            scheduler=SchedulerConfig(max_num_seqs=args.in_flight),
        )
    )
    kv = engine.runner.kv
    wall = run_turns(engine, agents, order, args, record)
    res = summarize(rows, wall)
    res.update(
        pool_tokens=kv.num_slots,
        window_rows=getattr(kv, "num_window_slots", None),
        pool_mib=kv.pool_bytes / 2**20,
        preemptions=engine.scheduler.num_preemptions,
        reclaimed=getattr(kv, "num_reclaimed", 0),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    engine.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-bytes", type=int, default=None, help="default: a third of the working set")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pool_bytes is None:  # the working set at the plain pool's 18 layers x 2,048 bytes a token
        longest = args.system_tokens + args.turns * 40 + 30
        args.pool_bytes = args.agents * longest * 18 * LAYER_BYTES // 3
    if args.one:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    print(
        f"{args.agents} agents x {args.turns} turns, system prompt ~{args.system_tokens} tokens, "
        f"{args.max_tokens} out, {args.in_flight} in flight; pool {args.pool_bytes / 2**20:.0f} MiB"
    )
    for n in (1024, 4096, 8192, 32768):  # one sequence's KV: 3 full layers + 15 windowed (512)
        plain, window = 18 * LAYER_BYTES * n, 3 * LAYER_BYTES * n + 15 * LAYER_BYTES * min(n, 512)
        print(f"one {n}-token sequence: plain {plain / 2**20:.1f} MiB, windowed {window / 2**20:.1f} MiB")
    print(
        "| pool | token slots | window rows | hit share | TTFT p50 s | TTFT p95 s | tok/s | wall s | preemptions | rows reclaimed | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--one", name, *sys.argv[1:]]
        if "--pool-bytes" not in sys.argv:
            cmd += ["--pool-bytes", str(args.pool_bytes)]
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=os.environ.copy())
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        r = json.loads(line[7:])
        print(
            f"| {name} ({r['pool_mib']:.0f} MiB) | {r['pool_tokens']:,} | {r['window_rows'] or '-'} | "
            f"{r['hit_share']:.1%} | {r['ttft_p50']:.3f} | {r['ttft_p95']:.3f} | {r['tok_s']:.1f} | "
            f"{r['wall_s']:.0f} | {r['preemptions']} | {r['reclaimed']:,} | {r['peak_rss_mib']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
