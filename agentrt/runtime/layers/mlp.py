"""Gated MLPs: down(act(gate(x)) * up(x)) with SiLU (SwiGLU, Shazeer 2020) or GELU-tanh (GeGLU,
Gemma), and gpt-oss's clamped SwiGLU (transformers `GptOssExperts._apply_gate`). Gate and up
projections are one fused linear [2I, H] (gate rows first)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, LayerOps

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamp")

SWIGLU_ALPHA = 1.702  # gpt-oss: glu = gate * sigmoid(alpha * gate)


def gated_activation(gate_up: torch.Tensor, act: str, limit: float | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> [T, I]. Raises ValueError for an unknown activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    if act == "silu":
        return F.silu(gate) * up
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if act == "swiglu_clamp":
        if limit is not None:
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))
    raise ValueError(f"unknown MLP activation '{act}' (known: {', '.join(ACTIVATIONS)})")


class GatedMLP(nn.Module):
    """forward(x [T, hidden]) -> [T, hidden]; SiLU through the run's `ops.silu_mul` (forward.LayerOps)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str = "silu",
        bias: bool = False,
        limit: float | None = None,
        ops: LayerOps = TORCH_OPS,
    ):
        super().__init__()
        self.ops = ops
        if act not in ACTIVATIONS:
            raise ValueError(f"unknown MLP activation '{act}' (known: {', '.join(ACTIVATIONS)})")
        self.act, self.limit = act, limit
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act == "silu":
            return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.act, self.limit))
