"""One multi-head latent attention layer (layers/mla.py) against a grouped-query attention layer of
about the same parameter count (issue 53's benchmark, CPU, float32): decode-step time at a context,
prefill tokens/s from empty, and the KV bytes per token each keeps.

    OMP_NUM_THREADS=2 python bench/mla_layer.py [--threads 2] [--reps 10] [--batch 1 8]
                                                 [--context 512 4096] [--prefill 512] [--json out.json]

Layers (random weights), both run through the torch backend's metadata and a KV pool as the engine
runs them (backends/torch_attention.build_torch_metadata, kv_cache.KVPool):
- MLA at DeepSeek-V2-Lite's shape: hidden 2048, 16 heads, no q LoRA, kv_lora_rank 512, keys 128 + 64
  RoPE, values 128 (13.8 M parameters; the pool keeps 576 values per token);
- GQA: hidden 2048, 16 heads of 128 on 8 KV heads (12.6 M parameters; 2 x 8 x 128 values per token),
  on the torch path and (`gqa C++`, where the kernels build) the cpu backend's C++ attention kernel,
  the engine's CPU path for it (latent attention stays on gather + matmuls there).
Each number is the median over --reps rounds (after one warm-up) of one timed call; a round runs every
case in turn, so other processes' load falls on all alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from agentrt.runtime.backends.torch_attention import build_torch_metadata
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kv_cache import CacheSpec, KVPool
from agentrt.runtime.layers.attention import Attention, AttentionConfig
from agentrt.runtime.layers.mla import MLAConfig, MultiHeadLatentAttention
from agentrt.runtime.layers.rotary import RopeSpec, rope_tables

HIDDEN, HEADS = 2048, 16
MLA = MLAConfig(None, 512, 128, 64, 128, rope_interleave=True)


def layers(cpu_kernel: bool) -> dict[str, tuple[torch.nn.Module, CacheSpec, int, bool]]:
    """name -> (layer, its cache spec, its RoPE dimension, whether its attention takes the C++ kernel)."""
    mla = MultiHeadLatentAttention(MLA, HIDDEN, HEADS, MLA.qk_head_dim**-0.5)
    gqa = Attention(AttentionConfig(HIDDEN, HEADS, 8, 128, 128**-0.5))
    for m in (mla, gqa):
        for p in m.parameters():
            torch.nn.init.normal_(p, 0, 0.02)
    out = {
        "mla": (mla, MLA.cache_spec(), MLA.qk_rope_head_dim, False),
        "gqa": (gqa, CacheSpec(8, 128, 128), 128, False),
    }
    if cpu_kernel:  # the engine's CPU path for GQA (the cpu backend); MLA stays on gather + matmuls there
        out["gqa C++"] = (gqa, CacheSpec(8, 128, 128), 128, True)
    return out


def _step(layer, pool, tables, chunks, x, cpu_kernel=False):
    batch = build_torch_metadata(chunks, torch.device("cpu"), cpu_kernel=cpu_kernel)
    batch.meta.prepare_rope(batch.positions, *tables, x.dtype)
    return layer(x, pool.k[0], pool.v[0], batch.meta)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from agentrt.runtime.config import default_cache_dir
    from agentrt.runtime.kernels import cpu_kernels

    cpu_kernel = cpu_kernels.load(default_cache_dir()) is None
    torch.manual_seed(0)
    max_ctx = max(args.context) + 1  # RoPE rows
    cases = []
    results: dict[str, list[float]] = {}
    with torch.inference_mode():
        for name, (layer, spec, rope_dim, kernel) in layers(cpu_kernel).items():
            params = sum(p.numel() for p in layer.parameters())
            bytes_per_token = spec.row_bytes(torch.float32)
            need = sum(b * (c + 1) for b in args.batch for c in args.context) + args.prefill
            pool = KVPool([spec], torch.float32, "cpu", need * bytes_per_token)
            tables = rope_tables(RopeSpec(tuple([1e-3] * (rope_dim // 2))), max_ctx + args.prefill, "cpu")
            print(f"{name}: {params / 1e6:.1f} M parameters, {bytes_per_token:,} KV bytes/token (float32)")
            for b in args.batch:
                for ctx in args.context:
                    seqs = [pool.allocate(ctx + 1) for _ in range(b)]
                    chunks = [SeqChunk([0], ctx, s) for s in seqs]
                    x = torch.randn(b, HIDDEN)
                    cases.append(
                        (f"{name} decode batch {b} context {ctx}", layer, pool, tables, chunks, x, kernel)
                    )
            slots = pool.allocate(args.prefill)
            x = torch.randn(args.prefill, HIDDEN)
            chunks = [SeqChunk([0] * args.prefill, 0, slots)]
            cases.append((f"{name} prefill {args.prefill}", layer, pool, tables, chunks, x, kernel))
        for rep in range(args.reps + 1):
            for label, layer, pool, tables, chunks, x, kernel in cases:
                t = time.perf_counter()
                _step(layer, pool, tables, chunks, x, kernel)
                if rep:
                    results.setdefault(label, []).append(time.perf_counter() - t)
    out = {}
    for label, times in results.items():
        ms = statistics.median(times) * 1e3
        extra = f", {int(label.rsplit(' ', 1)[1]) / ms * 1e3:,.0f} tokens/s" if "prefill" in label else ""
        print(f"  {label}: {ms:.2f} ms{extra}")
        out[label] = ms
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
