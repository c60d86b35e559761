"""Speculative decoding: proposers (n-gram prompt lookup, draft model, Medusa heads), draft trees,
verification (greedy / sampled match, rejection sampling, typical acceptance) and Medusa head
training. A leaf package: it never imports `runtime` or `api` (the engine drives it)."""

from agentrt.speculative.ngram import NgramProposer
from agentrt.speculative.tree import DraftTree

__all__ = ["DraftTree", "NgramProposer"]
