"""The architectures agentrt runs: Hugging Face architecture name -> (module, class) under
models/, imported on first use. `arch_from_hf_config` is the one entry: it unwraps a multimodal
config's `text_config`, finds the family, and lets it read its config."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

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
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_next", "Qwen3_5MoeForCausalLM"),
    "MixtralForCausalLM": ("moe_families", "MixtralForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "DeepseekV3ForCausalLM"),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("gemma4", "Gemma4ForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("granite4", "GraniteMoeHybridForCausalLM"),
    "NemotronHForCausalLM": ("nemotron_h", "NemotronHForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

MODEL_TYPES = {  # config.model_type -> architecture, for configs without `architectures`
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "mixtral": "MixtralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
}


MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
"""config.json model_types transformers does not know that are a config it knows: Kimi K2's `kimi_k2`
(its config.json points at the checkpoint's own Python, which agentrt never runs) is DeepSeek V3's."""


def read_hf_config(model_dir: Path):
    """transformers' config of the checkpoint directory `model_dir` (AutoConfig.from_pretrained),
    a model_type of MODEL_TYPE_ALIASES read as the config class it names, without the checkpoint's
    code (its `auto_map` dropped). Raises what AutoConfig raises for an unreadable config."""
    from transformers import AutoConfig

    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        raw = None  # AutoConfig says what is wrong
    alias = MODEL_TYPE_ALIASES.get(raw.get("model_type")) if isinstance(raw, dict) else None
    if alias is None:
        return AutoConfig.from_pretrained(str(model_dir))
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "transformers_version")}
    return AutoConfig.for_model(alias, **fields)


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
