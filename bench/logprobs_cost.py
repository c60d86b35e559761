"""Decode cost of token logprobs (SamplingParams.logprobs): the engine on the default model, greedy,
`--tokens` output tokens per request (ignore_eos), batch 1 and 8, with logprobs=5 and without.
Reported: the median wall time of a decode step (ms; steps timed once every request has its first
token, runs with and without logprobs interleaved, median of the `--repeats` runs' medians), and
the log-softmax + top-k of one batch's logits rows alone ([B, vocab] float32).

    OMP_NUM_THREADS=1 python bench/logprobs_cost.py
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, default_cache_dir
from agentrt.runtime.engine import Engine
from agentrt.runtime.logprobs import logprob_tensors, read_host
from agentrt.runtime.models.loader import resolve_model_dir
from agentrt.runtime.request import SamplingParams


def run(engine: Engine, batch: int, tokens: int, logprobs: int | None) -> float:
    """Median seconds per decode step of `batch` requests over `tokens` steps, timed after every
    request has its first token (prefill excluded)."""
    prompt = engine.tokenizer.encode(
        "Write a long story about a lighthouse keeper.", add_special_tokens=False
    )
    params = SamplingParams(max_tokens=tokens + 2, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    reqs = [engine.add_request(prompt + [i], params) for i in range(batch)]
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    steps = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    while engine.has_work():
        engine.step()
    return statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    model_dir = resolve_model_dir("smollm2-135m-instruct", default_cache_dir())
    engine = Engine(
        EngineConfig(
            model=ModelConfig(model=str(model_dir), device="cpu", dtype=args.dtype),
            cache=CacheConfig(kv_cache_bytes=256 << 20, enable_prefix_cache=False),
        )
    )
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    print(
        f"# default model, {args.dtype}, greedy, {args.tokens} tokens per request, median of {args.repeats}"
    )
    run(engine, 1, 4, None)  # warm-up
    for batch in (1, 8):
        times: dict = {None: [], 5: []}
        for _ in range(args.repeats):  # interleaved: load changes on a shared machine hit both
            for logprobs, ts in times.items():
                ts.append(run(engine, batch, args.tokens, logprobs))
        for logprobs, ts in times.items():
            print(f"batch {batch}  logprobs={logprobs!s:4}  {1000 * statistics.median(ts):7.2f} ms/step")
        logits = torch.randn(batch, engine.vocab_size)
        samples = []
        for _ in range(50):
            t0 = time.perf_counter()
            lt = logprob_tensors(logits, list(range(batch)), torch.zeros(batch, dtype=torch.int64), 5)
            read_host(lt.chosen, lt.top_values, lt.top_ids)
            samples.append(time.perf_counter() - t0)
        print(
            f"batch {batch}  log-softmax + top-5 of [{batch}, {engine.vocab_size}] alone: "
            f"{1000 * statistics.median(samples):.3f} ms"
        )


if __name__ == "__main__":
    main()
