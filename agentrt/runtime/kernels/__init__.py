"""The runtime's kernels: Triton kernels for the CUDA path, each with a torch reference (`*_ref`)
that tests compare it to (on CPU under TRITON_INTERPRET=1, on small shapes), and the C++ kernels of
the CPU path. This module holds the Triton kernels' shared helpers (whether Triton can run here,
`tl.dot` precision, the head-layout check).

Triton (CUDA):
- paged decode attention (split-K, GQA): decode_attention.py
- extend attention (prefill of new tokens over a cached prefix, causal): extend_attention.py
- multi-head latent attention over the one-head latent rows, decode (split-K) and extend: mla_attention.py
- their shared blocks (page-table loads, the online-softmax step): paged.py
- fused RoPE + KV store into the pool: rope_store.py
- token-bitmask apply on the logits: bitmask.py
- the experts of a sparse MoE block as grouped GEMMs: fused_moe.py
- batch-invariant matmul and RMSNorm: batch_invariant.py
- the gated delta rule's decode step over a state pool (Gated DeltaNet): gated_delta_decode.py
- the chunked gated delta rule for prefill, snapshots at segment ends: gated_delta_chunk.py
- the short convolution's decode step over a state pool (Gated DeltaNet, Mamba-2): conv_step.py
- the Mamba-2 (SSD) decode step over a state pool: ssd_decode.py

C++ (CPU): one library built on first use and loaded as torch ops by cpu_kernels.py (its docstring
lists the sources): attention over the KV pool, the fused layer ops, the int8 / int4 matmuls and a
whole decode step's decoder stack.

The Triton kernels' KV addressing is a page table [B, max_pages] int32 of page ids with `page_size` tokens per page:
token j of sequence b sits at slot page_table[b, j // page_size] * page_size + j % page_size of
the pool [num_slots, num_kv_heads, head_dim]. agentrt's pool is token-granular (page_size 1: the
table holds slots); the kernels take any page size.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """TRITON_INTERPRET is set to a true value (Triton reads 1/true/yes/on as its CPU interpreter)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_usable(device: torch.device) -> bool:
    """True when Triton kernels can run on `device`: a CUDA device with triton installed, or any
    device with TRITON_INTERPRET=1 (the CPU interpreter used by tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or interpreting()


def upcast_dot(dtype: torch.dtype) -> bool:
    """Whether attention kernels upcast 16-bit operands to fp32 before `tl.dot`: only under the
    CPU interpreter, whose 16-bit dot is wrong (numpy has no bf16: measured, triton 3.9); a GPU
    keeps bf16/fp16 operands on the tensor cores with fp32 accumulation."""
    return dtype != torch.float32 and interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot` input precision: exact fp32 ("ieee") for fp32 activations (a GPU would otherwise
    round them to TF32), the default for 16-bit ones (whose fp32 upcast is exact under "tf32"
    too) and under the interpreter."""
    return "ieee" if dtype == torch.float32 or interpreting() else "tf32"


def require_contiguous_heads(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming the first tensor whose last dimension (the head vector) is not
    contiguous: the kernels index it with stride 1."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension, got strides {tuple(t.stride())}")
