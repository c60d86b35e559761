"""Scheduler: cache-aware admission, chunked prefill, KV allocation with eviction and preemption.

Every step gets a token budget (`max_num_batched_tokens`). Running requests go first: a decoding
request takes one token, a request still prefilling takes its next chunk. Then waiting requests
are admitted, longest cached prefix first (a request that has waited longer than
`reorder_window_s` goes first in arrival order, so nothing starves), each reusing the KV of its
cached prefix from the radix tree and prefilling the rest in chunks. When the KV pool is short,
unlocked cache leaves are evicted first (LRU); then the newest running request is preempted: its
computed KV goes into the radix tree (or is freed without cache) and it is requeued first in line,
to be recomputed, mostly from the cache, when room returns. A request is never dropped for lack
of KV. With lower KV tiers (runtime/kv_tiers.py) evicted leaves go down to them, finished requests
are written through to disk, and a waiting request whose prompt continues in a lower tier waits for
its blocks to load (other requests keep stepping), which are then put back into the pool and the
tree before it is admitted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

from agentrt.prefix_cache import RadixCache
from agentrt.runtime.config import SchedulerConfig
from agentrt.runtime.kv_cache import KVPool
from agentrt.runtime.kv_tiers import KVTiers
from agentrt.runtime.recurrent_state import settle_verify
from agentrt.runtime.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    """`request` computes tokens [context_len, context_len + num_new) of prompt + output this step;
    `sample` is True when the chunk reaches its last known token (a new token is sampled);
    `snapshots`: (n, state slot) recurrent-state snapshots after the chunk's first n tokens."""

    request: Request
    context_len: int
    num_new: int
    sample: bool
    snapshots: tuple[tuple[int, int], ...] = ()


class Scheduler:
    """Owns the waiting/running queues, the KV pool's allocation and the radix cache (None when
    the prefix cache is disabled)."""

    def __init__(
        self, config: SchedulerConfig, kv: KVPool, cache: RadixCache | None, tiers: KVTiers | None = None
    ):
        self.config = config
        self.kv = kv
        self.states = kv.states  # the recurrent layers' StatePool, or None
        if cache is not None and self.states is not None:
            cache.free_state = self.states.free
        self.cache = cache
        self.tiers = tiers if cache is not None and tiers is not None and tiers.enabled else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._step_context: dict[Request, int] = {}
        self._live: set[int] | None = None

    def add(self, r: Request) -> None:
        r.status = RequestStatus.WAITING
        self.waiting.append(r)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        self._step_context: dict[Request, int] = {}  # context_len of the chunks scheduled so far
        self._live: set[int] | None = None  # _live_window_slots of this step
        if self.cache is not None:
            for r in self.running:
                if r.cache.prefilled_since_insert:
                    self._cache_computed_prefix(r)
        if self.tiers is not None:
            self._promote_loaded()
        for r in list(self.running):
            if r not in self.running:  # preempted while making room for an earlier one
                continue
            remaining = r.num_tokens - len(r.slots)
            n = min(remaining, budget)
            if r.spec.draft is not None:  # a speculative verify chunk: the last token + the draft
                if remaining == 1 and budget >= 1 + len(r.spec.draft) and self._verify_states(r):
                    n = 1 + len(r.spec.draft)
                else:
                    r.spec.draft = None
            if n <= 0:
                continue  # prefill chunk waits for budget; decodes always take their 1 token
            if not self._allocate(r, n):
                continue  # r itself was preempted
            self._add_chunk(chunks, r, n)
            budget -= n
        for r in self._admission_order():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self.tiers is not None and self._loading(r):
                continue
            if not self._admit(r):
                break
            remaining = r.num_tokens - len(r.slots)
            n = min(remaining, budget)
            if not self._allocate(r, n, preempt=False):
                self._release(r, insert=False)
                self.running.remove(r)
                r.status = RequestStatus.WAITING
                self.waiting.appendleft(r)
                break
            self._add_chunk(chunks, r, n)
            budget -= n
        return chunks

    def _add_chunk(self, chunks: list[ScheduledChunk], r: Request, n: int) -> None:
        """(A verify chunk's draft slots lie beyond r.num_tokens; the engine trims them after.)"""
        snapshots = self._plan_snapshots(r, len(r.slots) - n, n) if self.states is not None else ()
        chunks.append(ScheduledChunk(r, len(r.slots) - n, n, len(r.slots) >= r.num_tokens, snapshots))
        self._step_context[r] = len(r.slots) - n
        if n > 1 and r.spec.draft is None:
            r.cache.prefilled_since_insert = True
        if self.kv.window:
            self._demote_passed(r, len(r.slots) - n)

    def _demote_passed(self, r: Request, context_len: int) -> None:
        """Demote the window rows of r's positions no query of r attends from now on (they go first
        when rows run short), except the window before the prompt's end (which the same prompt sent
        again, or the next turn of a conversation whose output tokenizes differently, reuses) and the
        window before r's cache hit when the tree branches there (a shared system prompt's end, which
        the next request that shares it reuses; a conversation's previous turn, which r extends
        alone, is demoted)."""
        w = self.kv.window
        dead = context_len - w
        if dead <= r.cache.window_demoted:
            return
        ends = {r.num_prompt_tokens}
        if r.cache.num_cached_tokens and r.cache.hit_node is not None and len(r.cache.hit_node.children) > 1:
            ends.add(r.cache.num_cached_tokens)
        keep = sorted((end - w - 1, end) for end in ends)
        lo = r.cache.window_demoted
        for keep_lo, keep_hi in keep:
            if min(dead, keep_lo) > lo:
                self.kv.demote(r.slots[lo : min(dead, keep_lo)])
            lo = max(lo, keep_hi)
        if dead > lo:
            self.kv.demote(r.slots[lo:dead])
        r.cache.window_demoted = dead

    def _plan_snapshots(self, r: Request, context_len: int, n: int) -> tuple[tuple[int, int], ...]:
        """State snapshots a chunk of r takes (with the prefix cache on): at each multiple of the
        pool's snapshot_interval inside the chunk and at the prompt's last token but one (what a
        request with the same prompt resumes from), each into a free state slot (a point without
        one is skipped: stored snapshots are dropped, LRU, only to give a request its working
        slot). Not in a verify chunk (draft tokens)."""
        if self.cache is None or r.spec.draft is not None:
            return ()
        every = self.states.snapshot_interval
        depths = set(range((context_len // every + 1) * every, context_len + n + 1, every))
        if context_len < r.num_prompt_tokens - 1 <= context_len + n:
            depths.add(r.num_prompt_tokens - 1)
        out = []
        for depth in sorted(d for d in depths if d > context_len):
            # free slots only: a prefill's snapshots never drop a stored one (another agent's end
            # of turn, which it returns to), so one long prompt cannot wipe the others' prefixes
            slot = self._state_slot(evict=False)
            if slot is None:
                continue
            r.cache.snapshots.append((depth, slot))
            out.append((depth - context_len, slot))
        return tuple(out)

    def _verify_states(self, r: Request) -> bool:
        """With recurrent layers: scratch slots for the state after each draft token of r's verify
        chunk (recurrent_state.settle_verify keeps the accepted one); False when they are short."""
        if self.states is None:
            return True
        for _ in range(len(r.spec.draft)):
            slot = self._state_slot()
            if slot is None:
                for s in r.cache.verify_states:
                    self.states.free(s)
                r.cache.verify_states = []
                return False
            r.cache.verify_states.append(slot)
        return True

    def _state_slot(self, keep: int | None = None, evict: bool = True) -> int | None:
        """A free state slot, dropping the least recently used snapshot (never the one in slot
        `keep`) when none is free and `evict`."""
        slot = self.states.allocate()
        hook = self.tiers.on_evict if self.tiers is not None else None  # the snapshot goes down
        if slot is None and evict and self.cache is not None and self.cache.evict_states(1, hook, keep):
            slot = self.states.allocate()
        return slot

    def _resume_snapshot(self, r: Request) -> int | None:
        """The slot of the snapshot r would resume from (the deepest one in its usable cached
        prefix), or None: what making room for r's working slot must not drop."""
        key = r.cached_key()
        match = self.cache.match_prefix(key, r.cache_salt, split=True)
        usable = self.kv.usable_prefix(match.slots)
        if usable < len(match.slots):
            match = self.cache.match_prefix(key[:usable], r.cache_salt, split=True)
        return self.cache.deepest_state(match.node)[1]

    def _attach_snapshots(self, r: Request, upto: int) -> None:
        """Hand r's snapshots at depths <= upto (their tokens now in the tree) to the radix tree."""
        keep = []
        for depth, slot in r.cache.snapshots:
            if depth > upto:
                keep.append((depth, slot))
            elif not self.cache.set_state(r.token_ids[:depth], slot, r.cache_salt):
                self.states.free(slot)
        r.cache.snapshots = keep

    def _cache_computed_prefix(self, r: Request) -> None:
        """Insert a running request's computed prefix (after a prefill chunk) into the radix tree,
        so requests arriving while it still runs share it (as SGLang caches unfinished requests).
        r then reads the tree's slots for that prefix; duplicates of ours are freed."""
        r.cache.prefilled_since_insert = False
        tokens = r.token_ids[: len(r.slots)]
        present = self.cache.insert(tokens, r.slots, r.cache_salt)
        match = self.cache.match_prefix(tokens, r.cache_salt, split=True)
        tree_slots = match.slots
        self.kv.adopt(r.slots[r.cache.num_shared : present], tree_slots[r.cache.num_shared : present])
        r.slots[: len(tree_slots)] = tree_slots
        self.cache.lock(match.node)
        if r.cache.node is not None:
            self.cache.unlock(r.cache.node)
        r.cache.node = match.node
        r.cache.num_shared = len(tree_slots)
        if r.cache.snapshots:
            self._attach_snapshots(r, len(tree_slots))

    def _admission_order(self):
        """Waiting requests, longest cached prefix first; those past the reorder window first."""
        if self.cache is None or len(self.waiting) < 2:
            order = list(self.waiting)
        else:
            now = time.monotonic()
            window = self.config.reorder_window_s
            aged = [r for r in self.waiting if now - r.arrival_time > window]
            fresh = [r for r in self.waiting if now - r.arrival_time <= window]
            fresh.sort(key=lambda r: -len(self.cache.match_prefix(r.cached_key(), r.cache_salt).slots))
            order = aged + fresh
        yield from order

    def _admit(self, r: Request) -> bool:
        """Move r to running with its cached prefix locked (with recurrent layers: a working state
        slot, a copy of the deepest snapshot of the prefix, which is cut there; False, r left
        waiting, when no state slot is free). (Memory is checked by _allocate.)"""
        if self.states is not None:
            keep = self._resume_snapshot(r) if self.cache is not None else None
            r.cache.state_slot = self._state_slot(keep)
            if r.cache.state_slot is None:
                return False
        self.waiting.remove(r)
        if self.cache is not None:
            key = r.cached_key()
            match = self.cache.match_prefix(key, r.cache_salt, split=True)
            usable = self.kv.usable_prefix(match.slots)  # windowed layers: the last window must be there
            if usable < len(match.slots):
                match = self.cache.match_prefix(key[:usable], r.cache_salt, split=True)
            if self.states is not None:  # recurrent layers: resume at the deepest snapshot
                depth, snapshot = self.cache.deepest_state(match.node)
                if depth < len(match.slots):
                    match = self.cache.match_prefix(key[:depth], r.cache_salt, split=True)
                if snapshot is not None:
                    self.states.copy(snapshot, r.cache.state_slot)
                credit, r.cache.tier_credit = r.cache.tier_credit, None
                if credit is not None and depth >= credit[0]:  # the loaded snapshot is (still) there
                    for tier, n in credit[1].items():
                        if n:
                            self.tiers.stats.hit_tokens[tier] += n
                            if r.cache.num_cached_tokens is None:
                                r.cache.tier_hits[tier] = r.cache.tier_hits.get(tier, 0) + n
            self.kv.touch(match.slots[-self.kv.window :] if self.kv.window else ())
            self.cache.lock(match.node)
            self.cache.touch(match.node)
            if r.cache.tier_node is not None:  # blocks loaded from a lower tier: now held by r's own lock
                self.cache.unlock(r.cache.tier_node)
                r.cache.tier_node = None
            r.cache.node = match.node
            r.slots = list(match.slots)
            r.cache.num_shared = len(match.slots)
            if r.cache.num_cached_tokens is None:  # first admission: prompt tokens served from cache
                r.cache.num_cached_tokens = len(match.slots)
                r.cache.hit_node = match.node
        elif r.cache.num_cached_tokens is None:
            r.cache.num_cached_tokens = 0
        r.status = RequestStatus.RUNNING
        self.running.append(r)
        return True

    def _allocate(self, r: Request, n: int, preempt: bool = True) -> bool:
        """Append n new slots to r.slots, evicting cache and then preempting newer requests as
        needed. False when r could not get them (r is then preempted, or left to the caller)."""
        while True:
            slots = self.kv.allocate(n)
            if slots is not None:
                r.slots.extend(slots)
                if self._live is not None:
                    self._live.update(slots)
                return True
            # rows short: reclaim a window's worth beyond the need, so the next calls find them free
            if self._free_some(n, n + self.kv.window, self._live_window_slots):
                continue
            if not preempt:
                return False
            victim = self.running[-1]
            self.preempt(victim)
            if victim is r:
                return False

    def make_room(self, n: int) -> bool:
        """For work outside the scheduler while no request runs (train-medusa's forwards): reclaim
        window rows and evict cached prefixes until n slots, each with a row, are free. False when
        the pool cannot hold n."""
        while self.kv.num_free < n or self.kv.num_free_window < n:
            if not self._free_some(n, n, set):
                return False
        return True

    def _free_some(self, n: int, reclaim: int, live: Callable[[], set[int]]) -> bool:
        """One step toward n free slots, each with a window row: when rows are short, reclaim
        `reclaim` of them outside live(); else evict cached prefixes. False when neither freed any."""
        if self.kv.num_free_window < n and self.kv.reclaim(reclaim, live()):
            return True
        short = max(n - self.kv.num_free, n - self.kv.num_free_window)
        return self.cache is not None and self._evict(short)

    def _live_window_slots(self) -> set[int]:
        """Slots whose windowed-layer K/V a running request can still attend: the last `window`
        before its context, and the new tokens of a chunk scheduled this step. Built once a step
        (slots allocated after are added by _allocate; a preemption rebuilds it)."""
        if self._live is None:
            w, ctx = self.kv.window, self._step_context
            self._live = {s for r in self.running for s in r.slots[max(0, ctx.get(r, len(r.slots)) - w) :]}
        return self._live

    def _evict(self, num_tokens: int) -> bool:
        """Evict unlocked cache leaves (down to the lower tiers when present) until num_tokens
        slots are free; False when nothing was evictable."""
        freed = self.cache.evict(num_tokens, self.tiers.on_evict if self.tiers is not None else None)
        if freed:
            self.kv.free(freed)
        return bool(freed)

    # ---- lower KV tiers -------------------------------------------------------------------------
    def _loading(self, r: Request) -> bool:
        """True while r waits for blocks from a lower tier (a lookup starts at its first try)."""
        if r.cache.tier_load is not None:
            return True
        if r.cache.tier_checked:
            return False
        r.cache.tier_checked = True
        key = r.cached_key()
        match = self.cache.match_prefix(key, r.cache_salt)
        if self.states is None:
            r.cache.tier_load = self.tiers.lookup(key, r.cache_salt, len(match.slots))
        else:  # recurrent layers: resumable at a snapshot only
            r.cache.tier_load = self.tiers.lookup_state(
                key, r.cache_salt, len(match.slots), self._state_depth(match)
            )
        return r.cache.tier_load is not None

    def _state_depth(self, match) -> int:
        """The depth of the deepest snapshot within a radix-tree match (its node's edge may reach
        past the match)."""
        depth, _ = self.cache.deepest_state(match.node)
        if depth > len(match.slots):
            depth, _ = self.cache.deepest_state(match.node.parent)
        return depth

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to `timeout` seconds until a waiting request's lower-tier load is done (when
        the engine has nothing else to run); returns at once when none is loading."""
        loads = [r.cache.tier_load.future for r in self.waiting if r.cache.tier_load is not None]
        if loads:
            futures_wait(loads, timeout, return_when=FIRST_COMPLETED)

    def _promote_loaded(self) -> None:
        for r in self.waiting:
            if r.cache.tier_load is not None and r.cache.tier_load.future.done():
                load, r.cache.tier_load = r.cache.tier_load, None
                try:
                    loaded = load.future.result()
                except Exception:
                    logger.exception("KV tier load for %s failed; computing its prompt instead", r.request_id)
                    continue
                if self.states is None:
                    self._promote(r, load, loaded)
                else:
                    self._promote_state(r, load, loaded)

    def _promote(self, r: Request, load, loaded) -> None:
        """Put loaded blocks back into the pool and the radix tree under r's cached prefix, locked
        for r until it is admitted. Blocks whose tokens differ from the prompt are dropped. When the
        pool's match no longer reaches the first loaded block (evicted meanwhile: it went down to a
        lower tier), r looks the tiers up again, once; when the pool has no room for the blocks now
        (running requests hold it), r keeps the loaded blocks and waits for room, as a prompt waits
        for admission, instead of computing them again."""
        tiers, B = self.tiers, self.tiers.block_tokens
        key = r.cached_key()
        start = load.first_block * B
        bounds = [start]  # block j covers tokens bounds[j]..bounds[j + 1]
        for tokens in loaded.tokens:
            if list(tokens) != key[bounds[-1] : bounds[-1] + len(tokens)]:
                break
            bounds.append(bounds[-1] + len(tokens))
        end = bounds[-1]
        match = self.cache.match_prefix(key[:end], r.cache_salt, split=True)
        have = len(match.slots)
        if have < start and not r.cache.tier_relooked:
            r.cache.tier_relooked, r.cache.tier_checked = True, False
            return
        if have < start or have >= end:
            self._count_load(loaded)
            return
        self.cache.lock(match.node)  # keep the prefix we extend while making room
        slots = self.kv.allocate(end - have)
        while slots is None and self._evict(end - have - self.kv.num_free):
            slots = self.kv.allocate(end - have)
        self.cache.unlock(match.node)
        if slots is None:
            r.cache.tier_load = load  # done: tried again at the next step
            return
        self._count_load(loaded)
        tiers.write_rows(slots, loaded, have - start)
        present = self.cache.insert(key[:end], match.slots + slots, r.cache_salt)
        if present > have:  # (cannot happen on the engine thread; kept safe)
            self.kv.free(slots[: present - have])
        node = self.cache.match_prefix(key[:end], r.cache_salt, split=True).node
        self.cache.lock(node)
        r.cache.tier_node = node
        for j in range(len(bounds) - 1):
            lo, hi = max(have, bounds[j]), bounds[j + 1]
            if hi > lo:
                tier = loaded.tiers[j]
                tiers.stats.hit_tokens[tier] += hi - lo
                if r.cache.num_cached_tokens is None:  # first admission: the request's usage counts it
                    r.cache.tier_hits[tier] = r.cache.tier_hits.get(tier, 0) + hi - lo

    def _promote_state(self, r: Request, load, loaded) -> None:
        """_promote with recurrent layers: the loaded snapshot at depth load.state_depth goes into
        a free state slot as the snapshot of r's prefix to that depth, with the loaded blocks the
        pool lacks up to it; nothing is kept when the snapshot or a block before it did not come.
        r's tier hits: the tokens past the pool's own snapshot that the load made resumable (those in
        a loaded block counted to its tier, those in the pool to the snapshot's)."""
        tiers, B = self.tiers, self.tiers.block_tokens
        key, start, depth = r.cached_key(), load.first_block * B, load.state_depth
        bounds = [start]
        for tokens in loaded.tokens:
            if list(tokens) != key[bounds[-1] : bounds[-1] + len(tokens)]:
                break
            bounds.append(bounds[-1] + len(tokens))
        match = self.cache.match_prefix(key[:depth], r.cache_salt, split=True)
        have, device_state = len(match.slots), self._state_depth(match)
        if have < min(start, depth) and not r.cache.tier_relooked:
            r.cache.tier_relooked, r.cache.tier_checked = True, False
            return
        gap = have < depth and not (start <= have and bounds[-1] >= depth)  # a block before it is missing
        if loaded.state is None or device_state >= depth or gap:
            self._count_load(loaded)
            return
        self.cache.lock(match.node)  # keep the prefix we extend while making room
        slots = self.kv.allocate(depth - have) if have < depth else []
        while slots is None and self._evict(depth - have - self.kv.num_free):
            slots = self.kv.allocate(depth - have)
        slot = self._state_slot() if slots is not None else None
        self.cache.unlock(match.node)
        if slot is None:
            if slots:
                self.kv.free(slots)
            r.cache.tier_load = load  # done: tried again at the next step
            return
        self._count_load(loaded)
        if slots:
            tiers.write_rows(slots, loaded, have - start)
            present = self.cache.insert(key[:depth], match.slots + slots, r.cache_salt)
            if present > have:  # (cannot happen on the engine thread; kept safe)
                self.kv.free(slots[: present - have])
        tiers.write_state(slot, loaded)
        if not self.cache.set_state(key[:depth], slot, r.cache_salt):
            self.states.free(slot)
        node = self.cache.match_prefix(key[:depth], r.cache_salt, split=True).node
        self.cache.lock(node)
        r.cache.tier_node = node
        hits = {loaded.state_tier: max(0, min(have, depth) - device_state)}
        for j in range(len(bounds) - 1):
            lo, hi = max(have, bounds[j]), min(bounds[j + 1], depth)
            if hi > lo:
                hits[loaded.tiers[j]] = hits.get(loaded.tiers[j], 0) + hi - lo
        r.cache.tier_credit = (depth, hits)  # counted when r resumes there (_admit)

    def _count_load(self, loaded) -> None:
        self.tiers.stats.num_loads += 1
        self.tiers.stats.load_seconds += loaded.seconds

    def _release_states(self, r: Request, insert: bool) -> None:
        settle_verify(self.states, r.cache)
        if insert:
            self._attach_snapshots(r, len(r.slots))
            slot = r.cache.state_slot
            if (
                slot is not None
                and r.slots
                and self.cache.set_state(r.token_ids[: len(r.slots)], slot, r.cache_salt)
            ):
                r.cache.state_slot = None
        for _, slot in r.cache.snapshots:
            self.states.free(slot)
        r.cache.snapshots = []
        if r.cache.state_slot is not None:
            self.states.free(r.cache.state_slot)
            r.cache.state_slot = None

    def preempt(self, r: Request) -> None:
        self.running.remove(r)
        self._live = None  # r's window is no longer live
        r.cache.tier_checked = r.cache.tier_relooked = False
        r.pending_jump_forward = 0  # recomputed with the rest, as prefill
        self._release(r, insert=True)
        r.status = RequestStatus.WAITING
        self.waiting.appendleft(r)
        self.num_preemptions += 1
        logger.info("preempted %s (KV pool full)", r.request_id)

    def finish(self, r: Request, insert: bool = True) -> None:
        """Remove r from the queues and release its KV (into the radix tree when caching and
        `insert`; a request that failed passes False: its KV is not trusted)."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        r.cache.tier_load = r.cache.tier_credit = None
        r.cache.hit_node = None
        if r.cache.tier_node is not None:
            self.cache.unlock(r.cache.tier_node)
            r.cache.tier_node = None
        self._release(r, insert=insert)

    def _release(self, r: Request, insert: bool) -> None:
        """Give back r's KV (into the tree when `insert`) and state slots (with `insert`, r's
        working state becomes the snapshot at its computed length)."""
        r.spec.draft = None
        if len(r.slots) > r.num_tokens:  # draft slots of a verify chunk (preempted mid-schedule)
            self.kv.free(r.slots[r.num_tokens :])
            del r.slots[r.num_tokens :]
        written = None  # the prefix to write through to the disk tier
        if self.cache is None:
            self.kv.free(r.slots)
        else:
            if insert and len(r.slots) > r.cache.num_shared:
                tokens = r.token_ids[: len(r.slots)]
                present = self.cache.insert(tokens, r.slots, r.cache_salt)
                if self.kv.window:  # duplicates of the tree's: their window rows go to the tree's slots
                    tree_slots = self.cache.match_prefix(tokens[:present], r.cache_salt).slots
                    self.kv.adopt(
                        r.slots[r.cache.num_shared : present], tree_slots[r.cache.num_shared : present]
                    )
                else:
                    self.kv.free(r.slots[r.cache.num_shared : present])  # duplicates of what the tree holds
                if self.tiers is not None:
                    written = tokens
            else:
                self.kv.free(r.slots[r.cache.num_shared :])
            if r.cache.node is not None:
                self.cache.unlock(r.cache.node)
        if self.states is not None:
            self._release_states(r, insert and self.cache is not None)
        if written is not None:  # (with recurrent layers, with the snapshots on its path, r's now)
            self.tiers.write_through(
                written,
                self.cache.match_prefix(written, r.cache_salt).slots,
                r.cache_salt,
                r.num_prompt_tokens,
                self.cache.path_states(written, r.cache_salt) if self.states is not None else (),
            )
        r.slots = []
        r.cache.num_shared = 0
        r.cache.window_demoted = 0
        r.cache.node = None
