"""Fused MoE Triton kernels vs their torch reference (CPU: TRITON_INTERPRET=1, set in conftest; on
a GPU the same tests run the compiled kernels), and the reference itself vs a token-by-token loop
written here and vs transformers' own experts modules (gpt-oss, Qwen3-MoE, Mixtral)."""

from __future__ import annotations

import math

import pytest
import torch

from agentrt.runtime.kernels import triton_usable

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_usable(DEVICE), reason="triton is not installed")


def routing(tokens: int, top_k: int, experts: int, gen: torch.Generator, used: int | None = None):
    """Random top-k routing: distinct experts per token drawn from the first `used` experts (the
    rest get no tokens), softmax-normalised weights."""
    used = experts if used is None else used
    ids = torch.stack([torch.randperm(used, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def moe_weights(experts: int, hidden: int, inter: int, gen: torch.Generator, bias: bool, scale: float = 1.0):
    """w_gate_up [E, 2I, H], w_down [E, H, I] scaled so activations stay O(1) (times `scale`), and
    optional biases [E, 2I], [E, H]."""
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * scale / math.sqrt(hidden)
    w_down = torch.randn(experts, hidden, inter, generator=gen) / math.sqrt(inter)
    b_gate_up = torch.randn(experts, 2 * inter, generator=gen) * 0.5 if bias else None
    b_down = torch.randn(experts, hidden, generator=gen) * 0.5 if bias else None
    return tuple(t.to(DEVICE) if t is not None else None for t in (w_gate_up, w_down, b_gate_up, b_down))


def token_loop(x, w_gate_up, w_down, weights, ids, activation, b_gate_up, b_down, limit, interleaved):
    """An independent float64 computation: one token and one chosen expert at a time, plain
    matrix-vector products, gate/up picked per the layout description."""
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w_gate_up[e].double().cpu() @ x[t].double().cpu()
            if b_gate_up is not None:
                gu += b_gate_up[e].double().cpu()
            if interleaved:  # pairs (gate_i, up_i) side by side
                gate, up = gu.view(inter, 2)[:, 0], gu.view(inter, 2)[:, 1]
            else:
                gate, up = gu[:inter], gu[inter:]
            if activation == "silu":
                h = gate / (1 + torch.exp(-gate)) * up
            else:
                if limit is not None:
                    gate = torch.where(gate > limit, limit, gate)
                    up = torch.where(up > limit, limit, torch.where(up < -limit, -limit, up))
                h = (up + 1) * gate / (1 + torch.exp(-1.702 * gate))
            y = w_down[e].double().cpu() @ h
            if b_down is not None:
                y += b_down[e].double().cpu()
            out[t] += float(weights[t, j]) * y
    return out


# -- align_by_expert -------------------------------------------------------------------------------

ALIGN_CASES = [  # (tokens, top_k, experts, used experts, block_m)
    (1, 1, 4, 4, 16),
    (1, 2, 8, 8, 16),
    (37, 2, 8, 5, 16),  # experts 5..7 get no tokens
    (40, 1, 4, 4, 4),
    (13, 2, 6, 6, 1),  # block_m 1: no padding at all
    (25, 2, 4, 2, 64),  # one block per used expert, mostly padding
]


@pytest.mark.parametrize("tokens,top_k,experts,used,block_m", ALIGN_CASES)
def test_align_by_expert(tokens, top_k, experts, used, block_m):
    from agentrt.runtime.kernels.fused_moe import align_by_expert

    gen = torch.Generator().manual_seed(tokens * 10 + experts)
    _, ids = routing(tokens, top_k, experts, gen, used)
    sorted_ids, block_expert, num_valid = align_by_expert(ids, experts, block_m)
    pairs, sentinel = tokens * top_k, tokens * top_k
    assert (
        sorted_ids.dtype == torch.int32 and block_expert.dtype == torch.int32 and isinstance(num_valid, int)
    )
    size = sorted_ids.numel()
    assert size % block_m == 0 and block_expert.numel() == size // block_m
    sorted_ids, block_expert, flat = sorted_ids.cpu(), block_expert.cpu(), ids.reshape(-1).cpu().long()

    counts = torch.bincount(flat, minlength=experts)
    assert num_valid == int(sum(math.ceil(c / block_m) * block_m for c in counts.tolist()))
    real = sorted_ids[sorted_ids != sentinel]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert (sorted_ids[num_valid:] == sentinel).all()  # the tail past the runs is padding
    assert (block_expert[num_valid // block_m :] == -1).all()

    blocks_per_expert = [0] * experts
    previous = -1
    for b in range(num_valid // block_m):
        e = int(block_expert[b])
        assert 0 <= e < experts and e >= previous  # runs in expert order
        previous = e
        blocks_per_expert[e] += 1
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        ours = rows[rows != sentinel]
        assert (flat[ours.long()] == e).all()  # a block holds one expert's pairs only
        assert ours.tolist() == sorted(ours.tolist())  # stable: ascending pair ids
        assert (rows[len(ours) :] == sentinel).all()  # padding at the end of the run
    for e in range(experts):
        assert blocks_per_expert[e] == math.ceil(int(counts[e]) / block_m)  # none for empty experts

    # the size is a static bound: another routing of the same shape gives the same shapes
    sorted2, blocks2, valid2 = align_by_expert(torch.zeros_like(ids), experts, block_m)
    assert sorted2.shape == (size,) and blocks2.shape == block_expert.shape
    assert valid2 == math.ceil(pairs / block_m) * block_m and (blocks2[: valid2 // block_m] == 0).all()


def test_align_by_expert_rejects_bad_inputs():
    from agentrt.runtime.kernels.fused_moe import align_by_expert

    ids = torch.tensor([[0, 1], [2, 3]], device=DEVICE)
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        align_by_expert(ids, 3, 16)
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        align_by_expert(-ids, 4, 16)
    with pytest.raises(ValueError, match="integer"):
        align_by_expert(ids.float(), 4, 16)
    with pytest.raises(ValueError, match="block_m"):
        align_by_expert(ids, 4, 0)


# -- fused_moe vs fused_moe_ref --------------------------------------------------------------------

MOE_CASES = [  # (tokens, hidden, inter, experts, used, top_k, activation, bias, interleaved, limit)
    (1, 64, 32, 4, 4, 1, "silu", False, False, None),
    (1, 64, 48, 8, 8, 2, "silu", False, False, None),
    (40, 64, 96, 8, 5, 2, "silu", False, False, None),  # three experts with no tokens
    (29, 64, 32, 4, 4, 1, "silu", True, False, None),
    (1, 64, 32, 4, 4, 2, "swiglu_clamp", True, True, 1.0),
    (40, 64, 48, 6, 4, 2, "swiglu_clamp", True, True, 1.0),
    (33, 64, 32, 4, 4, 1, "swiglu_clamp", True, False, 0.75),
    (17, 64, 96, 8, 8, 2, "swiglu_clamp", False, True, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,used,top_k,activation,bias,interleaved,limit", MOE_CASES
)
def test_fused_moe_matches_reference(
    tokens, hidden, inter, experts, used, top_k, activation, bias, interleaved, limit, dtype
):
    from agentrt.runtime.kernels.fused_moe import fused_moe, fused_moe_ref

    gen = torch.Generator().manual_seed(tokens * 100 + inter + top_k)
    scale = 2.0 if limit is not None else 1.0  # push some gates past the clamp
    w_gate_up, w_down, b_gate_up, b_down = moe_weights(experts, hidden, inter, gen, bias, scale)
    weights, ids = routing(tokens, top_k, experts, gen, used)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    args = (x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), weights, ids, activation, b_gate_up, b_down)
    out = fused_moe(*args, swiglu_limit=limit, interleaved=interleaved)
    ref = fused_moe_ref(*args, swiglu_limit=limit, interleaved=interleaved)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    else:  # the kernel rounds the intermediate to bf16, the reference does not
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    assert ref.abs().max() > 0.1  # a non-trivial output


def test_fused_moe_weight_views_and_unchecked_ids():
    """Transposed (non-contiguous) weight views and a strided x give the same result; check_ids
    False (the CUDA-graph path) computes the same thing; T = 0 gives an empty output."""
    from agentrt.runtime.kernels.fused_moe import fused_moe, fused_moe_ref

    gen = torch.Generator().manual_seed(7)
    w_gate_up, w_down, b_gate_up, b_down = moe_weights(4, 64, 32, gen, bias=True)
    weights, ids = routing(9, 2, 4, gen)
    x = torch.randn(9, 128, generator=gen).to(DEVICE)[:, ::2]  # row stride 128, column stride 2
    gu_view = w_gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down_view = w_down.transpose(1, 2).contiguous().transpose(1, 2)
    assert not gu_view.is_contiguous() and not x.is_contiguous()
    ref = fused_moe_ref(x, w_gate_up, w_down, weights, ids, "silu", b_gate_up, b_down)
    out = fused_moe(x, gu_view, down_view, weights, ids, "silu", b_gate_up, b_down, check_ids=False)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    empty = fused_moe(x[:0], w_gate_up, w_down, weights[:0], ids[:0])
    assert empty.shape == (0, 64)


# -- the reference vs independent computations -----------------------------------------------------


@pytest.mark.parametrize(
    "activation,bias,interleaved,limit",
    [
        ("silu", False, False, None),
        ("silu", True, True, None),
        ("swiglu_clamp", True, True, 1.0),
        ("swiglu_clamp", True, False, 0.5),
        ("swiglu_clamp", False, True, None),
    ],
)
def test_reference_matches_token_loop(activation, bias, interleaved, limit):
    from agentrt.runtime.kernels.fused_moe import fused_moe_ref

    gen = torch.Generator().manual_seed(11)
    w_gate_up, w_down, b_gate_up, b_down = moe_weights(6, 64, 40, gen, bias, scale=2.0)
    weights, ids = routing(21, 2, 6, gen, used=5)
    x = torch.randn(21, 64, generator=gen).to(DEVICE)
    args = (x, w_gate_up, w_down, weights, ids, activation, b_gate_up, b_down)
    ref = fused_moe_ref(*args, swiglu_limit=limit, interleaved=interleaved)
    loop = token_loop(*args, limit, interleaved)
    torch.testing.assert_close(ref.cpu().double(), loop, atol=1e-5, rtol=1e-5)
    if limit is not None:  # the clamp is engaged: without it the result differs
        unclamped = fused_moe_ref(*args, swiglu_limit=None, interleaved=interleaved)
        assert (unclamped - ref).abs().max() > 1e-2
    # the layout matters: the other gate/up order gives another result
    swapped = fused_moe_ref(*args, swiglu_limit=limit, interleaved=not interleaved)
    assert (swapped - ref).abs().max() > 1e-2


def _randomize(module: torch.nn.Module, gen: torch.Generator, scale: float) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(p.shape[-1]))


def test_reference_matches_transformers_gpt_oss_experts():
    """transformers' GptOssExperts: gate_up_proj [E, H, 2I] (x @ W, gate/up interleaved in the
    last dim), gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]."""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    from agentrt.runtime.kernels.fused_moe import fused_moe, fused_moe_ref

    experts, hidden, inter, top_k, limit = 4, 64, 32, 2, 1.0
    config = GptOssConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        swiglu_limit=limit,
    )
    module = modeling.GptOssExperts(config).to(DEVICE)
    gen = torch.Generator().manual_seed(3)
    _randomize(module, gen, scale=2.0)
    assert module.gate_up_proj.shape == (experts, hidden, 2 * inter)
    assert module.down_proj.shape == (experts, inter, hidden)
    assert module.alpha == pytest.approx(1.702)
    weights, ids = routing(19, top_k, experts, gen)
    x = torch.randn(19, hidden, generator=gen).to(DEVICE)
    with torch.no_grad():
        expected = module(x, router_indices=ids, routing_weights=weights)
    args = (
        x,
        module.gate_up_proj.detach().transpose(1, 2),  # [E, 2I, H] views, interleaved rows
        module.down_proj.detach().transpose(1, 2),
        weights,
        ids,
        "swiglu_clamp",
        module.gate_up_proj_bias.detach(),
        module.down_proj_bias.detach(),
    )
    ref = fused_moe_ref(*args, swiglu_limit=limit, interleaved=True)
    torch.testing.assert_close(ref, expected, atol=1e-5, rtol=1e-5)
    out = fused_moe(*args, swiglu_limit=limit, interleaved=True)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    unclamped = fused_moe_ref(*args, swiglu_limit=None, interleaved=True)
    assert (unclamped - expected).abs().max() > 1e-2  # the clamp was engaged


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_reference_matches_transformers_silu_experts(family):
    """transformers' Qwen3MoeExperts / MixtralExperts: gate_up_proj [E, 2I, H] (gate rows first,
    then up; F.linear), down_proj [E, H, I]: agentrt's layout as is."""
    if family == "qwen3_moe":
        modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
        from transformers import Qwen3MoeConfig

        config = Qwen3MoeConfig(
            hidden_size=64, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2
        )
        cls = getattr(modeling, "Qwen3MoeExperts", None)
    else:
        modeling = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
        from transformers import MixtralConfig

        config = MixtralConfig(
            hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2
        )
        cls = getattr(modeling, "MixtralExperts", None)
    if cls is None:
        pytest.skip(f"this transformers has no stacked experts module for {family}")
    from agentrt.runtime.kernels.fused_moe import fused_moe, fused_moe_ref

    assert config.hidden_act == "silu"
    module = cls(config).to(DEVICE)
    gen = torch.Generator().manual_seed(5)
    _randomize(module, gen, scale=1.0)
    assert module.gate_up_proj.shape == (8, 96, 64) and module.down_proj.shape == (8, 64, 48)
    weights, ids = routing(23, 2, 8, gen, used=6)
    x = torch.randn(23, 64, generator=gen).to(DEVICE)
    with torch.no_grad():
        expected = module(x, ids, weights)
    args = (x, module.gate_up_proj.detach(), module.down_proj.detach(), weights, ids)
    torch.testing.assert_close(fused_moe_ref(*args), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_moe(*args), expected, atol=2e-5, rtol=1e-4)


# -- validation ------------------------------------------------------------------------------------


def test_bad_inputs_raise():
    from agentrt.runtime.kernels.fused_moe import fused_moe, fused_moe_ref

    gen = torch.Generator().manual_seed(1)
    w_gate_up, w_down, b_gate_up, b_down = moe_weights(4, 64, 32, gen, bias=True)
    weights, ids = routing(5, 2, 4, gen)
    x = torch.randn(5, 64, generator=gen).to(DEVICE)
    good = {"x": x, "w_gate_up": w_gate_up, "w_down": w_down, "topk_weights": weights, "topk_ids": ids}
    cases = [
        ({"x": x[:, :48]}, "w_gate_up must be"),
        ({"x": x[0]}, "x must be"),
        ({"w_gate_up": w_gate_up[:, :63]}, "w_gate_up must be"),
        ({"w_down": w_down[:, :, :16]}, "w_down must be"),
        ({"w_down": w_down[:3]}, "w_down must be"),
        ({"topk_ids": ids[:4]}, "topk_ids and topk_weights"),
        ({"topk_weights": weights[:, :1]}, "topk_ids and topk_weights"),
        ({"topk_ids": ids + 2}, "topk_ids must lie in"),
        ({"topk_ids": ids - 1}, "topk_ids must lie in"),
        ({"topk_ids": ids.float()}, "integer"),
        ({"activation": "gelu"}, "unknown activation"),
        ({"gate_up_bias": b_gate_up[:, :32]}, "gate_up_bias must be"),
        ({"down_bias": b_down[:3]}, "down_bias must be"),
        ({"swiglu_limit": 7.0}, "swiglu_limit applies"),
        ({"w_down": w_down.to(torch.bfloat16)}, "dtype"),
    ]
    for fn in (fused_moe, fused_moe_ref):
        for change, message in cases:
            with pytest.raises(ValueError, match=message):
                fn(**{**good, **change})
