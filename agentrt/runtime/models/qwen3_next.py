"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid layers, Gated DeltaNet linear attention
(layers/gated_delta.py, its state in the state pool) interleaved per `layer_types` with gated full
attention (q_proj also projects a per-head output gate; q/k RMSNorm; partial RoPE), RMSNorms of the
`1 + w` form computed in float32 (folded into the weight at load; the DeltaNet's own gated norm is
a plain one), and Qwen3-MoE's sparse MLPs with a sigmoid-gated shared expert (transformers
`modeling_qwen3_next.py`, `modeling_qwen3_5.py`, `modeling_qwen3_5_moe.py`; vLLM `qwen3_next.py`).
Qwen3.5's multimodal RoPE (mrope) reduces to the plain RoPE for text, whose three position ids are
equal."""

from __future__ import annotations

from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch, base_arch

MIXERS = {"linear_attention": "gated_delta", "full_attention": "attention"}


def hybrid_arch(cfg, architecture: str) -> ModelArch:
    """The ModelArch of a Qwen3-Next / Qwen3.5 text config. Raises ValueError naming a layer type
    it does not know."""
    n = cfg.num_hidden_layers
    types = list(getattr(cfg, "layer_types", None) or [])[:n]
    unknown = sorted({t for t in types if t not in MIXERS})
    if unknown or len(types) != n:
        raise ValueError(
            f"{architecture}: layer_types must name {n} layers of {sorted(MIXERS)}, got {unknown or types}"
        )
    experts = getattr(cfg, "num_experts", 0) or 0
    moe = {}
    if experts:
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        dense = set(getattr(cfg, "mlp_only_layers", None) or ())
        moe = {
            "num_experts": experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "moe_layers": tuple(i not in dense and (i + 1) % step == 0 for i in range(n)),
            "moe_renormalize": bool(getattr(cfg, "norm_topk_prob", True)),
            "shared_expert_intermediate_size": getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
            "shared_expert_gate": bool(getattr(cfg, "shared_expert_intermediate_size", 0)),
        }
    return base_arch(
        cfg,
        architecture,
        intermediate_size=getattr(cfg, "intermediate_size", None) or getattr(cfg, "moe_intermediate_size", 0),
        qk_norm=True,
        norm_offset=1.0,
        norm_cast_last=True,
        attn_output_gate=True,
        layer_mixers=tuple(MIXERS[t] for t in types),
        mixer_config=cfg,
        **moe,
    )


class Qwen3NextForCausalLM(DecoderModel):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        return hybrid_arch(cfg, architecture)

    @classmethod
    def offset_norm(cls, name: str) -> bool:
        """The DeltaNet's gated RMSNorm is a plain `w` norm; every other norm is `1 + w`."""
        return name.endswith("norm.weight") and ".linear_attn.norm." not in name


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    pass


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    pass
