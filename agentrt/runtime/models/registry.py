"""The architectures agentrt runs: Hugging Face architecture name -> (module, class) under
models/, imported on first use. `arch_from_hf_config` is the one entry: it unwraps a multimodal
config's `text_config`, finds the family, and lets it read its config."""

from __future__ import annotations

import dataclasses
import importlib

from agentrt.runtime.forward import TORCH_OPS, LayerOps
from agentrt.runtime.models.checkpoint_quant import checkpoint_quant
from agentrt.runtime.models.config import ModelArch

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Phi3ForCausalLM": ("llama", "Phi3ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe_families", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("moe_families", "MixtralForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

MODEL_TYPES = {  # config.model_type -> architecture, for configs without `architectures`
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
}


def architecture_of(cfg) -> str:
    """The architecture name of a transformers config: `architectures[0]`, else from `model_type`."""
    archs = list(getattr(cfg, "architectures", None) or [])
    if archs:
        return archs[0]
    model_type = getattr(cfg, "model_type", "") or "unknown"
    return MODEL_TYPES.get(model_type, model_type)


def model_class(architecture: str):
    """The DecoderModel subclass of `architecture`. Raises ValueError naming it when unsupported."""
    if architecture not in ARCHITECTURES:
        shown = (
            architecture
            if len(architecture) <= 64
            else f"{architecture[:64]}... ({len(architecture)} characters)"
        )
        raise ValueError(
            f"unsupported architecture '{shown}': agentrt runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"agentrt.runtime.models.{module}"), name)


def arch_from_hf_config(cfg) -> ModelArch:
    """The ModelArch of a transformers config (a multimodal config's text part), with how its
    checkpoint stores the weights (`checkpoint_quant.checkpoint_quant` of its quantization_config).
    Raises ValueError naming the architecture, or the missing piece, when it is not supported, or
    naming the quantization method when the weights are stored in a format agentrt does not read."""
    architecture = architecture_of(cfg)
    cls = model_class(architecture)
    quant = checkpoint_quant(
        getattr(cfg, "quantization_config", None), architecture, getattr(cls, "mxfp4_experts", False)
    )
    text = getattr(cfg, "text_config", None) or cfg
    if text is not cfg:
        text.tie_word_embeddings = getattr(
            cfg, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)
        )
    arch = cls.arch_from_config(text, architecture)
    return arch if quant is None else dataclasses.replace(arch, checkpoint_quant=quant)


def build_model(arch: ModelArch, max_positions: int, ops: LayerOps = TORCH_OPS):
    """An (uninitialised-weights) model of `arch` on the current default device, its layers on the
    element-wise ops `ops` (forward.LayerOps)."""
    return model_class(arch.architecture)(arch, max_positions, ops)
