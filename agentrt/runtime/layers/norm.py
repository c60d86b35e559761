"""RMSNorm (Zhang & Sennrich 2019), with the residual add fused in (vLLM's layout).

Gemma's `(1 + weight)` form is this norm with the offset folded into the weight at load
(`models/base.py`): at float32 `x_normed * (1 + w)` is the same product either way. `cast_last`
keeps Gemma's order in lower precision: the product is taken in float32 and cast once.
"""

from __future__ import annotations

import torch
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, LayerOps


class RMSNorm(nn.Module):
    """forward(x [..., n * dim]) -> the same shape in x's dtype: weight * x / sqrt(mean(x^2) + eps) over
    every `dim` features (n > 1: a row of heads, q/k norm). `ops`: the run's element-wise ops
    (forward.LayerOps), bound when the model is built."""

    def __init__(self, dim: int, eps: float, cast_last: bool = False, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cast_last = cast_last
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = self.weight.shape[0]
        return self.ops.rms_norm(x.reshape(-1, dim), self.weight, self.eps, self.cast_last).view(x.shape)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x)), or (x, norm(x)) when residual is None; x [T, D]."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, self.cast_last)
