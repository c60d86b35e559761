"""Gated MLPs: down(act(gate(x)) * up(x)) with SiLU (SwiGLU, Shazeer 2020) or GELU-tanh (GeGLU,
Gemma), and gpt-oss's clamped SwiGLU (transformers `GptOssExperts._apply_gate`). Gate and up
projections are one fused linear [2I, H] (gate rows first). Non-gated MLPs, down(act(up(x))), with
the squared ReLU (Nemotron-H: So et al. 2021, "Primer", arXiv 2109.08668); `make_mlp` picks by the
activation's name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, LayerOps

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamp")
NON_GATED = ("relu2",)  # activations of the non-gated MLP (`MLP`)

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


class MLP(nn.Module):
    """forward(x [T, hidden]) -> [T, hidden]: down_proj(relu(up_proj(x)) ** 2), the non-gated MLP of
    Nemotron-H (transformers `NemotronHMLP`, `NemotronHExperts`). Raises ValueError for an activation
    not in NON_GATED."""

    def __init__(self, hidden: int, intermediate: int, act: str = "relu2", bias: bool = False):
        super().__init__()
        if act not in NON_GATED:
            raise ValueError(f"unknown non-gated MLP activation '{act}' (known: {', '.join(NON_GATED)})")
        self.act = act
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.square(F.relu(self.up_proj(x))))


def make_mlp(
    hidden: int,
    intermediate: int,
    act: str = "silu",
    bias: bool = False,
    limit: float | None = None,
    ops: LayerOps = TORCH_OPS,
) -> GatedMLP | MLP:
    """The MLP of activation `act`: `MLP` for a non-gated one (NON_GATED), else `GatedMLP`. Raises
    ValueError for an activation neither knows."""
    if act in NON_GATED:
        return MLP(hidden, intermediate, act, bias)
    return GatedMLP(hidden, intermediate, act, bias, limit, ops)
