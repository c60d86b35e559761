"""Verification rules on synthetic distributions (exactness is a statistical property: seeded,
fixed significance)."""

from __future__ import annotations

import torch

from agentrt.speculative.tree import DraftTree
from agentrt.speculative.verify import rejection_sample, typical_accept, verify_tree

ALPHA = 1e-3  # fixed significance; every draw is seeded, so the outcome is deterministic


def chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value of counts vs probabilities (cells with expected < 5 merged)."""
    n = float(observed.sum())
    exp = expected_probs * n
    big = exp >= 5
    obs = torch.cat([observed[big].double(), observed[~big].sum().double().reshape(1)])
    ex = torch.cat([exp[big].double(), exp[~big].sum().double().reshape(1)])
    keep = ex > 0
    stat = float((((obs - ex) ** 2)[keep] / ex[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_verify_tree_greedy_follows_the_argmax_path():
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 1, 2])  # 5 | 6 -> 7 -> 8
    argmax = {0: 6, 2: 7, 3: 9}  # rows: root, after 6 (node 1), after 7 (node 2)
    accepted, bonus = verify_tree(tree, lambda row: argmax[row])
    assert accepted == [1, 2] and bonus == 9
    accepted, bonus = verify_tree(tree, lambda row: 4)
    assert accepted == [] and bonus == 4
    accepted, bonus = verify_tree(tree, lambda row: -1)  # every token masked
    assert accepted == [] and bonus == -1


def test_rejection_sampling_preserves_the_target_distribution():
    """Two-position chain with fixed target rows p0, p1, p2 and a proposal q that disagrees with
    them: the first two emitted tokens must be distributed as p0 x p1."""
    g = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(3, vocab, generator=g) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, dim=-1)
    counts = torch.zeros(vocab * vocab)
    trials = 20000
    for _ in range(trials):
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        tree = DraftTree.chain(d, q)
        n, nxt = rejection_sample(p, tree, g)
        emitted = d[:n] + [nxt]
        if len(emitted) < 2:  # rejected at 0: the second token comes from p1 in the next pass
            emitted.append(int(torch.multinomial(p[1], 1, generator=g)))
        counts[emitted[0] * vocab + emitted[1]] += 1
    joint = (p[0][:, None] * p[1][None, :]).reshape(-1)
    assert chi_square_p(counts, joint) > ALPHA
    # and a wrong distribution is detected by the same test (the test can fail)
    assert chi_square_p(counts, (q[0][:, None] * q[1][None, :]).reshape(-1)) < ALPHA


def test_typical_acceptance_takes_likely_candidates_only():
    tree = DraftTree([1, 2], [-1, -1])
    peaked = torch.tensor([0.0, 0.9, 0.05, 0.05])
    accepted, bonus = typical_accept(tree, lambda row: peaked, lambda row: 3)
    assert accepted == [0] and bonus == 3  # token 1 passes; node 0 has no children -> bonus drawn
    flat_low = torch.tensor([0.97, 0.01, 0.01, 0.01])
    accepted, bonus = typical_accept(tree, lambda row: flat_low, lambda row: 0)
    assert accepted == [] and bonus == 0  # 0.01 is below min(0.09, 0.3 exp(-H))
