"""gpt-oss: alternating banded (sliding-window) and full attention layers, learned attention sinks,
biases on every attention projection, a MoE MLP in every layer (router with a bias, softmax over the
top-k logits, experts with biases and the clamped SwiGLU), YaRN RoPE (transformers
`modeling_gpt_oss.py`; vLLM `gpt_oss.py`). Checkpoints stack the experts as [E, H, 2I] with gate and
up interleaved along the last dimension; `split_experts` turns them into per-expert linear layers
[2I, H] (gate rows, then up rows). The MXFP4 checkpoints as released store those two stacked tensors
as `_blocks` / `_scales`: the loader de-quantizes them into this same [E, H, 2I] layout
(checkpoint_quant.py) before `split_experts` sees them."""

from __future__ import annotations

import re

import torch

from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch, base_arch


class GptOssForCausalLM(DecoderModel):
    mxfp4_experts = True  # MXFP4 expert blocks de-quantize into this family's stacked layout

    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:
        return base_arch(
            cfg,
            architecture,
            qkv_bias=True,
            o_bias=True,
            attn_sinks=True,
            num_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.intermediate_size,
            moe_layers=(True,) * cfg.num_hidden_layers,
            moe_routing="topk_softmax",
            router_bias=True,
            expert_act="swiglu_clamp",
            expert_bias=True,
            swiglu_limit=float(cfg.swiglu_limit),
        )

    @classmethod
    def rename(cls, name: str) -> str:
        return name.replace(".mlp.router.", ".mlp.gate.")

    @classmethod
    def split_experts(cls, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?", name)
        if m is None:
            return None
        out = []
        for e in range(value.shape[0]):
            # weights [in, out] -> [out, in] as a view (laid out so already where MXFP4 was de-quantized:
            # rows are then taken, not transposed); biases [out]
            w = value[e] if m[3] else value[e].t()
            if m[2] == "gate_up_proj":  # 2I interleaved gate, up -> gate rows, then up rows
                w = torch.cat((w[0::2], w[1::2]))
            kind = "bias" if m[3] else "weight"
            out.append((f"{m[1]}.{e}.{m[2]}.{kind}", w))
        return out
