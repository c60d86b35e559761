"""Gemma 4's mixture-of-experts block (`enable_moe_block`, e.g. gemma-4-26B-A4B; transformers
`Gemma4TextRouter`, `Gemma4TextExperts` and the MoE branch of `Gemma4TextDecoderLayer`).

It runs beside the dense MLP of every layer, on the stream after attention (the MLP's input before
its norm): the router normalises it without a weight, multiplies by a learned `router_scale` [hidden]
and hidden ** -0.5, projects to the experts' logits, and takes the top k of their softmax (float32)
renormalised to sum 1, each then multiplied by its expert's learned `per_expert_scale`. The experts
(GELU-tanh gated MLPs) read the stream through their own norm (`pre_feedforward_layernorm_2`); the
block returns norm_1(the dense MLP's output) + norm_2(the experts' weighted sum), which the layer's
`post_feedforward_layernorm` then norms again. The routing and the experts are layers/moe.py's
(`route`, `SparseMoE.forward_experts`, its per-expert token counts); only the router's input and
its per-expert scale are Gemma 4's.
"""

from __future__ import annotations

import torch
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, LayerOps
from agentrt.runtime.layers.moe import SparseMoE, route
from agentrt.runtime.layers.norm import RMSNorm


def rms_norm_unit(x: torch.Tensor, dim: int, eps: float) -> torch.Tensor:
    """RMSNorm without a weight over every `dim` features of x [..., n * dim], computed in float32 and
    cast back once (transformers' `Gemma4RMSNorm(with_scale=False)`)."""
    xf = x.reshape(-1, dim).float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).view(x.shape)


class Gemma4MoE(SparseMoE):
    """forward(stream [T, hidden], mlp_out [T, hidden] the dense MLP's output) -> [T, hidden] (module
    docstring). `gate`: the router's projection [E, hidden]; `router_scale` [hidden],
    `per_expert_scale` [E]; `experts`: E GELU-tanh GatedMLPs of width `intermediate`."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        eps: float,
        ops: LayerOps = TORCH_OPS,
    ):
        super().__init__(
            hidden, intermediate, num_experts, top_k, "softmax_topk", True, act="gelu_tanh", ops=ops
        )
        self.hidden, self.eps = hidden, eps
        self.router_scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps, True, ops)
        self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps, True, ops)
        self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps, True, ops)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] the stream -> (weights [T, k] in x's dtype, expert ids [T, k] int64)."""
        h = rms_norm_unit(x, self.hidden, self.eps) * self.router_scale * self.hidden**-0.5
        weights, ids = route(self.gate(h).float(), self.top_k, "softmax_topk", True)
        return (weights * self.per_expert_scale[ids]).to(x.dtype), ids

    def forward(self, x: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        weights, ids = self.route(x)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=len(self.experts))
        self.expert_tokens += counts
        routed = self.forward_experts(self.pre_feedforward_layernorm_2(x), weights, flat, counts)
        return self.post_feedforward_layernorm_1(mlp_out) + self.post_feedforward_layernorm_2(routed)
