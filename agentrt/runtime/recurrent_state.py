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


def run_recurrent(mixer, index: int, x: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden] through a recurrent mixer in three stages (layers/gated_delta.py,
    layers/mamba2.py): `project` every row of the batch at once; `scan` each sequence's rows, segment
    by segment between its snapshot points, its states (recurrent layer `index` of the pool) read and
    updated in place, copied into a snapshot's slot after the segment that ends there; the
    sequences decoding one token (no snapshot) in one `scan_decode` over their gathered states;
    `finish` every row at once. A row's result depends on its own sequence's rows and state only."""
    rows = mixer.project(x)
    tensors = batch.pool.tensors[index]
    single = [s for s in batch.seqs if s.end - s.start == 1 and not s.fresh and not s.snapshots]
    core = None

    def put(at, value: torch.Tensor) -> None:
        nonlocal core
        if core is None:
            core = value.new_empty((x.shape[0], *value.shape[1:]))
        core[at] = value

    if len(single) > 1:
        at = torch.tensor([s.start for s in single], device=x.device)
        slots = torch.tensor([s.slot for s in single], device=x.device)
        conv, rec = tensors["conv"].index_select(0, slots), tensors["recurrent"].index_select(0, slots)
        put(at, mixer.scan_decode(tuple(r.index_select(0, at) for r in rows), conv, rec))
        tensors["conv"].index_copy_(0, slots, conv)
        tensors["recurrent"].index_copy_(0, slots, rec)
    else:
        single = []
    batched = {id(s) for s in single}
    for seq in batch.seqs:
        if id(seq) in batched:
            continue
        states = {name: t[seq.slot] for name, t in tensors.items()}
        fresh, pos = seq.fresh, seq.start
        for n, snap in [*seq.snapshots, (seq.end - seq.start, None)]:
            end = seq.start + n
            if end > pos:
                part = tuple(r[pos:end] for r in rows)
                put(slice(pos, end), mixer.scan(part, states["conv"], states["recurrent"], fresh))
                fresh, pos = False, end
            elif fresh:  # a snapshot of the empty prefix: zeros
                for s in states.values():
                    s.zero_()
                fresh = False
            if snap is not None:
                for name, t in tensors.items():
                    t[snap].copy_(states[name])
    return mixer.finish(core, rows, x.dtype)
