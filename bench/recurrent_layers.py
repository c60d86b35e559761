"""One recurrent mixer layer against a dense attention + MLP layer of about the same parameter count
(issue 53's benchmark, CPU, float32, batch 1): decode-step time and prefill tokens/s, and the state a
sequence keeps (bytes) against the dense layer's KV bytes per token.

    OMP_NUM_THREADS=2 python bench/recurrent_layers.py [--threads 2] [--reps 20] [--prefill 512 2048]
                                                        [--context 512 4096] [--json out.json]

Layers (random weights; shapes of the released models at hidden 2048):
- Gated DeltaNet as Qwen3-Next's (16 key heads, 32 value heads, Dk = Dv = 128, conv 4),
  `GatedDeltaNet.forward_segment` (decode: the recurrence; prefill: the chunked form, chunk 64);
- Mamba-2 as Nemotron-H's mixer at hidden 2048 (64 heads of 64, state 128, 8 groups, conv 4),
  `Mamba2Mixer.forward_segment`;
- for each, a dense layer of the same parameter count: RMSNorm, q/k/v/o projections (16 heads of 128,
  2 KV heads), causal attention over a contiguous KV cache (torch SDPA), RMSNorm, SwiGLU MLP whose
  intermediate size makes up the rest of the parameters. Decode is measured at each --context length
  (attention reads the cache; the recurrent layers' step does not depend on it), prefill from empty.

Each number is the median over --reps rounds (after one warm-up round) of one timed call
(time.perf_counter); a round runs every case in turn, so other processes' load falls on all alike.
--flush-denormal sets FTZ/DAZ first: the chunked forms' decays (exp of a cumulative log decay that
reaches -100s inside a chunk under these random weights) produce float32 denormals, which are slow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.runtime.layers.gated_delta import GatedDeltaNet
from agentrt.runtime.layers.mamba2 import Mamba2Mixer

HIDDEN = 2048
HEADS, KV_HEADS, HEAD_DIM = 16, 2, 128


class DenseLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP over a contiguous KV cache [KV_HEADS, max_len, HEAD_DIM]."""

    def __init__(self, intermediate: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.gate_up = nn.Linear(HIDDEN, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, HIDDEN, bias=False)

    def forward(
        self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).split(
            [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1
        )
        k_cache[:, start : start + n] = k.view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
        v_cache[:, start : start + n] = v.view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
        keys, values = k_cache[:, : start + n], v_cache[:, : start + n]
        q = q.view(n, HEADS, HEAD_DIM).transpose(0, 1)
        attn = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], is_causal=(n > 1 and start == 0), enable_gqa=True
        )[0]
        h = x + self.o(attn.transpose(0, 1).reshape(n, -1))
        gate, up = self.gate_up(self.norm2(h)).chunk(2, -1)
        return h + self.down(F.silu(gate) * up)


def params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def dense_like(mixer: nn.Module) -> DenseLayer:
    """A dense layer whose parameter count is the mixer's (plus its norms), the MLP filling the rest."""
    attn = (HEADS + 2 * KV_HEADS) * HEAD_DIM * HIDDEN + HEADS * HEAD_DIM * HIDDEN
    intermediate = max(64, (params(mixer) - attn) // (3 * HIDDEN))
    return DenseLayer(intermediate)


def state_bytes(layer) -> int:
    total = 0
    for shape, dtype in layer.state_shapes().values():
        numel = 1
        for d in shape:
            numel *= d
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total


def mixer_cases(name: str, layer, args) -> tuple[dict, list]:
    """The row's fixed fields and its timed cases (key, tokens, fn)."""
    states = {k: torch.zeros(s, dtype=d) for k, (s, d) in layer.state_shapes().items()}
    conv, rec = states["conv"], states["recurrent"]
    layer.forward_segment(torch.randn(64, HIDDEN), conv, rec, True)
    x1 = torch.randn(1, HIDDEN)
    cases = [("decode_ms", 1, lambda: layer.forward_segment(x1, conv, rec, False))]
    for n in args.prefill:
        xn = torch.randn(n, HIDDEN)
        cases.append((f"prefill_{n}_tok_s", n, lambda xn=xn: layer.forward_segment(xn, conv, rec, True)))
    return {"layer": name, "params": params(layer), "state_bytes": state_bytes(layer)}, cases


def dense_cases(name: str, layer: DenseLayer, args) -> tuple[dict, list]:
    max_len = max([*args.context, *args.prefill]) + 1
    k_cache = torch.randn(KV_HEADS, max_len, HEAD_DIM)
    v_cache = torch.randn_like(k_cache)
    x1 = torch.randn(1, HIDDEN)
    cases = [(f"decode_ms_ctx{c}", 1, lambda c=c: layer(x1, k_cache, v_cache, c)) for c in args.context]
    for n in args.prefill:
        xn = torch.randn(n, HIDDEN)
        cases.append((f"prefill_{n}_tok_s", n, lambda xn=xn: layer(xn, k_cache, v_cache, 0)))
    row = {"layer": name, "params": params(layer), "kv_bytes_per_token": 2 * KV_HEADS * HEAD_DIM * 4}
    return row, cases


def run_interleaved(rows: list[tuple[dict, list]], reps: int) -> None:
    """Each round times every case once, in turn (so load from other processes falls on all of them
    alike); a case's number is its median over the rounds: ms for decode, tokens/s for prefill."""
    times: dict[tuple[int, str], list[float]] = {}
    for rnd in range(reps + 1):
        for i, (_, cases) in enumerate(rows):
            for key, _, fn in cases:
                t0 = time.perf_counter()
                fn()
                if rnd:  # round 0 warms up
                    times.setdefault((i, key), []).append(time.perf_counter() - t0)
    for i, (row, cases) in enumerate(rows):
        for key, tokens, _ in cases:
            sec = statistics.median(times[(i, key)])
            row[key] = sec * 1e3 if key.startswith("decode") else tokens / sec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--flush-denormal", action="store_true", help="torch.set_flush_denormal(True) (FTZ/DAZ) before timing"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    torch.manual_seed(0)
    rows = []
    with torch.inference_mode():
        gdn = GatedDeltaNet(HIDDEN, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128)
        mamba = Mamba2Mixer(HIDDEN, num_heads=64, head_dim=64, state_size=128, n_groups=8)
        for name, layer in (("gated_deltanet", gdn), ("mamba2", mamba)):
            for p in layer.parameters():  # projections scaled so activations stay O(1)
                if p.dim() > 1:
                    p.normal_(0, HIDDEN**-0.5)
            rows.append(mixer_cases(name, layer, args))
            rows.append(dense_cases(f"dense_like_{name}", dense_like(layer), args))
        run_interleaved(rows, args.reps)
    rows = [row for row, _ in rows]
    for row in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    if args.json:
        with open(args.json, "w") as f:
            meta = {
                "threads": args.threads,
                "flush_denormal": args.flush_denormal,
                "torch": torch.__version__,
            }
            json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
