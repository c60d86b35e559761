"""The batch-invariant layers of the CUDA path: linear layers and RMSNorm on the Triton kernels of
kernels/batch_invariant.py (one tile shape whatever the batch; `--deterministic` or
`--linear-kernel triton`). On the CPU they run only under TRITON_INTERPRET=1 (tests)."""

from __future__ import annotations

import torch
from torch import nn

from agentrt.runtime.kernels import batch_invariant


class TritonLinear(nn.Module):
    """y = x @ W^T + b through `batch_invariant.matmul`.

    Holds the nn.Linear's own `weight` [out, in] and `bias` [out] or None (a tied LM head keeps
    sharing the embedding's parameter). forward(x [..., in]) -> [..., out] in x's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = batch_invariant.matmul(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, batch-invariant Triton matmul"


def use_batch_invariant_kernels(model: nn.Module) -> list[str]:
    """Replace every nn.Linear of `model` (the LM head included) by a TritonLinear, in place; returns
    the replaced linear layers' names. Quantized layers (not nn.Linear) keep their kernels. (The
    norms' batch-invariant kernel is the model's LayerOps: backends.choose_layer_ops.)"""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, TritonLinear(model.get_submodule(name)))
    return names
