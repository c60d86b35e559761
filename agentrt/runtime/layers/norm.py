"""RMSNorm (Zhang & Sennrich 2019), with the residual add fused in (vLLM's layout).

Gemma's `(1 + weight)` form is this norm with the offset folded into the weight at load
(`models/base.py`): at float32 `x_normed * (1 + w)` is the same product either way. `cast_last`
keeps Gemma's order in lower precision: the product is taken in float32 and cast once.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """forward(x [..., dim]) -> [..., dim] in x's dtype: weight * x / sqrt(mean(x^2) + eps)."""

    def __init__(self, dim: int, eps: float, cast_last: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.cast_last = cast_last
        # kernel(x, weight, eps) in place of the torch ops (models/triton_linear.py sets the
        # batch-invariant Triton one)
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.cast_last:
            return (x * self.weight.float()).to(dtype)
        return self.weight * x.to(dtype)

    def forward_fused(self, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """forward(x) over every `dim` features of x [..., n * dim] (a row of heads: q/k norm);
        fused: the C++ rms_norm (float32 CPU), else the torch ops."""
        dim = self.weight.shape[0]
        if fused and self.kernel is None:
            rows = x.contiguous().view(-1, dim)
            return torch.ops.agentrt_cpu.rms_norm(rows, self.weight, self.eps).view(x.shape)
        return self(x.reshape(-1, dim)).view(x.shape)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x)), or (x, norm(x)) when residual is None; x [T, D].
        fused: one C++ op (kernels/cpu_layer_ops.cpp; float32 CPU), else the torch ops above."""
        if fused and self.kernel is None:
            if residual is None:
                return x, torch.ops.agentrt_cpu.rms_norm(x, self.weight, self.eps)
            return torch.ops.agentrt_cpu.add_rms_norm(residual, x, self.weight, self.eps)
        residual = x if residual is None else residual + x
        return residual, self(residual)
