"""GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`, transformers `modeling_glm4_moe.py`): the Llama layout
with a partial rotary embedding (`partial_rotary_factor`, 0.5 by default: the first half of each head
rotated, half-split), a bias on the q / k / v projections (`attention_bias`, none on o_proj), an
optional per-head q / k RMSNorm (`use_qk_norm`), dense MLPs in the first `first_k_dense_replace`
layers and a sparse MoE after them: sigmoid scores with the correction bias, group-limited top-k
(`n_group`, `topk_group`), `norm_topk_prob`, `routed_scaling_factor`, plus `n_shared_experts` shared
experts (layers/moe.py). The checkpoints' multi-token-prediction layers (`num_nextn_predict_layers`,
stored as layers num_hidden_layers...) are not read, as transformers ignores them."""

from __future__ import annotations

import re

import torch

from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch, base_arch

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class Glm4MoeForCausalLM(DecoderModel):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        """Raises ValueError naming the field for an activation other than SiLU."""
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{architecture}: hidden_act '{act}' is not supported (silu is)")
        n = cfg.num_hidden_layers
        first_dense = cfg.first_k_dense_replace
        return base_arch(
            cfg,
            architecture,
            qk_norm=bool(getattr(cfg, "use_qk_norm", False)),
            num_experts=cfg.n_routed_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            moe_layers=tuple(i >= first_dense for i in range(n)),
            moe_routing="sigmoid_topk",
            moe_renormalize=bool(cfg.norm_topk_prob),
            moe_correction_bias=True,
            moe_groups=cfg.n_group or 1,
            moe_topk_groups=cfg.topk_group or 1,
            routed_scaling_factor=float(cfg.routed_scaling_factor),
            shared_expert_intermediate_size=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0),
        )

    @classmethod
    def rename(cls, name: str) -> str:
        return name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """DecoderModel's load without the layers past `num_hidden_layers` (the multi-token-prediction
        module: layer 46 of GLM-4.5-Air, 92 of GLM-4.5)."""
        n = self.arch.num_layers
        kept = {k: v for k, v in tensors.items() if (m := LAYER.search(k)) is None or int(m[1]) < n}
        super().load_hf_state_dict(kept)
