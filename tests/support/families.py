"""The tiny random-weight model of each supported family, built from transformers' own config and
model classes (3 layers, hidden 64, sliding windows of 24 tokens, 4 experts top-2) and saved as a
Hugging Face directory with the default model's tokenizer."""

from __future__ import annotations

from pathlib import Path

WINDOW = 24
COMMON = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
}
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def family_config(name: str):
    """(transformers config class, overrides of COMMON) of family `name`."""
    return _families()[name]


def _families():
    from transformers import (
        Gemma3TextConfig,
        GptOssConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    moe = {"num_experts_per_tok": 2}
    return {
        "qwen3": (Qwen3Config, {"head_dim": 16}),
        "qwen3_moe": (
            Qwen3MoeConfig,
            {"head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32, "mlp_only_layers": [1], **moe},
        ),
        "mixtral": (MixtralConfig, {"num_local_experts": 4, "sliding_window": None, **moe}),
        "mistral_window": (MistralConfig, {"sliding_window": WINDOW}),
        "gemma3": (
            Gemma3TextConfig,
            {
                "head_dim": 16,
                "sliding_window": WINDOW,
                "layer_types": LAYER_TYPES,
                "query_pre_attn_scalar": 24,
                "tie_word_embeddings": True,
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                },
            },
        ),
        "gpt_oss": (
            GptOssConfig,
            {
                "head_dim": 16,
                "num_local_experts": 4,
                "sliding_window": WINDOW,
                "layer_types": LAYER_TYPES,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 128,
                    "rope_theta": 150000.0,
                },
                **moe,
            },
        ),
        "phi3": (
            Phi3Config,
            {
                "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 256,
                "rope_scaling": {
                    "rope_type": "longrope",
                    "short_factor": [1.0, 1.1, 1.3, 1.7],
                    "long_factor": [2.0, 3.0, 4.0, 5.0],
                },
            },
        ),
    }


def save_family(name: str, path: Path, tokenizer_dir: Path) -> Path:
    """Save family `name`'s tiny model (seed 0; learned sinks drawn from N(0, 1)) and the tokenizer
    of `tokenizer_dir` into `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls, overrides = family_config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**COMMON, **overrides}), dtype=torch.float32)
    with torch.no_grad():  # random sinks (their init is zeros-like small values)
        for n, p in model.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0, 1.0)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path
