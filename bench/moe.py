"""The cost of routing and grouping: a decode step of a Qwen3-MoE model against a dense Qwen3 with
the same active parameters, CPU, batch 1 and 16 (issue 35's MoE benchmark).

Both are random-weight models built from transformers' config classes: hidden 512, 8 layers, 8
heads / 2 KV heads of 64; the MoE has 8 experts of intermediate 512 with top-2 routing in every
layer, the dense model an MLP of intermediate 1024 (the same multiply-adds per token, 8x fewer MLP
weights). Each sequence holds a 128-token context; the median of --steps decode steps is printed
for each format (quantization none, and auto: int8 layers and LM head on the C++ kernels; routers stay dense).

    OMP_NUM_THREADS=2 .venv/bin/python bench/moe.py [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from agentrt.runtime.config import CacheConfig, ModelConfig
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.model_runner import ModelRunner

COMMON = {
    "vocab_size": 49152,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def build(root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3MoeConfig

    configs = {
        "dense": Qwen3Config(**COMMON, intermediate_size=1024),
        "moe": Qwen3MoeConfig(
            **COMMON, intermediate_size=1024, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2
        ),
    }
    out = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        path = root / name
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
        out[name] = path
    return out


def step_ms(runner: ModelRunner, batch: int, steps: int, context: int = 128) -> float:
    torch.manual_seed(1)
    seqs = []
    for _ in range(batch):
        ids = torch.randint(0, 49152, (context,)).tolist()
        slots = runner.kv.allocate(context + steps + 1)
        runner.execute([SeqChunk(ids, 0, slots[:context])])
        seqs.append((ids, slots))
    times = []
    for s in range(steps):
        n = context + s
        chunks = [SeqChunk([ids[s % context]], n, slots[: n + 1]) for ids, slots in seqs]
        t = time.perf_counter()
        runner.execute(chunks)
        times.append(time.perf_counter() - t)
    for _, slots in seqs:
        runner.kv.free(slots)
    return 1000 * statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    from agentrt.runtime.config import default_cache_dir
    from agentrt.runtime.models.loader import resolve_model_dir

    tok_dir = resolve_model_dir("smollm2-135m-instruct", default_cache_dir())
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.processor() or platform.machine()}, "
        f"{os.environ.get('OMP_NUM_THREADS', 'all')} threads, decode step ms (median of {args.steps - 3})"
    )
    print("| model | format | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("|---|---|" + "---|" * len(args.batches))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = build(Path(tmp), tok_dir)
        for quant in ("none", "auto"):
            for name, path in dirs.items():
                runner = ModelRunner(
                    ModelConfig(
                        model=str(path), dtype="float32", quantization=quant, cache_dir=Path(tmp) / "c"
                    ),
                    CacheConfig(kv_cache_bytes=256 << 20),
                )
                row = [f"{step_ms(runner, b, args.steps):.2f}" for b in args.batches]
                print(f"| {name} | {quant} | " + " | ".join(row) + " |", flush=True)
                del runner


if __name__ == "__main__":
    main()
