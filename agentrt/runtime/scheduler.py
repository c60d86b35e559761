"""Scheduler: cache-aware admission, chunked prefill, KV allocation with eviction and preemption.

Every step gets a token budget (`max_num_batched_tokens`). Running requests go first: a decoding
request takes one token, a request still prefilling takes its next chunk. Then waiting requests
are admitted, longest cached prefix first (a request that has waited longer than
`reorder_window_s` goes first in arrival order, so nothing starves), each reusing the KV of its
cached prefix from the radix tree and prefilling the rest in chunks. When the KV pool is short,
unlocked cache leaves are evicted first (LRU); then the newest running request is preempted: its
computed KV goes into the radix tree (or is freed without cache) and it is requeued first in line,
to be recomputed, mostly from the cache, when room returns. A request is never dropped for lack
of KV.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from agentrt.prefix_cache import RadixCache
from agentrt.runtime.config import SchedulerConfig
from agentrt.runtime.kv_cache import KVPool
from agentrt.runtime.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledChunk:
    """`request` computes tokens [context_len, context_len + num_new) of prompt + output this step;
    `sample` is True when the chunk reaches its last known token (a new token is sampled)."""

    request: Request
    context_len: int
    num_new: int
    sample: bool


class Scheduler:
    """Owns the waiting/running queues, the KV pool's allocation and the radix cache (None when
    the prefix cache is disabled)."""

    def __init__(self, config: SchedulerConfig, kv: KVPool, cache: RadixCache | None):
        self.config = config
        self.kv = kv
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, r: Request) -> None:
        r.status = RequestStatus.WAITING
        self.waiting.append(r)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        if self.cache is not None:
            for r in self.running:
                if r.prefilled_since_insert:
                    self._cache_computed_prefix(r)
        for r in list(self.running):
            if r not in self.running:  # preempted while making room for an earlier one
                continue
            remaining = r.num_tokens - len(r.slots)
            n = min(remaining, budget)
            if r.spec.draft is not None:  # a speculative verify chunk: the last token + the draft
                if remaining == 1 and budget >= 1 + len(r.spec.draft):
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

    @staticmethod
    def _add_chunk(chunks: list[ScheduledChunk], r: Request, n: int) -> None:
        """(A verify chunk's draft slots lie beyond r.num_tokens; the engine trims them after.)"""
        chunks.append(ScheduledChunk(r, len(r.slots) - n, n, len(r.slots) >= r.num_tokens))
        if n > 1 and r.spec.draft is None:
            r.prefilled_since_insert = True

    def _cache_computed_prefix(self, r: Request) -> None:
        """Insert a running request's computed prefix (after a prefill chunk) into the radix tree,
        so requests arriving while it still runs share it (as SGLang caches unfinished requests).
        r then reads the tree's slots for that prefix; duplicates of ours are freed."""
        r.prefilled_since_insert = False
        tokens = r.token_ids[: len(r.slots)]
        present = self.cache.insert(tokens, r.slots, r.cache_salt)
        match = self.cache.match_prefix(tokens, r.cache_salt)
        tree_slots = match.slots
        for i in range(r.num_shared, present):
            if r.slots[i] != tree_slots[i]:
                self.kv.free([r.slots[i]])
        r.slots[: len(tree_slots)] = tree_slots
        self.cache.lock(match.node)
        if r.cache_node is not None:
            self.cache.unlock(r.cache_node)
        r.cache_node = match.node
        r.num_shared = len(tree_slots)

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
        """Move r to running with its cached prefix locked. (Memory is checked by _allocate.)"""
        self.waiting.remove(r)
        if self.cache is not None:
            match = self.cache.match_prefix(r.cached_key(), r.cache_salt)
            self.cache.lock(match.node)
            self.cache.touch(match.node)
            r.cache_node = match.node
            r.slots = list(match.slots)
            r.num_shared = len(match.slots)
            if r.num_cached_tokens is None:  # first admission: prompt tokens served from cache
                r.num_cached_tokens = len(match.slots)
        elif r.num_cached_tokens is None:
            r.num_cached_tokens = 0
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
                return True
            short = n - self.kv.num_free
            if self.cache is not None:
                freed = self.cache.evict(short)
                if freed:
                    self.kv.free(freed)
                    continue
            if not preempt:
                return False
            victim = self.running[-1]
            self.preempt(victim)
            if victim is r:
                return False

    def preempt(self, r: Request) -> None:
        self.running.remove(r)
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
        self._release(r, insert=insert)

    def _release(self, r: Request, insert: bool) -> None:
        r.spec.draft = None
        if len(r.slots) > r.num_tokens:  # draft slots of a verify chunk (preempted mid-schedule)
            self.kv.free(r.slots[r.num_tokens :])
            del r.slots[r.num_tokens :]
        if self.cache is None:
            self.kv.free(r.slots)
        else:
            if insert and len(r.slots) > r.num_shared:
                tokens = r.token_ids[: len(r.slots)]
                present = self.cache.insert(tokens, r.slots, r.cache_salt)
                self.kv.free(r.slots[r.num_shared : present])  # duplicates of what the tree holds
            else:
                self.kv.free(r.slots[r.num_shared :])
            if r.cache_node is not None:
                self.cache.unlock(r.cache_node)
        r.slots = []
        r.num_shared = 0
        r.cache_node = None
