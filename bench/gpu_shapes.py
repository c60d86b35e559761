"""Model shapes for bench/gpu.py: random-weight Llama-3.1-8B and Qwen2.5-0.5B architectures (from
their Hugging Face config.json files) and a tiny shape for the CPU smoke run."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentrt.runtime.models.llama import LlamaArch

SHAPES = {
    "llama-3.1-8b": LlamaArch(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=(
            ("factor", 8.0),
            ("high_freq_factor", 4.0),
            ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 8192),
            ("rope_type", "llama3"),
        ),
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        qkv_bias=False,
        mlp_bias=False,
    ),
    "qwen2.5-0.5b": LlamaArch(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling=(("rope_type", "default"),),
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        qkv_bias=True,
        mlp_bias=False,
    ),
    "tiny": LlamaArch(  # CPU smoke run only
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=(("rope_type", "default"),),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        qkv_bias=True,
        mlp_bias=False,
    ),
}
