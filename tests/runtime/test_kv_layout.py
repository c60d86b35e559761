"""The KV layout (ModelArch.kv_layout): caches of different shapes, layers without KV and layers
that share a cache, as the pool, the memory estimate and the model's forward see them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agentrt.runtime.kv_cache import CacheSpec, KVPool, uniform_layout
from agentrt.runtime.layers.rotary import RopeSpec
from agentrt.runtime.models.check_memory import kv_estimate
from agentrt.runtime.models.config import ModelArch


def _arch(**kw) -> ModelArch:
    base = {
        "architecture": "LlamaForCausalLM",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "ropes": (RopeSpec((1.0, 0.01)),),
        "layer_rope": (0, 0, 0, 0),
        "layer_windows": (None, None, None, None),
    }
    base.update(kw)
    return ModelArch(**base)


def test_the_default_layout_is_one_llama_cache_per_layer():
    arch = _arch()
    specs, caches = arch.kv_layout()
    assert specs == uniform_layout(4, 2, 4) and caches == (0, 1, 2, 3)
    assert arch.uniform_kv and "kv_layout" not in arch.layout_features()


def test_a_pool_of_mixed_caches_holds_each_shape_and_counts_its_bytes():
    layout = [CacheSpec(2, 4, 4), CacheSpec(1, 12, 0), CacheSpec(4, 8, 8)]
    pool = KVPool(layout, torch.float32, torch.device("cpu"), 1 << 16)
    assert [tuple(k.shape[1:]) for k in pool.k] == [(2, 4), (1, 12), (4, 8)]
    assert [tuple(v.shape[1:]) for v in pool.v] == [(2, 4), (1, 0), (4, 8)]
    assert pool.bytes_per_token == 4 * (2 * 2 * 4 + 12 + 2 * 4 * 8)
    assert pool.num_slots == (1 << 16) // pool.bytes_per_token
    int8 = KVPool(layout, torch.int8, torch.device("cpu"), 1 << 16)  # one float32 scale per row
    assert int8.bytes_per_token == 2 * 2 * (4 + 4) + (12 + 4) + 2 * 4 * (8 + 4)


def test_layers_without_kv_and_shared_caches_are_counted_once():
    """A hybrid layout: layers 0 and 2 keep no KV (linear attention), 3 reads layer 1's cache."""
    arch = _arch(cache_specs=(CacheSpec(2, 4, 4),), layer_cache=(None, 0, None, 0))
    assert not arch.uniform_kv and "kv_layout" in arch.layout_features()
    kv = kv_estimate(arch, torch.float32)
    assert (kv.num_layers, kv.full_layers, kv.pool_bytes_per_token) == (1, 1, 2 * 2 * 4 * 4)
    mixed = _arch(
        cache_specs=(CacheSpec(2, 4, 4), CacheSpec(1, 8, 8)),
        layer_cache=(0, 1, 0, 1),
        layer_windows=(16, None, 16, None),
    )
    kv = kv_estimate(mixed, torch.float32)
    assert kv.windows == ((16, 1),) and kv.layer_bytes == 2 * 2 * 4 * 4
    assert kv.full_bytes_per_token == 2 * 8 * 4
    assert kv.pool_bytes_per_token == 2 * 2 * 4 * 4 + 2 * 8 * 4
    assert kv.sequence_bytes(100) == 2 * 8 * 4 * 100 + 2 * 2 * 4 * 4 * 16


def test_the_model_hands_each_layer_its_cache(monkeypatch):
    """DecoderModel.forward gives layer i the caches of layer_cache[i] (None, None for no KV)."""
    from agentrt.runtime.models.base import DecoderLayer
    from agentrt.runtime.models.registry import build_model

    arch = _arch(cache_specs=(CacheSpec(2, 4, 4),) * 2, layer_cache=(None, 0, 1, 0))
    model = build_model(arch, 64)
    seen = []

    def spy(self, x, residual, k_cache, v_cache, meta, rope=None):
        seen.append(None if k_cache is None else int(k_cache[0, 0, 0]))
        return x, x if residual is None else residual

    monkeypatch.setattr(DecoderLayer, "forward", spy)

    class Meta:
        def prepare_rope(self, *a):
            pass

        def layer_view(self, window):
            return self

    k = [torch.full((3, 2, 4), float(i)) for i in range(2)]
    model(torch.tensor([1]), torch.tensor([0]), k, k, Meta())
    assert seen == [None, 0, 1, 0]


@pytest.mark.parametrize("field", ["cache_specs", "layer_cache"])
def test_the_arch_stays_frozen(field):
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(_arch(), field, ())
