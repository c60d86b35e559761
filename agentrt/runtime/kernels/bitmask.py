"""Token-bitmask apply: set the logits of tokens a grammar forbids to -inf, in place.

The bitmask layout is xgrammar's: [B, ceil(V / 32)] int32, bit j % 32 of word j // 32 set when
token j is allowed. One launch covers every masked row of the batch (rows chosen by `indices`
on the device, so no per-row Python loop and no host sync).

The engine reaches it only through `agentrt.runtime.sampler.apply_bitmask`, which uses this kernel
on CUDA and xgrammar's C++ kernel elsewhere (why, with timings: that function's docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_bitmask_kernel(
    Logits, Bitmask, Indices, vocab_size, stride_l, stride_b, HAS_INDICES: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(Indices + i) if HAS_INDICES else i
    offs = block * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab_size
    words = tl.load(Bitmask + row * stride_b + offs // 32, mask=in_vocab, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(Logits + row * stride_l + offs, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """In place on logits [B, V] fp32/bf16 (last dim contiguous): logits[r, j] = -inf where bit j
    of bitmask[r] is 0, for the rows r in `indices` ([N] int32/int64 on the logits' device; None =
    every row). bitmask: [B, ceil(V / 32)] int32 on the logits' device. Raises ValueError when
    the bitmask is too narrow for V, sits on another device, or either last dim is strided."""
    batch, vocab = logits.shape
    if (
        bitmask.shape[-1] * 32 < vocab
        or bitmask.device != logits.device
        or logits.stride(1) != 1
        or bitmask.stride(-1) != 1
    ):
        raise ValueError(
            f"bitmask {tuple(bitmask.shape)} on {bitmask.device} does not cover logits "
            f"{tuple(logits.shape)} on {logits.device}"
        )
    num_rows = batch if indices is None else indices.shape[0]
    if num_rows == 0:
        return
    block = 4096
    _apply_bitmask_kernel[(num_rows, triton.cdiv(vocab, block))](
        logits,
        bitmask,
        indices if indices is not None else bitmask,
        vocab,
        logits.stride(0),
        bitmask.stride(0),
        HAS_INDICES=indices is not None,
        BLOCK=block,
    )


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """Torch reference of `apply_token_bitmask` (unpacks the bits)."""
    vocab = logits.shape[1]
    rows = range(logits.shape[0]) if indices is None else indices.tolist()
    bits = torch.arange(vocab, device=logits.device)
    for r in rows:
        allowed = ((bitmask[r, bits // 32] >> (bits % 32)) & 1).bool()
        logits[r].masked_fill_(~allowed, float("-inf"))
