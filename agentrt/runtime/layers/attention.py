"""The attention layer: fused QKV projection (with or without bias), optional per-head q/k RMSNorm
(Qwen3, Gemma 3), rotary embedding, a write of K/V to the token-slot pool, and attention with this
layer's own scale, sliding window and learned sinks (`meta.attend`: runtime/attention.py on the CPU,
runtime/triton_attention.py on CUDA), then the output projection. Grouped-query attention (Ainslie
et al. 2023): query head h reads KV head h // (H / Hkv)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from agentrt.runtime.attention import kernel_cache
from agentrt.runtime.kernels import cpu_kernels
from agentrt.runtime.layers.norm import RMSNorm


@dataclass(frozen=True)
class AttentionConfig:
    """scale: the softmax scale (head_dim ** -0.5 unless the family says otherwise); window: a query
    at position p attends keys in (p - window, p], None = all; sinks: one learned logit per query
    head joins the softmax (gpt-oss); qk_norm: RMSNorm over head_dim on q and k before RoPE."""

    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-6
    norm_cast_last: bool = False
    window: int | None = None
    sinks: bool = False


class Attention(nn.Module):
    """forward(x [T, hidden], k_cache, v_cache [S, Hkv, D], meta, rope) -> [T, hidden]; the caches are
    tensors, or an int8 pool's kv_cache.QuantizedKV (written quantized, read de-quantized on load);
    rope: the layer's (cos, sin) tables [max_positions, rotary_dim // 2] float32, None = the model's
    first."""

    def __init__(self, cfg: AttentionConfig):
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale, self.window = cfg.scale, cfg.window
        self.qkv_proj = nn.Linear(cfg.hidden, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_cast_last)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, cfg.norm_cast_last)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.sinks else None

    def forward(self, x, k_cache, v_cache, meta, rope=None) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        fused = getattr(meta, "ops_fused", False)
        cos, sin = meta.rope_rows(rope) if fused else (None, None)
        if fused and 2 * cos.shape[-1] == self.head_dim and kernel_cache(k_cache):
            if self.cfg.qk_norm:  # norm each head of q and k in place, then the one op below
                q_end, k_end = self.q_size, self.q_size + self.kv_size
                qkv[:, :q_end] = self.q_norm.forward_fused(qkv[:, :q_end], True)
                qkv[:, q_end:k_end] = self.k_norm.forward_fused(qkv[:, q_end:k_end], True)
            # rotate q and k, write k and v to the pool (float32, or quantized to int8): one C++ op
            q, k = cpu_kernels.rope_store(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, self.num_heads)
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(t, self.num_heads, self.head_dim)
            k = k.reshape(t, self.num_kv_heads, self.head_dim)
            v = v.reshape(t, self.num_kv_heads, self.head_dim)
            if self.cfg.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = meta.rope_and_store(q, k, v, k_cache, v_cache, rope)
        out = meta.attend(q, k, v, k_cache, v_cache, scale=self.scale, window=self.window, sinks=self.sinks)
        return self.o_proj(out.reshape(t, self.q_size))
