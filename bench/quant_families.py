"""Quantized families: the C++ int8 / int4 kernels against transformers' float32 forward on the tiny
random-weight families of tests/support/families.py (the numbers INT_KERNEL_BOUNDS in
tests/runtime/test_model_families.py is set from; issue 51 item 8).

For Qwen3-MoE, Gemma 3 and gpt-oss (3 layers, hidden 64, initializer range 0.1) at int8 and at int4
(group 32; experts included, routers dense): one 80-token forward (seed 4, as the test), the max
|logit error| as a fraction of the largest |logit| and the top-1 agreement over the 80 positions;
then the same layers with their scales corrupted, to show what the bounds catch: `tenth` = 10% of the
scales 10% too large (the test's check), `all` = every scale 10% too large, `pm` = every scale 10%
too large or too small at random.

    OMP_NUM_THREADS=1 .venv/bin/python bench/quant_families.py [--corrupt tenth,all,pm]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from agentrt.runtime.config import CacheConfig, ModelConfig, default_cache_dir
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.models.loader import resolve_model_dir
from tests.support.families import save_family

FAMILIES = ["qwen3_moe", "gemma3", "gpt_oss"]


def corrupt(model: torch.nn.Module, mode: str) -> None:
    """Change the quantized layers' scales (buffers named `scales`) in place, seeded."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if not name.endswith("scales"):
                continue
            if mode == "tenth":
                pick = torch.rand(buf.shape, generator=gen) < 0.1
                buf[pick] = buf[pick] * 1.1
            elif mode == "all":
                buf.mul_(1.1)
            elif mode == "pm":
                up = torch.rand(buf.shape, generator=gen) < 0.5
                buf.mul_(torch.where(up, 1.1, 0.9).to(buf.dtype))
            else:
                raise ValueError(f"unknown corruption {mode!r}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corrupt", default="tenth,all,pm", help="corruptions to try, comma-separated")
    args = p.parse_args()
    modes = [m for m in args.corrupt.split(",") if m]
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, torch {torch.__version__}"
    )
    from transformers import AutoModelForCausalLM

    tokenizer_dir = resolve_model_dir("smollm2-135m-instruct", default_cache_dir())
    print(
        "| family | format | max logit error / largest logit | top-1 (80 positions) | "
        + " | ".join(f"{m}: error, top-1" for m in modes)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(modes))
    with tempfile.TemporaryDirectory(prefix="agentrt-quant-families-") as tmp:
        for family in FAMILIES:
            path = save_family(family, Path(tmp) / family, tokenizer_dir)
            hf = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.float32, attn_implementation="eager"
            ).eval()
            torch.manual_seed(4)
            ids = torch.randint(0, 49152, (80,)).tolist()
            with torch.no_grad():
                ref = hf(torch.tensor([ids])).logits[0]
            scale = ref.abs().max().item()
            for quantization in ("int8", "int4"):
                cells = []
                for mode in [None, *modes]:
                    runner = ModelRunner(
                        ModelConfig(
                            model=str(path),
                            device="cpu",
                            dtype="float32",
                            quantization=quantization,
                            quant_group_size=32,
                            cache_dir=path / "cache",
                        ),
                        CacheConfig(kv_cache_bytes=8 << 20),
                    )
                    if mode is not None:
                        corrupt(runner.model, mode)
                    ours = runner.execute([SeqChunk(ids, 0, runner.kv.allocate(80), num_logits=80)])
                    frac = (ours - ref).abs().max().item() / scale
                    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
                    cells.append(
                        f"{frac:.3f} (of {scale:.2f})" if mode is None else f"{frac:.3f}, {agree:.4f}"
                    )
                    if mode is None:
                        cells.append(f"{agree:.4f} ({round(agree * 80)}/80)")
                print(f"| {family} | {quantization} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
