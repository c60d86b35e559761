"""What one forward is made of, on the ground floor (torch only): the chunks a step runs
(`SeqChunk`), the inputs a backend prepares from them (`BatchInputs`), everything a layer may ask
of the forward (`ForwardMeta`), and the element-wise ops a model is built with (`LayerOps`).

A backend (runtime/backends/) turns a batch of SeqChunks into BatchInputs whose `meta` is its own
ForwardMeta; a layer reaches the KV pool only through that object, and its element-wise ops were
bound when the model was built, so no layer asks which backend runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F


@dataclass
class SeqChunk:
    """One sequence's part of a forward: `token_ids` new tokens at positions
    [context_len, context_len + len(token_ids)); `slots` are the KV slots of the whole context
    including the new tokens (len == context_len + len(token_ids)). `need_logits`: return the
    logits of the last `num_logits` new tokens (False for a prefill chunk that does not end the
    prompt; num_logits > 1 for a speculative verify chunk). `positions`: explicit positions of the
    new tokens (a draft tree: context_len + depth), with `tree_mask` [n, n] bool saying which new
    tokens each attends to; None = consecutive positions, causal. `seq_key`: identifies the
    sequence across steps (the Triton path keeps its slots on the device and uploads only new
    ones); None = anonymous (uploaded in full). For a model with recurrent layers
    (recurrent_state.py): `state_slot` the sequence's working state slot (read unless
    context_len == 0, then updated in place) and `snapshots` (n, slot) pairs: the state after the
    first n new tokens is copied into `slot`."""

    token_ids: list[int]
    context_len: int
    slots: list[int]
    need_logits: bool = True
    num_logits: int = 1
    positions: list[int] | None = None
    tree_mask: torch.Tensor | None = None
    seq_key: object | None = None
    state_slot: int | None = None
    snapshots: tuple[tuple[int, int], ...] = ()


def is_plain_decode(chunks: list[SeqChunk]) -> bool:
    """Every chunk decodes one token after a cached context and wants its logits (no tree): the
    batches the CUDA graphs, the compiled decode step and the C++ whole-stack op take."""
    return all(
        len(c.token_ids) == 1
        and c.context_len > 0
        and c.need_logits
        and c.num_logits == 1
        and c.tree_mask is None
        and c.positions is None
        for c in chunks
    )


class ForwardMeta(Protocol):
    """All a layer may ask of a forward (mini-sglang's `BaseAttnMetadata`, vLLM's attention
    metadata): one object per forward, built by the backend's `prepare`.

    slot_mapping: [T] int64 pool slot each new token's K/V is written to (-1: a padding row).
    Caches are one layer's [S, Hkv, D] pool tensors, or an int8 pool's kv_cache.QuantizedKV.
    """

    slot_mapping: torch.Tensor

    def prepare_rope(
        self, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """Called once per forward with the model's first RoPE tables [max_positions, rotary_dim // 2]
        float32 and the activations' dtype."""
        ...

    def rope_and_store(
        self,
        qkv: torch.Tensor,
        heads: tuple[int, int, int],
        k_cache,
        v_cache,
        rope=None,
        v_dim: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2 Hkv) D] (q/k already normed), heads = (H, Hkv, D) -> (q [T, H, D] rotated,
        k [T, Hkv, D], v [T, Hkv, D]); k (rotated) and v are written to the caches. rope: the layer's
        (cos, sin) tables, None = the model's first. v_dim: the V heads' width when not D; 0 = qkv
        [T, (H + Hkv) D] holds no V and nothing is written to v_cache (multi-head latent attention,
        layers/mla.py: its latent is K's)."""
        ...

    def attend(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        *,
        scale: float,
        window: int | None = None,
        sinks=None,
        value_dim: int | None = None,
    ) -> torch.Tensor:
        """q [T, H, D] -> out [T, H, D]: softmax(q k^T * scale) v over each token's keys; window: a
        query at position p attends keys in (p - window, p] (None = all); sinks: [H] float32 logits
        that join each head's softmax without a value, or None. value_dim: each key row's last
        value_dim features are its value (K and V one row: multi-head latent attention), v and
        v_cache are not read and out is [T, H, value_dim]."""
        ...

    def run_recurrent(self, mixer, index: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]: a recurrent mixer (recurrent_state.run_recurrent) over each
        sequence of the batch, with recurrent layer `index`'s states of the forward's state pool.
        Raises ValueError when the forward has no state pool."""
        ...

    def layer_view(self, window: int | None) -> ForwardMeta:
        """This forward's metadata for a layer with sliding window `window` (None = full attention):
        the windowed layers' rows of a sliding-window pool (kv_window.py), else self."""
        ...


class BatchInputs(NamedTuple):
    """What one forward needs, on the device: input_ids [T] int64, positions [T] int64, the
    backend's ForwardMeta, logit_idx [N] int64 rows whose logits are wanted."""

    meta: ForwardMeta
    input_ids: torch.Tensor
    positions: torch.Tensor
    logit_idx: torch.Tensor


def flatten_chunks(chunks: list[SeqChunk]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(token ids, positions, new tokens' slots, logits rows) of a flat batch of SeqChunks."""
    ids, positions, new_slots, logit_idx = [], [], [], []
    for chunk in chunks:
        n = len(chunk.token_ids)
        start = len(ids)
        ids.extend(chunk.token_ids)
        positions.extend(
            chunk.positions
            if chunk.positions is not None
            else range(chunk.context_len, chunk.context_len + n)
        )
        new_slots.extend(chunk.slots[chunk.context_len :])
        if chunk.need_logits:
            logit_idx.extend(range(start + n - chunk.num_logits, start + n))
    return ids, positions, new_slots, logit_idx


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cast_last: bool = False
) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) as written in PyTorch: x [..., D], weight [D] -> [..., D] in
    x's dtype; cast_last: the product in float32, cast once (Gemma's order)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if cast_last:
        return (x * weight.float()).to(dtype)
    return weight * x.to(dtype)


@dataclass(frozen=True)
class LayerOps:
    """The element-wise ops a model is built with, chosen once per run (mini-sglang's
    `layers/norm.py`, vLLM's `CustomOp.dispatch_forward`): the layers call these and never ask
    which backend runs them.

    rms_norm(x [R, D], weight [D], eps, cast_last) -> [R, D];
    add_rms_norm(x [T, D], residual [T, D] or None, weight, eps, cast_last) -> (residual + x, its norm);
    silu_mul(gate_up [T, 2I]) -> [T, I] (SiLU(gate) * up, gate first).
    """

    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float, bool], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor | None, torch.Tensor, float, bool], tuple[torch.Tensor, torch.Tensor]
    ]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


def _torch_add_rms_norm(x, residual, weight, eps, cast_last=False):
    residual = x if residual is None else residual + x
    return residual, torch_rms_norm(residual, weight, eps, cast_last)


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


TORCH_OPS = LayerOps("torch", torch_rms_norm, _torch_add_rms_norm, _torch_silu_mul)


def run_forward(
    model,
    k_caches,
    v_caches,
    chunks: list[SeqChunk],
    prepare: Callable[[list[SeqChunk]], BatchInputs],
    device: torch.device,
    return_hidden: bool = False,
):
    """One eager forward of `model` (forward(ids, positions, k_caches, v_caches, meta) -> hidden,
    compute_logits(hidden) -> logits) over the inputs `prepare` builds from `chunks`: logits [N, vocab]
    fp32 for the rows each chunk asks (need_logits, num_logits; in order), with return_hidden
    (logits, hidden [N, hidden_size] after the final norm). An empty batch gives [0, vocab]."""
    if not chunks:
        empty = torch.empty(0, model.arch.vocab_size, device=device)
        return (empty, torch.empty(0, model.arch.hidden_size, device=device)) if return_hidden else empty
    batch = prepare(chunks)
    hidden = model(batch.input_ids, batch.positions, k_caches, v_caches, batch.meta)
    rows = hidden[batch.logit_idx]
    logits = model.compute_logits(rows)
    return (logits, rows) if return_hidden else logits
