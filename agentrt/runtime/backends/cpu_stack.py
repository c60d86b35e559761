"""The C++ whole-stack decode (kernels/cpu_decode_layers.cpp): a decode-only batch runs every layer,
the final norm included, in one op when every projection runs a C++ int8/int4 kernel; any other batch
runs the torch backend with the C++ kernels (backends/torch_attention.py, `cpu_kernel`).

The op knows one layer: the plain Llama layer. `SUPPORTS` is the allow-list of the layout features
(models/config.py `ModelArch.layout_features`) it implements beyond that layer. `CpuStackBackend`
refuses any other model with the features named; `make_backend` then runs the `cpu` backend layer by
layer and the start line says why.
"""

from __future__ import annotations

import torch

from agentrt.runtime.backends.torch_attention import TorchBackend
from agentrt.runtime.forward import SeqChunk, is_plain_decode, run_forward
from agentrt.runtime.kernels import cpu_kernels

SUPPORTS = frozenset({"qkv_bias", "mlp_bias", "mlp:silu"})
WEIGHTS_PER_LAYER = 18  # the op's order: input norm, then (weight, scales, mins, bias) of qkv, o,
# the post-attention norm, then those of gate_up and down


def unsupported(arch) -> frozenset[str]:
    """The layout features of `arch` (ModelArch) the whole-stack op does not implement (empty: it
    runs this model)."""
    return arch.layout_features() - SUPPORTS


def stack_weights(model) -> tuple[list[torch.Tensor], list[int]] | None:
    """(weights, out_features) for `torch.ops.agentrt_cpu.decode_layers` (WEIGHTS_PER_LAYER tensors per
    layer, that op's order) when the model's layout is supported and every projection of every layer
    runs a C++ kernel (Int8Linear or Int4BlockLinear after `pack_for_kernel`), else None."""
    if unsupported(model.arch):
        return None
    none = torch.empty(0)
    weights: list[torch.Tensor] = []
    out_features: list[int] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(getattr(m, "use_kernel", False) for m in linears):
            return None
        weights.append(layer.input_layernorm.weight.detach())
        for i, m in enumerate(linears):
            if i == 2:
                weights.append(layer.post_attention_layernorm.weight.detach())
            mins = getattr(m, "mins", None)
            weights += [
                m.qweight,
                m.scales,
                none if mins is None else mins,
                none if m.bias is None else m.bias,
            ]
        out_features = [m.out_features for m in linears]  # the same in every layer
    return weights, out_features


def decode_stack(model, batch, k_caches, v_caches, stack, num_layers: int | None = None) -> torch.Tensor:
    """hidden [T, hidden] after the final norm of a decode-only batch (forward.BatchInputs of the torch
    backend with `cpu_kernel`), every layer (or the first `num_layers`) in one C++ op. stack: the
    model's `stack_weights`."""
    meta = batch.meta
    return run_stack(
        model, stack, batch.input_ids, batch.positions, meta.slot_mapping, meta.decode_slots,
        meta.decode_lens, k_caches, v_caches, num_layers,
    )  # fmt: skip


def run_stack(model, stack, ids, positions, slot_mapping, slots, lens, k_caches, v_caches, num_layers=None):
    """The whole-stack op over ids / positions / slot_mapping / lens [B] int64 and the context slots
    [B, L] int64 (padded): hidden [B, hidden] after the final norm."""
    weights, out_features = stack
    arch = model.arch
    x = model.embed(ids)
    cos, sin = model.rope_cos[positions].to(x.dtype), model.rope_sin[positions].to(x.dtype)
    n = len(model.layers) if num_layers is None else num_layers
    return cpu_kernels.decode_layers(
        x, weights[: n * WEIGHTS_PER_LAYER], k_caches[:n], v_caches[:n], cos, sin, slot_mapping, slots, lens,
        model.norm.weight, out_features, arch.num_heads, arch.rms_norm_eps, arch.head_dim**-0.5,
    )  # fmt: skip


class CpuStackBackend:
    """The torch backend with the C++ kernels, and decode-only batches through the whole-stack op.
    Raises ValueError at construction when the model's layout or its layers are not the op's."""

    captured_sizes: tuple[int, ...] = ()
    name = "cpu"

    def __init__(self, eager: TorchBackend):
        self.eager, self.reason = eager, eager.reason
        missing = unsupported(eager.model.arch)
        if missing:
            raise ValueError(f"the C++ whole-stack decode does not implement {', '.join(sorted(missing))}")
        self.stack = stack_weights(eager.model)
        if self.stack is None:
            raise ValueError("the C++ whole-stack decode needs every projection on a C++ int8/int4 kernel")
        self.on_caches = cpu_kernels.stack_caches(eager.kv.k)

    def prepare(self, chunks: list[SeqChunk]):
        return self.eager.prepare(chunks)

    def run(self, chunks: list[SeqChunk], return_hidden: bool = False):
        """Logits [N, vocab] fp32 (with return_hidden, and the hidden rows): forward.run_forward, a
        decode-only batch through the one op."""
        e = self.eager
        if not chunks or not self.on_caches:
            return e.run(chunks, return_hidden)
        if is_plain_decode(chunks):
            rows = self._plain_decode(chunks)
            logits = e.model.compute_logits(rows)
            return (logits, rows) if return_hidden else logits
        batch = e.prepare(chunks)
        if batch.meta.decode_idx is None or batch.meta.prefills:
            return run_forward(e.model, e.kv.k, e.kv.v, chunks, lambda _: batch, e.device, return_hidden)
        rows = decode_stack(e.model, batch, e.kv.k, e.kv.v, self.stack)[batch.logit_idx]
        logits = e.model.compute_logits(rows)
        return (logits, rows) if return_hidden else logits

    def _plain_decode(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """hidden [B, hidden] after the final norm of a plain-decode batch (forward.is_plain_decode),
        the op's inputs built straight from the chunks (no attention metadata: the op takes the context
        slots padded to the longest, each sequence's length, the new tokens' slots and RoPE rows)."""
        model, kv = self.eager.model, self.eager.kv
        i64 = torch.int64
        small = torch.tensor(
            [
                [c.token_ids[0] for c in chunks],
                [c.context_len for c in chunks],
                [c.slots[c.context_len] for c in chunks],
                [len(c.slots) for c in chunks],
            ],
            dtype=i64,
        )
        ids, positions, slot_mapping, lens = small
        if len(chunks) == 1:
            slots = torch.tensor(chunks[0].slots, dtype=i64)[None]
        else:
            width = max(len(c.slots) for c in chunks)
            slots = torch.tensor([c.slots + [0] * (width - len(c.slots)) for c in chunks], dtype=i64)
        return run_stack(model, self.stack, ids, positions, slot_mapping, slots, lens, kv.k, kv.v)

    def describe(self) -> str:
        return "decode eager (C++ whole-stack op)"
