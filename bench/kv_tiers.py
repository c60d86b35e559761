"""KV memory for many agents (issue 38): the replicas benchmark's agent trace in one process, with a
KV pool a fraction of the trace's working set, under: no tiers, int8 KV, int8 KV + host tier,
int8 KV + host + disk tier, and an unbounded pool for reference; then a restart in the middle of the
trace (TTFT of each agent's first request after it, with and without the disk tier).

Each configuration runs in its own subprocess (its peak RSS is its own). The trace: `--agents` agents
x `--turns` turns (bench/replicas.py: a long system prompt of its own per agent, growing history),
each agent's turns in order, `--in-flight` requests at a time, greedy, `--max-tokens` each. Reports
per configuration: prefix-cache hit share (cached prompt tokens / prompt tokens, and per tier),
TTFT p50/p95, completion tokens/s, wall time, peak RSS.

    .venv/bin/python bench/kv_tiers.py                      # the issue's run (~15 min on 2 cores)
    .venv/bin/python bench/kv_tiers.py --agents 3 --turns 2 --system-tokens 100   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replicas import Agent, system_prompt

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import SamplingParams

CONFIGS = {
    "no tiers": {},
    "int8 KV": {"kv_cache_dtype": "int8"},
    "int8 KV + host": {"kv_cache_dtype": "int8", "host": True},
    "int8 KV + host + disk": {"kv_cache_dtype": "int8", "host": True, "disk": True},
    "unbounded pool": {"unbounded": True},
}


def make_agents(args) -> tuple[list[Agent], list[int]]:
    rng = random.Random(args.seed)
    agents = [Agent(a, system_prompt(rng, a, args.system_tokens), []) for a in range(args.agents)]
    order = [a for a in range(args.agents) for _ in range(args.turns)]
    rng.shuffle(order)
    return agents, order


def engine_for(args, cfg: dict, disk_dir: str | None) -> Engine:
    pool = 2 << 30 if cfg.get("unbounded") else args.pool_bytes
    cache = CacheConfig(
        kv_cache_bytes=pool,
        kv_cache_dtype=cfg.get("kv_cache_dtype", "auto"),
        kv_host_bytes=args.host_bytes if cfg.get("host") else 0,
        kv_disk_dir=disk_dir if cfg.get("disk") else None,
        kv_disk_bytes=args.disk_bytes,
    )
    return Engine(
        EngineConfig(
            model=ModelConfig(quantization="auto"),
            cache=cache,
            scheduler=SchedulerConfig(max_num_seqs=args.in_flight),
        )
    )


def run_turns(engine: Engine, agents: list[Agent], order: list[int], args, record) -> float:
    """Run `order` (agent indices; each agent's turns in order) with args.in_flight requests at a
    time; record(agent, turn, ttft_s, output) per finished request. Returns the wall seconds."""
    tok = engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    pending = list(order)
    busy: dict[str, tuple[int, int, float]] = {}  # request id -> (agent, turn, start)
    first: dict[str, float] = {}
    start = time.perf_counter()
    while pending or busy:
        active = {a for a, _, _ in busy.values()}
        while len(busy) < args.in_flight:
            nxt = next((a for a in pending if a not in active), None)
            if nxt is None:
                break
            pending.remove(nxt)
            active.add(nxt)
            agent = agents[nxt]
            turn = len(agent.history) // 2
            body = agent.request(turn, args.max_tokens)
            text = tok.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
            req = engine.add_request(tok.encode(text, add_special_tokens=False), params)
            busy[req.request_id] = (nxt, turn, time.perf_counter())
        for out in engine.step():
            if out.request_id not in first and out.token_ids:
                first[out.request_id] = time.perf_counter()
            if out.finished:
                a, turn, t0 = busy.pop(out.request_id)
                record(a, turn, first.get(out.request_id, time.perf_counter()) - t0, out)
                agents[a].advance(turn)
    return time.perf_counter() - start


def summarize(rows: list[dict], wall: float) -> dict:
    ttft = sorted(r["ttft"] for r in rows)
    prompt = sum(r["prompt"] for r in rows)
    by_tier = {t: sum(r["tiers"].get(t, 0) for r in rows) / max(1, prompt) for t in ("host", "disk")}
    return {
        "requests": len(rows),
        "hit_share": sum(r["cached"] for r in rows) / max(1, prompt),
        "host_share": by_tier["host"],
        "disk_share": by_tier["disk"],
        "ttft_p50": statistics.median(ttft),
        "ttft_p95": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
        "tok_s": sum(r["completion"] for r in rows) / wall,
        "wall_s": wall,
        "prompt_tokens": prompt,
    }


def one(args) -> dict:
    """One configuration (in this subprocess): the whole trace, or with --restart the trace cut in
    half by a restart (engine closed, a new one on the same disk directory)."""
    cfg = CONFIGS[args.one]
    agents, order = make_agents(args)
    rows: list[dict] = []

    def record(a, turn, ttft, out):
        rows.append(
            {
                "agent": a,
                "turn": turn,
                "ttft": ttft,
                "prompt": out.num_prompt_tokens,
                "cached": out.num_cached_tokens,
                "tiers": dict(out.cached_tokens_by_tier),
                "completion": len(out.token_ids),
            }
        )

    disk_dir = args.disk_dir
    engine = engine_for(args, cfg, disk_dir)
    pool_tokens = engine.runner.kv.num_slots
    if not args.restart:
        wall = run_turns(engine, agents, order, args, record)
        res = summarize(rows, wall)
    else:
        half = len(order) // 2
        run_turns(engine, agents, order[:half], args, record)
        engine.close()
        del engine
        engine = engine_for(args, cfg, disk_dir)
        # each agent's first request after the restart, alone; then its next one, alone (warm)
        returning = list(dict.fromkeys(a for a in order[half:]))
        returning = [a for a in returning if order[half:].count(a) >= 2]
        warmup = engine.tokenizer.encode("Warm-up: say hello.", add_special_tokens=False)
        engine.generate(
            [(warmup, SamplingParams(temperature=0, max_tokens=2), None)]
        )  # a fresh process's first step
        rows.clear()
        args.in_flight = 1
        run_turns(engine, agents, returning, args, record)
        back = list(rows)
        rows.clear()
        run_turns(engine, agents, returning, args, record)
        res = {
            "returning_ttft_p50": statistics.median(r["ttft"] for r in back),
            "warm_ttft_p50": statistics.median(r["ttft"] for r in rows),
            "returning_hit_share": sum(r["cached"] for r in back) / max(1, sum(r["prompt"] for r in back)),
            "returning_agents": len(back),
        }
    res["pool_tokens"] = pool_tokens
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if engine.tiers is not None:
        res["tier_bytes"] = {t: b for t, b, _, _ in engine.tiers.gauges()}
    engine.close()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=15)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pool-bytes", type=int, default=None, help="default: a quarter of the working set at float32"
    )
    ap.add_argument("--host-bytes", type=int, default=2 << 30)
    ap.add_argument("--disk-bytes", type=int, default=8 << 30)
    ap.add_argument(
        "--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS)
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--restart", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--disk-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.pool_bytes is None:
        # working set: agents x (system + turns x ~(user + answer) + template) tokens at 46,080 bytes/token (float32)
        longest = args.system_tokens + args.turns * 40 + 30
        args.pool_bytes = max(args.agents * longest // 4, 2 * longest) * 46_080
    if args.one:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return

    def sub(name: str, restart: bool = False, disk_dir: str | None = None) -> dict:
        cmd = [sys.executable, __file__, "--one", name, *sys.argv[1:]]
        if "--pool-bytes" not in sys.argv:
            cmd += ["--pool-bytes", str(args.pool_bytes)]
        if restart:
            cmd.append("--restart")
        if disk_dir:
            cmd += ["--disk-dir", disk_dir]
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, env=os.environ.copy())
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return json.loads(line[7:])

    print(
        f"{args.agents} agents x {args.turns} turns, system prompt ~{args.system_tokens} tokens, "
        f"{args.max_tokens} tokens out, {args.in_flight} in flight; pool {args.pool_bytes / 2**20:.0f} MiB"
    )
    results = {}
    for name in args.configs.split(","):
        tmp = tempfile.mkdtemp(prefix="kvtier-") if CONFIGS[name].get("disk") else None
        results[name] = sub(name, disk_dir=tmp)
        r = results[name]
        print(
            f"| {name} | {r['pool_tokens']:,} | {r['hit_share']:.1%} (host {r['host_share']:.1%}, disk "
            f"{r['disk_share']:.1%}) | {r['ttft_p50']:.3f} | {r['ttft_p95']:.3f} | {r['tok_s']:.1f} | "
            f"{r['wall_s']:.0f} | {r['peak_rss_mib']:.0f} |",
            flush=True,
        )
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\nrestart after half the trace: TTFT of each agent's first request after it (alone)")
    for name in ("int8 KV + host", "int8 KV + host + disk"):
        tmp = tempfile.mkdtemp(prefix="kvtier-")
        r = sub(name, restart=True, disk_dir=tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        print(
            f"| {name} | warm p50 {r['warm_ttft_p50']:.3f} s | returning p50 {r['returning_ttft_p50']:.3f} s "
            f"({r['returning_ttft_p50'] / r['warm_ttft_p50']:.2f}x) | returning hit share "
            f"{r['returning_hit_share']:.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
