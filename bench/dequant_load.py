"""What de-quantizing a checkpoint as released costs at load (runtime/models/checkpoint_quant.py), side
by side with transformers' own de-quantization of the same tensors, on realistic shapes (random data):

- one gpt-oss-20b layer's MXFP4 experts: gate_up_proj blocks [32, 5760, 90, 16] + scales and
  down_proj blocks [32, 2880, 90, 16] + scales (24 such layers in the model, 36 in gpt-oss-120b with
  128 experts);
- one DeepSeek-size block-FP8 matrix [7168, 18432] (float8_e4m3fn, 128x128 float32 scales).

    OMP_NUM_THREADS=2 python bench/dequant_load.py [--threads 2] [--reps 3] [--dtypes bfloat16 float32]
                                                   [--json out.json]

Times are the median of --reps runs (time.perf_counter around the call, after one warm-up). agentrt's
MXFP4 time includes what its loader does next (gpt-oss's split_experts into per-expert [out, in]
weights, materialized); transformers' is `convert_moe_packed_tensors`, its whole load-time work (it
keeps the stacked tensor). FP8: agentrt's `dequantize_fp8_blocks` against transformers'
`Fp8Dequantize._dequantize_one` (its load path). Bytes: the stored tensors and the de-quantized result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from agentrt.runtime.models.checkpoint_quant import dequantize_fp8_blocks, dequantize_mxfp4
from agentrt.runtime.models.gpt_oss import GptOssForCausalLM

GPT_OSS_20B_LAYER = {"gate_up_proj": (32, 5760, 90), "down_proj": (32, 2880, 90)}  # [E, rows, cols / 32]
DEEPSEEK_MATRIX = (7168, 18432)


def _median(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_mxfp4(dtype: torch.dtype, reps: int) -> dict:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        name: (
            torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g),
            torch.randint(119, 124, shape, dtype=torch.uint8, generator=g),
        )
        for name, shape in GPT_OSS_20B_LAYER.items()
    }

    def ours():  # the loader's work: de-quantize, then gpt-oss's per-expert [out, in] weights
        for name, (blocks, scales) in tensors.items():
            stacked = dequantize_mxfp4(blocks, scales, dtype)
            for _, w in GptOssForCausalLM.split_experts(f"layers.0.mlp.experts.{name}", stacked):
                w.contiguous()

    def theirs():
        for blocks, scales in tensors.values():
            convert_moe_packed_tensors(blocks, scales, dtype=dtype)

    stored = sum(b.numel() + s.numel() for b, s in tensors.values())
    values = sum(2 * b.numel() for b, _ in tensors.values())
    return {
        "what": "gpt-oss-20b one layer's MXFP4 experts (gate_up + down)",
        "dtype": str(dtype).removeprefix("torch."),
        "stored_bytes": stored,
        "dequantized_bytes": values * dtype.itemsize,
        "agentrt_s": _median(ours, reps),
        "transformers_s": _median(theirs, reps),
    }


def bench_fp8(dtype: torch.dtype, reps: int) -> dict:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    rows, cols = DEEPSEEK_MATRIX
    weight = (torch.randn(rows, cols) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(rows // 128, cols // 128) * 1e-3
    reference = Fp8Dequantize(None)
    return {
        "what": f"block-FP8 matrix {rows}x{cols} (128x128 scales)",
        "dtype": str(dtype).removeprefix("torch."),
        "stored_bytes": weight.numel() + scale.numel() * 4,
        "dequantized_bytes": weight.numel() * dtype.itemsize,
        "agentrt_s": _median(lambda: dequantize_fp8_blocks(weight, scale, (128, 128), dtype), reps),
        "transformers_s": _median(lambda: reference._dequantize_one(weight, scale, dtype), reps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for bench in (bench_mxfp4, bench_fp8):
            r = bench(dtype, args.reps)
            rows.append(r)
            print(
                f"{r['what']} -> {r['dtype']}: {r['stored_bytes'] / 1e6:,.0f} MB stored -> "
                f"{r['dequantized_bytes'] / 1e6:,.0f} MB; agentrt {r['agentrt_s']:.2f} s "
                f"({r['dequantized_bytes'] / r['agentrt_s'] / 1e9:.2f} GB/s written), "
                f"transformers {r['transformers_s']:.2f} s",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
