"""Rotary position embeddings (RoFormer, Su et al. 2021) with every scaling the families use.

The inverse frequencies and the attention factor come from transformers' own RoPE initialisers
(`modeling_rope_utils.ROPE_INIT_FUNCTIONS`: linear, dynamic, llama3, YaRN, LongRoPE), so a family
rotates exactly as its reference does; `default` is the plain `1 / theta^(2i / dim)`. A model keeps
one float32 cos/sin table per distinct spec (Gemma 3's local and global layers have two).

LongRoPE (Phi-3/4): the table holds the short factors below `original_max_position_embeddings` and
the long factors from there on, one fixed table for every sequence. transformers switches the whole
sequence to the long factors once it is longer than that (its earlier positions then rotate
differently than when they were cached); a KV cache needs a position's rotation fixed, so positions
past the original context use the long factors, as the factors were fitted for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeSpec:
    """inv_freq: [rotary_dim // 2] float32 values; attention_factor multiplies cos and sin (YaRN,
    LongRoPE); long_inv_freq / original_max: LongRoPE's frequencies from position original_max on."""

    inv_freq: tuple[float, ...]
    attention_factor: float = 1.0
    long_inv_freq: tuple[float, ...] | None = None
    original_max: int = 0

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    @property
    def identity(self) -> bool:
        """Every frequency is zero: cos 1 and sin 0 at every position, a rotation that leaves q and k
        exactly as they are (x * 1 - y * 0 = x), a NoPE layer's (`RopeSpec.nope`)."""
        return not any(self.inv_freq)

    @classmethod
    def nope(cls, head_dim: int) -> RopeSpec:
        """The RoPE of a layer without position embedding (SmolLM3's `no_rope_layers`): zero
        frequencies over the whole head, so every backend's rotation (torch, C++, Triton) returns q
        and k unchanged, bit for bit, and the layer needs no option of its own."""
        return cls((0.0,) * (head_dim // 2))


def rope_spec(hf_config, head_dim: int, layer_type: str | None = None) -> RopeSpec:
    """The RoPE of `hf_config` (a transformers config; `layer_type` selects one entry of a per-layer-type
    `rope_parameters`, as Gemma 3's). Raises ValueError for a RoPE type transformers does not know."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(hf_config.rope_parameters or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    kind = params.get("rope_type") or params.get("type") or "default"
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    if kind == "default":
        dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        theta = float(params.get("rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return RopeSpec(tuple(inv.tolist()))
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"unsupported RoPE scaling '{kind}' (transformers knows {sorted(ROPE_INIT_FUNCTIONS)})"
        )
    inv, factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", **kwargs)
    if kind != "longrope":
        return RopeSpec(tuple(inv.float().tolist()), float(factor))
    original = int(
        params.get("original_max_position_embeddings")
        or getattr(hf_config, "original_max_position_embeddings", 0)
        or hf_config.max_position_embeddings
    )
    long_inv, _ = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", seq_len=original + 1, **kwargs)
    return RopeSpec(tuple(inv.float().tolist()), float(factor), tuple(long_inv.float().tolist()), original)


def rope_tables(spec: RopeSpec, max_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) tables [max_positions, rotary_dim // 2] on `device`, the attention factor
    applied (as transformers multiplies cos and sin by it)."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    inv = torch.tensor(spec.inv_freq, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv)
    if spec.long_inv_freq is not None and max_positions > spec.original_max:
        long = torch.tensor(spec.long_inv_freq, dtype=torch.float32, device=device)
        freqs[spec.original_max :] = torch.outer(pos[spec.original_max :], long)
    cos, sin = freqs.cos(), freqs.sin()
    if spec.attention_factor != 1.0:
        cos, sin = cos * spec.attention_factor, sin * spec.attention_factor
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (RoFormer, Su et al. 2021). x [T, heads, head_dim]; cos/sin
    [T, rotary_dim // 2] -> x with its first rotary_dim features rotated (half-split layout within
    them, as transformers' partial rotary: Phi-3/4) and the rest passed through."""
    half = cos.shape[-1]
    if 2 * half != x.shape[-1]:
        rot = 2 * half
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
