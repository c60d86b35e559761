"""How a forward runs, chosen once at start and handed down as one object (mini-sglang's
`attention/__init__.py` registry, vLLM's attention backends).

A `Backend` turns a batch of forward.SeqChunks into forward.BatchInputs (its own ForwardMeta) and
runs the model over them. The backends:

- `torch` (backends/torch_attention.py): gather + SDPA, the reference;
- `cpu`: the torch backend with the C++ kernels (attention in place, RoPE + KV write in one op), and
  decode-only batches through the C++ whole-stack op where the model is its layout
  (backends/cpu_stack.py), or through the compiled decode graphs with `compiled`
  (backends/compiled_decode.py, which also wraps `torch`);
- `triton` (backends/triton.py), with CUDA graphs for decode (backends/cuda_graph.py).

`make_backend` is where a backend's name becomes an object; `choose_layer_ops` picks the
element-wise ops the model is built with, before it is built, and `describe_attention` names the
choice on the start line (outside this package only run_plan.py and platform.py, which choose it,
read the name: tests/test_decide_once.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from agentrt.runtime.backends.torch_attention import TorchBackend, build_torch_metadata
from agentrt.runtime.forward import TORCH_OPS, BatchInputs, LayerOps, SeqChunk, run_forward

# Why a hybrid model's decode on the Triton backend runs eagerly (the start line and run_plan say it)
GRAPHS_SKIP_RECURRENT = "CUDA graphs do not capture the recurrent layers' state updates"


class Backend(Protocol):
    """name: the attention backend (`torch`, `cpu`, `triton`); reason: why it was chosen."""

    name: str
    reason: str
    captured_sizes: tuple[int, ...]  # decode batch sizes replayed from captured CUDA graphs, () if none

    def prepare(self, chunks: list[SeqChunk]) -> BatchInputs:
        """The inputs of one forward over `chunks`, with this backend's ForwardMeta."""
        ...

    def run(self, chunks: list[SeqChunk], return_hidden: bool = False):
        """Logits [N, vocab] fp32 of the rows the chunks ask (need_logits, num_logits; in order);
        with return_hidden, (logits, hidden [N, hidden_size] after the final norm)."""
        ...

    def describe(self) -> str:
        """How decode steps run, for the start line."""
        ...


def choose_layer_ops(backend: str, linear_kernel: str) -> LayerOps:
    """The element-wise ops a model is built with: the batch-invariant Triton norms with the Triton
    linear kernel (`--deterministic` on CUDA, or requested), the C++ ops with the `cpu` backend,
    torch's otherwise."""
    silu_mul = TORCH_OPS.silu_mul
    if backend == "cpu":
        from agentrt.runtime.kernels.cpu_kernels import CPU_OPS

        if linear_kernel != "triton":
            return CPU_OPS
        silu_mul = CPU_OPS.silu_mul
    if linear_kernel == "triton":
        from agentrt.runtime.kernels.batch_invariant import invariant_ops

        return invariant_ops(silu_mul)
    return TORCH_OPS


def make_backend(
    name: str,
    model,
    kv,
    device: torch.device,
    *,
    reason: str = "",
    compiled: bool = False,
    max_num_seqs: int = 16,
    max_len: int = 0,
    graph_batch_sizes=(1,),
    capture_graphs: bool = False,
    cache_dir: Path | None = None,
    threads: int = 1,
) -> Backend:
    """The backend `name` (platform.choose_attention_backend's choice) over `model` and its KV pool
    `kv`. compiled: decode through the AOTInductor graphs (CPU; `cache_dir`, `threads` key the
    build); the Triton backend's slot table holds 2 x max_num_seqs + 8 sequences of max_len + 128
    slots (a verify chunk may hold 65 tokens past the context), its CUDA graphs the
    `graph_batch_sizes` up to max_num_seqs (captured with capture_graphs; none for a model with
    recurrent layers, whose decode runs eagerly). Raises ValueError for an unknown name."""
    if name == "triton":
        from agentrt.runtime.backends.cuda_graph import CudaGraphBackend
        from agentrt.runtime.backends.triton import TritonBackend

        eager = TritonBackend(model, kv, device, 2 * max_num_seqs + 8, max_len + 128, reason)
        if model.arch.recurrent_layers:  # the graphs' static metadata carries no state slots
            eager.graph_note = GRAPHS_SKIP_RECURRENT if capture_graphs else ""
            return eager
        sizes = [b for b in graph_batch_sizes if b <= max(max_num_seqs, 1)] or [1]
        return CudaGraphBackend(eager, sizes, capture_graphs)
    if name not in ("torch", "cpu"):
        raise ValueError(f"unknown attention backend {name!r} (known: torch, cpu, triton)")
    torch_backend = TorchBackend(model, kv, device, name == "cpu", reason)
    if compiled:
        from agentrt.runtime.backends.compiled_decode import CompiledDecodeBackend

        return CompiledDecodeBackend(torch_backend, max_num_seqs, cache_dir, threads)
    if name == "cpu":
        from agentrt.runtime.backends import cpu_stack

        if cpu_stack.stack_weights(model) is not None:
            return cpu_stack.CpuStackBackend(torch_backend)
        missing = cpu_stack.unsupported(model.arch)
        torch_backend.stack_note = (
            f"layer by layer: the C++ whole-stack op does not implement {', '.join(sorted(missing))}"
            if missing
            else "layer by layer: the C++ whole-stack op needs every projection on a C++ int8/int4 kernel"
        )
    return torch_backend


def describe_attention(backend: str, kv_dtype: torch.dtype) -> tuple[str, str]:
    """(the attention backend as the start line names it, the KV pool's dtype name): the cpu backend
    says where a pool's dtype sends attention to torch's path instead."""
    from agentrt.runtime.backends.torch_attention import kernel_reads_pool

    kv = str(kv_dtype).removeprefix("torch.")
    if backend == "cpu" and not kernel_reads_pool(kv_dtype):
        backend += f" (torch's path: the C++ kernel does not read a {kv} pool; not batch-invariant)"
    return backend, kv


@torch.inference_mode()
def run_chunks(
    model,
    k_caches,
    v_caches,
    chunks: list[SeqChunk],
    device: torch.device,
    return_hidden: bool = False,
    swa_map: torch.Tensor | None = None,
):
    """One eager forward over the torch reference path (gather + SDPA; no C++ attention): logits
    [N, vocab] fp32, with return_hidden (logits, hidden [N, hidden_size]); see forward.run_forward.
    What a draft model, Medusa training and the tests run outside a runner's own backend."""
    return run_forward(
        model,
        k_caches,
        v_caches,
        chunks,
        lambda c: build_torch_metadata(c, device, False, swa_map),
        device,
        return_hidden,
    )
