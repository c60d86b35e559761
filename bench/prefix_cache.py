"""Prefix-cache benchmarks on the in-process engine, cache on vs off in one run.

1. Shared prefix: 32 requests = one 1,500-token system prompt + distinct ~50-token questions,
   32 new tokens each, submitted together: computed prefill tokens, TTFT p50/p95, total time.
2. Multi-turn agent trace: 8 conversations x 6 turns, each turn resends the whole history:
   prompt tokens served from the cache after the first turn.

    python bench/prefix_cache.py [--model NAME] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import SamplingParams

WORDS = [
    "agent",
    "tool",
    "schema",
    "cache",
    "token",
    "prefix",
    "radix",
    "model",
    "server",
    "request",
    "batch",
    "decode",
    "prefill",
    "page",
    "latency",
    "throughput",
    "memory",
    "kernel",
    "grammar",
    "json",
    "output",
    "policy",
    "retry",
    "budget",
    "context",
    "history",
]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _ids(engine: Engine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )


def run_batch(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.monotonic()
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    return reqs, time.monotonic() - t0


def shared_prefix(engine: Engine, rng: random.Random) -> dict:
    system = _text(rng, 1500)
    while len(engine.tokenizer.encode(system)) > 1500:
        system = system.rsplit(" ", 1)[0]
    prompts = [
        _ids(
            engine,
            [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: " + _text(rng, 45)},
            ],
        )
        for i in range(32)
    ]
    before = engine.stats.num_computed_prefill_tokens
    reqs, wall = run_batch(engine, prompts, 32)
    ttfts = sorted(r.first_token_time - r.arrival_time for r in reqs)
    return {
        "prompt_tokens": sum(len(p) for p in prompts),
        "computed": engine.stats.num_computed_prefill_tokens - before,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": ttfts[int(0.95 * (len(ttfts) - 1))],
        "wall": wall,
    }


def multi_turn(engine: Engine, rng: random.Random) -> dict:
    convs = [[{"role": "system", "content": f"You are agent {c}. " + _text(rng, 120)}] for c in range(8)]
    first_prompt = first_cached = later_prompt = later_cached = reusable = 0
    previous: list[list[int]] = [[] for _ in convs]  # last turn's prompt + output, per conversation
    for turn in range(6):
        for conv in convs:
            conv.append({"role": "user", "content": _text(rng, 30)})
        before_p, before_c = engine.stats.num_prompt_tokens, engine.stats.num_cached_prompt_tokens
        prompts = [_ids(engine, conv) for conv in convs]
        for p, prev in zip(prompts, previous):  # what any cache could reuse: the common prefix
            reusable += next((i for i, (a, b) in enumerate(zip(p, prev)) if a != b), min(len(p), len(prev)))
        reqs, _ = run_batch(engine, prompts, 24)
        previous = [r.prompt_ids + r.output_ids for r in reqs]
        prompt = engine.stats.num_prompt_tokens - before_p
        cached = engine.stats.num_cached_prompt_tokens - before_c
        if turn == 0:
            first_prompt, first_cached = prompt, cached
            reusable = 0
        else:
            later_prompt, later_cached = later_prompt + prompt, later_cached + cached
        for conv, r in zip(convs, reqs):
            conv.append(
                {
                    "role": "assistant",
                    "content": engine.tokenizer.decode(r.output_ids, skip_special_tokens=True),
                }
            )
    return {
        "first_turn_hit": first_cached / first_prompt,
        "later_hit": later_cached / later_prompt,
        "later_reusable": reusable / later_prompt,
        "later_prompt_tokens": later_prompt,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {os.cpu_count()} CPUs, model {args.model}, "
        f"dtype {args.dtype}"
    )
    rows = []
    for enabled in (False, True):
        engine = Engine(
            EngineConfig(
                model=ModelConfig(model=args.model, dtype=args.dtype),
                cache=CacheConfig(enable_prefix_cache=enabled),
            )
        )
        sp = shared_prefix(engine, random.Random(0))
        mt = multi_turn(engine, random.Random(1))
        rows.append((enabled, sp, mt))
        del engine
    print("\n| prefix cache | prompt tokens | computed prefill tokens | TTFT p50 s | TTFT p95 s | total s |")
    print("|---|---|---|---|---|---|")
    for enabled, sp, _ in rows:
        print(
            f"| {'on' if enabled else 'off'} | {sp['prompt_tokens']} | {sp['computed']} | {sp['ttft_p50']:.2f} | "
            f"{sp['ttft_p95']:.2f} | {sp['wall']:.1f} |"
        )
    print(
        "\n| prefix cache | multi-turn: cached share of prompt tokens, turn 1 | turns 2-6 | turns 2-6 reusable "
        "(common prefix with the previous turn) |"
    )
    print("|---|---|---|---|")
    for enabled, _, mt in rows:
        print(
            f"| {'on' if enabled else 'off'} | {mt['first_turn_hit']:.1%} | {mt['later_hit']:.1%} | "
            f"{mt['later_reusable']:.1%} |"
        )


if __name__ == "__main__":
    main()
