"""The Triton backend (CUDA; the CPU interpreter in tests): a persistent device slot table and
the per-forward metadata that drives the kernels in runtime/kernels/.

`TritonAttentionMetadata` is a forward.ForwardMeta, as the torch backend's `AttentionMetadata`.
A batch where every sequence decodes one token runs the split-K decode kernel (and can be
replayed from a CUDA graph, see cuda_graph.py); any other batch (prefill chunks, speculative
verify chunks, mixed) runs the extend kernel for all its sequences, a decode being an extend of
one token. Multi-head latent attention layers (layers/mla.py) run kernels/mla_attention.py's decode
and extend forms the same way.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from agentrt.runtime.forward import BatchInputs, SeqChunk, flatten_chunks, run_forward
from agentrt.runtime.kernels.decode_attention import decode_attention, decode_splits
from agentrt.runtime.kernels.extend_attention import extend_attention
from agentrt.runtime.kernels.mla_attention import mla_decode, mla_extend
from agentrt.runtime.kernels.rope_store import rope_and_store
from agentrt.runtime.recurrent_state import RecurrentBatch, StatePool, recurrent_batch, run_recurrent

# The Triton backend replaces the attention alone (rope_and_store, attend): every other layout feature
# (models/config.py ModelArch.layout_features: norms, MLPs, MoE routing, biases) runs as the layers'
# own torch ops under it. These attention layouts its kernels do not implement:
UNSUPPORTED: frozenset[str] = frozenset()


def unsupported(arch) -> frozenset[str]:
    """The layout features of `arch` (ModelArch) the Triton attention does not implement (empty: it
    runs this model); run_plan then takes the torch backend and says why."""
    return arch.layout_features() & UNSUPPORTED


class SlotTable:
    """KV slots of each running sequence, one row per sequence, on the device (SGLang's
    req_to_token pool): [num_rows, max_len] int32.

    `sync` gives each sequence a row and uploads only the slots that changed since the previous
    step (usually the one new token), so a step costs O(new tokens) host-to-device traffic rather
    than O(context). Rows of sequences absent from a step stay until a new sequence needs one
    (least recently used first); correctness never depends on a key's history, since the cached
    copy is compared with the sequence's slots every step.
    """

    def __init__(self, num_rows: int, max_len: int, device: torch.device):
        self.max_len = max_len
        self.table = torch.zeros(num_rows, max_len, dtype=torch.int32, device=device)
        self._rows: OrderedDict[Hashable, tuple[int, list[int]]] = OrderedDict()
        self._free = list(range(num_rows - 1, -1, -1))

    def sync(self, entries: list[tuple[Hashable, list[int]]]) -> list[int]:
        """Rows (in order) for entries of (sequence key, its KV slots). Raises ValueError when a
        sequence is longer than max_len or the batch has more sequences than rows."""
        keys = {key for key, _ in entries}
        if len(keys) != len(entries):
            raise ValueError("a sequence appears twice in one batch")
        longest = max((len(slots) for _, slots in entries), default=0)
        if longest > self.max_len:
            raise ValueError(f"sequence of {longest} tokens exceeds the slot table's {self.max_len}")
        new_keys = sum(1 for key in keys if key not in self._rows)
        spare = len(self._free) + sum(1 for key in self._rows if key not in keys)
        if new_keys > spare:  # checked before any change, so a refused batch leaves the table as it was
            raise ValueError(f"more sequences in one batch than the slot table's {self.table.shape[0]} rows")
        rows, r_idx, c_idx, vals = [], [], [], []
        for key, slots in entries:
            entry = self._rows.pop(key, None)
            if entry is None:
                row, synced = self._take_row(keys), []
            else:
                row, synced = entry
            n = len(synced)
            start = n if n <= len(slots) and slots[:n] == synced else 0
            r_idx.extend([row] * (len(slots) - start))
            c_idx.extend(range(start, len(slots)))
            vals.extend(slots[start:])
            self._rows[key] = (row, list(slots))
            rows.append(row)
        if vals:
            dev = self.table.device
            self.table[torch.tensor(r_idx, device=dev), torch.tensor(c_idx, device=dev)] = torch.tensor(
                vals, dtype=torch.int32, device=dev
            )
        return rows

    def _take_row(self, in_use: set) -> int:
        if self._free:
            return self._free.pop()
        for key in self._rows:  # least recently used first (sync checked that one exists)
            if key not in in_use:
                return self._rows.pop(key)[0]
        raise AssertionError("no row to recycle")


@dataclass
class TritonAttentionMetadata:
    """slot_mapping: [T] int64 pool slot of each new token (-1: a padding row, not stored).
    positions: [T] int64. page_table: the SlotTable's [rows, max_len] int32; page_rows: [B] int32
    row per sequence. Decode batches (is_decode): seq_lens [B] int32 (context incl. the new token),
    num_splits (split-K launch constant). Extend batches: q_starts / q_lens / prefix_lens [B] int32,
    max_q_len, and optionally a flat uint8 tree mask with int64 offsets per sequence."""

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    page_table: torch.Tensor
    page_rows: torch.Tensor
    is_decode: bool
    seq_lens: torch.Tensor | None = None
    num_splits: int = 1
    q_starts: torch.Tensor | None = None
    q_lens: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    max_q_len: int = 1
    tree_mask: torch.Tensor | None = None
    tree_offsets: torch.Tensor | None = None
    cos_table: torch.Tensor | None = None
    sin_table: torch.Tensor | None = None
    swa_map: torch.Tensor | None = None  # [num_slots] int64 slot -> window row (kv_window.py), or None
    recurrent: RecurrentBatch | None = None  # the recurrent layers' sequences and state pool, or None
    _window_view: TritonAttentionMetadata | None = None

    def prepare_rope(self, positions, cos_table, sin_table, dtype) -> None:
        """Keep the fp32 cos/sin tables [max_positions, head_dim // 2]; the kernel gathers rows."""
        self.cos_table, self.sin_table = cos_table, sin_table
        self._window_view = None

    def run_recurrent(self, mixer, index: int, x: torch.Tensor) -> torch.Tensor:
        """forward.ForwardMeta.run_recurrent, scanned by the Triton kernels over the state pool's
        slots in place (backends/triton_recurrent.py)."""
        from agentrt.runtime.backends.triton_recurrent import triton_scans

        if self.recurrent is None:
            raise ValueError("this forward has no recurrent state pool")
        return run_recurrent(mixer, index, x, self.recurrent, triton_scans(mixer))

    def layer_view(self, window: int | None) -> TritonAttentionMetadata:
        """The metadata a layer with sliding window `window` reads (forward.ForwardMeta.layer_view)."""
        return self if window is None or self.swa_map is None else self.window_view()

    def window_view(self) -> TritonAttentionMetadata:
        """This batch's metadata for a sliding-window layer of a SlidingWindowKVPool: the new tokens'
        slots (padding -1 kept) and the whole page table mapped through `swa_map` to the windowed
        layers' rows; built once per forward (inside a captured CUDA graph, part of the graph)."""
        if self.swa_map is None:
            return self
        if self._window_view is None:
            m = self.swa_map
            sm = self.slot_mapping
            self._window_view = dataclasses.replace(
                self,
                slot_mapping=torch.where(sm >= 0, m[sm.clamp(min=0)], sm),
                page_table=m[self.page_table.long()].to(torch.int32),
                swa_map=None,
                _window_view=None,
            )
        return self._window_view

    def rope_rows(self, rope=None):
        """The layer's (cos, sin) tables themselves: the Triton kernels gather the positions' rows."""
        return rope if rope is not None else (self.cos_table, self.sin_table)

    def rope_and_store(self, qkv, heads, k_cache, v_cache, rope=None, v_dim=None):
        """qkv [T, (H + 2 Hkv) D], heads (H, Hkv, D) -> (q [T, H, D] rotated, k [T, Hkv, D] unrotated:
        the kernels read K from the pool, v [T, Hkv, D]); k rotated and v are written to the pool in one
        kernel. rope: the layer's (cos, sin) tables [max_positions, rotary_dim // 2], None = the
        model's first. v_dim 0: qkv holds no V and none is stored (multi-head latent attention, v
        [T, Hkv, 0]). Raises NotImplementedError for another V width than D or 0."""
        num_heads, num_kv_heads, head_dim = heads
        if v_dim is not None and v_dim not in (0, head_dim):
            raise NotImplementedError("the Triton attention stores V of K's width or none (v_dim 0)")
        t = qkv.shape[0]
        v_dim = head_dim if v_dim is None else v_dim
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * v_dim], dim=-1)
        q = q.reshape(t, num_heads, head_dim)
        k = k.reshape(t, num_kv_heads, head_dim)
        v = v.reshape(t, num_kv_heads, v_dim)
        cos_table, sin_table = self.rope_rows(rope)
        v_in, v_out = (v, v_cache) if v_dim else (None, None)
        q = rope_and_store(
            q, k, v_in, cos_table, sin_table, self.positions, self.slot_mapping, k_cache, v_out
        )
        return q, k, v

    def attend(
        self, q, k, v, k_cache, v_cache, *, scale=None, window=None, sinks=None, value_dim=None
    ) -> torch.Tensor:
        """q [T, H, D] -> out [T, H, D]; K/V come from the pool (the new tokens' are stored). scale,
        window, sinks: as forward.ForwardMeta.attend. value_dim: multi-head latent attention, out
        [T, H, value_dim] (`attend_latent`)."""
        if value_dim is not None:
            return self.attend_latent(q, k_cache, scale, value_dim, window, sinks)
        extra = {}
        if window is not None:
            extra["window"] = window
        if sinks is not None:
            extra["sinks"] = sinks
        if self.is_decode:
            return decode_attention(
                q,
                k_cache,
                v_cache,
                self.page_table,
                self.seq_lens,
                sm_scale=scale,
                num_splits=self.num_splits,
                page_rows=self.page_rows,
                **extra,
            )
        out = torch.zeros_like(q)
        return extend_attention(
            q,
            k_cache,
            v_cache,
            self.q_starts,
            self.q_lens,
            self.prefix_lens,
            self.page_table,
            self.max_q_len,
            tree_mask=self.tree_mask,
            tree_offsets=self.tree_offsets,
            sm_scale=scale,
            out=out,
            page_rows=self.page_rows,
            **extra,
        )

    def attend_latent(self, q, k_cache, scale, value_dim: int, window=None, sinks=None) -> torch.Tensor:
        """Multi-head latent attention (layers/mla.py) by kernels/mla_attention.py: q [T, H, D] over
        the one-head rows k_cache [S, 1, D], the values their last value_dim features -> [T, H,
        value_dim]; the split-K decode kernel for a decode batch, else its extend form (trees too).
        Raises NotImplementedError for a window or sinks (no latent-attention model has them)."""
        if window is not None or sinks is not None:
            raise NotImplementedError("the Triton latent attention takes no window or sinks")
        if self.is_decode:
            return mla_decode(
                q, k_cache, self.page_table, self.seq_lens, value_dim, sm_scale=scale,
                num_splits=self.num_splits, page_rows=self.page_rows,
            )  # fmt: skip
        return mla_extend(
            q, k_cache, self.q_starts, self.q_lens, self.prefix_lens, self.page_table, self.max_q_len,
            value_dim, sm_scale=scale, page_rows=self.page_rows, tree_mask=self.tree_mask,
            tree_offsets=self.tree_offsets, out=q.new_zeros(*q.shape[:2], value_dim),
        )  # fmt: skip


def build_triton_metadata(
    chunks: list[SeqChunk],
    table: SlotTable,
    dev: torch.device,
    swa_map: torch.Tensor | None = None,
    states: StatePool | None = None,
) -> BatchInputs:
    """Inputs of the Triton path for a flat batch of SeqChunks; uploads the chunks' new slots to
    `table`. swa_map: a sliding-window pool's slot -> row map; states: the recurrent layers' state
    pool (recurrent_state.recurrent_batch, which raises ValueError for a chunk without a state slot
    or with a draft tree), or None."""
    ids, positions, new_slots, logit_idx = flatten_chunks(chunks)
    q_lens = [len(c.token_ids) for c in chunks]
    prefix_lens = [c.context_len for c in chunks]
    q_starts = [0]
    for n in q_lens[:-1]:
        q_starts.append(q_starts[-1] + n)
    trees = [c.tree_mask for c in chunks]
    rows = table.sync(
        [(c.seq_key if c.seq_key is not None else ("anon", i), c.slots) for i, c in enumerate(chunks)]
    )
    i32, i64 = {"dtype": torch.int32, "device": dev}, {"dtype": torch.int64, "device": dev}
    is_decode = all(n == 1 and p > 0 for n, p in zip(q_lens, prefix_lens)) and all(t is None for t in trees)
    meta = TritonAttentionMetadata(
        slot_mapping=torch.tensor(new_slots, **i64),
        positions=torch.tensor(positions, **i64),
        page_table=table.table,
        page_rows=torch.tensor(rows, **i32),
        is_decode=is_decode,
        swa_map=swa_map,
        recurrent=recurrent_batch(chunks, states),
    )
    if is_decode:
        meta.seq_lens = torch.tensor([p + 1 for p in prefix_lens], **i32)
        meta.num_splits = decode_splits(max(prefix_lens) + 1)
    else:
        meta.q_starts, meta.q_lens = torch.tensor(q_starts, **i32), torch.tensor(q_lens, **i32)
        meta.prefix_lens, meta.max_q_len = torch.tensor(prefix_lens, **i32), max(q_lens)
        if any(t is not None for t in trees):
            blocks, offsets, acc = [], [], 0
            for n, t in zip(q_lens, trees):
                block = t if t is not None else torch.ones(n, n, dtype=torch.bool).tril()
                blocks.append(block.reshape(-1).to(torch.uint8).cpu())
                offsets.append(acc)
                acc += n * n
            meta.tree_mask = torch.cat(blocks).to(dev)
            meta.tree_offsets = torch.tensor(offsets, **i64)
    return BatchInputs(meta, torch.tensor(ids, **i64), meta.positions, torch.tensor(logit_idx, **i64))


class TritonBackend:
    """forward.ForwardMeta by the Triton kernels over a device slot table of `num_rows` sequences of
    at most `max_len` slots, the model run eagerly (cuda_graph.CudaGraphBackend replays decode)."""

    captured_sizes: tuple[int, ...] = ()
    name = "triton"

    def __init__(self, model, kv, device: torch.device, num_rows: int, max_len: int, reason: str = ""):
        self.model, self.kv, self.device, self.reason = model, kv, device, reason
        self.slot_table = SlotTable(num_rows, max_len, device)

    def prepare(self, chunks: list[SeqChunk]) -> BatchInputs:
        return build_triton_metadata(chunks, self.slot_table, self.device, self.kv.swa_map, self.kv.states)

    def run(self, chunks: list[SeqChunk], return_hidden: bool = False):
        """Logits [N, vocab] fp32 (with return_hidden, and the hidden rows): forward.run_forward."""
        return run_forward(self.model, self.kv.k, self.kv.v, chunks, self.prepare, self.device, return_hidden)

    # why decode does not replay CUDA graphs here (set by backends.make_backend), or ""
    graph_note: str = ""

    def describe(self) -> str:
        return f"decode eager ({self.graph_note})" if self.graph_note else "decode eager"
