"""Prefix caching on a hybrid model (Gated DeltaNet + attention) against a full-attention model of
the same shape, on one multi-turn agent trace, side by side in one run.

Trace: 10 agents x 8 turns. Every agent's prompt is a shared system prompt (2,048 tokens) + its own
history (each earlier turn's user message and the model's answer) + a new 40-token user message;
each answer is 24 greedy tokens. A turn's 10 requests are submitted together, the turns in order.
Per turn: the share of prompt tokens served from the prefix cache (`num_cached_tokens`, for the
hybrid the depth of the state snapshot it resumed from) and TTFT (mean, from submission to the step
that produced the first token).

Models: tiny random-weight models built from transformers' configs: Qwen3.5 (hybrid: 3 of every 4
layers linear attention) and Qwen3 (every layer attention) with the same hidden size, layers, heads
and MLP; the default model's tokenizer.

    python bench/hybrid_agents.py [--agents 10] [--turns 8] [--system 2048] [--interval 256]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, default_cache_dir
from agentrt.runtime.engine import Engine
from agentrt.runtime.models.loader import resolve_model_dir
from agentrt.runtime.request import SamplingParams

SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}
LINEAR = {  # Qwen3.5's Gated DeltaNet heads at this width
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
}


def build(kind: str, path: Path, tokenizer_dir: Path) -> tuple[Path, int]:
    """Save a random model of `kind` ("hybrid" or "full") to `path`; returns (path, parameters)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5TextConfig, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(**SHAPE, **LINEAR) if kind == "hybrid" else Qwen3Config(**SHAPE)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path, sum(p.numel() for p in model.parameters())


def run_trace(engine: Engine, args) -> list[tuple[float, float]]:
    """(hit share, mean TTFT in seconds) per turn."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 48000) for _ in range(n)]

    system = tokens(args.system)
    history = [[] for _ in range(args.agents)]
    no_eos = {t: -100.0 for t in engine.stop_ids}
    params = SamplingParams(temperature=0, max_tokens=args.answer, logit_bias=no_eos)
    per_turn = []
    for _turn in range(args.turns):
        prompts = [system + h + tokens(args.user) for h in history]
        start = time.perf_counter()
        reqs = [engine.add_request(p, params) for p in prompts]
        first: dict[str, float] = {}
        done: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step():
                if out.token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter() - start
                if out.finished:
                    done[out.request_id] = (out.token_ids, out.num_cached_tokens)
        cached = sum(done[r.request_id][1] for r in reqs)
        share = cached / sum(len(p) for p in prompts)
        per_turn.append((share, sum(first[r.request_id] for r in reqs) / len(reqs)))
        for i, r in enumerate(reqs):
            history[i] = prompts[i][len(system) :] + done[r.request_id][0]
    return per_turn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=10)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=2048)
    parser.add_argument("--user", type=int, default=40)
    parser.add_argument("--answer", type=int, default=24)
    parser.add_argument("--interval", type=int, default=256, help="state snapshot every N tokens")
    args = parser.parse_args()
    tok = resolve_model_dir("smollm2-135m-instruct", default_cache_dir())
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("full", "hybrid"):
            path, params = build(kind, Path(tmp) / kind, tok)
            engine = Engine(
                EngineConfig(
                    model=ModelConfig(model=str(path), device="cpu", dtype="float32"),
                    cache=CacheConfig(kv_cache_bytes=1 << 30, state_snapshot_interval=args.interval),
                )
            )
            print(f"{kind}: {params / 1e6:.1f}M parameters; {engine.runner.memory_plan.describe()}")
            results[kind] = run_trace(engine, args)
            engine.close()
    print(
        f"\n{args.agents} agents x {args.turns} turns, system prompt {args.system} tokens, snapshots every {args.interval}"
    )
    print("turn | hit share full | hit share hybrid | TTFT full (ms) | TTFT hybrid (ms)")
    for t, ((hf, tf), (hh, th)) in enumerate(zip(results["full"], results["hybrid"])):
        print(f"{t + 1:4d} | {hf:14.1%} | {hh:16.1%} | {tf * 1e3:14.1f} | {th * 1e3:16.1f}")
    total = {k: sum(s for s, _ in v) / len(v) for k, v in results.items()}
    print(
        f"mean | {total['full']:14.1%} | {total['hybrid']:16.1%} | difference {100 * (total['full'] - total['hybrid']):.1f} points"
    )


if __name__ == "__main__":
    main()
