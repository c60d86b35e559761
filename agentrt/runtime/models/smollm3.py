"""SmolLM3 (`SmolLM3ForCausalLM`, transformers `modeling_smollm3.py`): the Llama layout with NoPE
layers: layer i rotates q and k only where `no_rope_layers[i]` is 1 (by default every fourth layer
has no position embedding). A NoPE layer's RoPE is `RopeSpec.nope` (zero frequencies: the rotation
is the identity in every backend, layers/rotary.py), so the attention layer needs no option of its
own. `attention_bias` puts a bias on o_proj as well as q / k / v; sliding windows only with
`use_sliding_window`."""

from __future__ import annotations

import dataclasses

from agentrt.runtime.layers.rotary import RopeSpec
from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch, base_arch


class SmolLM3ForCausalLM(DecoderModel):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        """Raises ValueError naming `no_rope_layers` when it is shorter than the layers."""
        n = cfg.num_hidden_layers
        bias = bool(getattr(cfg, "attention_bias", False))
        arch = base_arch(cfg, architecture, qkv_bias=bias, o_bias=bias)
        if not getattr(cfg, "use_sliding_window", False):
            arch = dataclasses.replace(arch, layer_windows=(None,) * n)
        uses_rope = list(getattr(cfg, "no_rope_layers", None) or [1] * n)
        if len(uses_rope) < n:
            raise ValueError(f"config no_rope_layers has {len(uses_rope)} entries for {n} layers")
        if all(uses_rope[:n]):
            return arch
        nope = len(arch.ropes)
        return dataclasses.replace(
            arch,
            ropes=(*arch.ropes, RopeSpec.nope(arch.head_dim)),
            layer_rope=tuple(r if uses_rope[i] else nope for i, r in enumerate(arch.layer_rope)),
        )
