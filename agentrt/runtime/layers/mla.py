"""Multi-head latent attention (MLA: DeepSeek-V2, arXiv 2405.04434; DeepSeek-V3, Kimi K2), with the
compressed latent cached instead of full K/V and the up-projections absorbed (the decode form of
vLLM's `MLACommonImpl` and SGLang's `forward_absorb`), for prefill and decode alike.

Per token: q from the hidden state, through a low-rank pair (q_a_proj -> RMSNorm -> q_b_proj) or one
q_proj, [H, nope + rope] per head; kv_a_proj_with_mqa gives the latent c [R] (RMSNormed) and one
decoupled RoPE key k_pe [rope] that every head shares. transformers (`modeling_deepseek_v3.py`)
expands c through kv_b_proj into per-head k_nope [H, nope] and v [H, v_head]; here kv_b_proj's two
halves are absorbed instead:

    q_nope . k_nope = q_nope . (W_UK c) = (W_UK^T q_nope) . c        W_UK [H, nope, R]
    out_h = sum_j p_hj (W_UV c_j) = W_UV (sum_j p_hj c_j)            W_UV [H, v_head, R]

so attention is multi-query attention (one KV head) over cached rows [k_pe | c] of rope + R
features, the query of head h being [q_pe_h | W_UK_h^T q_nope_h], the value the row's c (the cached
K's last R features, `ForwardMeta.attend(value_dim=R)`: no V cache), and W_UV lifts each head's
output before o_proj. The rows hold the RoPE key first so that the backends' partial rotary (the
first rotary_dim features) rotates it. The
softmax scale stays the reference's (nope + rope) ** -0.5, times DeepSeek's YaRN mscale squared.

The pool holds one CacheSpec(1, rope + R, 0) per layer: (R + rope) x dtype bytes per token and
layer (DeepSeek V3: 576 values, against 2 x 128 heads x 192 for full K/V).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, ForwardMeta, LayerOps
from agentrt.runtime.kv_cache import CacheSpec
from agentrt.runtime.layers.norm import RMSNorm

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm without the config's eps


@dataclass(frozen=True)
class MLAConfig:
    """The latent attention's shapes (config.json names): q_lora_rank None = one q_proj;
    kv_lora_rank R: the cached latent's width; qk_nope_head_dim / qk_rope_head_dim: each query and
    key head's parts without and with RoPE; v_head_dim: each value head; rope_interleave: the
    checkpoint's RoPE pairs are adjacent features (x0, x1), (x2, x3) ... (DeepSeek's layout), else
    the two halves; attention_bias: biases on q_a_proj, kv_a_proj_with_mqa and o_proj."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the RoPE key and the latent."""
        return self.qk_rope_head_dim + self.kv_lora_rank

    def cache_spec(self) -> CacheSpec:
        """One KV head of latent_dim features in K, no V cache."""
        return CacheSpec(1, self.latent_dim, 0)

    def describe_kv(self, num_layers: int, num_heads: int, dtype: torch.dtype) -> str:
        """What the pool holds per token, against full K/V (each head's nope + rope key and v_head
        value per layer, the cache an un-absorbed MLA would keep), at `dtype` (an int8 pool's
        scales counted): for the start line and `agentrt check`."""
        latent = num_layers * self.cache_spec().row_bytes(dtype)
        full = num_layers * CacheSpec(num_heads, self.qk_head_dim, self.v_head_dim).row_bytes(dtype)
        return (
            f"multi-head latent attention: {self.latent_dim} values per token and layer (kv_lora_rank "
            f"{self.kv_lora_rank} + RoPE key {self.qk_rope_head_dim}), {latent:,} bytes/token; full K/V "
            f"would take {full:,} ({full / latent:.1f}x)"
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (Peng et al. 2023, as DeepSeek writes it): 0.1 * mscale *
    ln(factor) + 1 for factor > 1, else 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope_parameters: dict | None) -> float:
    """qk_head_dim ** -0.5, times yarn_mscale(factor, mscale_all_dim) ** 2 under a YaRN RoPE with
    `mscale_all_dim` (DeepSeek V3 scales every feature's logit, not only the rotated ones:
    transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim**-0.5
    params = rope_parameters or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2n] with RoPE pairs (x0, x1), (x2, x3) ... -> [x0, x2, ..., x1, x3, ...]: the layout
    layers/rotary.apply_rope rotates (transformers' `apply_rotary_pos_emb_interleave` output)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentUp(nn.Module):
    """kv_b_proj's weight [H * (nope + v_head), R] (the checkpoint's), read as the two absorbed
    matrices: w_uk [H, nope, R] (the keys' up-projection) and w_uv [H, v_head, R] (the values').
    Not an nn.Linear: it never multiplies the latent, so the weight quantizers leave it dense."""

    def __init__(self, num_heads: int, nope: int, v_head: int, rank: int):
        super().__init__()
        self.num_heads, self.nope, self.v_head = num_heads, nope, v_head
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + v_head), rank))

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_uk [H, nope, R], w_uv [H, v_head, R]): views of the weight."""
        w = self.weight.view(self.num_heads, self.nope + self.v_head, -1)
        return w[:, : self.nope], w[:, self.nope :]


class MultiHeadLatentAttention(nn.Module):
    """forward(x [T, hidden], k_cache [S, 1, rope + R], v_cache [S, 1, 0], meta, rope) -> [T, hidden],
    as layers/attention.Attention's: the caches are one layer's pool tensors (or an int8 pool's
    kv_cache.QuantizedKV, one scale per cached row), rope the layer's (cos, sin) tables
    [max_positions, rope // 2] float32, None = the model's first. Checkpoint names as transformers'
    DeepseekV3Attention (q_proj or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, cfg: MLAConfig, hidden: int, num_heads: int, scale: float, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.cfg, self.num_heads, self.scale = cfg, num_heads, scale
        qk, bias = cfg.qk_head_dim, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, ops=ops)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, ops=ops)
        self.kv_b_proj = LatentUp(num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        self.o_proj = nn.Linear(num_heads * cfg.v_head_dim, hidden, bias=bias)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> q [T, H, nope + rope] (nope features first, as the checkpoint's)."""
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.cfg.qk_head_dim)

    def latent_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the rows to cache before RoPE, [T, rope + R]: the RoPE key (pairs
        de-interleaved) then the normed latent."""
        cfg = self.cfg
        c, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        if cfg.rope_interleave:
            k_pe = deinterleave(k_pe)
        return torch.cat((k_pe, self.kv_a_layernorm(c)), dim=-1)

    def forward(self, x, k_cache, v_cache, meta: ForwardMeta, rope=None) -> torch.Tensor:
        cfg, t, h = self.cfg, x.shape[0], self.num_heads
        w_uk, w_uv = self.kv_b_proj.split()
        q_nope, q_pe = self.query(x).split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        if cfg.rope_interleave:
            q_pe = deinterleave(q_pe)
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # W_UK absorbed into the query
        qkv = torch.cat((torch.cat((q_pe, q_latent), dim=-1).reshape(t, -1), self.latent_rows(x)), dim=-1)
        # one KV head of rope + R features, RoPE on the first `rope` of q's and k's; no V written
        q, k, _ = meta.rope_and_store(qkv, (h, 1, cfg.latent_dim), k_cache, v_cache, rope, v_dim=0)
        # V: each cached row's last R features (the latent); out [T, H, R]
        out = meta.attend(q, k, None, k_cache, None, scale=self.scale, value_dim=cfg.kv_lora_rank)
        out = torch.einsum("thr,hvr->thv", out, w_uv)  # W_UV lifts each head's latent output
        return self.o_proj(out.reshape(t, h * cfg.v_head_dim))
