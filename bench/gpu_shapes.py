"""Model shapes for bench/gpu.py: random-weight Llama-3.1-8B and Qwen2.5-0.5B architectures (from
their Hugging Face config.json files, rebuilt with transformers' config classes) and a tiny shape
for the CPU smoke run."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import LlamaConfig, Qwen2Config

from agentrt.runtime.models.registry import arch_from_hf_config

SHAPES = {
    "llama-3.1-8b": arch_from_hf_config(
        LlamaConfig(
            architectures=["LlamaForCausalLM"],
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_scaling={
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
                "rope_theta": 500000.0,
            },
            max_position_embeddings=131072,
            tie_word_embeddings=False,
        )
    ),
    "qwen2.5-0.5b": arch_from_hf_config(
        Qwen2Config(
            architectures=["Qwen2ForCausalLM"],
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        )
    ),
    "tiny": arch_from_hf_config(  # CPU smoke run only
        Qwen2Config(
            architectures=["Qwen2ForCausalLM"],
            vocab_size=4096,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    ),
}
