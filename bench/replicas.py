"""Replicas on Ray Serve: `prefix` vs `round_robin` vs `least_loaded` routing on one multi-agent
trace, side by side, and the same trace on one plain `agentrt serve` process.

The trace: `--agents` agents x `--turns` turns. Each agent has a long system prompt of its own
(~`--system-tokens` tokens) and a tool list of its own (3 tools); turn k sends the whole
conversation so far (system, then k user/assistant exchanges with fixed assistant text, so every
configuration sends byte-identical prompts) and streams `--max-tokens` tokens back (greedy).
Agents run concurrently with at most `--concurrency` requests in flight; who goes next is shuffled
(seeded), each agent's turns in order. Per configuration it reports the prefix-cache hit share
(sum of usage.prompt_tokens_details.cached_tokens / sum of prompt_tokens), TTFT p50/p95 (client
side: request sent -> first streamed token), and the wall time of the whole trace.

Replica runs: a local Ray cluster of `--replicas` x `--cpus-per-replica` CPUs; each policy gets a
fresh deployment (empty caches) of `--replicas` replicas, each with `--kv-cache-bytes` of KV (sized
below the whole trace's working set, as production caches are full: round-robin then thrashes).
The single process gets all the CPUs (`--replicas` x `--cpus-per-replica` threads) and the same
total KV (`--replicas` x `--kv-cache-bytes`).

    OMP_NUM_THREADS=1 .venv/bin/python bench/replicas.py                         # the full run
    OMP_NUM_THREADS=1 .venv/bin/python bench/replicas.py --agents 2 --turns 2 --system-tokens 300  # smoke

Needs Ray Serve (`pip install "agentrt[ray]"`) and the default model (make test installs it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

from agentrt.testing import agentrt_server, free_port

MODEL = "smollm2-135m-instruct"
WORDS = [
    "invoice",
    "ticket",
    "order",
    "refund",
    "contract",
    "shipment",
    "report",
    "account",
    "claim",
    "audit",
    "ledger",
    "vendor",
    "client",
    "payment",
    "balance",
    "policy",
    "review",
    "approve",
    "reject",
    "escalate",
    "archive",
    "verify",
    "compare",
    "record",
    "schedule",
]


def system_prompt(rng: random.Random, agent: int, num_tokens: int) -> str:
    """~num_tokens tokens (about 1.3 tokens per word with the default tokenizer) of rules."""
    words, lines = 0, [f"You are agent {agent}, a back-office assistant. Follow every rule."]
    while words * 1.3 < num_tokens:
        line = f"Rule {len(lines)}: " + " ".join(rng.choice(WORDS) for _ in range(12)) + "."
        lines.append(line)
        words += 14
    return "\n".join(lines)


def tools(rng: random.Random, agent: int) -> list[dict]:
    out = []
    for k in range(3):
        props = {w: {"type": "string", "description": f"the {w}"} for w in rng.sample(WORDS, 3)}
        out.append(
            {
                "type": "function",
                "function": {
                    "name": f"agent{agent}_tool{k}_{rng.choice(WORDS)}",
                    "description": " ".join(rng.choice(WORDS) for _ in range(8)),
                    "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
                },
            }
        )
    return out


@dataclass
class Agent:
    index: int
    system: str
    tools: list[dict]
    history: list[dict] = field(default_factory=list)

    def request(self, turn: int, max_tokens: int) -> dict:
        messages = [{"role": "system", "content": self.system}, *self.history]
        messages.append({"role": "user", "content": f"Turn {turn}: handle item {turn * 7 + self.index}."})
        return {
            "model": MODEL,
            "messages": messages,
            "tools": self.tools,
            "tool_choice": "none",
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def advance(self, turn: int) -> None:
        self.history.append({"role": "user", "content": f"Turn {turn}: handle item {turn * 7 + self.index}."})
        self.history.append({"role": "assistant", "content": f"Item {turn * 7 + self.index} handled."})


def make_trace(args) -> tuple[list[Agent], list[int]]:
    rng = random.Random(args.seed)
    agents = [Agent(a, system_prompt(rng, a, args.system_tokens), tools(rng, a)) for a in range(args.agents)]
    order = [a for a in range(args.agents) for _ in range(args.turns)]
    rng.shuffle(order)
    return agents, order


@dataclass
class Result:
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: str | None
    error: str | None = None


async def one_request(client: httpx.AsyncClient, body: dict) -> Result:
    t0 = time.perf_counter()
    ttft = None
    usage = None
    error = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        replica = resp.headers.get("x-agentrt-replica")
        if resp.status_code != 200:
            error = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
        else:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    continue
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if ttft is None and (delta.get("content") or delta.get("tool_calls")):
                        ttft = time.perf_counter() - t0
    latency = time.perf_counter() - t0
    prompt = usage["prompt_tokens"] if usage else 0
    cached = usage["prompt_tokens_details"]["cached_tokens"] if usage else 0
    return Result(ttft if ttft is not None else latency, latency, prompt, cached, replica, error)


async def run_trace(url: str, args) -> tuple[list[Result], float]:
    """The whole trace against `url`; (results, wall seconds)."""
    agents, order = make_trace(args)
    turn_of = dict.fromkeys(range(args.agents), 0)
    done = {a: asyncio.Event() for a in range(args.agents)}
    for e in done.values():
        e.set()
    slots = asyncio.Semaphore(args.concurrency)
    results: list[Result] = []

    async def run_one(
        client: httpx.AsyncClient, a: int, turn: int, ready: asyncio.Event, mine: asyncio.Event
    ):
        await ready.wait()  # the agent's previous turn has finished
        async with slots:
            results.append(await one_request(client, agents[a].request(turn, args.max_tokens)))
        agents[a].advance(turn)
        mine.set()

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout) as client:
        tasks = []
        for a in order:  # shuffled arrival; within an agent, each turn waits for the one before
            turn = turn_of[a]
            turn_of[a] += 1
            ready, mine = done[a], asyncio.Event()
            done[a] = mine
            tasks.append(asyncio.create_task(run_one(client, a, turn, ready, mine)))
            await asyncio.sleep(args.arrival_gap)
        await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


def summarize(name: str, results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttfts = sorted(r.ttft_s for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "config": name,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "hit_share": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else float("nan"),
        "ttft_p95_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else float("nan"),
        "wall_s": wall_s,
        "prompt_tokens": prompt,
        "replicas_used": len({r.replica for r in ok if r.replica}),
        "first_errors": [r.error for r in results if r.error][:3],
    }


def run_single(args) -> dict:
    threads = args.replicas * args.cpus_per_replica
    flags = [
        "--device",
        "cpu",
        "--threads",
        str(threads),
        "--kv-cache-bytes",
        str(args.replicas * args.kv_cache_bytes),
    ]
    with agentrt_server(MODEL, *flags, timeout_s=600) as server:
        results, wall = asyncio.run(run_trace(server.url, args))
    return summarize(f"1 process ({threads} threads)", results, wall)


def run_replicas(args, policies: list[str]) -> list[dict]:
    import ray
    from ray import serve

    from agentrt.api.middleware import ServerOptions
    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
    from agentrt.scaleout.deploy import (
        APP_NAME,
        build_application,
        plan_resources,
        replica_options,
        replica_spec,
    )
    from agentrt.scaleout.policy import RoutingConfig
    from agentrt.scaleout.replica import ReplicaSpec

    cpus = args.replicas * args.cpus_per_replica
    for attempt in range(6):  # a loaded machine can miss the raylet's start-up window (15 s for its agent)
        try:
            ray.init(
                num_cpus=cpus, object_store_memory=300 << 20, include_dashboard=False, logging_level="WARNING"
            )
            break
        except Exception as e:
            print(f"ray.init failed ({e}); retrying", file=sys.stderr)
            ray.shutdown()
            if attempt == 5:
                raise
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    config = EngineConfig(
        model=ModelConfig(model=MODEL, device="cpu"), cache=CacheConfig(kv_cache_bytes=args.kv_cache_bytes)
    )
    resources = plan_resources(ray.cluster_resources(), "cpu", args.replicas, args.cpus_per_replica)
    spec = replica_spec(ReplicaSpec(config, MODEL, options=replica_options(ServerOptions())), resources)
    rows = []
    try:
        for policy in policies:
            serve.delete(APP_NAME)
            t0 = time.perf_counter()
            app = build_application(
                spec, args.replicas, RoutingConfig(policy=policy), ServerOptions(), resources
            )
            serve.run(app, name=APP_NAME, route_prefix="/")
            print(f"deployed {policy} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            results, wall = asyncio.run(run_trace(url, args))
            rows.append(summarize(f"{args.replicas} replicas, {policy}", results, wall))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument(
        "--system-tokens", type=int, default=1000, help="approximate system prompt length per agent"
    )
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    ap.add_argument("--arrival-gap", type=float, default=0.05, help="seconds between queued arrivals")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--cpus-per-replica", type=int, default=1)
    ap.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=384 << 20,
        help="KV per replica (default 384 MiB: ~8,700 tokens of the default model in fp32; the full trace's "
        "working set is ~14k tokens: half of it fits one replica, all of it does not)",
    )
    ap.add_argument("--policies", default="prefix,round_robin,least_loaded")
    ap.add_argument("--no-single", action="store_true", help="skip the single-process run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request at most")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()

    policies = [p for p in args.policies.split(",") if p]
    rows = run_replicas(args, policies) if policies else []
    if not args.no_single:
        rows.append(run_single(args))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(
        f"\n{args.agents} agents x {args.turns} turns, system prompt ~{args.system_tokens} tokens + 3 tools each, "
        f"max_tokens {args.max_tokens}, {args.concurrency} in flight, KV {args.kv_cache_bytes >> 20} MiB per replica"
    )
    print(
        f"{'configuration':<28} {'hit share':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'wall s':>8} {'errors':>6}"
    )
    for r in rows:
        print(
            f"{r['config']:<28} {r['hit_share']:>9.1%} {r['ttft_p50_s']:>8.2f}s {r['ttft_p95_s']:>8.2f}s "
            f"{r['wall_s']:>8.1f} {r['errors']:>6}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
