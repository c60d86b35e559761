"""A sparse mixture-of-experts block (Shazeer et al. 2017; Mixtral, Qwen3-MoE, gpt-oss).

A router picks `top_k` experts per token; the token's output is the routing-weighted sum of those
experts' gated MLPs. Routing as the references do it:
- `softmax_topk` (Mixtral, Qwen3-MoE): softmax over all experts in float32, the top k, renormalised
  to sum 1 when `renormalize` (Mixtral always, Qwen3-MoE per `norm_topk_prob`);
- `topk_softmax` (gpt-oss): the top k router logits, softmax over those k.
Tokens are grouped by expert (one stable sort of the token-expert pairs) and each expert runs once
over its group: a loop over the experts that have tokens, never over tokens. Each expert is a
`GatedMLP` of ordinary linear layers, so the CPU int8/int4 kernels and oneDNN packing apply to
experts as to any layer (formats.py). On CUDA the experts run as one Triton grouped GEMM
(kernels/fused_moe.py) when it is available.
"""

from __future__ import annotations

import torch
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, LayerOps
from agentrt.runtime.layers.mlp import GatedMLP

ROUTINGS = ("softmax_topk", "topk_softmax")


def route(
    logits: torch.Tensor, top_k: int, routing: str, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits' dtype, expert ids [T, k] int64)."""
    if routing == "softmax_topk":
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids
    if routing == "topk_softmax":
        values, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1), ids
    raise ValueError(f"unknown MoE routing '{routing}' (known: {', '.join(ROUTINGS)})")


class SparseMoE(nn.Module):
    """forward(x [T, hidden]) -> [T, hidden]. `gate`: the router, a linear [E, hidden];
    `experts`: E GatedMLPs. `expert_tokens` [E] int64 counts the tokens routed to each expert since
    the model was built (the engine's /metrics read them)."""

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
    ):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"unknown MoE routing '{routing}' (known: {', '.join(ROUTINGS)})")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, {num_experts}]")
        self.top_k, self.routing, self.renormalize = top_k, routing, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=router_bias)
        self.experts = nn.ModuleList(
            GatedMLP(hidden, intermediate, act, expert_bias, limit, ops) for _ in range(num_experts)
        )
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.act, self.limit, self.expert_bias = act, limit, expert_bias
        self._stacked: tuple | None = None  # the experts' weights stacked for the Triton kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.routing, self.renormalize)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=len(self.experts))
        self.expert_tokens += counts
        if x.device.type == "cuda" and self.act in ("silu", "swiglu_clamp") and self.stackable():
            return self.forward_grouped(x, weights, ids)
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
        return all(type(e.gate_up_proj) is nn.Linear and type(e.down_proj) is nn.Linear for e in self.experts)

    def forward_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts as one Triton grouped GEMM (kernels/fused_moe.py) over the stacked weights
        (stacked once, on first use): x [T, hidden], weights / ids [T, k] -> [T, hidden]."""
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
