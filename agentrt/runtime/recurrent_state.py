"""Recurrent state beside the KV pool: the per-sequence state of linear-attention and SSM layers
(Gated DeltaNet, Mamba-2: a short-convolution state and a recurrent state per layer), addressed by
state slot, and how one forward runs such a layer over a batch of sequences.

A running request owns one working slot, read and updated in place by every forward; the radix tree
(prefix_cache/radix_tree.py) owns snapshot slots: the state after the first `depth` tokens of a
cached prefix, taken at chosen token boundaries inside a forward (every `snapshot_interval` tokens,
the prompt's last token but one, a request's end), as SGLang's Mamba radix cache keeps them. A
returning prefix resumes from the deepest snapshot at or below its match: its working slot is a copy
of that snapshot, and the tokens past it are recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class StatePool:
    """The states of every recurrent layer, `num_slots` sequences' worth each.

    layer_shapes: per recurrent layer (in layer order), {state name: (shape of one sequence's state,
    dtype)} as the mixer's `state_shapes()` gives it; `tensors[j][name]` is [num_slots, *shape].
    Slots are handed out whole (every layer's states of one sequence). `snapshot_interval`: the
    scheduler snapshots a prefill every that many tokens. Raises ValueError when num_slots < 1 or
    the tensors cannot be allocated on `device`."""

    snapshot_interval = 256

    def __init__(self, layer_shapes: list[dict], num_slots: int, device: torch.device):
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.bytes_per_slot = self.bytes_per_slot_of(layer_shapes)
        try:
            self.tensors = [
                {
                    name: torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                    for name, (shape, dtype) in shapes.items()
                }
                for shapes in layer_shapes
            ]
        except RuntimeError as e:
            raise ValueError(
                f"cannot allocate a recurrent state pool of {num_slots * self.bytes_per_slot / 1e9:.2f} GB "
                f"on {device} ({type(e).__name__}): lower kv_cache_bytes or max_num_seqs"
            ) from None
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_slot_of(layer_shapes: list[dict]) -> int:
        """Bytes of one sequence's state over every recurrent layer."""
        total = 0
        for shapes in layer_shapes:
            for shape, dtype in shapes.values():
                n = 1
                for d in shape:
                    n *= d
                total += n * torch.empty((), dtype=dtype).element_size()
        return total

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is taken."""
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Every layer's state of slot `src` into slot `dst`."""
        for layer in self.tensors:
            for t in layer.values():
                t[dst].copy_(t[src])

    def layer(self, j: int, slot: int) -> dict[str, torch.Tensor]:
        """Views of recurrent layer j's states of one slot (written in place by the mixer)."""
        return {name: t[slot] for name, t in self.tensors[j].items()}


def plan_state_slots(
    budget: int, bytes_per_slot: int, max_num_seqs: int, state_slots: int | None = None
) -> int:
    """Slots of the state pool taken from a KV budget of `budget` bytes, as the engine sizes it:
    `state_slots` when given, else a quarter of the budget, at least 2 x (max_num_seqs + 1) (one
    working slot per running sequence and one spare; the rest hold prefix snapshots). Raises
    ValueError when the slots take the whole budget or leave none for snapshots."""
    working = max_num_seqs + 1
    slots = state_slots or max(2 * working, budget // 4 // bytes_per_slot)
    if slots * bytes_per_slot >= budget:
        raise ValueError(
            f"the KV budget ({budget:,} bytes) cannot hold {slots} recurrent states of {bytes_per_slot:,} "
            f"bytes each besides the KV: raise kv_cache_bytes, or lower max_num_seqs / state_slots"
        )
    if slots <= working:
        raise ValueError(f"state_slots={slots} must exceed max_num_seqs + 1 = {working}")
    return slots


def settle_verify(pool: StatePool, cache) -> None:
    """After a speculative verify chunk (request.CacheState `cache`): roll the working state back to
    the tokens kept (`verify_kept` of the chunk: the snapshot taken after them, unless all were
    kept) and free the scratch slots."""
    if not cache.verify_states:
        return
    k = cache.verify_kept
    if cache.state_slot is not None and 0 < k <= len(cache.verify_states):
        pool.copy(cache.verify_states[k - 1], cache.state_slot)
    for slot in cache.verify_states:
        pool.free(slot)
    cache.verify_states, cache.verify_kept = [], 0


@dataclass
class SeqState:
    """One sequence's part of a forward for the recurrent layers: rows [start, end) of the flat
    batch, its working state slot, `fresh` (the chunk starts the sequence: the state starts at zero
    instead of the slot's), and `snapshots`: (n, slot) pairs, the state after the first n tokens of
    this chunk copied into `slot` (n ascending, 0 < n <= end - start)."""

    start: int
    end: int
    slot: int
    fresh: bool
    snapshots: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class RecurrentBatch:
    """The recurrent layers' view of one forward: the state pool and each sequence's SeqState."""

    pool: StatePool
    seqs: list[SeqState]
    memo: dict = field(default_factory=dict)  # values every recurrent layer of this forward shares

    def decoding(self, min_batch: int, device: torch.device):
        """(the sequences decoding one token: no snapshot, not fresh, [] when fewer than `min_batch`;
        their rows [B] int64; their working slots [B] int64), built once per forward."""
        key = ("decoding", min_batch)
        if key not in self.memo:
            single = [s for s in self.seqs if s.end - s.start == 1 and not s.fresh and not s.snapshots]
            if len(single) < min_batch:
                single = []
            at = torch.tensor([s.start for s in single], dtype=torch.int64, device=device)
            slots = torch.tensor([s.slot for s in single], dtype=torch.int64, device=device)
            self.memo[key] = (single, at, slots)
        return self.memo[key]


def recurrent_batch(chunks, pool: StatePool | None) -> RecurrentBatch | None:
    """The RecurrentBatch of a flat batch of forward.SeqChunks (each with its `state_slot`), or None
    without a state pool. Raises ValueError for a chunk without a state slot or with a draft tree
    (a recurrent state has no tree form)."""
    if pool is None:
        return None
    seqs, start = [], 0
    for chunk in chunks:
        n = len(chunk.token_ids)
        if chunk.state_slot is None:
            raise ValueError("a model with recurrent layers needs a state slot for every sequence")
        if chunk.tree_mask is not None:
            raise ValueError("draft trees are not supported by recurrent layers (use a chain)")
        seqs.append(
            SeqState(start, start + n, chunk.state_slot, chunk.context_len == 0, list(chunk.snapshots))
        )
        start += n
    return RecurrentBatch(pool, seqs)


@dataclass(frozen=True)
class Scans:
    """How a backend runs the middle stage of `run_recurrent` (the scan) for one kind of mixer.

    decode(mixer, rows, tensors, slots) -> core [B, ...]: one token of each of B sequences (`project`'s
    rows of those tokens, slots [B] int64 their working slots in the layer's state `tensors`, whose
    rows are updated in place); taken when at least `min_decode_batch` sequences decode one token
    (no snapshot, not fresh). segments(mixer, rows, tensors, seqs, memo) -> [(row index, core)]: the
    other sequences (SeqState) of the batch, states updated and snapshots written as `run_recurrent`
    says; `memo` a dict that lives for one forward (what every recurrent layer of it can share)."""

    decode: Callable
    segments: Callable
    min_decode_batch: int = 2


def gathered_decode(mixer, rows, tensors: dict, slots: torch.Tensor) -> torch.Tensor:
    """Scans.decode in torch: the states of `slots` gathered, `mixer.scan_decode`, scattered back."""
    conv, rec = tensors["conv"].index_select(0, slots), tensors["recurrent"].index_select(0, slots)
    core = mixer.scan_decode(rows, conv, rec)
    tensors["conv"].index_copy_(0, slots, conv)
    tensors["recurrent"].index_copy_(0, slots, rec)
    return core


def segment_scans(mixer, rows, tensors: dict, seqs: list[SeqState], memo: dict) -> list:
    """Scans.segments in torch: `mixer.scan` per sequence, segment by segment between its snapshot
    points, on its slot's states in place."""
    out = []
    for seq in seqs:
        states = {name: t[seq.slot] for name, t in tensors.items()}
        fresh, pos = seq.fresh, seq.start
        for n, snap in [*seq.snapshots, (seq.end - seq.start, None)]:
            end = seq.start + n
            if end > pos:
                part = tuple(r[pos:end] for r in rows)
                out.append((slice(pos, end), mixer.scan(part, states["conv"], states["recurrent"], fresh)))
                fresh, pos = False, end
            elif fresh:  # a snapshot of the empty prefix: zeros
                for s in states.values():
                    s.zero_()
                fresh = False
            if snap is not None:
                for name, t in tensors.items():
                    t[snap].copy_(states[name])
    return out


TORCH_SCANS = Scans(gathered_decode, segment_scans)


def run_recurrent(
    mixer, index: int, x: torch.Tensor, batch: RecurrentBatch, scans: Scans = TORCH_SCANS
) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden] through a recurrent mixer in three stages (layers/gated_delta.py,
    layers/mamba2.py): `project` every row of the batch at once; scan each sequence's rows, segment
    by segment between its snapshot points, its states (recurrent layer `index` of the pool) read and
    updated in place, copied into a snapshot's slot after the segment that ends there (`scans.segments`),
    the sequences decoding one token (no snapshot) in one `scans.decode` (torch's: over their gathered
    states; the Triton backend's: kernels addressing the pool's slots); `finish` every row at once. A
    row's result depends on its own sequence's rows and state only."""
    rows = mixer.project(x)
    tensors = batch.pool.tensors[index]
    single, at, slots = batch.decoding(scans.min_decode_batch, x.device)
    core = None

    def put(where, value: torch.Tensor) -> None:
        nonlocal core
        if core is None:
            core = value.new_empty((x.shape[0], *value.shape[1:]))
        core[where] = value

    if single:
        put(at, scans.decode(mixer, tuple(r.index_select(0, at) for r in rows), tensors, slots))
    batched = {id(s) for s in single}
    rest = [s for s in batch.seqs if id(s) not in batched]
    if rest:
        for where, value in scans.segments(mixer, rows, tensors, rest, batch.memo):
            put(where, value)
    return mixer.finish(core, rows, x.dtype)
