"""A sparse mixture-of-experts block (Shazeer et al. 2017; Mixtral, Qwen3-MoE, gpt-oss, DeepSeek V3,
GLM-4.5, MiniMax M2, Qwen3-Next).

A router picks `top_k` experts per token; the token's output is the routing-weighted sum of those
experts' gated MLPs. Routing as the references do it:
- `softmax_topk` (Mixtral, Qwen3-MoE, Qwen3-Next): softmax over all experts in float32, the top k,
  renormalised to sum 1 when `renormalize` (Mixtral always, Qwen3-MoE per `norm_topk_prob`);
- `topk_softmax` (gpt-oss): the top k router logits, softmax over those k;
- `sigmoid_topk` (DeepSeek V3's `noaux_tc`, GLM-4.5, MiniMax M2; transformers `DeepseekV3TopkRouter`,
  `Glm4MoeTopkRouter`, `MiniMaxM2TopKRouter`): scores = sigmoid(logits) in float32; the experts are
  chosen on scores + `e_score_correction_bias` (the aux-loss-free balancing bias, Wang et al. 2024,
  arXiv 2408.15664: it steers the choice and never enters the weights), group-limited when
  `num_groups` > 1 (the experts split into `num_groups` equal groups, each ranked by the sum of its
  two best biased scores, only the best `topk_groups` groups eligible); the weights are the chosen
  experts' unbiased scores, renormalised to sum 1 (plus 1e-20, as DeepSeek) when `renormalize`, then
  times `routed_scaling_factor`.
Shared experts run on every token beside the routed ones: DeepSeek / GLM / Nemotron-H's
`shared_experts` (one MLP of n_shared_experts * moe_intermediate_size, added unweighted) or
Qwen3-Next / Qwen3.5-MoE's `shared_expert` scaled by sigmoid(`shared_expert_gate`(x)), a linear
[1, hidden]. Experts and shared experts are MLPs of the block's activation: gated (`GatedMLP`), or
non-gated for Nemotron-H's squared ReLU (`relu2`: layers/mlp.py `MLP`).

Tokens are grouped by expert (one stable sort of the token-expert pairs) and each expert runs once
over its group: a loop over the experts that have tokens, never over tokens. Each expert is a
`GatedMLP` (or `MLP`) of ordinary linear layers, so the CPU int8/int4 kernels and oneDNN packing apply to
experts as to any layer (formats.py). On CUDA the routed experts run as one Triton grouped GEMM
(kernels/fused_moe.py) when it is available: it takes any routing's weights and ids; the shared
experts stay ordinary layers.
"""

from __future__ import annotations

import torch
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, LayerOps
from agentrt.runtime.layers.mlp import GatedMLP, make_mlp

ROUTINGS = ("softmax_topk", "topk_softmax", "sigmoid_topk")


def route(
    logits: torch.Tensor,
    top_k: int,
    routing: str,
    renormalize: bool,
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits' dtype, expert ids [T, k] int64). correction_bias
    [E] (any float dtype, added in float32), num_groups / topk_groups and scaling apply to
    `sigmoid_topk` (module docstring). Raises ValueError for an unknown routing."""
    if routing == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids
    if routing == "topk_softmax":
        values, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1), ids
    if routing == "sigmoid_topk":
        scores = logits.float().sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if num_groups > 1:
            choice = _group_limited(choice, num_groups, topk_groups)
        ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if scaling != 1.0:
            weights = weights * scaling
        return weights.to(logits.dtype), ids
    raise ValueError(f"unknown MoE routing '{routing}' (known: {', '.join(ROUTINGS)})")


def _group_limited(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """choice [T, E] float32 with the experts outside each token's best `topk_groups` groups set to
    -inf; a group's rank is the sum of its two best scores (DeepSeek V3's `noaux_tc`)."""
    t, e = choice.shape
    group_scores = choice.view(t, num_groups, e // num_groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    keep = group_mask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
    return choice.masked_fill(~keep.bool(), float("-inf"))


class SparseMoE(nn.Module):
    """forward(x [T, hidden]) -> [T, hidden]. `gate`: the router, a linear [E, hidden];
    `experts`: E MLPs of activation `act` (mlp.make_mlp: gated, or non-gated for relu2);
    `e_score_correction_bias` [E] (correction_bias, `sigmoid_topk` only): a
    parameter the checkpoint fills, never trained; `shared_experts` (shared_intermediate > 0) or
    `shared_expert` + `shared_expert_gate` (shared_gate too): the shared expert(s). `expert_tokens`
    [E] int64 counts the tokens routed to each expert since the model was built (the engine's
    /metrics read them). Raises ValueError for an unknown routing, a top_k outside [1, E], or a group
    layout the experts do not divide into (E % num_groups, fewer than 2 experts per group, top_k more
    than the experts of topk_groups groups), or a correction bias / groups / scaling with a routing
    other than sigmoid_topk."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        routing: str = "softmax_topk",
        renormalize: bool = True,
        router_bias: bool = False,
        act: str = "silu",
        expert_bias: bool = False,
        limit: float | None = None,
        ops: LayerOps = TORCH_OPS,
        *,
        correction_bias: bool = False,
        num_groups: int = 1,
        topk_groups: int = 1,
        routed_scaling: float = 1.0,
        shared_intermediate: int = 0,
        shared_gate: bool = False,
    ):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"unknown MoE routing '{routing}' (known: {', '.join(ROUTINGS)})")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, {num_experts}]")
        _check_groups(routing, num_experts, top_k, correction_bias, num_groups, topk_groups, routed_scaling)
        self.top_k, self.routing, self.renormalize = top_k, routing, renormalize
        self.num_groups, self.topk_groups, self.routed_scaling = num_groups, topk_groups, routed_scaling
        self.gate = nn.Linear(hidden, num_experts, bias=router_bias)
        self.experts = nn.ModuleList(
            make_mlp(hidden, intermediate, act, expert_bias, limit, ops) for _ in range(num_experts)
        )
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts), requires_grad=False) if correction_bias else None
        )
        self.shared_gate = shared_gate and shared_intermediate > 0
        if self.shared_gate:  # Qwen3-Next / Qwen3.5-MoE
            self.shared_expert = make_mlp(hidden, shared_intermediate, act, ops=ops)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        elif shared_intermediate > 0:  # DeepSeek V3 / GLM-4.5
            self.shared_experts = make_mlp(hidden, shared_intermediate, act, ops=ops)
        self.has_shared = shared_intermediate > 0
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.act, self.limit, self.expert_bias = act, limit, expert_bias
        self._stacked: tuple | None = None  # the experts' weights stacked for the Triton kernel

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (routing weights [T, k] in x's dtype, expert ids [T, k] int64)."""
        return route(
            self.gate(x),
            self.top_k,
            self.routing,
            self.renormalize,
            self.e_score_correction_bias,
            self.num_groups,
            self.topk_groups,
            self.routed_scaling,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=len(self.experts))
        self.expert_tokens += counts
        if x.device.type == "cuda" and self.act in ("silu", "swiglu_clamp") and self.stackable():
            out = self.forward_grouped(x, weights, ids)
        else:
            out = self.forward_experts(x, weights, flat, counts)
        if not self.has_shared:
            return out
        if self.shared_gate:
            return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out + self.shared_experts(x)

    def forward_experts(
        self, x: torch.Tensor, weights: torch.Tensor, flat: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts one by one over their tokens: x [T, hidden], weights [T, k], flat
        [T * k] the expert ids in pair order (t * k + j), counts [E] -> [T, hidden]."""
        order = torch.argsort(flat, stable=True)  # pairs t * k + j grouped by expert
        flat_weights = weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            pairs = order[start : start + n]
            tokens = pairs // self.top_k
            y = self.experts[e](x.index_select(0, tokens))
            out.index_add_(0, tokens, y * flat_weights.index_select(0, pairs)[:, None])
            start += n
        return out

    def stackable(self) -> bool:
        """Whether every expert's projections are dense nn.Linear (the Triton kernel's input)."""
        return all(
            isinstance(e, GatedMLP) and type(e.gate_up_proj) is nn.Linear and type(e.down_proj) is nn.Linear
            for e in self.experts
        )

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts as one Triton grouped GEMM (kernels/fused_moe.py) over the stacked
        weights (stacked once, on first use): x [T, hidden], weights / ids [T, k] -> [T, hidden]."""
        from agentrt.runtime.kernels.fused_moe import fused_moe

        if self._stacked is None:
            experts = list(self.experts)
            bias = self.expert_bias
            self._stacked = (
                torch.stack([e.gate_up_proj.weight for e in experts]),
                torch.stack([e.down_proj.weight for e in experts]),
                torch.stack([e.gate_up_proj.bias for e in experts]) if bias else None,
                torch.stack([e.down_proj.bias for e in experts]) if bias else None,
            )
        w13, w2, b13, b2 = self._stacked
        return fused_moe(
            x,
            w13,
            w2,
            weights.float(),
            ids,
            activation=self.act,
            gate_up_bias=b13,
            down_bias=b2,
            swiglu_limit=self.limit if self.act == "swiglu_clamp" else None,
            check_ids=False,
        )


def _check_groups(
    routing: str,
    num_experts: int,
    top_k: int,
    correction_bias: bool,
    num_groups: int,
    topk_groups: int,
    routed_scaling: float,
) -> None:
    """Raises ValueError for a group-limited layout the experts cannot take, or sigmoid-only options
    on another routing (SparseMoE's docstring)."""
    if routing != "sigmoid_topk":
        if correction_bias or num_groups != 1 or routed_scaling != 1.0:
            raise ValueError(
                f"MoE routing '{routing}': the correction bias, group-limited top-k and routed scaling "
                "apply to sigmoid_topk only"
            )
        return
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"n_group={num_groups} must be a positive divisor of the {num_experts} experts")
    if num_groups > 1:
        per_group = num_experts // num_groups
        if per_group < 2:
            raise ValueError(
                f"n_group={num_groups} leaves {per_group} expert per group; groups are ranked by "
                "their two best experts"
            )
        if not 1 <= topk_groups <= num_groups:
            raise ValueError(f"topk_group={topk_groups} must be in [1, n_group={num_groups}]")
        if top_k > topk_groups * per_group:
            raise ValueError(
                f"num_experts_per_tok={top_k} exceeds the {topk_groups * per_group} experts of "
                f"topk_group={topk_groups} groups"
            )
