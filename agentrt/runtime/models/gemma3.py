"""Gemma 3 (text): interleaved sliding-window and global attention layers (`layer_types`), each
type with its own RoPE base; RMSNorms of the `1 + w` form (folded into the weight at load) around
attention and the MLP as well as before them; q/k RMSNorm; the embeddings scaled by sqrt(hidden);
softmax scale query_pre_attn_scalar ** -0.5; GELU-tanh gated MLP; tied LM head (transformers
`modeling_gemma3.py`; vLLM `gemma3.py`)."""

from __future__ import annotations

from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch, base_arch


class Gemma3ForCausalLM(DecoderModel):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"{architecture}: attention logit soft-capping is not supported")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(f"{architecture}: bidirectional attention is not supported")
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"{architecture}: activation '{act}' is not supported (gelu_pytorch_tanh is)")
        return base_arch(
            cfg,
            architecture,
            hidden_act="gelu_tanh",
            qk_norm=True,
            norm_offset=1.0,
            norm_cast_last=True,
            sandwich_norms=True,
            embed_scale=cfg.hidden_size**0.5,
            attn_scale=cfg.query_pre_attn_scalar**-0.5,
            final_logit_softcap=getattr(cfg, "final_logit_softcapping", None),
        )
