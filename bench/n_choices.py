"""`n` choices in one request vs the same choices as separate concurrent requests, side by side in
one run against a real `agentrt serve` (default model): prefill tokens computed (from /metrics)
and the wall time until every choice has finished.

Each trial uses a fresh ~1,000-token prompt (a random ticket id first, so no earlier trial's cache
helps), temperature 1 with a seed, 32 new tokens per choice.

    python bench/n_choices.py [--n 4] [--trials 3] [--prompt-words 700]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import re
import statistics
import time
import uuid

import httpx
from prefix_cache import WORDS  # bench/ is the script's directory

from agentrt.testing.server import agentrt_server

MODEL = "smollm2-135m-instruct"


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def _prompt(words: int) -> str:
    rng = random.Random()
    return f"Ticket {uuid.uuid4().hex}. " + " ".join(rng.choice(WORDS) for _ in range(words))


async def _one(client: httpx.AsyncClient, url: str, prompt: str, n: int, seed: int) -> dict:
    resp = await client.post(
        f"{url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "n": n,
            "seed": seed,
            "temperature": 1.0,
            "max_tokens": 32,
            "ignore_eos": True,
        },
        timeout=600,
    )
    resp.raise_for_status()
    return resp.json()


async def _trial(url: str, mode: str, n: int, words: int) -> tuple[float, float, int]:
    prompt = _prompt(words)
    before = _metric(url, "agentrt_computed_prefill_tokens_total")
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        if mode == "n":
            bodies = [await _one(client, url, prompt, n, 1)]
        else:
            bodies = await asyncio.gather(*(_one(client, url, prompt, 1, 1 + i) for i in range(n)))
        wall = time.perf_counter() - t0
    computed = _metric(url, "agentrt_computed_prefill_tokens_total") - before
    choices = sum(len(b["choices"]) for b in bodies)
    assert choices == n, choices
    return wall, computed, bodies[0]["usage"]["prompt_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=700)
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    with agentrt_server(MODEL) as server:
        asyncio.run(_trial(server.url, "n", args.n, 50))  # warm-up
        rows = {"n": [], "separate": []}
        for _ in range(args.trials):
            for mode in ("n", "separate"):  # interleaved: the same conditions for both
                rows[mode].append(asyncio.run(_trial(server.url, mode, args.n, args.prompt_words)))
    print(f"n={args.n}, {args.trials} trials, 32 tokens per choice")
    print("| mode | prompt tokens | prefill tokens computed (median) | wall s (median) |")
    print("|---|---|---|---|")
    for mode, label in (
        ("n", f"one request, n={args.n}"),
        ("separate", f"{args.n} concurrent requests, n=1"),
    ):
        walls, computed, prompts = zip(*rows[mode])
        print(
            f"| {label} | {statistics.median(prompts):.0f} | {statistics.median(computed):.0f} | "
            f"{statistics.median(walls):.2f} |"
        )


if __name__ == "__main__":
    main()
