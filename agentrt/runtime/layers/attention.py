"""The attention layer: fused QKV projection (with or without bias), optional per-head q/k RMSNorm
(Qwen3, Gemma 3), rotary embedding, a write of K/V to the token-slot pool, and attention with this
layer's own scale, sliding window and learned sinks (`meta.rope_and_store`, `meta.attend`: the
forward's backend, runtime/backends/), then the output projection. Grouped-query attention (Ainslie
et al. 2023): query head h reads KV head h // (H / Hkv)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, ForwardMeta, LayerOps
from agentrt.runtime.layers.norm import RMSNorm


@dataclass(frozen=True)
class AttentionConfig:
    """scale: the softmax scale (head_dim ** -0.5 unless the family says otherwise); window: a query
    at position p attends keys in (p - window, p], None = all; sinks: one learned logit per query
    head joins the softmax (gpt-oss); qk_norm: RMSNorm over head_dim on q and k before RoPE, or with
    qk_norm_full over the whole q and k projections (all heads at once, MiniMax M2); output_gate:
    q_proj also projects a gate per head (each head's rows [q (D), gate (D)], as checkpoints store
    them) and the attention output is multiplied by sigmoid(gate) before o_proj (Qwen3-Next)."""

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
    qk_norm_full: bool = False
    output_gate: bool = False


class Attention(nn.Module):
    """forward(x [T, hidden], k_cache, v_cache [S, Hkv, D], meta, rope) -> [T, hidden]; the caches are
    tensors, or an int8 pool's kv_cache.QuantizedKV (written quantized, read de-quantized on load);
    rope: the layer's (cos, sin) tables [max_positions, rotary_dim // 2] float32, None = the model's
    first. ops: the run's element-wise ops (the q/k norms')."""

    def __init__(self, cfg: AttentionConfig, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale, self.window = cfg.scale, cfg.window
        q_rows = 2 * self.q_size if cfg.output_gate else self.q_size
        self.qkv_proj = nn.Linear(cfg.hidden, q_rows + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden, bias=cfg.o_bias)
        if cfg.qk_norm:
            q_dim, k_dim = (self.q_size, self.kv_size) if cfg.qk_norm_full else (cfg.head_dim, cfg.head_dim)
            self.q_norm = RMSNorm(q_dim, cfg.norm_eps, cfg.norm_cast_last, ops)
            self.k_norm = RMSNorm(k_dim, cfg.norm_eps, cfg.norm_cast_last, ops)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.sinks else None

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the fused projection [T, (H + 2 Hkv) D], each head of q and k normed
        (qk_norm), or q and k each as a whole (qk_norm_full)."""
        return self.qkv_and_gate(x)[0]

    def qkv_and_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] -> (qkv as `qkv` gives it, the output gate's logits [T, H D] or None)."""
        qkv, gate = self.qkv_proj(x), None
        if self.cfg.output_gate:
            t, d = qkv.shape[0], self.head_dim
            qg = qkv[:, : 2 * self.q_size].view(t, self.num_heads, 2 * d)
            gate = qg[..., d:].reshape(t, self.q_size)
            qkv = torch.cat((qg[..., :d].reshape(t, self.q_size), qkv[:, 2 * self.q_size :]), dim=1)
        if self.cfg.qk_norm:  # in place
            q_end, k_end = self.q_size, self.q_size + self.kv_size
            qkv[:, :q_end] = self.q_norm(qkv[:, :q_end])
            qkv[:, q_end:k_end] = self.k_norm(qkv[:, q_end:k_end])
        return qkv, gate

    def forward(self, x, k_cache, v_cache, meta: ForwardMeta, rope=None) -> torch.Tensor:
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        qkv, gate = self.qkv_and_gate(x)
        q, k, v = meta.rope_and_store(qkv, heads, k_cache, v_cache, rope)
        out = meta.attend(q, k, v, k_cache, v_cache, scale=self.scale, window=self.window, sinks=self.sinks)
        out = out.reshape(x.shape[0], self.q_size)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))
