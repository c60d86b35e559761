"""A KV pool for models with sliding-window layers (Gemma 3, gpt-oss, Mistral/Phi-3 with a window):
the full-attention layers keep K/V for every token, the windowed layers only for the tokens some
request can still attend.

Two sets of rows (page size 1, as kv_cache.KVPool):

- **token slots** [num_slots]: what the scheduler, the radix tree and the requests hold, one per
  token, as with the plain pool; the full-attention layers' K/V rows are indexed by them.
- **window rows** [num_window_slots + 1]: the windowed layers' K/V. `swa_map[slot]` (int64, on the
  pool's device) is the window row of a token slot, 0 when it has none (row 0 is never handed out
  and stays zeros, so a kernel that reads a dropped position reads zeros, which a window masks).

A slot gets a window row when it is allocated. The row goes back to the free list when the slot is
freed, and earlier when the pool is short of window rows (`reclaim`): rows of slots no running
request can attend are dropped, least recently used first, and the slot stays in the radix tree
with its full-attention K/V. A cached prefix of length L is usable only when the window rows of its
last `window` tokens are still there (`usable_prefix`): a request then recomputes from the last
point that holds. Rows are not freed the moment a request moves past them: a finished request's
prompt end is what the same prompt, sent again, needs. Instead the scheduler demotes them to the
front of the LRU order (`demote`), so a long prompt's interior goes before other requests' cached
prefix ends. vLLM's hybrid KV cache manager likewise frees out-of-window blocks into its cached free
queue, and SGLang's SWA radix cache tombstones them lazily.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from agentrt.runtime.kv_cache import KVPool, uniform_layout


def window_layer_split(layer_windows) -> tuple[int, int, int]:
    """(full-attention layers, windowed layers, the largest window) of per-layer windows (None = full)."""
    windows = [w for w in layer_windows if w is not None]
    return len(layer_windows) - len(windows), len(windows), max(windows, default=0)


def plan_window_pool(
    layer_windows,
    layer_bytes: int,
    budget_bytes: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    ratio: float | None = None,
) -> tuple[int, int] | str:
    """(token slots, window rows) of a windowed pool in `budget_bytes`, or a string saying why a
    plain pool (every layer for every token) is used instead.

    layer_bytes: K + V bytes of one token in one layer. `ratio` (window rows per token slot, as
    SGLang's --swa-full-tokens-ratio) fixes the split; None (auto) gives the windowed layers
    2 x (max_num_seqs x window + max_num_batched_tokens) rows, what every running sequence's window
    plus a step's new tokens need, twice over so that cached prefixes keep their windows, but at
    most half the budget, and the rest of the budget to token slots. Raises ValueError when `ratio` leaves fewer window rows than
    one request needs (window + max_num_batched_tokens)."""
    full, windowed, window = window_layer_split(layer_windows)
    if not windowed:
        return "no sliding-window layers"
    if window >= max_model_len:
        return f"the window ({window}) is not shorter than max_model_len ({max_model_len})"
    need = window + max_num_batched_tokens
    bf, bs = full * layer_bytes, windowed * layer_bytes
    if ratio is not None:
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {ratio}")
        slots = int(budget_bytes // (bf + ratio * bs))
        rows = int(ratio * slots)
        if rows < need:
            raise ValueError(
                f"swa_full_tokens_ratio={ratio} gives the windowed layers {rows} rows, fewer than one "
                f"request needs (window {window} + max_num_batched_tokens {max_num_batched_tokens}): "
                "raise it or the KV budget"
            )
        return slots, rows
    if bf == 0:  # every layer windowed: token slots cost nothing but the tree's bookkeeping
        rows = int(budget_bytes // bs)
        return (4 * rows, rows) if rows >= need else "the budget holds fewer rows than one request's window"
    rows = min(2 * (max_num_seqs * window + max_num_batched_tokens), int(budget_bytes // 2 // bs))
    slots = int((budget_bytes - rows * bs) // bf)
    if rows < need or slots < rows:
        return f"half the budget holds fewer window rows than one request needs (window + {max_num_batched_tokens})"
    return slots, rows


class SlidingWindowKVPool(KVPool):
    """A KVPool whose windowed layers (`layer_windows[i]` not None) hold `num_window_slots` rows; see
    the module docstring. k[i] / v[i] are [num_slots, Hkv, D] for a full-attention layer and
    [num_window_slots + 1, Hkv, D] for a windowed one (QuantizedKV for int8, as KVPool).
    `window`: the largest window (tokens). The slot -> row map is kept on the host; on a CPU
    `swa_map` is the same memory, on a GPU a device copy that `sync_map` brings up to date (the
    entries changed since, one copy) before a forward. Raises ValueError as KVPool."""

    def __init__(
        self,
        layer_windows,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_slots: int,
        num_window_slots: int,
    ):
        self.num_full_layers, self.num_window_layers, self.window = window_layer_split(layer_windows)
        full, windowed = self.num_full_layers, self.num_window_layers
        self.layer_windows = tuple(layer_windows)
        self.num_window_slots = num_window_slots
        layout = uniform_layout(len(layer_windows), num_kv_heads, head_dim)
        self.window_bytes_per_token = self.bytes_per_token_of(layout[:windowed], dtype)
        full_bytes = self.bytes_per_token_of(layout[:full], dtype)
        super().__init__(
            layout,
            dtype,
            device,
            num_slots * full_bytes + num_window_slots * self.window_bytes_per_token,
            num_slots=num_slots,
            layer_rows=[num_slots if w is None else num_window_slots + 1 for w in layer_windows],
        )
        self.bytes_per_token = full_bytes
        self.swa_map = torch.zeros(num_slots, dtype=torch.int64, device=device)
        on_cpu = self.swa_map.device.type == "cpu"
        # host map: on a CPU the same memory as swa_map; else a copy, its changes kept in _dirty
        self._row_of = self.swa_map.numpy() if on_cpu else np.zeros(num_slots, dtype=np.int64)
        self._dirty: dict[int, int] | None = None if on_cpu else {}
        self._free_rows = list(range(num_window_slots, 0, -1))
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots holding a row, least recent first
        self.num_reclaimed = 0  # rows dropped from slots still allocated (a metric)

    @property
    def pool_bytes(self) -> int:
        return self.num_slots * self.bytes_per_token + self.num_window_slots * self.window_bytes_per_token

    @property
    def num_free_window(self) -> int:
        return len(self._free_rows)

    def has_window_row(self, slot: int) -> bool:
        return bool(self._row_of[slot])

    def allocate(self, n: int) -> list[int] | None:
        """n token slots, each with a window row; None (nothing taken) when either runs short."""
        if n > len(self._free_rows):
            return None
        slots = super().allocate(n)
        if slots is None:
            return None
        rows = self._free_rows[len(self._free_rows) - n :]
        del self._free_rows[len(self._free_rows) - n :]
        rows.reverse()
        for s, r in zip(slots, rows):
            self._set_row(s, r)
            self._lru[s] = None
        return slots

    def _set_row(self, s: int, r: int) -> None:
        self._row_of[s] = r
        if self._dirty is not None:
            self._dirty[s] = r

    def sync_map(self) -> None:
        """Bring the device copy of the slot -> row map up to date (a GPU pool; no-op on a CPU)."""
        if self._dirty:
            idx = torch.tensor(list(self._dirty), dtype=torch.int64)
            rows = torch.tensor(list(self._dirty.values()), dtype=torch.int64)
            self.swa_map[idx.to(self.swa_map.device)] = rows.to(self.swa_map.device)
            self._dirty.clear()

    def free(self, slots: list[int]) -> None:
        for s in slots:
            self._drop_row(s)
        super().free(slots)

    def _drop_row(self, s: int) -> None:
        r = int(self._row_of[s])
        if r:
            self._set_row(s, 0)
            self._free_rows.append(r)
            del self._lru[s]

    def reclaim(self, n: int, live: set[int]) -> int:
        """Drop window rows of slots not in `live` (the slots running requests can still attend),
        least recently used first, until n rows are free; returns how many were dropped."""
        dropped = []
        for s in self._lru:
            if len(self._free_rows) + len(dropped) >= n:
                break
            if s not in live:
                dropped.append(s)
        for s in dropped:
            self._drop_row(s)
        self.num_reclaimed += len(dropped)
        return len(dropped)

    def touch(self, slots) -> None:
        """Mark these slots' rows as just used (the LRU order of `reclaim`)."""
        for s in slots:
            if s in self._lru:
                self._lru.move_to_end(s)

    def demote(self, slots) -> None:
        """Mark these slots' rows as the first to reclaim: a running request has moved past them
        (they serve only a later request whose cached prefix ends right there)."""
        for s in slots:
            if s in self._lru:
                self._lru.move_to_end(s, last=False)

    def usable_prefix(self, slots: list[int]) -> int:
        """The longest L <= len(slots) such that the last `window` of slots[:L] (all of them when
        L < window) hold window rows: how much of a cached prefix a request can reuse."""
        end = len(slots)
        j = end - 1
        while j >= max(0, end - self.window):
            if not self._row_of[slots[j]]:
                end = j
            j -= 1
        return end

    def adopt(self, mine: list[int], theirs: list[int]) -> None:
        """A request recomputed tokens the radix tree already holds (`theirs`): where the tree's slot
        has lost its window row and the request's (`mine`) has one, the row moves to the tree's slot;
        the request's slots are then freed."""
        for m, t in zip(mine, theirs):
            if m != t and not self._row_of[t] and self._row_of[m]:
                self._set_row(t, int(self._row_of[m]))
                self._set_row(m, 0)
                del self._lru[m]
                self._lru[t] = None
        self.free([m for m, t in zip(mine, theirs) if m != t])
