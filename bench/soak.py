"""Soak: many concurrent clients with random disconnects and mixed constraints against a real server,
then the server's memory and KV state.

Each of `--concurrency` clients loops until `--duration` seconds have passed: it sends a chat request
(streamed, or 1 in 10 not streamed) with one of: no constraint, a JSON Schema, a regex (some with a
fresh repetition count, so the compiler and its cache churn), a choice list, tools; with probability
`--drop-rate` it goes away early (a stream closed after a few events, a non-streamed request
cancelled). Counted: requests completed, dropped by the client (aborts), and errors (anything else:
an HTTP error, an error event, a broken stream). Memory: the server process's RSS at the start, after
`--warmup` seconds and at the end; KV: /metrics once every request has settled.

    python bench/soak.py [--duration 60] [--concurrency 64] [--drop-rate 0.3] [--model fake|NAME]

`--model fake` (default) serves the fake model runner (agentrt.testing, no weights) from a child
process, with a 64-entry grammar cache (the default is 512) so that the cache is full, and memory
steady, within the warm-up of a short run; any other name runs `agentrt serve NAME`. tests/api/test_soak.py runs the same function.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import psutil

FAKE_MODEL = "fake"
FAKE_SERVER = r"""
import sys
import uvicorn
from agentrt.api.app import create_app
from agentrt.runtime.async_engine import AsyncEngine
from agentrt.grammars.spec import GrammarConfig
from agentrt.runtime.config import EngineConfig, SchedulerConfig
from agentrt.testing import fake_engine

config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=64), grammar=GrammarConfig(cache_size=64))
engine = fake_engine(config, max_model_len=2048, num_kv_slots=32768, record_forwards=False)
uvicorn.run(create_app(AsyncEngine(engine=engine), sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]),
            log_level="warning")
"""

SYSTEM = "You are a careful assistant for a logistics company. Answer briefly and precisely. " * 2
TOPICS = ["a parcel to Hue", "an invoice", "a delayed truck", "customs forms", "a refund", "warehouse stock"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Hanoi", "Hue", "Da Nang", "Saigon"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "array",
    "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}},
    "maxItems": 3,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "track_parcel",
            "description": "Where a parcel is",
            "parameters": {
                "type": "object",
                "properties": {"tracking_id": {"type": "string", "maxLength": 16}},
                "required": ["tracking_id"],
            },
        },
    }
]
KINDS = ("plain", "json_schema", "regex", "regex_fresh", "choice", "tools")


@dataclass
class SoakResult:
    """Counts, the server's RSS (bytes) at the start / after warm-up / at the end, and its gauges
    once every request settled (None: they never settled within the settle timeout)."""

    duration_s: float = 0.0
    num_completed: int = 0
    num_aborted: int = 0
    errors: list[str] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=dict)
    rss_start: int = 0
    rss_warm: int = 0
    rss_end: int = 0
    settled_gauges: dict[str, float] | None = None
    rss_samples: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the start, RSS bytes) every `sample_every_s`."""

    @property
    def rss_growth_after_warmup(self) -> float:
        """(end - after warm-up) / after warm-up."""
        return (self.rss_end - self.rss_warm) / self.rss_warm if self.rss_warm else float("nan")

    def report(self) -> str:
        mb = 1 << 20
        g = self.settled_gauges or {}
        return (
            f"duration {self.duration_s:.0f} s: {self.num_completed} completed, {self.num_aborted} dropped by "
            f"the client (aborted), {len(self.errors)} errors; by kind {self.by_kind}\n"
            f"server RSS: start {self.rss_start / mb:.1f} MiB, after warm-up {self.rss_warm / mb:.1f} MiB, "
            f"end {self.rss_end / mb:.1f} MiB (growth after warm-up {100 * self.rss_growth_after_warmup:+.2f}%)\n"
            f"settled: KV usage {g.get('agentrt_kv_usage_ratio')}, running "
            f"{g.get('agentrt_num_requests_running')}, waiting {g.get('agentrt_num_requests_waiting')}"
            + "\nRSS (MiB) over time: "
            + ", ".join(f"{t:.0f}s {r / mb:.0f}" for t, r in self.rss_samples)
            + (
                f"\nerrors by kind: {dict(Counter(e.split(':', 1)[0] for e in self.errors))}"
                if self.errors
                else ""
            )
            + (f"\nfirst errors: {self.errors[:5]}" if self.errors else "")
        )


def default_warmup_s(duration_s: float) -> float:
    """Seconds before the warm RSS sample: 30% of the run, at least 20 s (caches fill: prefix cache,
    grammar cache, allocator pools)."""
    return max(20.0, 0.3 * duration_s)


def gauges(url: str) -> dict[str, float]:
    """GET /metrics: the unlabelled agentrt_* samples (name -> value)."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("agentrt_") and "{" not in line:
            name, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def request_body(rng: random.Random, model: str, kind: str) -> dict:
    """One chat request of `kind` (see KINDS)."""
    body: dict = {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Request {rng.randrange(10**6)} about {rng.choice(TOPICS)}."},
        ],
        "max_tokens": rng.randint(8, 48),
        "temperature": rng.choice([0.0, 0.7]),
        "seed": rng.randrange(1000),
    }
    if kind == "json_schema":
        schema = rng.choice([PERSON, ITEMS])
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        body["max_tokens_policy"] = "close"
        body["max_tokens"] = 96
    elif kind == "regex":
        body["regex"] = "[A-Z][a-z]{2,8}( [a-z]{1,6}){0,4}\\."
    elif kind == "regex_fresh":  # a new spec most times: compile + grammar-cache churn
        body["regex"] = f"[a-z]{{1,{rng.randint(1, 5000)}}}"
    elif kind == "choice":
        body["choice"] = ["yes", "no", "maybe later"]
    elif kind == "tools":
        body["tools"] = TOOLS
        body["tool_choice"] = rng.choice(["auto", "required"])
        body["max_tokens"] = 64
    return body


async def _one(
    client: httpx.AsyncClient,
    url: str,
    rng: random.Random,
    model: str,
    kinds: tuple[str, ...],
    drop_rate: float,
    res: SoakResult,
) -> None:
    kind = rng.choice(kinds)
    body = request_body(rng, model, kind)
    drop = rng.random() < drop_rate
    stream = rng.random() >= 0.1
    body["stream"] = stream
    res.by_kind[kind] = res.by_kind.get(kind, 0) + 1
    path = f"{url}/v1/chat/completions"
    if not stream:
        try:
            if drop:  # the client gives up after a moment: the server must abort the request
                try:
                    r = await asyncio.wait_for(client.post(path, json=body), timeout=rng.uniform(0.0, 0.3))
                except asyncio.TimeoutError:
                    res.num_aborted += 1
                    return
            else:
                r = await client.post(path, json=body)
            if r.status_code != 200:
                res.errors.append(f"{kind}: {r.status_code} {r.text[:200]}")
            else:
                res.num_completed += 1
        except httpx.HTTPError as e:
            res.errors.append(f"{kind}: {type(e).__name__}: {e}")
        return
    drop_after = rng.randint(0, 6) if drop else None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.errors.append(f"{kind}: {r.status_code} {(await r.aread())[:200]!r}")
                return
            n = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    res.num_completed += 1
                    return
                if "error" in json.loads(data):
                    res.errors.append(f"{kind}: error event {data[:200]}")
                    return
                n += 1
                if drop_after is not None and n >= drop_after:
                    res.num_aborted += 1  # leaving the block closes the connection mid-stream
                    return
            res.errors.append(f"{kind}: stream ended without [DONE]")
    except httpx.HTTPError as e:
        res.errors.append(f"{kind}: {type(e).__name__}: {e}")


async def _client(
    url: str,
    rng: random.Random,
    model: str,
    kinds: tuple[str, ...],
    drop_rate: float,
    deadline: float,
    res: SoakResult,
) -> None:
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        while time.monotonic() < deadline:
            await _one(client, url, rng, model, kinds, drop_rate, res)


async def _settle(url: str, timeout_s: float) -> dict[str, float] | None:
    """The gauges once nothing runs, waits or holds KV (None when that never happens in time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        g = await asyncio.to_thread(gauges, url)
        idle = (
            g.get("agentrt_num_requests_running") == 0
            and g.get("agentrt_num_requests_waiting") == 0
            and g.get("agentrt_kv_usage_ratio") == 0
        )
        if idle:
            return g
        await asyncio.sleep(0.2)
    return None


def run_soak(
    url: str,
    pid: int,
    *,
    duration_s: float,
    warmup_s: float,
    concurrency: int = 64,
    drop_rate: float = 0.3,
    model: str = FAKE_MODEL,
    kinds: tuple[str, ...] = KINDS,
    seed: int = 0,
    settle_timeout_s: float = 60.0,
    sample_every_s: float = 10.0,
) -> SoakResult:
    """Run the soak against the server at `url` whose process is `pid` (its RSS is read); returns
    the counts, RSS samples and settled gauges."""
    proc = psutil.Process(pid)
    res = SoakResult(rss_start=proc.memory_info().rss)

    async def main() -> None:
        t0 = time.monotonic()
        deadline = t0 + duration_s

        async def sample_rss() -> None:
            while time.monotonic() < deadline:
                res.rss_samples.append((time.monotonic() - t0, proc.memory_info().rss))
                await asyncio.sleep(min(sample_every_s, max(0.0, deadline - time.monotonic())))

        async def sample_warm() -> None:
            await asyncio.sleep(warmup_s)
            res.rss_warm = proc.memory_info().rss

        warm = asyncio.create_task(sample_warm())
        samples = asyncio.create_task(sample_rss())
        rngs = [random.Random(seed * 1000 + i) for i in range(concurrency)]
        await asyncio.gather(*(_client(url, rng, model, kinds, drop_rate, deadline, res) for rng in rngs))
        await warm
        await samples
        res.duration_s = time.monotonic() - t0
        res.settled_gauges = await _settle(url, settle_timeout_s)
        res.rss_end = proc.memory_info().rss

    asyncio.run(main())
    return res


@contextlib.contextmanager
def soak_server(model: str = FAKE_MODEL, log_path=None, serve_args: tuple = ()) -> Iterator[tuple[str, int]]:
    """(base URL, pid) of a server in a child process: the fake runner, or `agentrt serve MODEL
    --max-num-seqs 64 *serve_args`."""
    from agentrt.testing import agentrt_server, free_port, launch_server

    if model == FAKE_MODEL:
        port = free_port()
        cmd = [sys.executable, "-c", FAKE_SERVER, str(port), FAKE_MODEL]
        with launch_server(cmd, port, log_path=log_path) as srv:
            yield srv.url, srv.proc.pid
    else:
        with agentrt_server(model, "--max-num-seqs", "64", *serve_args, log_path=log_path) as srv:
            yield srv.url, srv.proc.pid


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default %(default)s)")
    p.add_argument(
        "--warmup", type=float, default=None, help="seconds before the warm RSS sample (default: 20%%)"
    )
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--drop-rate", type=float, default=0.3, help="share of requests the client abandons")
    p.add_argument("--model", default=FAKE_MODEL, help="fake (the fake runner) or a model for agentrt serve")
    p.add_argument("--kinds", default=",".join(KINDS), help="request kinds, comma-separated (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--serve-args",
        default="",
        help='extra `agentrt serve` flags for a real model, e.g. "--compile-nice 5"',
    )
    args = p.parse_args()
    warmup = args.warmup if args.warmup is not None else default_warmup_s(args.duration)
    with soak_server(args.model, serve_args=tuple(args.serve_args.split())) as (url, pid):
        res = run_soak(
            url,
            pid,
            duration_s=args.duration,
            warmup_s=warmup,
            concurrency=args.concurrency,
            drop_rate=args.drop_rate,
            model=args.model,
            kinds=tuple(args.kinds.split(",")),
            seed=args.seed,
        )
    print(
        f"soak: model {args.model} {args.serve_args}, {args.concurrency} clients, drop rate {args.drop_rate}"
    )
    print(res.report())
    return 0 if not res.errors and res.settled_gauges is not None else 1


if __name__ == "__main__":
    sys.exit(main())
