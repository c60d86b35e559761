"""The tiny random-weight model of each supported family, built from transformers' own config and
model classes (3 layers, Gemma 4's 4, hidden 64, sliding windows of 24 tokens, 4 experts top-2) and
saved as a Hugging Face directory with the default model's tokenizer."""

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
NO_SPECIAL_IDS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}  # defaults past 49152
GLM4_MOE = {  # layer 0 dense; 8 experts in 4 groups, the best 2 groups eligible; partial rotary 0.5
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "use_qk_norm": True,
    "attention_bias": True,
}
GEMMA4 = {  # both layer types KV-shared (layers 2, 3 read 0, 1), full layers wider with keys as values
    "num_hidden_layers": 4,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "sliding_window": WINDOW,
    "layer_types": [*LAYER_TYPES[:2]] * 2,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": True,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 49152,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}
GEMMA4_MOE = {  # the 26B-A4B layout: a MoE block beside every dense MLP, no PLE, no KV sharing
    **GEMMA4,
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
}


HYBRID = {  # Gated DeltaNet + gated attention (Qwen3-Next, Qwen3.5): 2 linear-attention layers
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "partial_rotary_factor": 0.5,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
HYBRID_MOE = {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}

GRANITE4 = {  # Mamba-2 (4 heads of 32, 2 groups, state 16) + attention; 4 experts top-2 (width 32)
    # beside a shared MLP of 48; RoPE; every Granite multiplier away from 1
    "layer_types": ["mamba", "attention", "mamba"],
    "intermediate_size": 32,
    "mamba_n_heads": 4,
    "mamba_d_state": 16,
    "mamba_n_groups": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "shared_intermediate_size": 48,
    "position_embedding_type": "rope",
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.0625,
    "logits_scaling": 0.5,  # a divisor below 1: logits of ~10, so 1e-4 is a tight bound
}
GRANITE4_DENSE = {  # the dense Granite 4.0 layout: no experts (the shared MLP alone), NoPE
    **GRANITE4,
    "layer_types": ["attention", "mamba", "mamba"],
    "num_local_experts": 0,
    "position_embedding_type": "nope",
}

NEMOTRON_H = {  # one block per layer: Mamba-2 (4 heads of 16, 2 groups, state 16), MoE (8 squared-ReLU
    # experts in 2 groups, 1 eligible, top-2, + a shared one), attention (NoPE), MLP, Mamba-2 (a Mamba-2
    # block first: transformers' cache reads the sequence length from block 0)
    "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention"],
    "head_dim": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 48,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
}

DEEPSEEK_V3 = {  # latent attention (q LoRA 24, latent 32, keys 16 + 8 rotated, values 12) with YaRN's
    # mscale on the softmax scale; layer 0 dense, then 8 experts in 2 groups (1 eligible), 1 shared
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
}


def family_config(name: str):
    """(transformers config class, overrides of COMMON) of family `name`."""
    return _families()[name]


def _families():
    from transformers import (
        DeepseekV3Config,
        Gemma3TextConfig,
        Gemma4TextConfig,
        Glm4MoeConfig,
        GptOssConfig,
        GraniteMoeHybridConfig,
        MiniMaxM2Config,
        MistralConfig,
        MixtralConfig,
        NemotronHConfig,
        Phi3Config,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
        SmolLM3Config,
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
        "gemma4": (Gemma4TextConfig, GEMMA4),
        "gemma4_moe": (Gemma4TextConfig, GEMMA4_MOE),
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
        "glm4_moe": (Glm4MoeConfig, GLM4_MOE),
        "qwen3_next": (Qwen3NextConfig, {**HYBRID, **HYBRID_MOE, "mlp_only_layers": [1], **moe}),
        "qwen3_5": (Qwen3_5TextConfig, HYBRID),
        "minimax_m2": (
            MiniMaxM2Config,
            {
                "head_dim": 16,
                "num_local_experts": 8,
                "intermediate_size": 32,
                "rotary_dim": 8,
                **moe,
                **NO_SPECIAL_IDS,
            },
        ),
        "smollm3": (
            SmolLM3Config,
            {"no_rope_layers": [1, 0, 1], "attention_bias": True, **NO_SPECIAL_IDS},
        ),
        "deepseek_v3": (DeepseekV3Config, DEEPSEEK_V3),
        "granite4": (GraniteMoeHybridConfig, GRANITE4),
        "granite4_dense": (GraniteMoeHybridConfig, GRANITE4_DENSE),
        "nemotron_h": (NemotronHConfig, NEMOTRON_H),
        "deepseek_v3_q_proj": (
            DeepseekV3Config,
            {**DEEPSEEK_V3, "q_lora_rank": None, "rope_interleave": False},
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
    """Save family `name`'s tiny model (seed 0; learned sinks drawn from N(0, 1) and MoE
    correction biases from N(0, 0.5); Gemma 4's norm weights, layer scalars and router scales, ones
    at init, from U(0.5, 1.5)) and the tokenizer of `tokenizer_dir` into `path`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls, overrides = family_config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**COMMON, **overrides}), dtype=torch.float32)
    with torch.no_grad():  # random sinks (their init is zeros-like small values)
        for n, p in model.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0, 1.0)
        for n, b in model.named_buffers():  # zeros at init: drawn so that the choice it steers shows
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
        if name.startswith(("gemma4", "qwen3_next", "qwen3_5")):  # a norm read as 1 + w, a scale dropped
            for n, t in [*model.named_parameters(), *model.named_buffers()]:
                if n.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", "layer_scalar", "scale")):
                    t.uniform_(0.5, 1.5)
        if name.startswith(("granite4", "nemotron_h")):  # norms, the Mamba skip D (and dt bias): ones
            for n, t in model.named_parameters():
                if n.endswith(("norm.weight", ".D")) or (name != "nemotron_h" and n.endswith(".dt_bias")):
                    t.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))
    return path
