"""The torch backend: attention over the token-slot KV pool by gather + SDPA (the reference for
every other backend), or, with `cpu_kernel`, the C++ kernels of kernels/cpu_kernels.py (attention
that reads the pool in place, RoPE and the KV write in one op; float32 on the CPU).

`AttentionMetadata` is this backend's forward.ForwardMeta: `prepare_rope` once per forward,
`rope_and_store` (rotate q/k, write k/v to the pool) and `attend` per layer, `layer_view` for a
sliding-window layer.

One forward carries a flat batch of T new tokens from several sequences. Decoding sequences
(one new token each) are attended together, padded to the longest context; prefill chunks are
attended one sequence at a time with a causal mask offset by the tokens already cached.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from agentrt.runtime.forward import BatchInputs, SeqChunk, flatten_chunks, run_forward
from agentrt.runtime.kernels import cpu_kernels
from agentrt.runtime.kv_cache import QuantizedKV, dequantize_kv, gather_kv, quantize_kv, store_kv
from agentrt.runtime.layers.rotary import apply_rope
from agentrt.runtime.recurrent_state import RecurrentBatch, StatePool, recurrent_batch, run_recurrent


def gather_slots(cache, slots: torch.Tensor) -> torch.Tensor:
    """cache [S, Hkv, D] (a tensor or an int8 pool's QuantizedKV), slots [...] int64 -> [..., Hkv, D]:
    the rows of those slots, de-quantized to float32 from an int8 pool (kv_cache.gather_kv).

    `index_select` on the [S, Hkv * D] view copies whole rows; advanced indexing (`cache[slots]`)
    computes an offset per element and took 1.4x as long for a batch-16 decode step's gathers
    (default model, context 400, 2 threads: step 289-318 -> 222 ms, bit-identical)."""
    return gather_kv(cache, slots)


KERNEL_FLOAT_POOLS = (torch.float32, torch.float16)  # float pool dtypes the C++ kernel reads in place


def kernel_cache(cache) -> bool:
    """Whether the C++ attention kernel reads this layer cache in place: float32, float16 or an int8
    pool."""
    return isinstance(cache, QuantizedKV) or cache.dtype in KERNEL_FLOAT_POOLS


def kernel_reads_pool(dtype: torch.dtype) -> bool:
    """Whether the C++ attention kernel reads a KV pool of `dtype` (kv_cache.KVPool: an int8 pool
    is a QuantizedKV) in place."""
    return dtype == torch.int8 or dtype in KERNEL_FLOAT_POOLS


def as_stored(x: torch.Tensor, cache) -> torch.Tensor:
    """x [T, Hkv, D] as attention reads it back from `cache`: through int8 and back (de-quantized,
    in x's dtype) for an int8 pool, rounded to the pool's dtype and back for a float pool of another
    dtype, so that a chunk attending its own new K/V sees what a later chunk reading them from the
    pool sees; x itself when the pool has x's dtype."""
    if isinstance(cache, QuantizedKV):
        return dequantize_kv(*quantize_kv(x)).to(x.dtype)
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


@dataclass
class PrefillSpan:
    """New tokens [start, end) of one sequence in the flat batch.

    context_len: tokens of this sequence already in the KV pool before this chunk.
    kv_slots: [context_len + end - start] int64 slots of the whole context, or None when
        context_len == 0 (attention then reads the chunk's own K/V, no gather).
    tree_mask: [end - start, end - start] bool, True where a new token attends to another new
        token (a speculative draft tree, see speculative/tree.py); None = causal. Every new token
        attends to the whole cached context.
    """

    start: int
    end: int
    context_len: int
    kv_slots: torch.Tensor | None
    tree_mask: torch.Tensor | None = None


class KernelRows(NamedTuple):
    """The keys of every new token of a batch, for the CPU kernel (kernels/cpu_decode_attention.cpp):
    slots [R, L] int64 rows of pool slots (padded with 0), seq [T] int64 the slot row of each new
    token (empty: token t reads row t), lens [T] int64 how many of its row's slots it attends."""

    slots: torch.Tensor
    seq: torch.Tensor
    lens: torch.Tensor


def kernel_rows(chunks, dev: torch.device) -> KernelRows:
    """KernelRows of a flat batch of SeqChunks: a decoding sequence or a prefill chunk is one slot row
    (its whole context), its token i attending the first context_len + i + 1 slots (causal); a draft
    tree's token (tree_mask) gets a row of its own, the context and then its ancestors in order, so
    that it attends exactly the keys it would have had as a decoded token."""
    rows: list[list[int]] = []
    seq: list[int] = []
    lens: list[int] = []
    for chunk in chunks:
        n, ctx = len(chunk.token_ids), chunk.context_len
        if chunk.tree_mask is None:
            seq.extend([len(rows)] * n)
            lens.extend(range(ctx + 1, ctx + n + 1))
            rows.append(list(chunk.slots))
            continue
        mask = chunk.tree_mask.tolist()
        new = chunk.slots[ctx:]
        for i in range(n):
            seq.append(len(rows))
            row = list(chunk.slots[:ctx]) + [s for s, m in zip(new, mask[i]) if m]
            lens.append(len(row))
            rows.append(row)
    width = max(len(r) for r in rows)
    i64 = {"dtype": torch.int64, "device": dev}
    return KernelRows(
        torch.tensor([r + [0] * (width - len(r)) for r in rows], **i64),
        torch.tensor(seq, **i64),
        torch.tensor(lens, **i64),
    )


@dataclass
class AttentionMetadata:
    """slot_mapping: [T] int64 pool slot each new token's K/V is written to.
    decode_idx: [B] int64 positions in the flat batch of the decode tokens (or None).
    decode_slots: [B, L] int64 context slots per decode sequence, padded (padding masked).
    decode_mask: [B, 1, 1, L] bool, True where a key is attended.
    prefills: spans of sequences with more than one new token (or a first token)."""

    slot_mapping: torch.Tensor
    decode_idx: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSpan]
    cos: torch.Tensor | None = None  # [T, head_dim // 2] in the activations' dtype, set by prepare_rope
    sin: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None  # [B] int64 keys per decode sequence (the C++ kernel's input)
    cpu_kernel: bool = False  # attention through kernels/cpu_kernels.py (float32 on the CPU)
    rows: KernelRows | None = None  # every new token's keys, for the C++ kernel (set with cpu_kernel)
    positions: torch.Tensor | None = None  # [T] int64, set by prepare_rope
    rope_dtype: torch.dtype | None = None
    swa_map: torch.Tensor | None = None  # [num_slots] int64 slot -> window row (kv_window.py), or None
    recurrent: RecurrentBatch | None = None  # the recurrent layers' sequences and state pool, or None
    _rope_rows: dict = field(default_factory=dict, repr=False)
    _windowed: dict = field(default_factory=dict, repr=False)
    _window_view: AttentionMetadata | None = field(default=None, repr=False)

    def prepare_rope(
        self, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """Gather the cos/sin rows [T, rotary_dim // 2] of this batch's positions [T] once per forward
        (the model's first RoPE table; `rope_rows` gathers a layer's other table once, on first use)."""
        self.positions, self.rope_dtype = positions, dtype
        self.cos, self.sin = cos_table[positions].to(dtype), sin_table[positions].to(dtype)
        self._rope_rows = {id(cos_table): (self.cos, self.sin)}
        self._windowed = {}
        self._window_view = None

    def run_recurrent(self, mixer, index: int, x: torch.Tensor) -> torch.Tensor:
        """forward.ForwardMeta.run_recurrent."""
        if self.recurrent is None:
            raise ValueError("this forward has no recurrent state pool")
        return run_recurrent(mixer, index, x, self.recurrent)

    def layer_view(self, window: int | None) -> AttentionMetadata:
        """The metadata a layer with sliding window `window` reads (forward.ForwardMeta.layer_view)."""
        return self if window is None or self.swa_map is None else self.window_view()

    def window_view(self) -> AttentionMetadata:
        """This batch's metadata for a sliding-window layer of a SlidingWindowKVPool: every slot
        (written, decoded, gathered, kernel rows) mapped through `swa_map` to the windowed layers'
        rows (built once per forward, after prepare_rope); self when there is no map."""
        if self.swa_map is None:
            return self
        if self._window_view is None:
            m = self.swa_map

            def rows_of(t):
                return None if t is None else m[t]

            self._window_view = dataclasses.replace(
                self,
                slot_mapping=m[self.slot_mapping],
                decode_slots=rows_of(self.decode_slots),
                prefills=[dataclasses.replace(p, kv_slots=rows_of(p.kv_slots)) for p in self.prefills],
                rows=None if self.rows is None else self.rows._replace(slots=m[self.rows.slots]),
                swa_map=None,
                _windowed={},
            )
        return self._window_view

    def rope_rows(self, rope=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, rotary_dim // 2] of this batch's positions for a layer's tables `rope`
        ((cos_table, sin_table) [max_positions, rotary_dim // 2] float32; None = the first)."""
        if rope is None:
            return self.cos, self.sin
        rows = self._rope_rows.get(id(rope[0]))
        if rows is None:
            rows = (rope[0][self.positions].to(self.rope_dtype), rope[1][self.positions].to(self.rope_dtype))
            self._rope_rows[id(rope[0])] = rows
        return rows

    def rope_and_store(self, qkv, heads, k_cache, v_cache, rope=None, v_dim=None):
        """qkv [T, (H + 2 Hkv) D], heads (H, Hkv, D) -> (q [T, H, D], k [T, Hkv, D] rotated, v
        [T, Hkv, D]); k and v are written to the pool (cast to a float pool's dtype, quantized into an
        int8 pool: kv_cache.store_kv). With `cpu_kernel`, float32, a full-width RoPE and a pool the C++
        kernel reads, one C++ op (cpu_kernels.rope_store). rope: the layer's (cos, sin) tables, None =
        the model's first. v_dim: V's width when not D (0: no V in qkv, none written; v [T, Hkv, 0])."""
        num_heads, num_kv_heads, head_dim = heads
        t = qkv.shape[0]
        cos, sin = self.rope_rows(rope)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        if v_dim is not None and v_dim != head_dim:
            v_size = num_kv_heads * v_dim
            q, k, v = qkv.split([q_size, kv_size, v_size], dim=-1)
            q = apply_rope(q.reshape(t, num_heads, head_dim), cos, sin)
            k = apply_rope(k.reshape(t, num_kv_heads, head_dim), cos, sin)
            store_kv(k_cache, self.slot_mapping, k)
            if v_dim:
                store_kv(v_cache, self.slot_mapping, v.reshape(t, num_kv_heads, v_dim))
            return q, k, v.reshape(t, num_kv_heads, v_dim)
        if (
            self.cpu_kernel
            and qkv.dtype == torch.float32
            and 2 * cos.shape[-1] == head_dim
            and kernel_cache(k_cache)
        ):
            q, k = cpu_kernels.rope_store(qkv, cos, sin, k_cache, v_cache, self.slot_mapping, num_heads)
            return q, k, qkv[:, q_size + kv_size :].view(t, num_kv_heads, head_dim)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(t, num_heads, head_dim)
        k = k.reshape(t, num_kv_heads, head_dim)
        v = v.reshape(t, num_kv_heads, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        store_kv(k_cache, self.slot_mapping, k)
        store_kv(v_cache, self.slot_mapping, v)
        return q, k, v

    def attend(
        self, q, k, v, k_cache, v_cache, *, scale=None, window=None, sinks=None, value_dim=None
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] (this batch), caches [S, Hkv, D] (tensors, or an int8 pool's
        QuantizedKV: read de-quantized) -> out [T, H, D].
        scale: softmax scale (None = D ** -0.5); window: a query at position p attends keys at
        positions in (p - window, p] (None = all); sinks: [H] float32 learned logits that join each
        head's softmax without a value (gpt-oss), or None. value_dim: the values are each key row's
        last value_dim features (multi-head latent attention; v / v_cache unread, out [T, H,
        value_dim]), attended by gather + SDPA (the C++ kernels read K and V of one width)."""
        gqa = q.shape[1] != k.shape[1]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        kernel = value_dim is None and q.dtype == torch.float32 and kernel_cache(k_cache)
        if self.rows is not None and kernel:
            rows = self.rows if window is None else self._windowed_rows(window)
            return cpu_kernels.attention(q, k_cache, v_cache, rows, scale=scale, sinks=sinks)
        if self.decode_idx is not None and not self.prefills:
            return self._decode(q, k_cache, v_cache, gqa, scale, window, sinks, value_dim)
        out = q.new_empty(*q.shape[:-1], value_dim) if value_dim else torch.empty_like(q)
        if self.decode_idx is not None:
            out[self.decode_idx] = self._decode(
                q[self.decode_idx], k_cache, v_cache, gqa, scale, window, sinks, value_dim
            )
        for span in self.prefills:
            qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
            n = span.end - span.start
            if span.kv_slots is None:  # the chunk's own K/V, as the pool holds them
                ks = as_stored(k[span.start : span.end], k_cache).transpose(0, 1).unsqueeze(0)
                vs = (
                    ks[..., -value_dim:]
                    if value_dim
                    else as_stored(v[span.start : span.end], v_cache).transpose(0, 1).unsqueeze(0)
                )
                mask = None
                if window is not None or sinks is not None:
                    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            else:
                ks = gather_slots(k_cache, span.kv_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
                vs = (
                    ks[..., -value_dim:]
                    if value_dim
                    else gather_slots(v_cache, span.kv_slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
                )
                total = span.kv_slots.shape[0]
                if span.tree_mask is None:
                    q_pos = torch.arange(span.context_len, span.context_len + n, device=q.device)
                    mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]
                else:
                    mask = torch.ones(n, total, dtype=torch.bool, device=q.device)
                    mask[:, span.context_len :] = span.tree_mask
            if window is not None:  # key positions: the context's are its indexes, new tokens' their own
                q_pos = self.positions[span.start : span.end]
                key_pos = torch.cat((torch.arange(span.context_len, device=q.device), q_pos))
                mask = mask & (key_pos[None, :] > q_pos[:, None] - window)
            if value_dim:
                o = _sdpa_one_kv_head(qs, ks, vs, mask, scale)
            else:
                o = _sdpa(qs, ks, vs, mask, gqa, scale, sinks)
            out[span.start : span.end] = o.squeeze(0).transpose(0, 1)
        return out

    def _windowed_rows(self, window: int) -> KernelRows:
        """self.rows cut to each token's last `window` keys (built once per window and forward)."""
        rows = self._windowed.get(window)
        if rows is None:
            slots, seq, lens = self.rows
            base = slots if seq.numel() == 0 else slots.index_select(0, seq)
            width = min(window, base.shape[1])
            start = (lens - window).clamp(min=0)
            cols = (start[:, None] + torch.arange(width, device=lens.device)[None, :]).clamp(
                max=base.shape[1] - 1
            )
            rows = KernelRows(
                base.gather(1, cols), torch.empty(0, dtype=torch.int64, device=lens.device), lens - start
            )
            self._windowed[window] = rows
        return rows

    def _decode(
        self, q, k_cache, v_cache, gqa: bool, scale: float, window=None, sinks=None, value_dim=None
    ) -> torch.Tensor:
        if (
            self.cpu_kernel
            and value_dim is None
            and q.dtype == torch.float32
            and kernel_cache(k_cache)
            and window is None
        ):
            return cpu_kernels.decode_attention(
                q, k_cache, v_cache, self.decode_slots, self.decode_lens, scale=scale, sinks=sinks
            )
        qd = q.unsqueeze(2)  # [B, H, 1, D]
        kd = gather_slots(k_cache, self.decode_slots).to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
        if value_dim:  # the values are the keys' last value_dim features (MLA's latent)
            vd = kd[..., -value_dim:]
        else:
            vd = gather_slots(v_cache, self.decode_slots).to(q.dtype).transpose(1, 2)
        mask = self.decode_mask
        if window is not None:
            first = (self.decode_lens - window)[:, None, None, None]
            mask = mask & (torch.arange(mask.shape[-1], device=q.device) >= first)
        if value_dim:
            return _sdpa_one_kv_head(qd, kd, vd, mask, scale).squeeze(2)
        return _sdpa(qd, kd, vd, mask, gqa, scale, sinks).squeeze(2)


MQA_MASK_ELEMENTS = 1 << 24  # the folded scores' elements per batch row and matmul (64 MB of float32)


def _sdpa_one_kv_head(q, k, v, mask, scale: float) -> torch.Tensor:
    """Attention of H query heads over one KV head (multi-head latent attention's rows): q [B, H, n,
    D], k [B, 1, L, D], v [B, 1, L, Dv], mask [.., n, L] bool (True = attend) or None (causal, n == L)
    -> [B, H, n, Dv]. The heads are folded into the query rows of the one KV head (row h * n + i), so
    K and V are read as they are: SDPA's enable_gqa first copies them once per head (128 heads, 2,048
    keys of 576, batch 4, 2 threads: 12.9 s against 0.28 s folded). Two matmuls and a float32 softmax,
    not SDPA: with V narrower than K (a view of its last columns) SDPA takes its math path, which took
    1.3-3x as long on these shapes (16 heads x 513 keys: 29 -> 9 ms; 4 x 128 heads x 2,048 keys: 143 ->
    95 ms; loaded Zen 4, 2 threads). Heads are taken in groups whose scores stay within
    MQA_MASK_ELEMENTS per batch row."""
    b, h, n, d = q.shape
    total = k.shape[-2]
    if mask is None:
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    group = max(1, min(h, MQA_MASK_ELEMENTS // max(1, n * total)))
    keys_t = k.transpose(-1, -2)
    outs = []
    for start in range(0, h, group):
        g = min(group, h - start)
        rows = q[:, start : start + g].reshape(b, 1, g * n, d)
        m = mask.expand(mask.shape[0], g, n, total).reshape(mask.shape[0], 1, g * n, total)
        scores = torch.matmul(rows, keys_t).mul_(scale).masked_fill_(~m, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        outs.append(torch.matmul(probs, v).view(b, g, n, v.shape[-1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _sdpa(q, k, v, mask, gqa: bool, scale: float, sinks) -> torch.Tensor:
    """Scaled dot-product attention. q [B, H, n, D], k/v [B, Hkv, L, D], mask [.., n, L] bool
    (True = attend) or None (causal); sinks [H] float32 or None. Without sinks: torch SDPA; with
    them: the softmax over the scores and one sink logit per head, the sink's share dropped
    (transformers' GptOssAttention eager)."""
    if sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None:
        n, total = q.shape[-2], k.shape[-2]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def build_torch_metadata(
    chunks: list[SeqChunk],
    dev: torch.device,
    cpu_kernel: bool = False,
    swa_map: torch.Tensor | None = None,
    states: StatePool | None = None,
) -> BatchInputs:
    """Inputs of the torch path for a flat batch of SeqChunks: decoding sequences gather their
    context slots padded to the longest (or, with cpu_kernel, the C++ decode kernel reads them in
    place); the others are prefill spans. swa_map: a sliding-window pool's slot -> row map; states:
    the recurrent layers' state pool (recurrent_state.recurrent_batch), or None."""
    ids, positions, new_slots, logit_idx = flatten_chunks(chunks)
    decode_rows, prefills, start = [], [], 0
    for chunk in chunks:
        n = len(chunk.token_ids)
        if n == 1 and chunk.context_len > 0:
            decode_rows.append((start, chunk.slots))
        else:
            kv_slots = None
            if chunk.context_len > 0:
                kv_slots = torch.tensor(chunk.slots, dtype=torch.int64, device=dev)
            tree_mask = chunk.tree_mask.to(dev) if chunk.tree_mask is not None else None
            prefills.append(PrefillSpan(start, start + n, chunk.context_len, kv_slots, tree_mask))
        start += n
    decode_idx = decode_slots = decode_mask = lens = None
    if decode_rows:
        max_len = max(len(s) for _, s in decode_rows)
        padded = [s + [0] * (max_len - len(s)) for _, s in decode_rows]
        decode_idx = torch.tensor([i for i, _ in decode_rows], dtype=torch.int64, device=dev)
        decode_slots = torch.tensor(padded, dtype=torch.int64, device=dev)
        lens = torch.tensor([len(s) for _, s in decode_rows], device=dev)
        decode_mask = (torch.arange(max_len, device=dev)[None, :] < lens[:, None])[:, None, None, :]
    i64 = {"dtype": torch.int64, "device": dev}
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=dev),
        decode_idx=decode_idx,
        decode_slots=decode_slots,
        decode_mask=decode_mask,
        prefills=prefills,
        decode_lens=lens,
        cpu_kernel=cpu_kernel,
        rows=None,
        swa_map=swa_map,
        recurrent=recurrent_batch(chunks, states),
    )
    if cpu_kernel and chunks:  # a decode-only batch's rows are its decode slots (no second copy)
        only_decode = not prefills and decode_slots is not None
        meta.rows = (
            KernelRows(decode_slots, torch.empty(0, **i64), lens) if only_decode else kernel_rows(chunks, dev)
        )
    return BatchInputs(
        meta, torch.tensor(ids, **i64), torch.tensor(positions, **i64), torch.tensor(logit_idx, **i64)
    )


class TorchBackend:
    """forward.ForwardMeta by this module (`cpu_kernel`: the C++ attention and RoPE + KV write), the
    model run eagerly. model: a models/base.DecoderModel; kv: the runner's KV pool (kv_cache.KVPool
    or kv_window.SlidingWindowKVPool)."""

    captured_sizes: tuple[int, ...] = ()

    def __init__(self, model, kv, device: torch.device, cpu_kernel: bool, reason: str = ""):
        self.model, self.kv, self.device, self.cpu_kernel = model, kv, device, cpu_kernel
        self.name = "cpu" if cpu_kernel else "torch"
        self.reason = reason

    def prepare(self, chunks: list[SeqChunk]) -> BatchInputs:
        return build_torch_metadata(chunks, self.device, self.cpu_kernel, self.kv.swa_map, self.kv.states)

    def run(self, chunks: list[SeqChunk], return_hidden: bool = False):
        """Logits [N, vocab] fp32 (with return_hidden, and the hidden rows [N, hidden]): see
        forward.run_forward."""
        return run_forward(self.model, self.kv.k, self.kv.v, chunks, self.prepare, self.device, return_hidden)

    # why a cpu backend does not take the C++ whole-stack decode (set by backends.make_backend), or ""
    stack_note: str = ""

    def describe(self) -> str:
        return f"decode eager ({self.stack_note})" if self.stack_note else "decode eager"
