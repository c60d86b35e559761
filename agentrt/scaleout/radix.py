"""An approximate radix tree of the prompt prefixes a router has sent to one replica.

The router cannot see a replica's real prefix cache (agentrt/prefix_cache/radix_tree.py, token ids
-> KV slots); it remembers instead what it sent there, as SGLang's cache-aware router does with its
approximate tree per worker (sgl-router, `tree.rs`: characters, LRU eviction per tenant) and Ray
Serve LLM's PrefixCacheAffinityRouter with its text tree. Here the alphabet is a *chunk id*: the
routing key's text cut into fixed-size chunks counted from its start, each hashed to a 64-bit id
(agentrt/scaleout/routing_key.py), so an edge is a tuple of ints and two keys share a path exactly
as far as their first full chunks agree. Matching is in whole chunks: a shared prefix is seen to
the last chunk boundary before the first differing character.

Memory is bounded by `max_chunks`, the chunk ids held over all edges (each node holds at least one,
so nodes <= chunks + 1). An insert that goes over the bound evicts least recently used leaves (a
node's time is that of the last insert that passed through it) down to 90% of it, never the path
just inserted; a key longer than the bound is kept to its first `max_chunks` chunks. Evicting
whole leaves, oldest first, is what the replicas' own caches do with their KV (LRU of unlocked
leaves), so the tree forgets roughly what they forget when the bound matches their capacity.

Not thread-safe: the owner (agentrt/scaleout/policy.py RoutingTable) holds a lock.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

LOW_WATERMARK = 0.9
"""An eviction frees leaves until the tree holds at most this share of `max_chunks`."""


class _Node:
    __slots__ = ("children", "edge", "last_access", "parent")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None, last_access: int):
        self.edge = edge
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_access = last_access


def _common_len(edge: tuple[int, ...], chunks: Sequence[int], start: int) -> int:
    """How many leading ids of `edge` equal chunks[start:]."""
    n = min(len(edge), len(chunks) - start)
    k = 0
    while k < n and edge[k] == chunks[start + k]:
        k += 1
    return k


class ChunkRadixTree:
    """Chunk-id sequences -> nothing but their presence; `match` gives the longest stored prefix.

    max_chunks: the most chunk ids held (>= 1); raises ValueError otherwise."""

    def __init__(self, max_chunks: int):
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self.max_chunks = max_chunks
        self._root = _Node((), None, 0)
        self._clock = 0
        self.num_chunks = 0
        self.num_nodes = 1  # the root
        self.num_evicted_chunks = 0

    def match(self, chunks: Sequence[int]) -> int:
        """The number of leading chunks of `chunks` stored in the tree (0..len(chunks)). Does not
        modify the tree (LRU times are refreshed by `insert` only)."""
        node, i = self._root, 0
        while i < len(chunks):
            child = node.children.get(chunks[i])
            if child is None:
                break
            k = _common_len(child.edge, chunks, i)
            i += k
            if k < len(child.edge):
                break
            node = child
        return i

    def insert(self, chunks: Sequence[int]) -> int:
        """Store `chunks` (its first `max_chunks` ids), marking its whole path most recently used,
        then evict LRU leaves if the tree is over its bound. Returns the number of ids added."""
        chunks = chunks[: self.max_chunks]
        self._clock += 1
        now = self._clock
        node, i = self._root, 0
        node.last_access = now
        added = 0
        while i < len(chunks):
            child = node.children.get(chunks[i])
            if child is None:
                leaf = _Node(tuple(chunks[i:]), node, now)
                node.children[chunks[i]] = leaf
                added = len(chunks) - i
                self.num_chunks += added
                self.num_nodes += 1
                break
            k = _common_len(child.edge, chunks, i)
            if k < len(child.edge):  # split the edge: the shared part becomes its own node
                mid = _Node(child.edge[:k], node, child.last_access)
                node.children[chunks[i]] = mid
                child.edge = child.edge[k:]
                child.parent = mid
                mid.children[child.edge[0]] = child
                self.num_nodes += 1
                child = mid
            child.last_access = now
            i += k
            node = child
        if self.num_chunks > self.max_chunks:
            self.evict(int(self.max_chunks * LOW_WATERMARK), keep=now)
        return added

    def evict(self, target_chunks: int, keep: int | None = None) -> int:
        """Remove least recently used leaves until at most `target_chunks` ids remain, sparing
        nodes last used at time `keep` (the insert in progress). Returns the ids removed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.last_access != keep]
        heapq.heapify(heap)
        removed = 0
        while self.num_chunks > target_chunks and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None  # leaves are never the root
            del parent.children[leaf.edge[0]]
            leaf.parent = None
            self.num_chunks -= len(leaf.edge)
            self.num_nodes -= 1
            removed += len(leaf.edge)
            if parent is not self._root and not parent.children and parent.last_access != keep:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self.num_evicted_chunks += removed
        return removed

    def clear(self) -> None:
        """Forget everything (the replica's cache is gone)."""
        self._root = _Node((), None, self._clock)
        self.num_chunks = 0
        self.num_nodes = 1

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def count_chunks(self) -> int:
        """The ids held, counted by walking the tree (equals `num_chunks`; for tests)."""
        total, stack = 0, list(self._root.children.values())
        while stack:
            node = stack.pop()
            total += len(node.edge)
            stack.extend(node.children.values())
        return total
