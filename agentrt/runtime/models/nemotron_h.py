"""Nemotron-H (`NemotronHForCausalLM`: Nemotron-H 8B / 47B, NVIDIA-Nemotron-Nano-9B-v2 and 12B-v2,
Nemotron 3 Nano; transformers `modeling_nemotron_h.py`, vLLM `nemotron_h.py`).

Each layer is ONE block, per `layers_block_type` (the released configs' `hybrid_override_pattern`,
M / * / - / E, which transformers reads into it): RMSNorm, then one of
- "linear_attention": the Mamba-2 mixer (layers/mamba2.py; its state in the state pool, no KV),
- "full_attention": attention without any position embedding (the identity RoPE, `RopeSpec.nope`),
  no biases, scale head_dim ** -0.5,
- "mlp": a non-gated squared-ReLU MLP (layers/mlp.py `MLP`),
- "moe": DeepSeek V3's router (sigmoid scores, aux-loss-free correction bias, group-limited top-k,
  renormalised per `norm_topk_prob`, `routed_scaling_factor`) over non-gated squared-ReLU experts,
  plus one shared squared-ReLU MLP (layers/moe.py),
then the residual add. The shared `DecoderLayer` composes a token mixer AND an MLP in every layer;
a Nemotron-H block has exactly one of them, so the family builds its own layer (`NemotronHBlock`,
the `layer_class` seam) and the mixer-less blocks say so in the ModelArch (`layer_mixers[i]`
"none": no KV, no state), rather than pairing blocks into DecoderLayers (block i's MLP would need
block i+1's norm, and runs of M or - blocks would still leave layers with one half missing).
RMSNorms take the product in float32 and cast once (`norm_cast_last`).

Checkpoints name the model `backbone.` (`embeddings`, `layers.N.norm`, `layers.N.mixer.*`,
`norm_f`); the experts per expert (`mixer.experts.E.up_proj`) or stacked as transformers 5 keeps
them ([E, I, H] / [E, H, I]). A multi-token-prediction head (`mtp.*`) is not read, as transformers.
Refused from the config: MoE latent projections (`moe_latent_size`), an MLP activation other than
relu2, `mlp_bias` with MoE blocks.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, ForwardMeta, LayerOps
from agentrt.runtime.layers.attention import Attention, AttentionConfig
from agentrt.runtime.layers.mamba2 import Mamba2Mixer
from agentrt.runtime.layers.mlp import MLP
from agentrt.runtime.layers.moe import SparseMoE
from agentrt.runtime.layers.norm import RMSNorm
from agentrt.runtime.layers.rotary import RopeSpec
from agentrt.runtime.models.base import PACKED, DecoderModel
from agentrt.runtime.models.config import ModelArch

MIXERS = {  # block type (and the legacy names transformers also reads) -> layer_mixers entry
    "linear_attention": "mamba2",
    "mamba": "mamba2",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "none",
    "moe": "none",
}
MODULE = {"mamba2": "linear_attn", "attention": "self_attn", "none": "mlp"}  # the block's mixer module
STACKED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(up_proj|down_proj)")


class NemotronHBlock(nn.Module):
    """forward(x, residual, k_cache, v_cache, meta, rope) -> (this block's output, the stream before
    it), DecoderLayer's contract: x [T, hidden] the previous block's output (the embeddings for block
    0, with residual None). The block's one module is `linear_attn` (Mamba-2), `self_attn` or `mlp`
    (MLP or SparseMoE), chosen once here."""

    def __init__(self, arch: ModelArch, i: int, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_cast_last, ops)
        kind = arch.layer_mixers[i]
        if kind == "mamba2":
            self.linear_attn = Mamba2Mixer.from_hf_config(arch.mixer_config)
            index = arch.recurrent_layers.index(i)
            self.mix = lambda h, k_cache, v_cache, meta, rope: meta.run_recurrent(self.linear_attn, index, h)
        elif kind == "attention":
            self.self_attn = Attention(
                AttentionConfig(
                    arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.scale
                ),
                ops,
            )
            self.mix = self.self_attn.forward  # (a bound method: not registered as a module)
        else:
            if arch.is_moe_layer(i):
                self.mlp = SparseMoE(
                    arch.hidden_size,
                    arch.moe_intermediate_size,
                    arch.num_experts,
                    arch.num_experts_per_tok,
                    arch.moe_routing,
                    arch.moe_renormalize,
                    act=arch.expert_act,
                    ops=ops,
                    correction_bias=arch.moe_correction_bias,
                    num_groups=arch.moe_groups,
                    topk_groups=arch.moe_topk_groups,
                    routed_scaling=arch.routed_scaling_factor,
                    shared_intermediate=arch.shared_expert_intermediate_size,
                )
            else:
                self.mlp = MLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.mlp_bias)
            self.mix = lambda h, k_cache, v_cache, meta, rope: self.mlp(h)

    def forward(self, x, residual, k_cache, v_cache, meta: ForwardMeta, rope=None):
        residual, h = self.input_layernorm.add_forward(x, residual)
        return self.mix(h, k_cache, v_cache, meta, rope), residual


class NemotronHForCausalLM(DecoderModel):
    layer_class = NemotronHBlock
    packed_modules_mapping = PACKED  # q/k/v packed; the MLPs' up_proj is not a gated MLP's half

    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        """Raises ValueError naming the config field of a variant not supported (module docstring)."""
        types = list(getattr(cfg, "layers_block_type", None) or [])
        unknown = sorted({t for t in types if t not in MIXERS})
        if unknown or not types:
            raise ValueError(
                f"{architecture}: layers_block_type must name every block from {sorted(MIXERS)}, "
                f"got {unknown or types}"
            )
        if getattr(cfg, "moe_latent_size", None) is not None:
            raise ValueError(f"{architecture}: moe_latent_size (MoE latent projections) is not supported")
        act = getattr(cfg, "mlp_hidden_act", "relu2")
        if act != "relu2":
            raise ValueError(f"{architecture}: mlp_hidden_act '{act}' is not supported (relu2 is)")
        moe = [t == "moe" for t in types]
        mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        if mlp_bias and any(moe):
            raise ValueError(f"{architecture}: mlp_bias with MoE blocks is not supported")
        experts = {}
        if any(moe):
            experts = {
                "num_experts": cfg.n_routed_experts,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "moe_layers": tuple(moe),
                "moe_routing": "sigmoid_topk",
                "moe_renormalize": bool(cfg.norm_topk_prob),
                "moe_correction_bias": True,
                "moe_groups": cfg.n_group or 1,
                "moe_topk_groups": cfg.topk_group or 1,
                "routed_scaling_factor": float(cfg.routed_scaling_factor),
                "shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
                "expert_act": act,
            }
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        n = len(types)
        return ModelArch(
            architecture=architecture,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=n,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.layer_norm_epsilon,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            ropes=(RopeSpec.nope(head_dim),),
            layer_rope=(0,) * n,
            layer_windows=(None,) * n,
            mlp_bias=mlp_bias,
            hidden_act=act,
            norm_cast_last=True,
            layer_mixers=tuple(MIXERS[t] for t in types),
            mixer_config=cfg,
            **experts,
        )

    def rename(self, name: str) -> str | None:
        """DecoderModel.rename, of this model (not the class): block N's `mixer.` is its
        `linear_attn.`, `self_attn.` or `mlp.` by the block's kind (module docstring); None for the
        multi-token-prediction head."""
        name = re.sub(r"^backbone\.", "", name)
        if name.startswith("mtp."):
            return None  # not part of the decoder (transformers skips it too)
        name = {"embeddings.weight": "embed_tokens.weight", "norm_f.weight": "norm.weight"}.get(name, name)
        m = re.fullmatch(r"layers\.(\d+)\.(norm|mixer)\.(.*)", name)
        if m is None:
            return name
        i, part, rest = int(m[1]), m[2], m[3]
        if part == "norm":
            return f"layers.{i}.input_layernorm.{rest}"
        kinds = self.arch.layer_mixers
        kind = kinds[i] if i < len(kinds) else "none"  # a layer past the model: refused by the load
        rest = rest.replace("gate.e_score_correction_bias", "e_score_correction_bias")
        return f"layers.{i}.{MODULE[kind]}.{rest}"

    @classmethod
    def split_experts(cls, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """transformers 5's stacked experts (`...mlp.experts.up_proj` [E, I, H], `down_proj` [E, H, I])
        -> per-expert (name, tensor) pairs."""
        m = STACKED_EXPERTS.fullmatch(name)
        if m is None:
            return None
        return [(f"{m[1]}.{e}.{m[2]}.weight", value[e]) for e in range(value.shape[0])]
