"""Multi-head latent attention (layers/mla.py) against transformers' DeepseekV3Attention on the same
random weights: the absorbed form over the cached latent through the torch backend's metadata
(prefill, a chunk on top of the cache, decodes, and a decode batched with another sequence's
prefill), with and without the q LoRA, interleaved RoPE pairs or not, the C++ kernels' metadata or
not; and the pool holds the latent only."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.backends.torch_attention import build_torch_metadata
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kv_cache import KVPool, QuantizedKV
from agentrt.runtime.layers.mla import MLAConfig, MultiHeadLatentAttention, mla_softmax_scale
from agentrt.runtime.layers.rotary import rope_spec, rope_tables

HIDDEN, HEADS, RANK, NOPE, ROPE, V_HEAD = 64, 4, 32, 16, 8, 12
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def hf_config(q_lora_rank, interleave: bool):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=RANK,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V_HEAD,
        max_position_embeddings=128,
        rope_interleave=interleave,
        rope_parameters=dict(YARN),
    )
    cfg._attn_implementation = "eager"
    return cfg


def layers(q_lora_rank, interleave: bool):
    """(transformers' attention, its rotary embedding, ours with the same weights, our (cos, sin) tables)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    cfg = hf_config(q_lora_rank, interleave)
    torch.manual_seed(0)
    hf = DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    mla = MLAConfig(q_lora_rank, RANK, NOPE, ROPE, V_HEAD, interleave)
    ours = MultiHeadLatentAttention(mla, HIDDEN, HEADS, mla_softmax_scale(NOPE + ROPE, cfg.rope_parameters))
    ours.load_state_dict(hf.state_dict())  # the checkpoint's names, strict
    assert ours.scale == pytest.approx(hf.scaling, rel=1e-12)  # mscale**2 folded in, as transformers'
    tables = rope_tables(rope_spec(cfg, ROPE), 128, torch.device("cpu"))
    return hf, DeepseekV3RotaryEmbedding(cfg), ours, tables


def reference(hf, rotary, x: torch.Tensor) -> torch.Tensor:
    """transformers' causal attention over x [n, hidden] -> [n, hidden]."""
    n = x.shape[0]
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return hf(x[None], rotary(x[None], pos), mask)[0][0]


def step(ours, tables, pool, chunks, x, cpu_kernel=False) -> torch.Tensor:
    batch = build_torch_metadata(chunks, torch.device("cpu"), cpu_kernel=cpu_kernel)
    batch.meta.prepare_rope(batch.positions, *tables, x.dtype)
    with torch.no_grad():
        return ours(x, pool.k[0], pool.v[0], batch.meta)


@pytest.mark.parametrize("cpu_kernel", [False, True])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_latent_attention_matches_transformers(q_lora_rank, interleave, cpu_kernel):
    hf, rotary, ours, tables = layers(q_lora_rank, interleave)
    pool = KVPool(
        [MLAConfig(q_lora_rank, RANK, NOPE, ROPE, V_HEAD).cache_spec()], torch.float32, "cpu", 1 << 20
    )
    torch.manual_seed(1)
    xa, xb = torch.randn(40, HIDDEN), torch.randn(12, HIDDEN)
    ref_a, ref_b = reference(hf, rotary, xa), reference(hf, rotary, xb)
    sa, sb = pool.allocate(40), pool.allocate(12)

    def chunk(start, end, slots):
        return SeqChunk([0] * (end - start), start, slots[:end])

    got = [step(ours, tables, pool, [chunk(0, 20, sa)], xa[:20], cpu_kernel)]  # prefill
    got.append(step(ours, tables, pool, [chunk(20, 30, sa)], xa[20:30], cpu_kernel))  # a chunk on the cache
    mixed = step(
        ours, tables, pool, [chunk(30, 31, sa), chunk(0, 12, sb)], torch.cat((xa[30:31], xb)), cpu_kernel
    )
    got.append(mixed[:1])  # a decode batched with another sequence's prefill
    for i in range(31, 40):  # decodes
        got.append(step(ours, tables, pool, [chunk(i, i + 1, sa)], xa[i : i + 1], cpu_kernel))
    tol = 1e-5
    scale = ref_a.abs().max().item()
    assert (torch.cat(got) - ref_a).abs().max().item() < tol * scale
    assert (mixed[1:] - ref_b).abs().max().item() < tol * scale


def test_the_pool_holds_the_normed_latent_and_the_rotated_rope_key_only():
    hf, _, ours, tables = layers(24, True)
    spec = MLAConfig(24, RANK, NOPE, ROPE, V_HEAD).cache_spec()
    assert (spec.num_kv_heads, spec.k_dim, spec.v_dim) == (1, ROPE + RANK, 0)
    assert spec.row_bytes(torch.bfloat16) == (ROPE + RANK) * 2  # against 2 x 4 heads x 28 full K/V
    pool = KVPool([spec], torch.float32, "cpu", 1 << 20)
    assert pool.v[0].shape == (pool.num_slots, 1, 0)
    torch.manual_seed(1)
    x = torch.randn(9, HIDDEN)
    slots = pool.allocate(9)
    step(ours, tables, pool, [SeqChunk([0] * 9, 0, slots)], x)
    cached = pool.k[0][slots, 0]
    with torch.no_grad():
        c, k_pe = hf.kv_a_proj_with_mqa(x).split([RANK, ROPE], dim=-1)
        latent = hf.kv_a_layernorm(c)
    assert torch.equal(cached[:, ROPE:], latent)  # the compressed latent, as the reference caches it
    assert not torch.allclose(cached[1:, :ROPE].abs().sum(-1), k_pe[1:].abs().sum(-1))  # rotated


def test_an_int8_pool_quantizes_each_latent_row_with_one_scale():
    """The same steps over an int8 pool: one absmax scale per cached row [k_pe | c], the values read
    back from the de-quantized row. Measured here: max error 3-6% of the largest output (the RoPE key's
    larger values set the scale; the latent's relative error is ~3%, the key's ~0.4%)."""
    hf, rotary, ours, tables = layers(24, True)
    pool = KVPool([MLAConfig(24, RANK, NOPE, ROPE, V_HEAD).cache_spec()], torch.int8, "cpu", 1 << 20)
    assert isinstance(pool.k[0], QuantizedKV) and pool.v[0].data.shape[-1] == 0
    torch.manual_seed(1)
    x = torch.randn(24, HIDDEN)
    ref = reference(hf, rotary, x)
    slots = pool.allocate(24)
    got = [step(ours, tables, pool, [SeqChunk([0] * 16, 0, slots[:16])], x[:16])]
    for i in range(16, 24):
        got.append(step(ours, tables, pool, [SeqChunk([0], i, slots[: i + 1])], x[i : i + 1]))
    assert (pool.k[0].scale[slots] > 0).all()
    assert (torch.cat(got)[15:] - ref[15:]).abs().max().item() < 0.1 * ref.abs().max().item()


def test_heads_folded_over_the_one_kv_head_match_sdpa_in_any_grouping(monkeypatch):
    """The torch backend's MQA path (heads folded into the query rows, in groups that bound the
    folded mask) against SDPA's own grouped-query attention, with a causal chunk over a context."""
    import agentrt.runtime.backends.torch_attention as ta

    torch.manual_seed(2)
    q, k = torch.randn(2, 6, 5, 40), torch.randn(2, 1, 9, 40)
    v = k[..., 8:]
    mask = torch.arange(9)[None, :] <= torch.arange(4, 9)[:, None]  # 5 new tokens after 4 cached
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3
    )
    for limit in (1 << 24, 2 * 5 * 9, 1):  # one group, groups of 2 heads, one head at a time
        monkeypatch.setattr(ta, "MQA_MASK_ELEMENTS", limit)
        assert torch.allclose(ta._sdpa_one_kv_head(q, k, v, mask, 0.3), want, atol=1e-6)
    causal = torch.nn.functional.scaled_dot_product_attention(
        q[..., :5, :], k[..., :5, :], v[..., :5, :], is_causal=True, enable_gqa=True, scale=0.3
    )
    assert torch.allclose(ta._sdpa_one_kv_head(q, k[..., :5, :], v[..., :5, :], None, 0.3), causal, atol=1e-6)
