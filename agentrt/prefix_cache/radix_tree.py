"""Radix tree prefix cache (as in SGLang's RadixAttention, Zheng et al. 2023, arXiv 2312.07104).

Each edge holds a run of token ids and the KV slots computed for them (token-granular: one slot per
token). A path from the root spells a token prefix whose KV is cached. Requests lock the node where
their matched prefix ends (lock_ref counts up to the root) so the slots they read cannot be evicted;
`evict` frees only unlocked leaves, least recently used first, and a parent whose last child goes
becomes a leaf itself. Separate namespaces (`salt`, e.g. a tenant's `cache_salt`) never share KV.

For a model with recurrent layers a node may also hold a state snapshot (`TreeNode.state`, a slot of
runtime/recurrent_state.StatePool): the recurrent state after the tokens up to the end of its edge.
Only a prefix that ends at a snapshot can be resumed (`deepest_state`); the snapshot goes with its
node when the node is evicted, and `evict_states` drops snapshots alone (least recently used first)
when the state pool runs short (as SGLang's Mamba radix cache).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

# on_evict(path_tokens, path_slots, start, salt, state): a leaf holding path_tokens[start:] is about
# to go; path_tokens / path_slots spell its whole prefix from the root (its slots are still valid);
# state: its snapshot's state slot (the state after path_tokens, still valid), or None.
EvictHook = Callable[[list[int], list[int], int, str, "int | None"], None]


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)  # token ids of the edge into this node
    value: list[int] = field(default_factory=list)  # KV slots, len(value) == len(key)
    children: dict[int, TreeNode] = field(default_factory=dict)  # first token id -> child
    parent: TreeNode | None = None
    lock_ref: int = 0
    last_access: int = 0
    state: int | None = None  # state slot of the recurrent state after this edge's last token


class MatchResult(NamedTuple):
    """slots: KV slots of the longest cached prefix (may end inside an edge);
    node: the node whose edge holds the last matched token (the root when nothing matched) —
    lock it to protect every slot in `slots`."""

    slots: list[int]
    node: TreeNode


class RadixCache:
    """Radix tree of cached KV. Slot ownership: slots inserted belong to the tree until `evict`
    returns them to the caller (who frees them in the KV pool)."""

    def __init__(self) -> None:
        self._roots: dict[str, TreeNode] = {}
        self._clock = itertools.count(1)
        self.total_tokens = 0  # tokens held by the tree
        self.locked_tokens = 0  # tokens on nodes with lock_ref > 0
        self.num_states = 0  # state snapshots held by the tree
        self.free_state: Callable[[int], None] | None = None  # returns an evicted snapshot's slot

    def root(self, salt: str = "") -> TreeNode:
        if salt not in self._roots:
            self._roots[salt] = TreeNode(lock_ref=1)  # roots are never evicted
        return self._roots[salt]

    @property
    def evictable_tokens(self) -> int:
        return self.total_tokens - self.locked_tokens

    def match_prefix(self, token_ids: list[int], salt: str = "", split: bool = False) -> MatchResult:
        """Longest cached prefix of token_ids. Without `split` the tree is not modified (not even
        access times), and a match ending inside an edge returns that edge's node, which holds more
        tokens than matched. With `split` (for a caller that locks the node) such an edge is split
        where the match ends, so the node holds exactly the matched tokens: locking it protects them
        without pinning the rest of the edge, which stays evictable."""
        node = self.root(salt)
        slots: list[int] = []
        i = 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                break
            n = _common_len(child.key, token_ids, i)
            slots.extend(child.value[:n])
            i += n
            if n < len(child.key):
                node = self._split(child, n) if split else child
                break
            node = child
        return MatchResult(slots, node)

    def insert(self, token_ids: list[int], slots: list[int], salt: str = "") -> int:
        """Cache KV `slots` for `token_ids` (same length). Returns how many leading tokens were
        already cached: the caller's slots for those positions are not taken (the caller frees
        the ones that differ from the cached ones); the rest now belong to the tree."""
        if len(token_ids) != len(slots):
            raise ValueError(f"insert: {len(token_ids)} token ids but {len(slots)} slots")
        node = self.root(salt)
        now = next(self._clock)
        node.last_access = now
        i = 0
        while i < len(token_ids):
            child = node.children.get(token_ids[i])
            if child is None:
                new = TreeNode(list(token_ids[i:]), list(slots[i:]), parent=node, last_access=now)
                node.children[token_ids[i]] = new
                self.total_tokens += len(new.key)
                return i
            n = _common_len(child.key, token_ids, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            i += n
            node = child
        return i

    def touch(self, node: TreeNode) -> None:
        """Mark node and its ancestors as just used (LRU order)."""
        now = next(self._clock)
        while node is not None:
            node.last_access = now
            node = node.parent

    def lock(self, node: TreeNode) -> None:
        """Protect node and its ancestors from eviction (reference counted)."""
        while node is not None:
            if node.lock_ref == 0:
                self.locked_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.locked_tokens -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int, on_evict: EvictHook | None = None) -> list[int]:
        """Remove unlocked leaves, least recently used first, until at least num_tokens slots are
        freed or nothing evictable is left. Returns the freed slots (the caller returns them to
        the KV pool). Locked nodes and their ancestors are never touched. `on_evict` sees each leaf
        (with its whole prefix) before it goes, while its KV is still in its slots."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            if on_evict is not None:
                tokens, slots, salt = self.path(leaf)
                on_evict(tokens, slots, len(tokens) - len(leaf.key), salt, leaf.state)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            freed.extend(leaf.value)
            self._drop_state(leaf)
            self.total_tokens -= len(leaf.key)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def set_state(self, token_ids: list[int], slot: int, salt: str = "") -> bool:
        """Make `slot` the snapshot of the state after `token_ids` (a cached prefix: the edge is
        split there). False when the prefix is not cached in full or already has a snapshot: the
        caller keeps (frees) the slot."""
        if not token_ids:
            return False
        match = self.match_prefix(token_ids, salt, split=True)
        if len(match.slots) != len(token_ids) or match.node.state is not None:
            return False
        match.node.state = slot
        self.num_states += 1
        return True

    def deepest_state(self, node: TreeNode) -> tuple[int, int | None]:
        """(depth in tokens, state slot) of the deepest snapshot on the path from the root to `node`
        (node included); (0, None) when there is none."""
        depths, n = [], node
        while n.parent is not None:
            depths.append(n)
            n = n.parent
        depth = sum(len(n.key) for n in depths)
        for n in depths:  # deepest first
            if n.state is not None:
                return depth, n.state
            depth -= len(n.key)
        return 0, None

    def evict_states(
        self, num_states: int, on_evict: EvictHook | None = None, keep: int | None = None
    ) -> int:
        """Drop up to `num_states` snapshots, least recently used first (those on locked paths last,
        the snapshot in slot `keep` never), keeping their KV; returns how many were dropped (their
        slots go to `free_state`). `on_evict` sees each one before it goes, as `evict` shows a leaf
        (start = the prefix's length: its KV stays)."""
        nodes = []
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.state is not None and n.state != keep:
                nodes.append(n)
        nodes.sort(key=lambda n: (n.lock_ref > 0, n.last_access))
        for n in nodes[:num_states]:
            if on_evict is not None:
                tokens, slots, salt = self.path(n)
                on_evict(tokens, slots, len(tokens), salt, n.state)
            self._drop_state(n)
        return min(num_states, len(nodes))

    def path_states(self, token_ids: list[int], salt: str = "") -> list[tuple[int, int]]:
        """(depth in tokens, state slot) of each snapshot on the cached path of `token_ids`, at depths
        <= len(token_ids), shallowest first. Does not modify the tree."""
        node, depth, out = self.root(salt), 0, []
        while depth < len(token_ids):
            child = node.children.get(token_ids[depth])
            if child is None:
                break
            n = _common_len(child.key, token_ids, depth)
            if n < len(child.key):
                break
            node, depth = child, depth + n
            if node.state is not None:
                out.append((depth, node.state))
        return out

    def _drop_state(self, node: TreeNode) -> None:
        if node.state is not None:
            slot, node.state = node.state, None
            self.num_states -= 1
            if self.free_state is not None:
                self.free_state(slot)

    def path(self, node: TreeNode) -> tuple[list[int], list[int], str]:
        """(token ids, slots, salt) of the prefix that ends at node's edge, from the root."""
        keys, values = [], []
        while node.parent is not None:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        salt = next(s for s, r in self._roots.items() if r is node)
        return [t for k in reversed(keys) for t in k], [v for vs in reversed(values) for v in vs], salt

    def _leaves(self):
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split child's edge after n tokens; returns the new upper node (keeps child's locks)."""
        upper = TreeNode(
            child.key[:n],
            child.value[:n],
            parent=child.parent,
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        upper.children[child.key[n]] = child
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key, child.value = child.key[n:], child.value[n:]
        return upper


def _common_len(key: list[int], token_ids: list[int], start: int) -> int:
    n = min(len(key), len(token_ids) - start)
    i = 0
    while i < n and key[i] == token_ids[start + i]:
        i += 1
    return i
