"""DeepSeek V3 / V3.1 / R1 and Kimi K2 (same architecture, `DeepseekV3ForCausalLM`; Kimi K2's
config.json says model_type `kimi_k2`, read as deepseek_v3: registry.read_hf_config): multi-head
latent attention in every layer (layers/mla.py; YaRN RoPE on the decoupled key, interleaved pairs,
DeepSeek's mscale on the softmax scale), dense MLPs in the first `first_k_dense_replace` layers and
MoE MLPs after them (layers/moe.py `sigmoid_topk`: sigmoid scores, the aux-loss-free correction bias,
group-limited top-k over `n_group` groups, renormalised, times `routed_scaling_factor`; plus
`n_shared_experts` shared experts). transformers `modeling_deepseek_v3.py` is the reference.

Checkpoint names are transformers' (per-expert `experts.N.*_proj` as released, or stacked as
transformers 5 saves them); the router's `gate.e_score_correction_bias` is SparseMoE's
`e_score_correction_bias`; the layers past `num_hidden_layers` (the released checkpoints'
multi-token-prediction module, layer 61 of DeepSeek V3) are skipped, as transformers skips them.
"""

from __future__ import annotations

import re
from typing import ClassVar

from agentrt.runtime.layers.mla import MLAConfig, mla_softmax_scale
from agentrt.runtime.models.base import PACKED_MLP, DecoderModel
from agentrt.runtime.models.config import ModelArch, base_arch

LAYER = re.compile(r"layers\.(\d+)\.")


class DeepseekV3ForCausalLM(DecoderModel):
    # q_proj (without a q LoRA) is the latent attention's own, not packed with k / v
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = dict(PACKED_MLP)

    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        mla = MLAConfig(
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            rope_interleave=bool(getattr(cfg, "rope_interleave", True)),
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
        )
        n = cfg.num_hidden_layers
        experts = getattr(cfg, "n_routed_experts", None) or 0
        first_dense = getattr(cfg, "first_k_dense_replace", None) or 0
        moe_layers = tuple(experts > 0 and i >= first_dense for i in range(n))
        moe = {}
        if any(moe_layers):
            moe = {
                "num_experts": experts,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "moe_routing": "sigmoid_topk",
                "moe_renormalize": bool(cfg.norm_topk_prob),
                "moe_correction_bias": True,
                "moe_groups": cfg.n_group or 1,
                "moe_topk_groups": cfg.topk_group or 1,
                "routed_scaling_factor": float(cfg.routed_scaling_factor),
                "shared_expert_intermediate_size": cfg.moe_intermediate_size * (cfg.n_shared_experts or 0),
            }
        # base_arch reads the RoPE at cfg.head_dim, which transformers sets to qk_rope_head_dim
        return base_arch(
            cfg,
            architecture,
            head_dim=mla.qk_head_dim,
            qkv_bias=False,
            attn_scale=mla_softmax_scale(mla.qk_head_dim, getattr(cfg, "rope_parameters", None)),
            mla=mla,
            cache_specs=(mla.cache_spec(),) * n,
            moe_layers=moe_layers,
            **moe,
        )

    def rename(self, name: str) -> str | None:  # an instance's: the layer count is the arch's
        m = LAYER.match(name)
        if m is not None and int(m[1]) >= self.arch.num_layers:
            return None  # the multi-token-prediction layer(s)
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
