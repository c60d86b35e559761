"""Verification of a draft against the target model's distributions at every draft position.

Rows: row 0 holds the target's next-token logits/probabilities after the root (the last known
token), row i + 1 those after draft node i. Three rules:

- `verify_tree` (deterministic drafts: n-gram, greedy draft model, Medusa top-k trees): at the
  root, draw the target token from row 0 exactly as non-speculative decoding would (argmax when
  greedy, a sample otherwise); if a child of the current node carries that token, accept it and
  continue from it, else the drawn token is the bonus. The emitted tokens are distributed exactly
  as without speculation (each is a draw from the target row of the accepted path); for greedy it
  is token-identical. For a point-mass proposal this is the same as rejection sampling below.
- `rejection_sample` (sampled linear drafts with proposal probabilities q): Leviathan et al. 2023,
  "Fast Inference from Transformers via Speculative Decoding" (arXiv 2211.17192), Chen et al. 2023
  (arXiv 2302.01318): accept draft token d with probability min(1, p(d) / q(d)); at the first
  rejection sample from normalize(max(p - q, 0)); when all are accepted sample a bonus token from
  the last row. Preserves the target distribution.
- `typical_accept` (Medusa's typical acceptance, Cai et al. 2024, arXiv 2401.10774, section 2.3.1):
  accept a candidate x when p(x) > min(epsilon, delta * exp(-H(p))). Faster acceptance at
  temperature > 0, but it does NOT preserve the target distribution: opt-in only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from agentrt.speculative.tree import DraftTree


def verify_tree(tree: DraftTree, draw: Callable[[int], int]) -> tuple[list[int], int]:
    """draw(row) -> the target token at that row (-1 when the row admits no token).
    Returns (accepted node indices along one root-to-node path, bonus token). Rows are drawn
    lazily, only along the accepted path (so a seeded generator advances once per emitted token)."""
    node, accepted = -1, []
    while True:
        tok = draw(node + 1)
        if tok < 0:
            return accepted, tok
        child = next((c for c in tree.children(node) if tree.token_ids[c] == tok), None)
        if child is None:
            return accepted, tok
        accepted.append(child)
        node = child


def rejection_sample(p_probs: torch.Tensor, tree: DraftTree, generator: torch.Generator) -> tuple[int, int]:
    """p_probs [N + 1, V] fp32 target probabilities (temperature, filters and grammar mask applied);
    tree: a chain of N tokens with q_probs [N, V] fp32 (the proposer's probabilities).
    Returns (number of draft tokens accepted, the token that follows them)."""
    if tree.q_probs is None or not tree.is_chain:
        raise ValueError("rejection sampling needs a linear draft with proposal probabilities")
    dev = p_probs.device
    for i, d in enumerate(tree.token_ids):
        p, q = float(p_probs[i, d]), float(tree.q_probs[i, d])
        u = float(torch.rand((), generator=generator, device=generator.device))
        if q > 0.0 and u * q < p:
            continue
        residual = torch.clamp(p_probs[i] - tree.q_probs[i].to(dev), min=0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere: only possible when p == q
            residual = p_probs[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator).item())
    last = p_probs[len(tree)]
    return len(tree), int(torch.multinomial(last, 1, generator=generator).item())


def typical_accept(
    tree: DraftTree,
    probs: Callable[[int], torch.Tensor],
    draw: Callable[[int], int],
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> tuple[list[int], int]:
    """probs(row) -> [V] fp32 target probabilities at that row; draw(row) -> a token sampled from
    it. At each node the child with the highest p(x) among those passing
    p(x) > min(epsilon, delta * exp(-H(p))) is accepted; when none passes the drawn token is the
    bonus. Returns (accepted nodes, bonus)."""
    node, accepted = -1, []
    while True:
        kids = tree.children(node)
        if kids:
            p = probs(node + 1)
            entropy = float(-(p * torch.log(p.clamp_min(1e-20))).sum())
            threshold = min(epsilon, delta * float(torch.exp(torch.tensor(-entropy))))
            scored = [(float(p[tree.token_ids[c]]), c) for c in kids]
            best = max((s for s in scored if s[0] > threshold), default=None)
            if best is not None:
                accepted.append(best[1])
                node = best[1]
                continue
        return accepted, draw(node + 1)
