"""Gemma 4 (text): the decoder of `Gemma4ForCausalLM` and the language model of
`Gemma4ForConditionalGeneration` (transformers `models/gemma4/modeling_gemma4.py`).

What differs from Gemma 3 (gemma3.py):
- RMSNorms scale by `w`, not `1 + w` (no offset at load); the values get an RMSNorm without a weight
  (`v_norm`) beside the q/k norms; the softmax scale is 1 (the q/k norms set the logits' size).
- Full-attention layers have their own head size and KV-head count (`per_layer_config`, or
  `global_head_dim` / `num_global_key_value_heads` in older configs), so the KV pool holds one
  CacheSpec per cache (`ModelArch.cache_specs`); with `attention_k_eq_v` they have no V projection:
  the values are the key projection (before k's norm and RoPE) through `v_norm`.
- KV sharing: the last `num_kv_shared_layers` layers have no K/V projections; each reads the cache
  of the last earlier layer of its own type (`ModelArch.layer_cache` names it twice) and writes
  none. Within one forward it attends to the K/V that layer wrote (transformers' `shared_kv_states`).
- Full-attention RoPE is `proportional`: the rotated frequencies of a `partial_rotary_factor` share of
  the head, padded with zero frequencies to the whole head (transformers' initialiser computes it).
- Per-layer embeddings (PLE, `hidden_size_per_layer_input` P > 0): a second embedding table
  [vocab_size_per_layer_input, layers x P] scaled by sqrt(P), plus a projection of the scaled token
  embeddings (x hidden ** -0.5, RMSNorm over P), summed and x 2 ** -0.5; after its MLP, layer i adds
  norm(W_up (gelu(W_gate x) * ple_i)) to the stream.
- Every layer ends by multiplying the stream by its learned `layer_scalar`.
- KV-shared layers' MLPs are twice as wide with `use_double_wide_mlp`.
- `enable_moe_block`: a sparse MoE beside the dense MLP in every layer (gemma4_moe.py).

Refused with a ValueError naming the config field: bidirectional attention over all tokens
(`use_bidirectional_attention: "all"`; "vision" is causal for text), attention biases, an activation
other than GELU-tanh, layer types other than sliding/full attention, every layer KV-shared, a
per-layer-embedding vocabulary smaller than the vocabulary. The vision and audio towers are not
loaded (text only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from numbers import Integral

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, ForwardMeta, LayerOps
from agentrt.runtime.kv_cache import CacheSpec
from agentrt.runtime.layers.mlp import GatedMLP
from agentrt.runtime.layers.norm import RMSNorm
from agentrt.runtime.layers.rotary import apply_rope, rope_spec
from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch, layer_windows
from agentrt.runtime.models.gemma4_moe import Gemma4MoE, rms_norm_unit

LAYER_TYPES = ("sliding_attention", "full_attention")
SKIPPED_TOWERS = ("vision_tower", "audio_tower", "embed_vision", "embed_audio")
ROUTER_NAMES = {
    "router.proj.": "gate.",
    "router.scale": "router_scale",
    "router.per_expert_scale": "per_expert_scale",
}


@dataclass(frozen=True)
class Gemma4Arch(ModelArch):
    """ModelArch plus Gemma 4's per-layer shapes. `layer_heads[i]` = (KV heads, head size) of layer
    i's attention; `layer_kv[i]`: "own" (q, k, v projections), "k_eq_v" (values from the key
    projection) or "shared" (q only; K/V of the cache `layer_cache[i]`, written by an earlier layer);
    `layer_intermediate[i]` its MLP width; `ple_dim` / `ple_vocab`: the per-layer embeddings' width
    and vocabulary (0: none)."""

    layer_heads: tuple[tuple[int, int], ...] = ()
    layer_kv: tuple[str, ...] = ()
    layer_intermediate: tuple[int, ...] = ()
    ple_dim: int = 0
    ple_vocab: int = 0

    def __post_init__(self) -> None:
        """Raises ValueError naming the config field when a layer's head counts imply no weights."""
        super().__post_init__()
        for i, (kv_heads, head_dim) in enumerate(self.layer_heads):
            for name, value in (("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
                if not isinstance(value, Integral) or value < 1:
                    raise ValueError(
                        f"config per_layer_config[{i}].{name} must be a positive integer, got {value!r}"
                    )
            if self.num_heads % kv_heads:
                raise ValueError(
                    f"config num_attention_heads ({self.num_heads}) must be a multiple of layer {i}'s "
                    f"num_key_value_heads ({kv_heads})"
                )

    def layout_features(self) -> frozenset[str]:
        """ModelArch's features plus Gemma 4's layer: the value norm and the layer scalar always, the
        per-layer embeddings and the key-as-value projection where used."""
        extra = {"v_norm", "layer_scalar"}
        if self.ple_dim:
            extra.add("per_layer_embeddings")
        if "k_eq_v" in self.layer_kv:
            extra.add("k_eq_v")
        return super().layout_features() | extra


class Gemma4Attention(nn.Module):
    """forward(x [T, hidden], k_cache, v_cache, meta, rope, shared, rows) -> (out [T, hidden], (k, v)):
    `qkv_proj` holds q, k and v rows ("own"), q and k ("k_eq_v": v is the key projection), or q only
    ("shared": k, v = `shared`, the K/V its cache's writer returned in this forward; q rotated here by
    `rows`, the layer's (cos, sin) [T, rotary_dim // 2] at this batch's positions; nothing written).
    The returned (k, v) are what `meta.rope_and_store` gave (or `shared`). Softmax scale 1."""

    def __init__(self, arch: Gemma4Arch, i: int, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.num_heads = arch.num_heads
        self.num_kv_heads, self.head_dim = arch.layer_heads[i]
        self.kv = arch.layer_kv[i]
        self.window = arch.layer_windows[i]
        self.eps = arch.rms_norm_eps
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        rows = self.q_size + {"own": 2, "k_eq_v": 1, "shared": 0}[self.kv] * self.kv_size
        self.qkv_proj = nn.Linear(arch.hidden_size, rows, bias=False)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, self.eps, True, ops)
        if self.kv != "shared":
            self.k_norm = RMSNorm(self.head_dim, self.eps, True, ops)

    def forward(self, x, k_cache, v_cache, meta: ForwardMeta, rope=None, shared=None, rows=None):
        t = x.shape[0]
        proj = self.qkv_proj(x)
        q = self.q_norm(proj[:, : self.q_size])
        if self.kv == "shared":
            q = apply_rope(q.view(t, self.num_heads, self.head_dim), *rows)
            k, v = shared
        else:
            k_raw = proj[:, self.q_size : self.q_size + self.kv_size]
            v_raw = k_raw if self.kv == "k_eq_v" else proj[:, self.q_size + self.kv_size :]
            qkv = torch.cat((q, self.k_norm(k_raw), rms_norm_unit(v_raw, self.head_dim, self.eps)), dim=-1)
            heads = (self.num_heads, self.num_kv_heads, self.head_dim)
            q, k, v = meta.rope_and_store(qkv, heads, k_cache, v_cache, rope)
        out = meta.attend(q, k, v, k_cache, v_cache, scale=1.0, window=self.window)
        return self.o_proj(out.reshape(t, self.q_size)), (k, v)


class Gemma4Layer(nn.Module):
    """forward(x [T, hidden] the stream, caches, meta, rope, ple [T, P] or None, shared, rows) ->
    (the stream after this layer, (k, v) of its attention): norms before and after attention and
    the MLP, the per-layer-embedding block, then x layer_scalar."""

    def __init__(self, arch: Gemma4Arch, i: int, ops: LayerOps = TORCH_OPS):
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps

        def norm(dim: int = hidden) -> RMSNorm:
            return RMSNorm(dim, eps, True, ops)

        self.input_layernorm = norm()
        self.self_attn = Gemma4Attention(arch, i, ops)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()
        self.mlp = GatedMLP(hidden, arch.layer_intermediate[i], "gelu_tanh", ops=ops)
        self.moe = None
        if arch.is_moe_layer(i):
            self.moe = Gemma4MoE(
                hidden, arch.moe_intermediate_size, arch.num_experts, arch.num_experts_per_tok, eps, ops
            )
        self.layer_scalar = nn.Parameter(torch.ones(1))
        if arch.ple_dim:
            self.per_layer_input_gate = nn.Linear(hidden, arch.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(arch.ple_dim, hidden, bias=False)
            self.post_per_layer_input_norm = norm()

    def forward(self, x, k_cache, v_cache, meta: ForwardMeta, rope=None, ple=None, shared=None, rows=None):
        a, kv = self.self_attn(self.input_layernorm(x), k_cache, v_cache, meta, rope, shared, rows)
        x, h = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm(a), x)
        h = self.mlp(h)
        if self.moe is not None:
            h = self.moe(x, h)
        x = x + self.post_feedforward_layernorm(h)
        if ple is not None:
            g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * ple
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar, kv


def _layer_shapes(cfg, types: list[str]) -> list[tuple[int, int]]:
    """(KV heads, head size) per layer: transformers' `per_layer_config` where the config has one,
    else `global_head_dim` / `num_global_key_value_heads` (the latter only with attention_k_eq_v) on
    the full-attention layers."""
    per_layer = getattr(cfg, "per_layer_config", None)
    out = []
    for i, t in enumerate(types):
        if per_layer is not None:
            lc = per_layer[i]
            out.append((lc.num_key_value_heads, lc.head_dim))
            continue
        kv, dim = cfg.num_key_value_heads, cfg.head_dim
        if t == "full_attention":
            dim = getattr(cfg, "global_head_dim", None) or dim
            if getattr(cfg, "attention_k_eq_v", False):
                kv = getattr(cfg, "num_global_key_value_heads", None) or kv
        out.append((kv, dim))
    return out


def _kv_sharing(types: list[str], num_shared: int) -> list[int]:
    """The layer whose K/V each layer attends: itself, or for the last `num_shared` layers the last
    earlier unshared layer of the same type (transformers' `kv_sharing_modes`). Raises ValueError
    naming num_kv_shared_layers when every layer would share, or a shared type has no writer."""
    n = len(types)
    if not isinstance(num_shared, Integral) or not 0 <= num_shared < n:
        raise ValueError(
            f"config num_kv_shared_layers must be an integer in [0, {n - 1}] (some layer must write K/V), "
            f"got {num_shared!r}"
        )
    first = n - num_shared
    source = list(range(n))
    for i in range(first, n):
        writers = [j for j in range(first) if types[j] == types[i]]
        if not writers:
            raise ValueError(
                f"config num_kv_shared_layers={num_shared}: layer {i} ({types[i]}) shares K/V, but no "
                "earlier layer of that type writes any"
            )
        source[i] = writers[-1]
    return source


def _checked_layer_types(cfg, architecture: str) -> list[str]:
    """The config's layer types, after the refusals of the module docstring (ValueError naming the
    config field)."""
    bidirectional = getattr(cfg, "use_bidirectional_attention", None)
    if bidirectional not in (None, False, "vision"):
        raise ValueError(
            f"{architecture}: use_bidirectional_attention={bidirectional!r} is not supported "
            "(a causal decoder: None, or 'vision', which is causal over text)"
        )
    if getattr(cfg, "attention_bias", False):
        raise ValueError(f"{architecture}: attention_bias is not supported")
    act = getattr(cfg, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{architecture}: hidden_activation '{act}' is not supported (gelu_pytorch_tanh is)")
    ple_vocab = getattr(cfg, "vocab_size_per_layer_input", 0) or 0
    if getattr(cfg, "hidden_size_per_layer_input", 0) and ple_vocab < cfg.vocab_size:
        raise ValueError(
            f"{architecture}: vocab_size_per_layer_input ({ple_vocab}) is smaller than vocab_size "
            f"({cfg.vocab_size}): tokens past it have no per-layer embedding"
        )
    n = cfg.num_hidden_layers
    types = list(cfg.layer_types or [])[:n]
    bad = [t for t in types if t not in LAYER_TYPES]
    if len(types) != n or bad:
        raise ValueError(
            f"{architecture}: layer_types must name {n} layers from {LAYER_TYPES}, got {bad or types}"
        )
    return types


def _kv_layout(cfg, types: list[str], shapes: list[tuple[int, int]]):
    """(each layer's kind "own" / "k_eq_v" / "shared", one CacheSpec per writing layer, each layer's
    cache index): Gemma4Arch's layer_kv, cache_specs and layer_cache."""
    n = len(types)
    source = _kv_sharing(types, getattr(cfg, "num_kv_shared_layers", 0) or 0)
    k_eq_v = bool(getattr(cfg, "attention_k_eq_v", False))
    kinds = tuple(
        "shared" if source[i] != i else ("k_eq_v" if k_eq_v and t == "full_attention" else "own")
        for i, t in enumerate(types)
    )
    writers = [i for i in range(n) if source[i] == i]
    specs = tuple(CacheSpec(shapes[i][0], shapes[i][1], shapes[i][1]) for i in writers)
    return kinds, specs, tuple(writers.index(source[i]) for i in range(n))


class Gemma4ForCausalLM(DecoderModel):
    """Gemma 4's decoder over the shared layers (module docstring): forward(input_ids [T] int64,
    positions [T] int64, k_caches, v_caches (one per CacheSpec), meta) -> hidden [T, hidden]."""

    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> Gemma4Arch:
        """Raises ValueError naming the config field of a variant not supported (module docstring).
        Per-layer shapes come from `per_layer_config` (transformers raises on a global `head_dim`
        of such a config); the global ones are the first layer's."""
        n = cfg.num_hidden_layers
        types = _checked_layer_types(cfg, architecture)
        shapes = _layer_shapes(cfg, types)
        kinds, specs, layer_cache = _kv_layout(cfg, types, shapes)
        rope_types = sorted(set(types))
        dims = {t: next(shapes[i][1] for i in range(n) if types[i] == t) for t in rope_types}
        ropes = tuple(rope_spec(cfg, dims[t], t) for t in rope_types)
        wide = 2 if getattr(cfg, "use_double_wide_mlp", False) else 1
        intermediate = tuple(cfg.intermediate_size * (wide if kinds[i] == "shared" else 1) for i in range(n))
        ple_dim = getattr(cfg, "hidden_size_per_layer_input", 0) or 0
        ple_vocab = getattr(cfg, "vocab_size_per_layer_input", 0) or 0
        moe = {}
        if getattr(cfg, "enable_moe_block", False):
            moe = {
                "num_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.top_k_experts,
                "moe_intermediate_size": cfg.moe_intermediate_size,
                "moe_layers": (True,) * n,
                "expert_act": "gelu_tanh",
            }
        return Gemma4Arch(
            architecture=architecture,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=n,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=shapes[0][0],
            head_dim=shapes[0][1],
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
            ropes=ropes,
            layer_rope=tuple(rope_types.index(t) for t in types),
            layer_windows=layer_windows(cfg, n),
            hidden_act="gelu_tanh",
            qk_norm=True,
            norm_cast_last=True,
            sandwich_norms=True,
            embed_scale=cfg.hidden_size**0.5,
            attn_scale=1.0,
            final_logit_softcap=getattr(cfg, "final_logit_softcapping", None),
            cache_specs=specs,
            layer_cache=layer_cache,
            layer_heads=tuple(shapes),
            layer_kv=kinds,
            layer_intermediate=intermediate,
            ple_dim=ple_dim,
            ple_vocab=ple_vocab if ple_dim else 0,
            **moe,
        )

    layer_class = Gemma4Layer

    def __init__(self, arch: Gemma4Arch, max_positions: int, ops: LayerOps = TORCH_OPS):
        super().__init__(arch, max_positions, ops)
        if arch.ple_dim:
            width = arch.num_layers * arch.ple_dim
            self.embed_tokens_per_layer = nn.Embedding(arch.ple_vocab, width)
            self.per_layer_model_projection = nn.Linear(arch.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(arch.ple_dim, arch.rms_norm_eps, True, ops)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """input_ids [T], x [T, hidden] the scaled token embeddings -> [T, layers, P]: the per-layer
        embeddings (transformers' get_per_layer_inputs + project_per_layer_inputs)."""
        a = self.arch
        t, p = input_ids.shape[0], a.ple_dim
        scale = torch.tensor(p**0.5, dtype=torch.float32).to(x.dtype)
        tok = F.embedding(input_ids, self.embed_tokens_per_layer.weight) * scale
        proj = self.per_layer_model_projection(x) * a.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(t, a.num_layers, p))
        return (proj + tok.view(t, a.num_layers, p)) * 2.0**-0.5

    def forward(
        self, input_ids, positions, k_caches, v_caches, meta: ForwardMeta, num_layers: int | None = None
    ) -> torch.Tensor:
        """num_layers: run only the first layers (then the final norm): a self-draft's early exit."""
        x = self.embed(input_ids)
        ple = self.per_layer_inputs(input_ids, x) if self.arch.ple_dim else None
        meta.prepare_rope(positions, self.rope_cos, self.rope_sin, x.dtype)
        windows, kinds = self.arch.layer_windows, self.arch.layer_kv
        written: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # cache -> (k, v) of this forward
        rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # RoPE -> (cos, sin) at positions
        for i, layer in enumerate(self.layers[:num_layers]):
            c, rope = self.layer_cache[i], self.layer_rope(i)
            shared = layer_rows = None
            if kinds[i] == "shared":
                shared, r = written[c], self.arch.layer_rope[i]
                if r not in rows:
                    cos, sin = rope or (self.rope_cos, self.rope_sin)
                    rows[r] = (cos[positions].to(x.dtype), sin[positions].to(x.dtype))
                layer_rows = rows[r]
            x, kv = layer(
                x,
                k_caches[c],
                v_caches[c],
                meta.layer_view(windows[i]),
                rope,
                None if ple is None else ple[:, i],
                shared,
                layer_rows,
            )
            written.setdefault(c, kv)
        return self.norm(x)

    @classmethod
    def split_experts(cls, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """A layer's stacked experts (`layers.N.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
        -> per-expert linear weights of gemma4_moe.Gemma4MoE."""
        m = re.fullmatch(r"((?:.*\.)?layers\.\d+)\.experts\.(gate_up_proj|down_proj)", name)
        if m is None:
            return None
        return [(f"{m[1]}.moe.experts.{e}.{m[2]}.weight", value[e]) for e in range(value.shape[0])]

    @classmethod
    def rename(cls, name: str) -> str:
        """The MoE block's router and norms live in `layers.N.moe` here (gemma4_moe.Gemma4MoE)."""
        m = re.fullmatch(
            r"((?:.*\.)?layers\.\d+)\.(router\..+|(?:pre|post)_feedforward_layernorm_\d\.weight)", name
        )
        if m is None:
            return name
        tail = m[2]
        for old, new in ROUTER_NAMES.items():
            if tail.startswith(old):
                tail = new + tail[len(old) :]
        return f"{m[1]}.moe.{tail}"

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """DecoderModel's loading after Gemma 4's own attention layouts: a KV-shared layer's q
        projection is its whole `qkv_proj` (k/v weights a checkpoint keeps for it are ignored, as
        transformers does), a key-as-value layer's is q and k stacked; the vision and audio towers
        are skipped. Raises ValueError as DecoderModel.load_hf_state_dict does, or naming a missing
        q/k projection."""
        kinds = self.arch.layer_kv
        out: dict[str, torch.Tensor] = {}
        stacked: dict[str, dict[str, torch.Tensor]] = {}
        for name, value in tensors.items():
            if any(s in name for s in SKIPPED_TOWERS):
                continue
            m = re.fullmatch(r"(.*?layers\.(\d+)\.self_attn\.)([qkv])_proj\.weight", name)
            kind = kinds[int(m[2])] if m and int(m[2]) < len(kinds) else "own"
            if kind == "own":
                out[name] = value
            elif kind == "shared":
                if m[3] == "q":
                    out[f"{m[1]}qkv_proj.weight"] = value
            else:
                stacked.setdefault(m[1], {})[m[3]] = value
        for prefix, found in stacked.items():
            missing = [p for p in ("q", "k") if p not in found]
            if missing:
                raise ValueError(f"weights for '{prefix}qkv_proj' lack {[p + '_proj' for p in missing]}")
            if "v" in found:
                raise ValueError(
                    f"unexpected weight '{prefix}v_proj.weight' (attention_k_eq_v: keys are values)"
                )
            out[f"{prefix}qkv_proj.weight"] = torch.cat((found["q"], found["k"]), dim=0)
        super().load_hf_state_dict(out)
