"""GPU engine benchmark on random-weight models of real shapes (issue 7), one short call.

Needs only PyTorch and Triton: no model files, no tokenizer, no internet. Builds Llama-3.1-8B and
Qwen2.5-0.5B shapes in bf16 directly on the GPU (weights N(0, 0.02), KV pool filled with random
values: nothing is timed on zeros), and measures with agentrt's own CUDA path (Triton kernels,
device slot table, CUDA-graph decode):

- copy bandwidth (device-to-device, bytes read + written per second), measured in the same run;
- decode tokens/s at batch 1, 8, 64 over 4096-token contexts, end to end per step (slot-table
  update, host-to-device inputs, graph replay, argmax, the one host sync) and graph replay alone;
  the roofline bound = (weights read + KV read per step) / copy bandwidth, and the achieved share;
- batch-1 decode without CUDA graphs (eager Triton path), for the graphs' effect;
- prefill tokens/s (one 4096-token prompt; 8 x 512);
- constrained vs unconstrained decode (batch 1 and 8): a JSON-schema bitmask every step, filled by
  xgrammar matchers on a CPU thread while the GPU runs (as the engine does) and applied by the
  Triton bitmask kernel; without xgrammar installed, a fixed random bitmask is uploaded and applied
  each step instead (the row says which);
- prefix-cache TTFT for a 4096-token shared prefix + 64-token suffix: cold (prefill all) vs warm
  (radix-tree match, extend the suffix over the cached prefix).

Run on a GPU machine from the repo root (a few minutes; python = one with torch + triton, e.g.
.venv/bin/python):  python bench/gpu.py [--models llama-3.1-8b,qwen2.5-0.5b] [--out results.json]
Host work per decode step only (no model, any device, seconds):  python bench/gpu.py --device cpu --host-only
CPU smoke run of every code path (tiny shape, Triton interpreter, ~2-3 minutes; its speeds are
the interpreter's and mean nothing):
    TRITON_INTERPRET=1 .venv/bin/python bench/gpu.py --device cpu --models tiny --context 96 --steps 4
The constrained row uses real xgrammar matchers when xgrammar is importable (a bare PyTorch
image lacks it: install or carry the wheels of xgrammar, pydantic, pydantic-core,
annotated-types, typing-inspection), else a fixed random bitmask (the row says which).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_shapes import SHAPES

from agentrt.prefix_cache import RadixCache
from agentrt.runtime.backends import run_chunks
from agentrt.runtime.backends.cuda_graph import DecodeGraphRunner
from agentrt.runtime.backends.triton import SlotTable
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kernels import interpreting
from agentrt.runtime.kernels.bitmask import apply_token_bitmask
from agentrt.runtime.kv_cache import KVPool, uniform_layout
from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch
from agentrt.runtime.models.registry import build_model as build_family_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
    },
    "required": ["name", "age", "tags"],
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10 after 3 warm-ups)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def build_model(
    arch: ModelArch, max_positions: int, device: torch.device, dtype: torch.dtype
) -> DecoderModel:
    """Random weights N(0, 0.02) (norm weights 1 + N(0, 0.02)) allocated on the device in dtype."""
    with torch.device("meta"):
        model = build_family_model(arch, max_positions)
    model = model.to(dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02, generator=gen)
            if "norm" in name:
                p.add_(1.0)
        if arch.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
    model.init_rope()
    return model.eval()


def weight_read_bytes(model: DecoderModel, batch: int) -> int:
    """Bytes a decode step reads: every weight once, except the untied embedding table (only
    `batch` rows of it)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name == "embed_tokens.weight" and not model.arch.tie_word_embeddings:
            total += batch * p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


class Bench:
    def __init__(self, name: str, args, device: torch.device, bandwidth: float):
        self.name, self.args, self.device, self.bw = name, args, device, bandwidth
        self.arch = SHAPES[name]
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        a, ctx = self.arch, args.context
        self.max_len = ctx + 2 * args.steps + 256
        self.bytes_per_token = KVPool.bytes_per_token_of(a.kv_layout()[0], self.dtype)
        tokens = max(args.batches) * self.max_len + 4 * (ctx + 128)
        self.table = SlotTable(2 * max(args.batches) + 8, self.max_len, device)
        self.capture_s = 0.0
        if args.host_only:  # slot bookkeeping only: a KV pool of 1-element tokens, no model
            self.model = self.graphs = None
            self.kv = KVPool(uniform_layout(1, 1, 1), torch.float32, device, tokens * 8)
        else:
            self.model = build_model(a, self.max_len + 8, device, self.dtype)
            self.kv = KVPool(a.kv_layout()[0], self.dtype, device, tokens * self.bytes_per_token)
            for k, v in zip(self.kv.k, self.kv.v):
                k.normal_()
                v.normal_()
            t = time.perf_counter()
            self.graphs = DecodeGraphRunner(
                self.model,
                self.kv.k,
                self.kv.v,
                self.table,
                args.batches,
                device,
                device.type == "cuda" and not args.eager,
            )
            self.capture_s = time.perf_counter() - t
        self.gen = torch.Generator().manual_seed(1)
        self.rows: list[dict] = []

    def ids(self, n: int) -> list[int]:
        return torch.randint(0, self.arch.vocab_size - 1, (n,), generator=self.gen).tolist()

    # ---- decode ----------------------------------------------------------------------------------
    def _sequences(self, batch: int):
        seqs = []
        for b in range(batch):
            slots = self.kv.allocate(self.args.context + 2 * self.args.steps + 8)
            seqs.append(
                {
                    "key": (self.name, batch, b),
                    "slots": slots,
                    "len": self.args.context,
                    "tok": self.ids(1)[0],
                }
            )
        return seqs

    def _chunks(self, seqs) -> list[SeqChunk]:
        return [SeqChunk([s["tok"]], s["len"], s["slots"][: s["len"] + 1], seq_key=s["key"]) for s in seqs]

    def decode(
        self, batch: int, mask_mode: str | None = None, eager: bool = False
    ) -> tuple[float, float | None]:
        """(tokens/s end to end, tokens/s of graph replay alone or None)."""
        seqs = self._sequences(batch)
        steps, warm = self.args.steps, 3
        masker = Masker(self, batch, mask_mode) if mask_mode else None
        elapsed = 0.0
        for step in range(warm + steps):
            sync(self.device)
            t = time.perf_counter()
            fill = masker.start() if masker else None
            chunks = self._chunks(seqs)
            if eager:
                logits = run_chunks(
                    self.model,
                    self.kv.k,
                    self.kv.v,
                    chunks,
                    self.device,
                    slot_table=self.table,
                )
            else:
                logits = self.graphs.run(chunks)
            if masker:
                masker.apply(logits, fill.result())
            toks = torch.argmax(logits, dim=-1).tolist()  # the step's one host sync
            if masker:
                masker.advance(toks)
            for s, tok in zip(seqs, toks):
                s["len"] += 1
                s["tok"] = tok
            if step >= warm:
                elapsed += time.perf_counter() - t
        replay = None
        bs = self.graphs.padded_size(batch)
        if not eager and bs in self.graphs.graphs:
            graph = self.graphs.graphs[bs][0]
            sync(self.device)
            t = time.perf_counter()
            for _ in range(steps):
                graph.replay()
            sync(self.device)
            replay = batch * steps / (time.perf_counter() - t)
        for s in seqs:
            self.kv.free(s["slots"])
        return batch * steps / elapsed, replay

    def host_overhead(self, batch: int, reps: int = 20) -> tuple[float, float]:
        """(torch path, Triton path) median seconds of host work to build one decode step's inputs
        at this batch and context (the torch path pads every context's slot list to a tensor; the
        Triton path uploads the one new slot per sequence to the device slot table)."""
        from agentrt.runtime.backends.torch_attention import build_torch_metadata
        from agentrt.runtime.backends.triton import build_triton_metadata

        seqs = self._sequences(batch)
        times: dict[str, list[float]] = {"torch": [], "triton": []}
        for rep in range(reps + 1):
            for s in seqs:
                s["len"] += 1
            chunks = self._chunks(seqs)
            for name, spent in times.items():
                sync(self.device)
                t = time.perf_counter()
                if name == "torch":
                    build_torch_metadata(chunks, self.device)
                else:
                    build_triton_metadata(chunks, self.table, self.device)
                sync(self.device)
                if rep:
                    spent.append(time.perf_counter() - t)
        for s in seqs:
            self.kv.free(s["slots"])
        return statistics.median(times["torch"]), statistics.median(times["triton"])

    def roofline(self, batch: int) -> float:
        """Tokens/s bound: batch tokens per (weights + KV bytes read) / bandwidth."""
        ctx = self.args.context + self.args.steps // 2
        step_bytes = weight_read_bytes(self.model, batch) + batch * ctx * self.bytes_per_token
        return batch * self.bw / step_bytes

    # ---- prefill and TTFT --------------------------------------------------------------------------
    def prefill(self, num_seqs: int, length: int) -> float:
        times = []
        for i in range(3):
            chunks = [
                SeqChunk(self.ids(length), 0, self.kv.allocate(length), seq_key=("p", i, j))
                for j in range(num_seqs)
            ]
            sync(self.device)
            t = time.perf_counter()
            logits = run_chunks(
                self.model,
                self.kv.k,
                self.kv.v,
                chunks,
                self.device,
                slot_table=self.table,
            )
            torch.argmax(logits, dim=-1).tolist()
            times.append(time.perf_counter() - t)
            for c in chunks:
                self.kv.free(c.slots)
        return num_seqs * length / min(times[1:])  # the first call compiles

    def _first_token(self, ids: list[int], cache: RadixCache | None, key) -> tuple[float, list[int]]:
        """Seconds from arrival to the first token (prefix-cache match, slot allocation, extend
        forward, argmax, host sync) and the request's slots."""
        sync(self.device)
        t = time.perf_counter()
        cached = cache.match_prefix(ids).slots if cache is not None else []
        slots = cached + self.kv.allocate(len(ids) - len(cached))
        chunk = SeqChunk(ids[len(cached) :], len(cached), slots, seq_key=key)
        logits = run_chunks(
            self.model,
            self.kv.k,
            self.kv.v,
            [chunk],
            self.device,
            slot_table=self.table,
        )
        torch.argmax(logits, dim=-1).tolist()
        return time.perf_counter() - t, slots

    def ttft(self, prefix_len: int, suffix_len: int = 64) -> tuple[float, float]:
        """(cold, warm) median seconds to the first token of a prefix + distinct suffix request:
        cold computes everything; warm finds the prefix in the radix tree and extends the suffix."""
        cache, prefix = RadixCache(), self.ids(prefix_len)
        cold, warm, owned = [], [], []
        for i in range(4):  # the first pair compiles kernels and fills the tree
            t_cold, slots = self._first_token(prefix + self.ids(suffix_len), None, ("cold", i))
            owned.append(slots)
            if i == 0:
                cache.insert(prefix, slots[:prefix_len])
                continue
            t_warm, slots = self._first_token(prefix + self.ids(suffix_len), cache, ("warm", i))
            owned.append(slots[prefix_len:])
            cold.append(t_cold)
            warm.append(t_warm)
        for slots in owned:
            self.kv.free(slots)
        return statistics.median(cold), statistics.median(warm)


class Masker:
    """A JSON-schema bitmask every step: xgrammar matchers over a synthetic vocabulary, filled on a
    CPU thread while the GPU runs; or, without xgrammar, a fixed random bitmask uploaded each step."""

    def __init__(self, bench: Bench, batch: int, mode: str):
        self.bench, self.batch = bench, batch
        vocab = bench.arch.vocab_size
        self.words = (vocab + 31) // 32
        self.pool = ThreadPoolExecutor(1)
        self.rows = torch.arange(batch, dtype=torch.int32, device=bench.device)
        self.mode = mode
        if mode == "xgrammar":
            import xgrammar as xgr

            self.xgr = xgr
            info = xgr.TokenizerInfo(synthetic_vocab(vocab), stop_token_ids=[vocab - 1])
            compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
            self.matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
            self.bitmask = xgr.allocate_token_bitmask(batch, vocab)
        else:
            import numpy as np

            bits = np.random.default_rng(2).random((batch, self.words * 32)) < 0.1  # ~10% of tokens allowed
            bits[:, 0] = True  # never an all-masked row
            packed = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
            self.bitmask = torch.from_numpy(packed.copy())

    def start(self):
        def fill():
            if self.mode == "xgrammar":
                for i, m in enumerate(self.matchers):
                    m.fill_next_token_bitmask(self.bitmask, i)
            return self.bitmask

        return self.pool.submit(fill)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True), self.rows)

    def advance(self, toks: list[int]) -> None:
        if self.mode != "xgrammar":
            return
        for m, tok in zip(self.matchers, toks):
            if not m.accept_token(tok) or m.is_terminated():
                m.reset()


def synthetic_vocab(size: int) -> list[str]:
    """Token strings for xgrammar: the 95 printable ASCII characters, then distinct 2-6 character
    strings over a JSON-ish alphabet, then an end-of-sequence token."""
    import random

    rng = random.Random(3)
    alphabet = 'abcdefghijklmnopqrstuvwxyz0123456789{}[]":, -_.ABCDEFGHIJ'
    vocab = [chr(c) for c in range(32, 127)]
    seen = set(vocab)
    while len(vocab) < size - 1:
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6)))
        if s not in seen:
            seen.add(s)
            vocab.append(s)
    return vocab + ["<eos>"]


def run_model(name: str, args, device: torch.device, bw: float, mask_mode: str) -> dict:
    t0 = time.perf_counter()
    b = Bench(name, args, device, bw)
    weights = sum(p.numel() * p.element_size() for p in b.model.parameters()) if b.model is not None else 0
    out = {
        "model": name,
        "weights_gb": weights / 1e9,
        "kv_bytes_per_token": b.bytes_per_token,
        "graph_capture_s": b.capture_s,
        "decode": [],
    }
    for batch in [] if args.host_only else args.batches:
        tps, replay = b.decode(batch)
        bound = b.roofline(batch)
        out["decode"].append(
            {
                "batch": batch,
                "tokens_s": tps,
                "replay_tokens_s": replay,
                "bound_tokens_s": bound,
                "fraction": tps / bound,
                "replay_fraction": (replay / bound) if replay else None,
            }
        )
        print(
            f"  [{name}] decode batch {batch}: {tps:.1f} tok/s ({tps / bound:.0%} of {bound:.1f} bound)",
            flush=True,
        )
    out["host_ms"] = []
    for batch in args.batches:
        t_torch, t_triton = b.host_overhead(batch)
        out["host_ms"].append({"batch": batch, "torch_ms": t_torch * 1e3, "triton_ms": t_triton * 1e3})
    if args.host_only:
        out["seconds"] = time.perf_counter() - t0
        return out
    out["eager_batch1_tokens_s"] = b.decode(1, eager=True)[0]
    out["prefill_long_tokens_s"] = b.prefill(1, args.context)
    out["prefill_batched_tokens_s"] = b.prefill(8, min(512, args.context))
    out["constrained"] = []
    for batch in (1, 8):
        if batch not in args.batches:
            continue
        plain = b.decode(batch)[0]
        masked = b.decode(batch, mask_mode=mask_mode)[0]
        out["constrained"].append(
            {
                "batch": batch,
                "plain_tokens_s": plain,
                "masked_tokens_s": masked,
                "overhead": plain / masked - 1,
                "mask": mask_mode,
            }
        )
    out["ttft_cold_s"], out["ttft_warm_s"] = b.ttft(args.context)
    out["seconds"] = time.perf_counter() - t0
    del b
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def print_tables(meta: dict, results: list[dict]) -> None:
    print(
        f"\n{meta['date']} | {meta['device']} | torch {meta['torch']}, triton {meta['triton']} | copy bandwidth "
        f"{meta['copy_bw_gbs']:.0f} GB/s (read + write) | context {meta['context']} tokens, {meta['steps']} steps"
        + (
            " | Triton interpreter: speeds are meaningless"
            if meta["interpret"] and not meta["host_only"]
            else ""
        )
    )
    print(
        "\n| model | batch | host ms per decode step: torch path (padded slot lists) | Triton path (slot table) |"
    )
    print("| --- | --- | --- | --- |")
    for r in results:
        for h in r["host_ms"]:
            print(f"| {r['model']} | {h['batch']} | {h['torch_ms']:.2f} | {h['triton_ms']:.2f} |")
    if meta["host_only"]:
        return
    print(
        "\n| model | batch | decode tok/s (end to end) | graph replay tok/s | roofline tok/s | achieved | replay share |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        for d in r["decode"]:
            rep = f"{d['replay_tokens_s']:.1f}" if d["replay_tokens_s"] else "-"
            rf = f"{d['replay_fraction']:.0%}" if d["replay_fraction"] else "-"
            print(
                f"| {r['model']} | {d['batch']} | {d['tokens_s']:.1f} | {rep} | {d['bound_tokens_s']:.1f} | "
                f"{d['fraction']:.0%} | {rf} |"
            )
    ctx = meta["context"]
    print(
        f"\n| model | weights GB | eager b1 tok/s | prefill 1x{ctx} tok/s | prefill 8x{min(512, ctx)} tok/s | "
        f"TTFT cold ms | TTFT warm ms ({ctx} cached) | graph capture s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['model']} | {r['weights_gb']:.2f} | {r['eager_batch1_tokens_s']:.1f} | "
            f"{r['prefill_long_tokens_s']:.0f} | {r['prefill_batched_tokens_s']:.0f} | {r['ttft_cold_s'] * 1e3:.1f} | "
            f"{r['ttft_warm_s'] * 1e3:.1f} | {r['graph_capture_s']:.1f} |"
        )
    print("\n| model | batch | unconstrained tok/s | constrained tok/s | overhead | bitmask |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        for c in r["constrained"]:
            print(
                f"| {r['model']} | {c['batch']} | {c['plain_tokens_s']:.1f} | {c['masked_tokens_s']:.1f} | "
                f"{c['overhead']:+.1%} | {c['mask']} |"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default="llama-3.1-8b,qwen2.5-0.5b")
    p.add_argument("--context", type=int, default=4096, help="context tokens per decoding sequence")
    p.add_argument("--steps", type=int, default=48, help="timed decode steps per measurement")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument(
        "--host-only",
        action="store_true",
        help="only the host work per decode step (input building), e.g. on CPU for the real shapes",
    )
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu with TRITON_INTERPRET=1 for a smoke run")
    try:
        import xgrammar  # noqa: F401

        mask_mode = "xgrammar"
    except ImportError:
        mask_mode = "synthetic"
    import triton

    bw = copy_bandwidth(device, (2 << 30) if device.type == "cuda" else (64 << 20))
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else ("cpu (Triton interpreter)" if interpreting() else "cpu"),
        "copy_bw_gbs": bw / 1e9,
        "context": args.context,
        "steps": args.steps,
        "interpret": interpreting(),
        "host_only": args.host_only,
    }
    print(
        f"copy bandwidth {bw / 1e9:.0f} GB/s" + ("" if args.host_only else f"; bitmask source: {mask_mode}"),
        flush=True,
    )
    results = []
    for name in args.models.split(","):
        results.append(run_model(name, args, device, bw, mask_mode))
        print(f"  [{name}] done in {results[-1]['seconds']:.0f} s", flush=True)
    print_tables(meta, results)
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
