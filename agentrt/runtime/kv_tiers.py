"""KV tiers below the radix tree: what the KV pool evicts goes down to a host tier and a disk tier
instead of away, and a prompt whose prefix is there is loaded back instead of recomputed.

- Blocks: `block_tokens` tokens of KV (every per-slot tensor of the pool, `KVPool.state_tensors`,
  in the pool's dtype: float32, bfloat16 or int8 + scales), keyed by chained hashes of the tokens
  and the cache namespace (prefix_cache/block_keys.py), so `cache_salt` isolation holds in every
  tier and keys survive a restart. Trailing partial blocks (fewer than `block_tokens` tokens) are
  kept too, under their own keys (block_keys.tail_key): a finished request's write-through stores
  the partial block at the end of its tokens and the one ending a token before its prompt's end, so
  a returning prompt resumes at its last shared token, not at a block boundary. Eviction from the
  pool stores full blocks only.
- Going down: when the radix tree evicts a leaf, its full blocks are gathered from the pool (on the
  engine thread: the slots are reused right after) and encoded and stored by a store thread into
  the host tier (an LRU in memory; on CPU, compressed losslessly: prefix_cache/tier_store.py); host
  evictions go on to the disk tier. With a disk tier every finished request's blocks are also
  written through to disk (as SGLang HiCache's storage write-through), so a restarted server finds
  its agents' prefixes again.
- Coming back: a waiting request whose prompt continues past the pool's match in a lower tier waits
  while a load thread reads and decodes those blocks (other requests keep stepping); the scheduler
  then copies them into fresh pool slots and inserts them into the radix tree, and admits the
  request with them as cached tokens (`Request.cache.tier_hits` counts them per tier).
- Recurrent state (a hybrid model's, runtime/recurrent_state.py): a prefix is resumable only where
  a state snapshot is, so the snapshots go down with the KV, each stored beside the (full or
  trailing partial) block ending at its depth under that block's `state_key`, in the same tiers,
  byte limits and LRU as the blocks: an evicted leaf's snapshot (with the partial block ending
  there), a snapshot dropped alone when the state pool runs short, and every snapshot on a finished
  request's path in the write-through. A lookup (`lookup_state`) takes the deepest snapshot a tier
  holds past the pool's own (at a block end covered by the pool and the run of blocks found, or a
  partial block at the run's end) and loads it with the blocks up to it; the scheduler puts the
  state into a free state slot as that prefix's snapshot, so the request resumes there.
- Bounded: each tier has a byte limit; blocks waiting to be stored are bounded by
  `max_pending_bytes` (beyond it a store is dropped and counted); a disk that fails turns its tier
  off with a warning. No request fails because of a tier.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agentrt.prefix_cache.block_keys import chain_keys, root_key, state_key, tail_key
from agentrt.prefix_cache.tier_store import Block, BlockCodec, DiskTier, HostTier
from agentrt.runtime.kv_cache import KVPool
from agentrt.runtime.models.formats import QUANT_CACHE_VERSION

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # of the block payload layout; part of the fingerprint


@dataclass
class TierLoad:
    """A running load of blocks `first_block`.. of a prompt (`keys` in order; the last may be a
    trailing partial block, block_keys.tail_key). Its future gives the LoadedBlocks (possibly fewer
    blocks than asked, when one was gone or failed its check)."""

    first_block: int
    keys: list[bytes]
    future: Future
    state_depth: int = 0  # lookup_state: the depth of the snapshot loaded with the blocks (else 0)


@dataclass
class LoadedBlocks:
    """Decoded blocks: `rows[i]` holds tensor i of the pool's state tensors for every loaded token
    ([loaded tokens, *row shape], the pool's dtype, on the CPU; a block is block_tokens tokens, a
    trailing partial block fewer); `tiers[j]` is where
    block j came from ("host" or "disk"); `tokens[j]` its token ids (checked against the prompt);
    `seconds`: the load thread's time reading and decoding them; `state`: the recurrent-state
    snapshot at the blocks' end (lookup_state; its tensors [*shape] in StatePool.tensors' order)."""

    rows: list[torch.Tensor]
    tiers: list[str]
    tokens: list[tuple[int, ...]]
    seconds: float = 0.0
    state: list[torch.Tensor] | None = None  # lookup_state: the snapshot (recurrent_state.StatePool
    state_tier: str = ""  # layout, one slot's tensors in order, on the CPU) and its tier; None: gone


@dataclass
class TierStats:
    """Counters since start (read by /metrics): hit tokens per tier, loads and their seconds, blocks
    stored per tier, blocks dropped (store backlog full), blocks failing their check at load."""

    hit_tokens: Counter = field(default_factory=Counter)
    num_loads: int = 0
    load_seconds: float = 0.0
    stored_blocks: Counter = field(default_factory=Counter)
    dropped_blocks: int = 0


class KVTiers:
    """The host and disk tiers of one KV pool. `host_bytes` 0 = no host tier; `disk_dir` None = no
    disk tier. `fingerprint` / `describe`: kv_fingerprint(). Engine-thread methods: on_evict,
    write_through, lookup; the rest runs on the store and load threads."""

    def __init__(
        self,
        kv: KVPool,
        *,
        block_tokens: int = 32,
        host_bytes: int = 0,
        disk_dir: str | None = None,
        disk_bytes: int = 4 << 30,
        fingerprint: bytes = b"\0" * 16,
        describe: str = "",
        compress: str = "zstd",
        max_pending_bytes: int = 256 << 20,
    ):
        if block_tokens < 1:
            raise ValueError(f"kv tier block_tokens must be >= 1, got {block_tokens}")
        if host_bytes < 0 or disk_bytes < 1:
            raise ValueError(f"kv tier byte limits must be positive (host {host_bytes}, disk {disk_bytes})")
        self.kv, self.block_tokens = kv, block_tokens
        tensors = kv.state_tensors()
        self._shapes = [tuple(t.shape[1:]) for t in tensors]
        self._dtypes = [t.dtype for t in tensors]
        self._row_bytes = [t[0].numel() * t.element_size() for t in tensors]
        self.block_bytes = block_tokens * sum(self._row_bytes)
        self.codec = BlockCodec(compress, typesize=tensors[0].element_size())
        # a hybrid model's recurrent-state snapshots (one slot's tensors, in order), or None
        self.states = getattr(kv, "states", None)
        if self.states is not None:
            flat = [t for layer in self.states.tensors for t in layer.values()]
            self.state_codec = BlockCodec(compress, typesize=flat[0].element_size())
        self.host = HostTier(host_bytes) if host_bytes > 0 else None
        self.disk = DiskTier(disk_dir, disk_bytes, fingerprint, describe) if disk_dir else None
        self.max_pending_bytes = max_pending_bytes
        self.stats = TierStats()
        self._pending: dict[bytes, Future] = {}  # keys being stored
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-store")
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-load")

    @property
    def enabled(self) -> bool:
        return self.host is not None or (self.disk is not None and self.disk.enabled)

    # ---- going down (engine thread) ---------------------------------------------------------
    def on_evict(
        self, path_tokens: list[int], path_slots: list[int], start: int, salt: str, state: int | None = None
    ) -> None:
        """RadixCache eviction hook: store the full blocks of path_tokens that reach into the
        evicted leaf (tokens start..) in the host tier (the disk tier when there is no host tier),
        unless a lower tier holds them already. With recurrent layers, the leaf's state snapshot
        `state` (the state after path_tokens) goes too, with the partial block ending there."""
        if not self.enabled:
            return
        if state is not None and self.states is not None:
            self._store_snapshots(
                path_tokens, path_slots, salt, [(len(path_tokens), state)], self.host is not None
            )
        b0, b1 = start // self.block_tokens, len(path_tokens) // self.block_tokens
        if b1 <= b0:
            return
        B = self.block_tokens
        keys = chain_keys(path_tokens[: b1 * B], salt, B)
        todo = [(keys[b], b * B, B) for b in range(b0, b1) if not self._held(keys[b])]
        if todo:
            self._submit(todo, path_tokens, path_slots, host=self.host is not None)

    def write_through(
        self,
        tokens: list[int],
        slots: list[int],
        salt: str,
        prompt_len: int,
        snapshots: list[tuple[int, int]] = (),
    ) -> None:
        """Write the blocks of a cached prefix (tokens, their pool slots) that the disk tier lacks
        (after a request finishes, so its prefix survives a restart), with its trailing partial
        block and the partial block ending one token before `prompt_len` (the request's prompt
        tokens): a returning prompt resumes at the last token it shares with the request, whether it
        carries the request's output (an agent's next turn) or not (the same prompt again, whose
        last token is always computed, as the pool's own cache hit leaves it). With recurrent layers,
        `snapshots`: (depth, state slot) of the snapshots on the prefix's path, written with the
        partial blocks ending at their depths."""
        if self.disk is None or not self.disk.enabled:
            return
        if snapshots and self.states is not None:
            self._store_snapshots(tokens, slots, salt, snapshots, host=False)
        B = self.block_tokens
        n = len(tokens) // B
        keys = chain_keys(tokens[: n * B], salt, B)
        spans = [(keys[b], b * B, B) for b in range(n)]
        for end in sorted({len(tokens), min(prompt_len - 1, len(tokens))}):
            a = end // B * B
            if end > a:
                parent = keys[a // B - 1] if a else root_key(salt)
                spans.append((tail_key(parent, tokens[a:end]), a, end - a))
        todo = [sp for sp in spans if sp[0] not in self.disk and sp[0] not in self._pending]
        if todo:
            self._submit(todo, tokens, slots, host=False)

    def _held(self, key: bytes) -> bool:
        if key in self._pending:
            return True
        if self.host is not None and self.host.touch(key):
            return True
        return self.disk is not None and key in self.disk

    def _submit(
        self, spans: list[tuple[bytes, int, int]], tokens: list[int], slots: list[int], host: bool
    ) -> None:
        """Hand blocks to the store thread: spans (key, first token, tokens) of tokens / slots."""
        row_bytes = sum(self._row_bytes)
        nbytes = sum(n for _, _, n in spans) * row_bytes
        with self._lock:
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.stats.dropped_blocks += len(spans)
                return
            self._pending_bytes += nbytes
        index = torch.tensor([s for _, a, n in spans for s in slots[a : a + n]], dtype=torch.int64)
        rows = [t.index_select(0, index.to(t.device)).cpu() for t in self.kv.state_tensors()]
        items = [(key, tuple(tokens[a : a + n])) for key, a, n in spans]
        future: Future = Future()
        with self._lock:
            for key, _ in items:
                self._pending[key] = future
        self._store_pool.submit(self._store, items, rows, host, nbytes, future)

    # ---- store thread -----------------------------------------------------------------------
    def _store(self, items, rows: list[torch.Tensor], host: bool, nbytes: int, future: Future) -> None:
        try:
            at = 0
            for key, tokens in items:
                n = len(tokens)
                raw = b"".join(r[at : at + n].contiguous().view(torch.uint8).numpy().tobytes() for r in rows)
                at += n
                block = Block(key, tokens, self.codec.encode(raw))
                if host and self.host is not None:
                    self.stats.stored_blocks["host"] += 1
                    for gone in self.host.put(block):
                        self._to_disk(gone)
                else:
                    self._to_disk(block)
        except Exception:  # a tier is a cache: never let its failure reach a request
            logger.exception("KV tier store failed; blocks dropped")
        finally:
            with self._lock:
                for key, _ in items:
                    if self._pending.get(key) is future:
                        del self._pending[key]
                self._pending_bytes -= nbytes
            future.set_result(None)

    def _to_host(self, block: Block) -> None:
        """Keep a block read from disk in the host tier too; what that evicts goes to the disk tier
        on the store thread (unless the disk holds it already)."""
        self.stats.stored_blocks["host"] += 1
        for gone in self.host.put(block):
            if self.disk is not None and gone.key not in self.disk:
                self._store_pool.submit(self._to_disk, gone)

    def _to_disk(self, block: Block) -> None:
        if self.disk is not None and block.key not in self.disk and self.disk.put(block):
            self.stats.stored_blocks["disk"] += 1

    # ---- coming back ------------------------------------------------------------------------
    def lookup(self, tokens: list[int], salt: str, device_len: int) -> TierLoad | None:
        """Start loading the blocks that continue a prompt past its `device_len` cached tokens in
        the pool (engine thread; the load runs on the load thread): the run of full blocks a lower
        tier holds, then, where the run ends, the longest trailing partial block held (at most
        block_tokens - 1 keys tried). None when they reach no further than the pool."""
        if not self.enabled:
            return None
        B = self.block_tokens
        first = device_len // B
        keys = chain_keys(tokens, salt, B)
        run: list[bytes] = []
        for key in keys[first:]:
            if not self._holds(key):
                break
            run.append(key)
        end = (first + len(run)) * B
        parent = keys[first + len(run) - 1] if first + len(run) > 0 else root_key(salt)
        for t in range(min(B - 1, len(tokens) - end), 0, -1):
            key = tail_key(parent, tokens[end : end + t])
            if self._holds(key):
                run.append(key)
                end += t
                break
        if end <= device_len:
            return None
        return TierLoad(first, run, self._load_pool.submit(self._load, run))

    def _holds(self, key: bytes) -> bool:
        return (
            key in self._pending
            or (self.host is not None and key in self.host)
            or (self.disk is not None and key in self.disk)
        )

    def _load(self, keys: list[bytes]) -> LoadedBlocks:
        t0 = time.monotonic()
        blocks, tiers = [], []
        for key in keys:
            pending = self._pending.get(key)
            if pending is not None:
                pending.result()
            block, tier = (self.host.get(key), "host") if self.host is not None else (None, "")
            if block is None and self.disk is not None:
                discarded = self.disk.num_discarded
                block, tier = self.disk.get(key), "disk"
                if block is not None and self.host is not None:
                    self._to_host(block)  # read once from disk, kept in memory for the next hit
                elif block is None and self.disk.num_discarded > discarded:
                    # a file failed its check: check the rest of the run now, so every bad file is
                    # dropped (and rewritten by this request) at once, not one per request
                    for rest in keys[len(blocks) + 1 :]:
                        self.disk.get(rest)
            if block is None:
                break
            blocks.append(block)
            tiers.append(tier)
        # full blocks, then at most one trailing partial block (lookup puts it last)
        B = self.block_tokens
        tail = len(blocks[-1].tokens) if blocks and len(blocks[-1].tokens) < B else 0
        full = len(blocks) - (tail > 0)
        # the full blocks' decoded payloads side by side ([full, block_bytes]: each holds tensor 0's
        # rows, then tensor 1's, ...), then one strided copy per pool tensor into its own staging
        payload = torch.empty(full, self.block_bytes, dtype=torch.uint8)
        for j in range(full):
            self.codec.decode(
                blocks[j].blob, out=memoryview(payload[j].numpy())
            )  # ValueError on a size mismatch
        tail_payload = torch.empty(tail * sum(self._row_bytes), dtype=torch.uint8)
        if tail:
            self.codec.decode(blocks[-1].blob, out=memoryview(tail_payload.numpy()))
        pinned = self.kv.state_tensors()[0].is_cuda  # page-locked staging: full-speed copies to a GPU
        rows, offset, tail_offset = [], 0, 0
        for rb, dt, shape in zip(self._row_bytes, self._dtypes, self._shapes):
            flat = torch.empty(full * B * rb + tail * rb, dtype=torch.uint8, pin_memory=pinned)
            flat[: full * B * rb].view(full, B * rb).copy_(payload[:, offset : offset + B * rb])
            flat[full * B * rb :] = tail_payload[tail_offset : tail_offset + tail * rb]
            rows.append(flat.view(dt).view(full * B + tail, *shape))
            offset += B * rb
            tail_offset += tail * rb
        return LoadedBlocks(rows, tiers, [b.tokens for b in blocks], time.monotonic() - t0)

    def write_rows(self, slots: list[int], loaded: LoadedBlocks, offset: int) -> None:
        """Copy loaded rows offset.. into pool `slots` (engine thread)."""
        index = torch.tensor(slots, dtype=torch.int64)
        for t, rows in zip(self.kv.state_tensors(), loaded.rows):
            t.index_copy_(0, index.to(t.device), rows[offset : offset + len(slots)].to(t.device))

    # ---- recurrent-state snapshots (a hybrid model's) ----------------------------------------
    def _store_snapshots(self, tokens: list[int], slots: list[int], salt: str, snapshots, host: bool) -> None:
        """Store state snapshots (depth, state slot) of the prefix `tokens` (their pool `slots`),
        each under the state_key of the block ending at its depth, with that block when it is a
        partial one; what a lower tier holds (pending included) is skipped: for the host path
        (`host`, eviction) any tier, else (the write-through) the disk tier."""
        B = self.block_tokens
        held = self._held if host else (lambda k: k in self._pending or k in self.disk)
        keys = chain_keys(tokens[: max(d for d, _ in snapshots) // B * B], salt, B)
        tails, states = [], []
        for depth, slot in snapshots:
            if not 0 < depth <= len(tokens):
                continue
            a = depth // B * B
            if depth == a:
                key = keys[a // B - 1]
            else:
                key = tail_key(keys[a // B - 1] if a else root_key(salt), tokens[a:depth])
                if not held(key):
                    tails.append((key, a, depth - a))
            if not held(state_key(key)):
                states.append((state_key(key), slot))
        if tails:
            self._submit(tails, tokens, slots, host)
        if states:
            self._submit_states(states, host)

    def _submit_states(self, items: list[tuple[bytes, int]], host: bool) -> None:
        """Hand snapshots (state key, state slot) to the store thread (copied out of the pool now)."""
        nbytes = len(items) * self.states.bytes_per_slot
        with self._lock:
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                self.stats.dropped_blocks += len(items)
                return
            self._pending_bytes += nbytes
        index = torch.tensor([slot for _, slot in items], dtype=torch.int64)
        rows = [
            t.index_select(0, index.to(t.device)).cpu()
            for layer in self.states.tensors
            for t in layer.values()
        ]
        keys = [key for key, _ in items]
        future: Future = Future()
        with self._lock:
            for key in keys:
                self._pending[key] = future
        self._store_pool.submit(self._store_states, keys, rows, host, nbytes, future)

    def _store_states(
        self, keys: list[bytes], rows: list[torch.Tensor], host: bool, nbytes: int, future
    ) -> None:
        try:
            for i, key in enumerate(keys):
                raw = b"".join(r[i].contiguous().view(torch.uint8).numpy().tobytes() for r in rows)
                block = Block(key, (), self.state_codec.encode(raw))
                if host and self.host is not None:
                    self.stats.stored_blocks["host"] += 1
                    for gone in self.host.put(block):
                        self._to_disk(gone)
                else:
                    self._to_disk(block)
        except Exception:  # a tier is a cache: never let its failure reach a request
            logger.exception("KV tier store of state snapshots failed; dropped")
        finally:
            with self._lock:
                for key in keys:
                    if self._pending.get(key) is future:
                        del self._pending[key]
                self._pending_bytes -= nbytes
            future.set_result(None)

    def lookup_state(
        self, tokens: list[int], salt: str, device_len: int, device_state: int
    ) -> TierLoad | None:
        """lookup for a model with recurrent layers, whose prefix resumes only at a state snapshot:
        the pool holds `device_len` tokens of the prompt and a snapshot at `device_state` (<= it).
        Finds the deepest snapshot a lower tier holds past device_state, where the KV up to it is in
        the pool or in the run of full blocks held after device_len (the longest partial block held
        with its snapshot at the run's end, else the deepest block end), and starts loading it with
        the blocks from the pool's end up to it. None when there is none."""
        if not self.enabled:
            return None
        B = self.block_tokens
        first = device_len // B
        keys = chain_keys(tokens, salt, B)
        run: list[bytes] = []
        for key in keys[first:]:
            if not self._holds(key):
                break
            run.append(key)
        end = (first + len(run)) * B
        parent = keys[end // B - 1] if end else root_key(salt)
        for t in range(min(B - 1, len(tokens) - end), 0, -1):
            key = tail_key(parent, tokens[end : end + t])
            if end + t > device_state and self._holds(key) and self._holds(state_key(key)):
                return self._start_state_load(first, [*run, key], state_key(key), end + t)
        for b in range(end // B, device_state // B, -1):  # block b - 1 ends at b * B > device_state
            if self._holds(state_key(keys[b - 1])):
                return self._start_state_load(first, run[: max(0, b - first)], state_key(keys[b - 1]), b * B)
        return None

    def _start_state_load(self, first: int, keys: list[bytes], skey: bytes, depth: int) -> TierLoad:
        return TierLoad(first, keys, self._load_pool.submit(self._load_state, keys, skey), depth)

    def _load_state(self, keys: list[bytes], skey: bytes) -> LoadedBlocks:
        """The snapshot under `skey`, then the blocks (load thread); no blocks when it is gone."""
        t0 = time.monotonic()
        pending = self._pending.get(skey)
        if pending is not None:
            pending.result()
        block, tier = (self.host.get(skey), "host") if self.host is not None else (None, "")
        if block is None and self.disk is not None:
            block, tier = self.disk.get(skey), "disk"
            if block is not None and self.host is not None:
                self._to_host(block)
        if block is None:
            return LoadedBlocks([], [], [], time.monotonic() - t0)
        raw = torch.frombuffer(bytearray(self.state_codec.decode(block.blob)), dtype=torch.uint8)
        state, at = [], 0
        for layer in self.states.tensors:
            for t in layer.values():
                n = t[0].numel() * t.element_size()
                state.append(raw[at : at + n].view(t.dtype).view(t.shape[1:]))
                at += n
        if at != len(raw):
            raise ValueError(f"a state snapshot of {len(raw)} bytes, expected {at}")
        loaded = self._load(keys)
        loaded.state, loaded.state_tier = state, tier
        loaded.seconds = time.monotonic() - t0
        return loaded

    def write_state(self, slot: int, loaded: LoadedBlocks) -> None:
        """Copy a loaded snapshot into state slot `slot` (engine thread)."""
        flat = [t for layer in self.states.tensors for t in layer.values()]
        for t, row in zip(flat, loaded.state):
            t[slot].copy_(row)

    # ---- upkeep -----------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> None:
        """Wait until every block handed to the store thread is stored."""
        done = self._store_pool.submit(lambda: None)
        done.result(timeout)

    def gauges(self) -> list[tuple[str, int, int, int]]:
        """(tier, bytes held, blocks held, byte limit) per tier present."""
        out = []
        if self.host is not None:
            out.append(("host", self.host.nbytes, len(self.host), self.host.budget_bytes))
        if self.disk is not None:
            out.append(("disk", self.disk.nbytes, len(self.disk), self.disk.budget_bytes))
        return out

    def close(self) -> None:
        """Finish the stores under way (a disk tier keeps them) and stop the threads."""
        self._store_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True, cancel_futures=True)


def kv_fingerprint(runner, block_tokens: int, compress: str) -> tuple[bytes, str]:
    """(16-byte fingerprint, description) of the KV a runner writes: the model directory and its
    weight files (names, sizes, modification times), the architecture, the run dtype and weight
    format (and the quantized layout's version), the pool's per-slot tensor shapes and dtypes (and
    the recurrent state pool's, with recurrent layers), the block size and the codec. Files a
    disk tier holds are reused only under the same fingerprint."""
    files = []
    model_dir = getattr(runner, "model_dir", None)
    if model_dir is not None and Path(model_dir).is_dir():
        for p in sorted(Path(model_dir).iterdir()):
            if p.suffix in (".safetensors", ".gguf", ".bin", ".json", ".pt") and p.is_file():
                st = p.stat()
                files.append([p.name, st.st_size, st.st_mtime_ns])
    fmt = getattr(runner, "weight_format", None)
    desc = {
        "version": FORMAT_VERSION,
        "model_dir": str(Path(model_dir).resolve()) if model_dir is not None else type(runner).__name__,
        "files": files,
        "arch": repr(getattr(runner, "arch", None)),
        "weights": None
        if fmt is None
        else [
            str(fmt.dtype),
            fmt.quantization,
            fmt.group_size,
            str(fmt.act_dtype),
            fmt.lm_head,
            fmt.act_int8,
            QUANT_CACHE_VERSION,  # the quantized layout (v5: int4 levels against float16 scales)
        ],
        "kv": [[list(t.shape[1:]), str(t.dtype)] for t in runner.kv.state_tensors()],
        "block_tokens": block_tokens,
        "codec": compress,
    }
    states = getattr(runner.kv, "states", None)
    if states is not None:  # a hybrid model's state snapshots: their layout too
        desc["state"] = [
            [[n, list(t.shape[1:]), str(t.dtype)] for n, t in layer.items()] for layer in states.tensors
        ]
    text = json.dumps(desc, sort_keys=True)
    short = f"{desc['model_dir']} kv {desc['kv'][0]} x{len(desc['kv'])} block {block_tokens} {compress}"
    return hashlib.blake2b(text.encode(), digest_size=16).digest(), short
