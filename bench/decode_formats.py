"""Decode speed and quality per weight format (fp32 / bf16 / int8 / int4), eager or compiled, on the default model.

    python bench/decode_formats.py                       # speed: step times at batch 1 and 16, A/B/A rounds
    python bench/decode_formats.py --profile             # torch.profiler top ops + cProfile of Engine.step
    python bench/decode_formats.py --quality 20          # extraction subset (agentrt extract's sampling:
                                                         # greedy, runaway repair): valid, field accuracy,
                                                         # share of outputs token-identical to fp32
    python bench/decode_formats.py --start               # start time cold (empty cache) vs warm per format
    python bench/decode_formats.py --ab REV              # step times with the working tree's CPU kernels
                                                         # and REV's, alternating step by step (one process)
    python bench/decode_formats.py --compiled            # each format eager and compiled (compile_decode,
                                                         # runtime/backends/compiled_decode.py), side by side; with
                                                         # --start: cold = the build, warm = loading it

The compiled engines build their graphs into the normal cache (AGENTRT_CACHE) on first use (minutes on
2 cores; the build time is printed), so run once before timing if the cache is cold.

Speed: each format's decode step (ModelRunner.execute of B one-token chunks at --context tokens, 128 by default: the forward
and the logits, no host work around it) timed as the median of `--steps` steps, formats interleaved over
`--rounds` rounds (A/B/A...), the 1-minute load average printed beside each number (the machine is
shared); single-stream tokens/s through Engine.generate (prefix cache off, EOS biased away): the time of
65 tokens minus the time of 1 (best of 3 each), per token. The weight-read bound is weight bytes / the copy bandwidth
measured here (bytes read + written per second of a 256 MB tensor copy).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.request import SamplingParams

FORMATS = {  # name -> (dtype, quantization, quantize_lm_head, linear_kernel, attention_backend)
    "fp32": ("float32", "none", False, "auto", "auto"),  # oneDNN linear layers, C++ decode attention
    "fp32-aten": ("float32", "none", False, "aten", "torch"),  # the CPU path before 2026-12-02
    "bf16": ("bfloat16", "none", False, "auto", "auto"),
    "int8-a8": ("float32", "int8", False, "auto", "auto"),  # int8 x int8 C++ kernel, Q8_0 activations
    "int8-a8+head": ("float32", "int8", True, "auto", "auto"),
    "int4-a8": ("float32", "int4", False, "auto", "auto"),  # Q4_1 x int8 C++ kernel, LM head fp32
    "int4-a8+head": ("float32", "int4", True, "auto", "auto"),  # the LM head int8 (Q8_0)
    "int8": ("bfloat16", "int8", False, "auto", "auto"),
    "int8+head": ("bfloat16", "int8", True, "auto", "auto"),
    "int4": ("bfloat16", "int4", False, "auto", "auto"),
    "int4+head": ("bfloat16", "int4", True, "auto", "auto"),
}
DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata" / "extraction"


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def load1() -> float:
    return os.getloadavg()[0]


def make_engine(
    fmt: str, threads: int | None, cache_dir: Path | None = None, kv: int = 512 << 20, compiled: bool = False
) -> Engine:
    dtype, quant, head, linear, attention = FORMATS[fmt]
    extra = {"cache_dir": cache_dir} if cache_dir is not None else {}
    t = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model=ModelConfig(
                device="cpu",
                dtype=dtype,
                quantization=quant,
                quantize_lm_head=head,
                linear_kernel=linear,
                attention_backend=attention,
                threads=threads,
                compile_decode=compiled,
                **extra,
            ),
            cache=CacheConfig(kv_cache_bytes=kv, enable_prefix_cache=False),
        )
    )
    if compiled:
        c = engine.runner.backend.compiled
        print(f"{fmt} compiled: {c.describe()}; engine start {time.perf_counter() - t:.1f} s", flush=True)
        if not c.active:
            raise SystemExit(f"{fmt}: the compiled decode step is off ({c.failure})")
    return engine


def variants(args) -> list[tuple[str, str, bool]]:
    """(label, format, compiled) of every engine to measure: each format eager, then compiled with
    --compiled."""
    out = []
    for f in args.formats:
        out.append((f, f, False))
        if args.compiled:
            out.append((f"{f} compiled", f, True))
    return out


def copy_bandwidth() -> float:
    """Bytes per second read + written by a 256 MB tensor copy (best of 5)."""
    src = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best


def read_bytes(engine: Engine) -> int:
    """Weight bytes a decode step reads: all weights but the embedding table, of which a step reads
    only a few rows, unless the LM head is that same tensor (a tied head on the aten path reads it
    whole; a packed oneDNN head or a quantized head is a copy of its own)."""
    model = engine.runner.model
    emb = model.embed_tokens.weight
    if getattr(model.lm_head, "weight", None) is emb:
        return engine.runner.weights_bytes
    return engine.runner.weights_bytes - emb.numel() * emb.element_size()


def step_time(engine: Engine, batch: int, steps: int, context: int = 128) -> float:
    """Median seconds of one decode step of `batch` sequences at `context` tokens (KV content arbitrary)."""
    runner = engine.runner
    slots = [runner.kv.allocate(context + steps + 4) for _ in range(batch)]
    try:
        times = []
        for i in range(steps + 2):
            chunks = [SeqChunk([100 + b], context + i, s[: context + i + 1]) for b, s in enumerate(slots)]
            t = time.perf_counter()
            runner.execute(chunks)
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:])
    finally:
        for s in slots:
            runner.kv.free(s)


def stream_tokens_per_s(engine: Engine, new_tokens: int = 64) -> float:
    """Decode tokens per second of one stream: `new_tokens` more tokens' time (best of 3 runs, as
    the 1-token run it is subtracted from: a single sample of either skewed the number by up to 2x on
    this shared machine)."""
    tok = engine.tokenizer
    ids = chat_ids(tok, [{"role": "user", "content": "Write a short story about a lighthouse keeper."}])
    no_eos = {t: -100.0 for t in engine.stop_ids}

    def run(n: int) -> float:
        t = time.perf_counter()
        engine.generate([(ids, SamplingParams(temperature=0, max_tokens=n, logit_bias=no_eos), None)])
        return time.perf_counter() - t

    run(2)
    return new_tokens / (min(run(new_tokens + 1) for _ in range(3)) - min(run(1) for _ in range(3)))


def speed(args) -> None:
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write), load {load1():.2f}", flush=True)
    labels = variants(args)
    engines = {label: make_engine(f, args.threads, compiled=c) for label, f, c in labels}
    names = [label for label, _, _ in labels]
    rows: dict[str, dict[str, list]] = {f: {"b1": [], "b16": [], "stream": []} for f in names}
    for r in range(args.rounds):
        for f in names if r % 2 == 0 else reversed(names):
            e = engines[f]
            b1, l1 = step_time(e, 1, args.steps, args.context), load1()
            b16, l16 = step_time(e, 16, args.steps, args.context), load1()
            st, ls = stream_tokens_per_s(e), load1()
            rows[f]["b1"].append((b1, l1))
            rows[f]["b16"].append((b16, l16))
            rows[f]["stream"].append((st, ls))
            print(
                f"round {r} {f:19s} step b1 {b1 * 1e3:6.1f} ms (load {l1:.1f})  b16 {b16 * 1e3:6.1f} ms "
                f"(load {l16:.1f})  stream {st:5.1f} tok/s (load {ls:.1f})",
                flush=True,
            )
    print(
        f"\nthreads {engines[names[0]].runner.num_threads}; context {args.context}; best of {args.rounds} rounds"
    )
    print(
        "| format | weights MB | read bound b1 ms (tok/s) | step b1 ms | b1 / bound | step b16 ms | b16 tok/s "
        "| single stream tok/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for f in names:
        w = read_bytes(engines[f])
        bound = w / (bw / 2)  # weights read once; bw counts read + write
        b1 = min(x for x, _ in rows[f]["b1"])
        b16 = min(x for x, _ in rows[f]["b16"])
        st = max(x for x, _ in rows[f]["stream"])
        print(
            f"| {f} | {w / 1e6:.0f} | {bound * 1e3:.1f} ({1 / bound:.0f}) | {b1 * 1e3:.1f} | {b1 / bound:.1f}x "
            f"| {b16 * 1e3:.1f} | {16 / b16:.0f} | {st:.1f} |"
        )


def ab(args) -> None:
    """Each format's decode step at batch 1 and 16 with the working tree's CPU kernels and with those of
    git revision args.ab (bench/gemv.py's load_baseline: its own op namespace, swapped in for
    torch.ops.agentrt_cpu), the two alternating step by step, --rounds x --steps steps each; the
    median step and the copy bandwidth (measured before each format) printed as a table."""
    from gemv import load_baseline

    from agentrt.runtime.config import default_cache_dir

    engines = {f: make_engine(f, args.threads) for f in args.formats}  # loads the working tree's kernels
    variants = {
        "current": torch.ops.agentrt_cpu,
        f"base {args.ab}": load_baseline(args.ab, default_cache_dir()),
    }
    print(
        f"threads {engines[args.formats[0]].runner.num_threads}; context {args.context}; load {load1():.2f}"
    )
    print("| format | copy GB/s (r+w) | " + " | ".join(f"{v} b1 ms | {v} b16 ms" for v in variants) + " |")
    print("| --- | --- | " + " | ".join("--- | ---" for _ in variants) + " |")
    for f, e in engines.items():
        bw = copy_bandwidth()
        times: dict[str, dict[int, list[float]]] = {v: {1: [], 16: []} for v in variants}
        for r in range(args.rounds * args.steps):
            for v in variants if r % 2 == 0 else reversed(list(variants)):
                torch.ops.agentrt_cpu = variants[v]
                try:
                    for batch in (1, 16):
                        times[v][batch].append(step_time(e, batch, 1, args.context))
                finally:
                    torch.ops.agentrt_cpu = variants["current"]
        cells = [
            f"{statistics.median(times[v][1]) * 1e3:.2f} | {statistics.median(times[v][16]) * 1e3:.2f}"
            for v in variants
        ]
        print(f"| {f} | {bw / 1e9:.1f} | {' | '.join(cells)} |", flush=True)


def profile(args) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    for f in args.formats:
        e = make_engine(f, args.threads, compiled=args.compiled)
        for batch in (1, 16):
            step_time(e, batch, 3, args.context)
            runner = e.runner
            slots = [runner.kv.allocate(args.context + 12) for _ in range(batch)]
            chunks = [SeqChunk([100 + b], args.context, s[: args.context + 1]) for b, s in enumerate(slots)]
            with tprofile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    runner.execute(chunks)
            for s in slots:
                runner.kv.free(s)
            print(
                f"\n## torch.profiler {f} batch {batch} context {args.context} (5 steps, load {load1():.1f})"
            )
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        # host time of Engine.step: cProfile over a batch-16 greedy decode
        tok = e.tokenizer
        ids = chat_ids(tok, [{"role": "user", "content": "Count to fifty."}])
        no_eos = {t: -100.0 for t in e.stop_ids}
        reqs = [(ids, SamplingParams(temperature=0, max_tokens=32, logit_bias=no_eos), None)] * 16
        e.generate(reqs[:1])
        pr = cProfile.Profile()
        t = time.perf_counter()
        pr.enable()
        e.generate(reqs)
        pr.disable()
        print(f"\n## cProfile {f}: Engine.generate, 16 x 32 tokens, {time.perf_counter() - t:.2f} s")
        pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)


def quality(args) -> None:
    import jsonschema

    from agentrt.extract.batch import extraction_params
    from agentrt.extract.prompt import extraction_messages
    from agentrt.grammars.spec import ConstraintSpec

    docs = [json.loads(line) for line in (DATA / "docs.jsonl").read_text().splitlines()][: args.quality]
    schemas = {p.stem: json.loads(p.read_text()) for p in (DATA / "schemas").glob("*.json")}
    ref_tokens = None
    for f in args.formats:
        e = make_engine(f, args.threads)
        tok = e.tokenizer
        reqs = []
        for d in docs:
            schema = schemas[d["schema_name"]]
            ids = chat_ids(tok, extraction_messages(d["text"], schema))
            spec = ConstraintSpec.json_schema(schema)
            params = dataclasses.replace(extraction_params(None), max_tokens=args.max_tokens, logprobs=None)
            reqs.append((ids, params, spec))
        t = time.perf_counter()
        outs = e.generate(reqs)
        elapsed = time.perf_counter() - t
        valid = fields_ok = fields = 0
        for d, out in zip(docs, outs):
            schema = schemas[d["schema_name"]]
            fields += len(d["gold"])
            try:
                obj = json.loads(out.text)
                jsonschema.validate(obj, schema, format_checker=jsonschema.FormatChecker())
            except (json.JSONDecodeError, jsonschema.ValidationError):
                continue
            valid += out.finish_reason == "stop"
            fields_ok += sum(obj.get(k) == v for k, v in d["gold"].items())
        tokens = [o.token_ids for o in outs]
        if ref_tokens is None:
            ref_tokens = tokens
        same = sum(a == b for a, b in zip(tokens, ref_tokens))
        print(
            f"| {f} | {len(docs)} | {valid}/{len(docs)} | {100 * fields_ok / fields:.1f}% | {same}/{len(docs)} "
            f"| {elapsed:.0f} s (load {load1():.1f}) |",
            flush=True,
        )
        del e


def start(args) -> None:
    for f in args.formats:
        with tempfile.TemporaryDirectory() as d:
            cache = Path(d)
            from agentrt.runtime.config import default_cache_dir

            # the converted GGUF comes from the normal cache; only the quantized weights start cold
            for link in default_cache_dir().glob("gguf-*"):
                (cache / link.name).symlink_to(link)
            for compiled in (False, True) if args.compiled else (False,):
                times = []
                for _ in range(2):
                    t = time.perf_counter()
                    make_engine(f, args.threads, cache, kv=64 << 20, compiled=compiled)
                    times.append(time.perf_counter() - t)
                label = f"{f} compiled" if compiled else f
                print(f"| {label} | {times[0]:.1f} s | {times[1]:.1f} s | load {load1():.1f}", flush=True)


def llama_stream(path: str, threads: int | None, new_tokens: int = 64) -> None:
    """llama-server's single-stream decode speed on the same model (Q4_1 GGUF): its own timings
    (`predicted_per_second`) of `new_tokens` tokens after a warm-up request, best of 3."""
    import httpx

    from agentrt.runtime.models.loader import find_registered_gguf
    from agentrt.testing import free_port, launch_server

    port = free_port()
    gguf = find_registered_gguf("smollm2-135m-instruct")
    cmd = [path, "-m", str(gguf), "-t", str(threads or os.cpu_count()), "-c", "4096", "--port", str(port)]
    with launch_server([*cmd, "--host", "127.0.0.1"], port, timeout_s=120) as server:
        body = {"prompt": "Write a short story about a lighthouse keeper.", "n_predict": new_tokens,
                "temperature": 0, "ignore_eos": True, "cache_prompt": False}  # fmt: skip
        speeds = []
        for _ in range(4):
            r = httpx.post(f"{server.url}/completion", json=body, timeout=120).json()
            speeds.append(r["timings"]["predicted_per_second"])
        print(
            f"| llama-server (Q4_1 GGUF, -t {threads or os.cpu_count()}) | single stream {max(speeds[1:]):.1f} tok/s |"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["fp32", "bf16", "int8", "int4"], choices=list(FORMATS))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument(
        "--context", type=int, default=128, help="tokens in each sequence's KV cache (extraction: 250-550)"
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--quality", type=int, default=0, help="extraction documents per format (0 = off)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--start", action="store_true", help="start time, cold vs warm quantized cache")
    p.add_argument(
        "--llama-server", help="also llama-server's single-stream tokens/s (a llama-server binary)"
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="each format eager and compiled (compile_decode); --profile: compiled",
    )
    p.add_argument(
        "--ab",
        metavar="REV",
        help="decode steps with the working tree's CPU kernels and git revision REV's, alternating step by step",
    )
    args = p.parse_args(argv)
    if args.ab:
        ab(args)
        return 0
    if args.profile:
        profile(args)
    elif args.quality:
        print("| format | docs | valid | field accuracy | greedy = fp32 | time |")
        print("| --- | --- | --- | --- | --- | --- |")
        quality(args)
    elif args.start:
        print("| format | start cold | start warm |")
        start(args)
    else:
        speed(args)
        if args.llama_server:
            llama_stream(args.llama_server, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
