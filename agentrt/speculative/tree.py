"""Draft trees: the tokens proposed for one verify pass and how they hang together.

A draft is a tree rooted at the sequence's last known token (the root, not part of the draft).
Node i has token `token_ids[i]` and parent `parents[i]` (-1 = the root); parents come before their
children. A linear draft (n-gram, draft model) is a chain: parents = [-1, 0, 1, ...]. Medusa drafts
are trees of top-k candidates per head (Cai et al. 2024, "Medusa", arXiv 2401.10774, section 2.1.2:
tree attention), laid out by a list of paths of top-k ranks (Medusa's `medusa_choices`).

In the verify pass the root and every node are fed at once: node i sits at position
context_len + depth[i] and attends to the cached context, the root and its own ancestors
(`attention_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Paths of top-k ranks, one node each: (0,) = head 0's best token, (0, 1) = head 1's second best
# after it, ... 16 nodes over 4 heads, widest near the root where acceptance is likeliest.
DEFAULT_MEDUSA_TREE: tuple[tuple[int, ...], ...] = (
    (0,),
    (1,),
    (2,),
    (3,),
    (0, 0),
    (0, 1),
    (0, 2),
    (1, 0),
    (1, 1),
    (2, 0),
    (0, 0, 0),
    (0, 0, 1),
    (0, 1, 0),
    (1, 0, 0),
    (0, 0, 0, 0),
    (0, 0, 0, 1),
)


@dataclass
class DraftTree:
    """token_ids [N] and parents [N] (-1 = root; parents[i] < i). q_probs: for a sampled linear
    draft, the proposer's probabilities [N, vocab] fp32 each token was drawn from (rejection
    sampling needs them); None for deterministic drafts."""

    token_ids: list[int]
    parents: list[int]
    q_probs: torch.Tensor | None = None
    depths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError("draft tree: token_ids and parents differ in length")
        self.depths = []
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"draft tree: node {i} has parent {p} (parents must come first)")
            self.depths.append(1 if p < 0 else self.depths[p] + 1)

    @classmethod
    def chain(cls, token_ids: list[int], q_probs: torch.Tensor | None = None) -> DraftTree:
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)), q_probs)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root), in order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (inclusive)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def prune(self, keep: list[bool]) -> DraftTree:
        """The subtree of nodes with keep[i] whose ancestors are all kept (renumbered)."""
        new_index: dict[int, int] = {}
        tokens, parents = [], []
        for i, p in enumerate(self.parents):
            if keep[i] and (p < 0 or p in new_index):
                new_index[i] = len(tokens)
                tokens.append(self.token_ids[i])
                parents.append(-1 if p < 0 else new_index[p])
        q = None
        if self.q_probs is not None:
            q = (
                self.q_probs[torch.tensor(sorted(new_index), dtype=torch.int64)]
                if new_index
                else self.q_probs[:0]
            )
        return DraftTree(tokens, parents, q)

    def attention_mask(self) -> torch.Tensor:
        """[N + 1, N + 1] bool over (root, nodes...): True where row attends to column (itself,
        the root and its ancestors)."""
        n = len(self.token_ids) + 1
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            row = i + 1
            mask[row, row] = True
            if p >= 0:
                mask[row] |= mask[p + 1]
        mask[0, 0] = True
        return mask


def tree_from_topk(topk_ids: list[list[int]], choices: tuple[tuple[int, ...], ...]) -> DraftTree:
    """Medusa candidates: topk_ids[h] = head h's token ids by rank (h = 0 predicts the token after
    next); each path in `choices` (ranks per depth, parents listed before children) is one node.
    Paths that need a rank or head beyond what topk_ids holds are skipped."""
    index: dict[tuple[int, ...], int] = {}
    tokens, parents = [], []
    for path in sorted(choices, key=lambda c: (len(c), c)):
        depth = len(path)
        if depth > len(topk_ids) or path[-1] >= len(topk_ids[depth - 1]):
            continue
        parent = index.get(path[:-1], -1) if depth > 1 else -1
        if depth > 1 and path[:-1] not in index:
            continue
        index[path] = len(tokens)
        tokens.append(topk_ids[depth - 1][path[-1]])
        parents.append(parent)
    return DraftTree(tokens, parents)
