"""Llama-layout families (Llama 2/3.x, Qwen2/2.5, Mistral, SmolLM2, Phi-3/4-mini): the shared
layers as they are, differing only in config fields. Qwen2 always has a QKV bias; Phi-3 ships its
projections fused (`qkv_proj`, `gate_up_proj`: loaded as they are) and uses LongRoPE with a partial
rotary dimension (layers/rotary.py)."""

from __future__ import annotations

from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch, base_arch


class LlamaForCausalLM(DecoderModel):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        return base_arch(cfg, architecture)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        return base_arch(cfg, architecture, qkv_bias=True)


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
