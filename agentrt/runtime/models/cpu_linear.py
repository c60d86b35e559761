"""Dense fp32 linear layers on the CPU through oneDNN's packed matmul.

torch's `F.linear` on the CPU calls MKL's sgemm, which on the development machine (AMD EPYC, AVX2)
runs the decode shapes (a few to a few dozen rows against a [out, in] weight) far below the
hardware: measured on the default model's layer shapes, 2 threads, the 120 projections of the 30
layers took 100 ms at 16 rows with `F.linear` and 55 ms with oneDNN's matmul on a weight reordered
once into its blocked layout (26 vs 40 ms at 1 row, 530 vs 620 ms at 256 rows); the tied LM head
[49152, 576] 51 vs 17 ms at 16 rows. The ops are the ones inductor's CPU freezing pass emits:
`torch.ops.mkldnn._reorder_linear_weight` (pack) and `torch.ops.mkldnn._linear_pointwise` (matmul).

The results differ from `F.linear` by summation order only (max abs difference ~1e-4 on logits of
std ~8 at fp32). CPU and float32 only; other dtypes, quantized layers and CUDA keep their kernels. Whether a run packs
its layers is runtime/platform.py's `choose_linear_kernel`.
"""

from __future__ import annotations

import torch
from torch import nn


class OneDNNLinear(nn.Module):
    """y = x @ W^T + b with W held in oneDNN's blocked layout.

    Buffers: `packed` (an opaque mkldnn tensor of the [out, in] float32 weight; it cannot be indexed
    or saved), `bias` [out] float32 or None. forward(x [..., in] float32) -> [..., out] float32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer(
            "packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous()), persistent=False
        )
        self.register_buffer("bias", None if bias is None else bias.detach().contiguous(), persistent=False)
        self.nbytes = weight.numel() * weight.element_size()  # the mkldnn tensor reports no storage

    @property
    def weight(self) -> torch.Tensor:
        """The dense [out, in] float32 weight, unpacked into a new tensor on each call (for readers
        such as Medusa training; the forward never needs it)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == self.in_features and x.dim() and x.shape[-1] == self.in_features:
            # one row runs as two: oneDNN takes a GEMV kernel for a single row (AVX-512 CPUs, in >= 1536),
            # whose sum order differs from its GEMM's, and a row must not change with the batch
            two = x.reshape(1, self.in_features).expand(2, self.in_features).contiguous()
            y = torch.ops.mkldnn._linear_pointwise(two, self.packed, self.bias, "none", [], "")
            return y[:1].reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, float32 oneDNN packed"


def pack_linears(model: nn.Module) -> list[str]:
    """Replace every float32 nn.Linear of `model` (the LM head included) by an OneDNNLinear in place;
    returns the replaced names. A tied LM head gets its own packed copy of the embedding matrix (the
    embedding lookup keeps the dense one)."""
    names = [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight.dtype == torch.float32
    ]
    for name in names:
        lin = model.get_submodule(name)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, OneDNNLinear(lin.weight, lin.bias))
    return names
