"""layers/moe.py's routings and shared experts against transformers' own MoE blocks, weights copied
(float32): DeepSeek V3 and GLM-4.5 (sigmoid scores, the correction bias, group-limited top-k,
renormalised, routed scaling, `shared_experts`), MiniMax M2 (sigmoid with the bias, no groups) and
Qwen3-Next (softmax top-k, `shared_expert` behind its sigmoid gate). The references' own outputs
are compared, and each option is shown to matter (turned off, the output moves)."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.layers.moe import SparseMoE, route

HIDDEN, INTER, TOKENS = 32, 16, 41


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def _copy_experts(moe: SparseMoE, experts) -> None:
    """transformers' stacked experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) into moe."""
    with torch.no_grad():
        for e, mlp in enumerate(moe.experts):
            mlp.gate_up_proj.weight.copy_(experts.gate_up_proj[e])
            mlp.down_proj.weight.copy_(experts.down_proj[e])


def _copy_mlp(ours, theirs) -> None:
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]))
        ours.down_proj.weight.copy_(theirs.down_proj.weight)


def _bias(num_experts: int, seed: int) -> torch.Tensor:
    """A correction bias large enough to change which experts win (sigmoid scores are in (0, 1))."""
    return torch.randn(num_experts, generator=torch.Generator().manual_seed(seed)) * 0.5


def _noaux_pair(family: str, norm: bool, scaling: float, groups: int, topk_groups: int):
    """(transformers' MoE block, ours with the same weights) for deepseek_v3 / glm4_moe."""
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as Block

        cfg = DeepseekV3Config
    else:
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE as Block

        cfg = Glm4MoeConfig
    config = cfg(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=2,
        n_group=groups,
        topk_group=topk_groups,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
    )
    ref = Block(config).eval()
    _randomize(ref, 1)
    with torch.no_grad():
        ref.gate.e_score_correction_bias.copy_(_bias(16, 2))
    ours = SparseMoE(
        HIDDEN,
        INTER,
        16,
        4,
        "sigmoid_topk",
        norm,
        correction_bias=True,
        num_groups=groups,
        topk_groups=topk_groups,
        routed_scaling=scaling,
        shared_intermediate=2 * INTER,
    )
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.e_score_correction_bias.copy_(ref.gate.e_score_correction_bias)
    _copy_experts(ours, ref.experts)
    _copy_mlp(ours.shared_experts, ref.shared_experts)
    return ref, ours


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize(
    ("norm", "scaling", "groups", "topk_groups"),
    [(True, 2.5, 4, 2), (False, 1.0, 4, 1), (True, 1.0, 1, 1), (True, 1.5, 8, 3)],
)
def test_noaux_routing_and_shared_experts_match_transformers(family, norm, scaling, groups, topk_groups):
    ref, ours = _noaux_pair(family, norm, scaling, groups, topk_groups)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ref(x[None])[0]
        _, ref_weights, ref_ids = ref.gate(x)
        weights, ids = ours.route(x)
        got = ours(x)
    # the same experts with the same weights (order within a token may differ: compare sorted)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), atol=0, rtol=0)
    err = (got - expected).abs().max().item()
    assert err < 1e-5, f"{family}: max error {err}"
    # each option matters: without the bias, the groups or the shared experts the output moves
    with torch.no_grad():
        unbiased = route(ours.gate(x), 4, "sigmoid_topk", norm, None, groups, topk_groups, scaling)[1]
        assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)
        if topk_groups < groups:
            ungrouped = route(ours.gate(x), 4, "sigmoid_topk", norm, ours.e_score_correction_bias)[1]
            assert not torch.equal(ungrouped.sort(-1).values, ids.sort(-1).values)
        shared = ours.shared_experts(x)
        assert (got - shared - expected).abs().max() > 1e-3


def test_minimax_m2_routing_matches_transformers():
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2SparseMoeBlock

    config = MiniMaxM2Config(
        hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8, num_experts_per_tok=2
    )
    ref = MiniMaxM2SparseMoeBlock(config).eval()
    _randomize(ref, 4)
    with torch.no_grad():
        ref.e_score_correction_bias.copy_(_bias(8, 5))
    ours = SparseMoE(HIDDEN, INTER, 8, 2, "sigmoid_topk", True, correction_bias=True)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
    _copy_experts(ours, ref.experts)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = ref(x[None])[0]
        got = ours(x)
        plain = route(ours.gate(x), 2, "sigmoid_topk", True)[1]
    err = (got - expected).abs().max().item()
    assert err < 1e-5, f"max error {err}"
    assert not torch.equal(plain.sort(-1).values, ours.route(x)[1].sort(-1).values)


@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_next_gated_shared_expert_matches_transformers(norm):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    config = Qwen3NextConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=24,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=norm,
    )
    ref = Qwen3NextSparseMoeBlock(config).eval()
    _randomize(ref, 7)
    ours = SparseMoE(HIDDEN, INTER, 8, 3, "softmax_topk", norm, shared_intermediate=24, shared_gate=True)
    with torch.no_grad():
        ours.gate.weight.copy_(ref.gate.weight)
        ours.shared_expert_gate.weight.copy_(ref.shared_expert_gate.weight)
    _copy_experts(ours, ref.experts)
    _copy_mlp(ours.shared_expert, ref.shared_expert)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = ref(x[None])[0]
        got = ours(x)
        ungated = (
            got - torch.sigmoid(ours.shared_expert_gate(x)) * ours.shared_expert(x) + ours.shared_expert(x)
        )
    err = (got - expected).abs().max().item()
    assert err < 1e-5, f"max error {err}"
    assert (ungated - expected).abs().max() > 1e-3  # the gate matters


def test_checkpoint_names_of_the_shared_experts():
    deepseek = SparseMoE(HIDDEN, INTER, 4, 2, "sigmoid_topk", correction_bias=True, shared_intermediate=8)
    qwen = SparseMoE(HIDDEN, INTER, 4, 2, shared_intermediate=8, shared_gate=True)
    plain = SparseMoE(HIDDEN, INTER, 4, 2)
    names = {n for n, _ in deepseek.named_parameters() if not n.startswith("experts.")}
    assert names == {
        "gate.weight",
        "e_score_correction_bias",
        "shared_experts.gate_up_proj.weight",
        "shared_experts.down_proj.weight",
    }
    names = {n for n, _ in qwen.named_parameters() if not n.startswith("experts.")}
    assert names == {
        "gate.weight",
        "shared_expert.gate_up_proj.weight",
        "shared_expert.down_proj.weight",
        "shared_expert_gate.weight",
    }
    assert {n for n, _ in plain.named_parameters() if not n.startswith("experts.")} == {"gate.weight"}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"routing": "softmax_topk", "correction_bias": True}, "sigmoid_topk only"),
        ({"routing": "topk_softmax", "num_groups": 2}, "sigmoid_topk only"),
        ({"routing": "softmax_topk", "routed_scaling": 2.0}, "sigmoid_topk only"),
        ({"num_groups": 3}, "positive divisor"),
        ({"num_groups": 8}, "1 expert per group"),
        ({"num_groups": 4, "topk_groups": 5}, r"topk_group=5 must be in \[1, n_group=4\]"),
        ({"num_groups": 4, "topk_groups": 1, "top_k": 3}, "num_experts_per_tok=3 exceeds the 2 experts"),
        ({"routing": "noaux"}, "unknown MoE routing 'noaux'"),
    ],
)
def test_bad_routing_options_raise(kw, message):
    args = {"routing": "sigmoid_topk", "top_k": 2, **kw}
    with pytest.raises(ValueError, match=message):
        SparseMoE(HIDDEN, INTER, 8, **args)


def test_sigmoid_routing_on_the_grouped_triton_path():
    """The CUDA path of the block (the routed experts as one Triton grouped GEMM, the interpreter on
    a CPU) takes the sigmoid routing's weights and ids as any other."""
    from agentrt.runtime.kernels import triton_usable

    if not triton_usable(torch.device("cpu")):
        pytest.skip("needs triton (TRITON_INTERPRET=1 on CPU)")
    _ref, ours = _noaux_pair("deepseek_v3", True, 2.5, 4, 2)
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        weights, ids = ours.route(x)
        flat = ids.reshape(-1)
        expected = ours.forward_experts(x, weights, flat, torch.bincount(flat, minlength=16))
        got = ours.forward_grouped(x, weights, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
