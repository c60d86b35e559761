"""Qwen3 (dense): the Llama layout with an RMSNorm over head_dim on q and k before RoPE and no QKV
bias (transformers `modular_qwen3.py`)."""

from __future__ import annotations

from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch, base_arch


class Qwen3ForCausalLM(DecoderModel):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        return base_arch(cfg, architecture, qk_norm=True)
