"""Sparse-MoE families over layers/moe.py: Qwen3-MoE (Qwen3's attention, MoE MLPs where
`decoder_sparse_step` says and not in `mlp_only_layers`, renormalised top-k per `norm_topk_prob`)
and Mixtral (Mistral's attention, every MLP a MoE, top-k always renormalised; checkpoints name the
block `block_sparse_moe` and the experts' projections w1 / w3 / w2)."""

from __future__ import annotations

import re

from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch, base_arch


class Qwen3MoeForCausalLM(DecoderModel):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        n = cfg.num_hidden_layers
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        dense = set(getattr(cfg, "mlp_only_layers", None) or ())
        experts = cfg.num_experts
        return base_arch(
            cfg,
            architecture,
            qk_norm=True,
            num_experts=experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            moe_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)),
            moe_renormalize=bool(cfg.norm_topk_prob),
        )


class MixtralForCausalLM(DecoderModel):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        return base_arch(
            cfg,
            architecture,
            num_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.intermediate_size,
            moe_layers=(True,) * cfg.num_hidden_layers,
        )

    @classmethod
    def rename(cls, name: str) -> str:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return re.sub(
            r"(\.experts\.\d+\.)(w[123])\.",
            lambda m: m[1] + {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}[m[2]] + ".",
            name,
        )
