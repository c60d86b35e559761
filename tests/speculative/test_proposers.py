"""N-gram prompt lookup, draft trees and Medusa checkpoints (no model needed)."""

from __future__ import annotations

import pytest
import torch

from agentrt.speculative.medusa import MedusaHeads, head_targets
from agentrt.speculative.ngram import NgramProposer
from agentrt.speculative.tree import DEFAULT_MEDUSA_TREE, DraftTree, tree_from_topk


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    seq = [5, 6, 7, 1, 2, 5, 6, 9, 9, 5, 6]
    # suffix (9, 5, 6) never occurred before; (5, 6) did at 0 and 5: the latest (5) wins
    assert p.propose(seq) == [9, 9, 5]
    assert p.propose(seq, k=1) == [9]
    assert p.propose([1, 2, 3, 4]) == []  # nothing repeats
    assert p.propose([7]) == []
    # the longest n wins over a later shorter match: (1, 2) at 0 beats (2) at 4
    assert NgramProposer(k=2, max_n=2).propose([1, 2, 3, 9, 2, 8, 1, 2]) == [3, 9]
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(k=2, min_n=3, max_n=2)


def test_chain_and_tree_masks():
    chain = DraftTree.chain([10, 11, 12])
    assert chain.is_chain and chain.depths == [1, 2, 3]
    assert torch.equal(chain.attention_mask(), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    # root -> a(0), b(1); a -> c(2); c -> d(3)
    tree = DraftTree([1, 2, 3, 4], [-1, -1, 0, 2])
    assert not tree.is_chain and tree.depths == [1, 1, 2, 3]
    m = tree.attention_mask()
    assert m[4].tolist() == [True, True, False, True, True]  # d sees root, a, c, itself; not b
    assert m[2].tolist() == [True, False, True, False, False]  # b sees root and itself
    assert tree.path(3) == [0, 2, 3] and tree.children(-1) == [0, 1]
    pruned = tree.prune([True, True, False, True])  # c cut: d goes with it
    assert pruned.token_ids == [1, 2] and pruned.parents == [-1, -1]
    with pytest.raises(ValueError, match="parents must come first"):
        DraftTree([1, 2], [1, -1])


def test_tree_from_topk_follows_the_choices():
    topk = [[100, 101, 102, 103], [200, 201, 202, 203], [300, 301, 302, 303], [400, 401, 402, 403]]
    tree = tree_from_topk(topk, DEFAULT_MEDUSA_TREE)
    assert len(tree) == len(DEFAULT_MEDUSA_TREE)
    assert tree.token_ids[:4] == [100, 101, 102, 103] and tree.parents[:4] == [-1, -1, -1, -1]
    # (0, 1): head 1's second token under head 0's first
    i = tree.token_ids.index(201)
    assert tree.parents[i] == 0 and tree.depths[i] == 2
    assert max(tree.depths) == 4
    short = tree_from_topk(topk[:2], DEFAULT_MEDUSA_TREE)  # two heads: depth <= 2
    assert max(short.depths) == 2 and len(short) == 10


@pytest.mark.parametrize("shared", [False, True])
def test_medusa_checkpoint_round_trip_in_the_original_layout(tmp_path, shared):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    heads = MedusaHeads(16, 40, num_heads=3, num_layers=2, shared_lm_head=shared)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    heads.save(tmp_path, dtype=torch.float32)
    keys = set(load_file(str(tmp_path / "medusa_lm_head.safetensors")))
    assert {"0.0.linear.weight", "0.1.linear.bias", "2.1.linear.weight"} <= keys
    assert ("0.2.weight" in keys) is not shared  # the LM head sits after the num_layers blocks
    back = MedusaHeads.load(tmp_path, 16, 40)
    h, w = torch.randn(5, 16), torch.randn(40, 16)
    assert torch.allclose(heads(h, w), back(h, w))
    assert back(h, w).shape == (3, 5, 40)
    with pytest.raises(ValueError, match="needs"):
        MedusaHeads.load(tmp_path, 32, 40)


def test_medusa_loads_the_original_layout_and_refuses_a_pickle_checkpoint(tmp_path):
    """The original repository's key layout (a state dict of the head ModuleList) loads from
    safetensors; its `medusa_lm_head.pt` (pickle) is refused, naming the file, and never read."""
    import json

    from safetensors.torch import save_file

    torch.manual_seed(1)
    hidden, vocab = 8, 20
    state = {}
    for k in range(2):
        state[f"{k}.0.linear.weight"] = torch.randn(hidden, hidden)
        state[f"{k}.0.linear.bias"] = torch.randn(hidden)
        state[f"{k}.1.weight"] = torch.randn(vocab, hidden)
    save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    heads = MedusaHeads.load(tmp_path, hidden, vocab)
    x = torch.randn(3, hidden)
    lin = torch.nn.functional.linear
    want = lin(
        x + torch.nn.functional.silu(lin(x, state["1.0.linear.weight"], state["1.0.linear.bias"])),
        state["1.1.weight"],
    )
    assert torch.allclose(heads(x)[1], want, atol=1e-5)
    (tmp_path / "medusa_lm_head.safetensors").unlink()
    torch.save(state, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"medusa_lm_head\.pt is a pickle checkpoint"):
        MedusaHeads.load(tmp_path, hidden, vocab)
    (tmp_path / "medusa_lm_head.pt").unlink()
    with pytest.raises(ValueError, match="has no medusa_lm_head"):
        MedusaHeads.load(tmp_path, hidden, vocab)


def test_head_targets_shift_by_k_plus_2_and_skip_the_prompt():
    t = head_targets([10, 11, 12, 13, 14, 15], num_heads=2, start=3)
    # position 2 (last prompt token): head 0 -> token at 4, head 1 -> token at 5
    assert t[0].tolist() == [-100, -100, 14, 15, -100, -100]
    assert t[1].tolist() == [-100, -100, 15, -100, -100, -100]
