"""Radix tree over token ids -> KV slots, with lock references and LRU eviction of unlocked leaves."""

from agentrt.prefix_cache.radix_tree import MatchResult, RadixCache, TreeNode

__all__ = ["MatchResult", "RadixCache", "TreeNode"]
