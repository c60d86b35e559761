"""MiniMax M2 / M2.1 (`MiniMaxM2ForCausalLM`, transformers `modeling_minimax_m2.py`): full attention
in every layer with an RMSNorm over the whole q and the whole k projection (all heads at once, before
the heads are split: `qk_norm_full`), a partial rotary embedding (the checkpoints' `rotary_dim`, read
by transformers as `partial_rotary_factor`), and a sparse MoE MLP in every layer routed by sigmoid
scores plus the correction bias (`e_score_correction_bias`, beside the router), top-k renormalised,
no groups and no shared experts (layers/moe.py `sigmoid_topk`). Checkpoints name the block
`block_sparse_moe` and the experts' projections w1 / w3 / w2, as Mixtral's."""

from __future__ import annotations

from agentrt.runtime.models.config import ModelArch, base_arch
from agentrt.runtime.models.moe_families import MixtralForCausalLM


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        """Raises ValueError naming the field for an activation other than SiLU."""
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{architecture}: hidden_act '{act}' is not supported (silu is)")
        return base_arch(
            cfg,
            architecture,
            qkv_bias=False,
            qk_norm=True,
            qk_norm_full=True,
            num_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.intermediate_size,
            moe_layers=(True,) * cfg.num_hidden_layers,
            moe_routing="sigmoid_topk",
            moe_correction_bias=True,
        )
