"""`ModelArch`: the shape and the per-layer layout of a decoder, read from a Hugging Face config.

One typed record for every family: the families (models/<family>.py) fill it from their config
with `base_arch` plus their own fields; the shared layers (runtime/layers/) are built from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Integral

from agentrt.runtime.kv_cache import CacheSpec
from agentrt.runtime.layers.mla import MLAConfig
from agentrt.runtime.layers.rotary import RopeSpec, rope_spec
from agentrt.runtime.models.checkpoint_quant import CheckpointQuant

CONFIG_COUNTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
"""config.json counts that must be positive integers where present (transformers divides by some
before any check of ours: `num_attention_heads: 0` is a ZeroDivisionError inside its config class)."""


DEFAULT_MAX_CONTEXT = 1 << 20
"""Without --max-model-len the context is the model's limit up to this many tokens: the RoPE tables
(and a KV budget's sequences) are sized by it, and a config's limit is the checkpoint's word (a
lying GGUF header's 4,000,000,000 took 12.5 GB before the process was killed)."""


def default_max_model_len(limit: int) -> int:
    """The context without --max-model-len: the model's limit, at most DEFAULT_MAX_CONTEXT tokens."""
    return min(limit, DEFAULT_MAX_CONTEXT)


def check_config_counts(raw: object) -> None:
    """Raises ValueError naming the first count of CONFIG_COUNTS in config.json's object `raw` (or
    its `text_config`) that is not a positive integer (null is left to the family's default)."""
    if not isinstance(raw, dict):
        return  # not an object: transformers' own error names it
    for where, cfg in (("", raw), ("text_config.", raw.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for name in CONFIG_COUNTS:
            value = cfg.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                shown = repr(value) if len(repr(value)) <= 64 else repr(value)[:64] + "..."
                raise ValueError(f"config {where}{name} must be a positive integer, got {shown}")


@dataclass(frozen=True)
class ModelArch:
    """Hyper-parameters of a decoder-only model.

    Per layer: `layer_windows[i]` the sliding window of layer i (None: full attention),
    `layer_rope[i]` the index into `ropes` of its rotary embedding, `moe_layers[i]` whether its MLP
    is the sparse MoE block. `attn_scale` None = head_dim ** -0.5. `norm_offset` is added to every
    RMSNorm weight at load (Gemma's `1 + w`); `sandwich_norms`: Gemma's norms after attention and
    after the MLP as well as before them. `embed_scale`: the embeddings are multiplied by it
    (Gemma: sqrt(hidden)). `final_logit_softcap`: logits = cap * tanh(logits / cap).
    `qk_norm_full`: the q / k RMSNorms span the whole projection (all heads, MiniMax M2), not each
    head. A RoPE of `ropes` whose frequencies are all zero (`RopeSpec.identity`) is a NoPE layer's.

    MoE (layers/moe.py `SparseMoE`): `moe_routing` and `moe_renormalize` as there; with
    `sigmoid_topk`, `moe_correction_bias` (the checkpoint's `e_score_correction_bias`),
    `moe_groups` / `moe_topk_groups` (n_group / topk_group) and `routed_scaling_factor`;
    `shared_expert_intermediate_size` > 0 adds shared experts of that width (`shared_experts`, or
    `shared_expert` behind a sigmoid gate with `shared_expert_gate`). Dense layers
    (`moe_layers[i]` False) use `intermediate_size`, experts `moe_intermediate_size`.

    `mla`: every layer's attention is multi-head latent attention (layers/mla.py: DeepSeek V3,
    Kimi K2), its KV cache the latent (`MLAConfig.cache_spec`); `head_dim` is then the query /
    key heads' width (nope + rope) and `attn_scale` the softmax scale.

    Hybrid models: `layer_mixers[i]` the token mixer of layer i, "attention" or a recurrent one
    ("gated_delta": layers/gated_delta.py, "mamba2": layers/mamba2.py; empty = attention
    everywhere), built from the Hugging Face config `mixer_config`; a recurrent layer keeps its state
    in the state pool (runtime/recurrent_state.py) and no KV. "none": the layer mixes no tokens
    (Nemotron-H's MLP and MoE blocks, a family's own `layer_class`): no KV, no state.
    `attn_output_gate`: the attention's output is multiplied by sigmoid(gate), the gate projected
    with q (Qwen3-Next, Qwen3.5).

    The KV layout (`kv_layout`): `cache_specs` the shape of each KV cache (empty: one
    CacheSpec(num_kv_heads, head_dim, head_dim) per layer) and `layer_cache[i]` the cache layer i
    writes and reads (empty: cache i; None: the layer keeps no KV, e.g. a linear-attention layer;
    layers that name the same cache share it, the later ones only reading it)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    ropes: tuple[RopeSpec, ...]
    layer_rope: tuple[int, ...]
    layer_windows: tuple[int | None, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    qk_norm: bool = False
    norm_offset: float = 0.0
    norm_cast_last: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    attn_sinks: bool = False
    final_logit_softcap: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    moe_routing: str = "softmax_topk"
    moe_renormalize: bool = True
    router_bias: bool = False
    expert_act: str = "silu"
    expert_bias: bool = False
    swiglu_limit: float | None = None
    moe_correction_bias: bool = False
    moe_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    qk_norm_full: bool = False
    mla: MLAConfig | None = None
    cache_specs: tuple[CacheSpec, ...] = ()
    layer_cache: tuple[int | None, ...] = ()
    layer_mixers: tuple[str, ...] = ()
    mixer_config: object = field(default=None, compare=False, repr=False)
    attn_output_gate: bool = False
    checkpoint_quant: CheckpointQuant | None = None  # how the checkpoint stores weights (None: as-is)

    def __post_init__(self) -> None:
        """Raises ValueError naming the config.json field when a count is below 1 or the attention
        heads are not a multiple of the KV heads: no weight could have the shapes they imply."""
        for name, value in (
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ):
            if not isinstance(value, Integral) or value < 1:
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"config num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose mixer is recurrent (state, no KV), in order."""
        return tuple(i for i, m in enumerate(self.layer_mixers) if m not in ("attention", "none"))

    def kv_layout(self) -> tuple[list[CacheSpec], tuple[int | None, ...]]:
        """(the KV caches' shapes, the cache index of each layer or None): what the KV pool is built
        from and how the model hands each layer its caches (by default one per attention layer;
        recurrent layers and layers without a mixer have none)."""
        caches = self.layer_cache
        if not caches:
            keyless, n = {i for i, m in enumerate(self.layer_mixers) if m != "attention"}, 0
            caches = tuple(None if i in keyless else (n := n + 1) - 1 for i in range(self.num_layers))
        count = len({c for c in caches if c is not None})
        specs = list(self.cache_specs) or [CacheSpec(self.num_kv_heads, self.head_dim, self.head_dim)] * count
        return specs, caches

    @property
    def uniform_kv(self) -> bool:
        """Every layer has its own cache of CacheSpec(num_kv_heads, head_dim, head_dim)."""
        specs, caches = self.kv_layout()
        plain = CacheSpec(self.num_kv_heads, self.head_dim, self.head_dim)
        return caches == tuple(range(self.num_layers)) and all(c == plain for c in specs)

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]

    def layout_features(self) -> frozenset[str]:
        """What this model's layers use beyond the plain Llama layer (one full-width RoPE, full
        attention, RMSNorm, a dense MLP): the names a backend's allow-list of what it supports is
        checked against (runtime/backends/)."""
        flags = {
            "partial_rope": any(r.rotary_dim != self.head_dim for r in self.ropes),
            "multi_rope": len(self.ropes) > 1,
            "window": self.windowed,
            "sinks": self.attn_sinks,
            "qk_norm": self.qk_norm,
            "sandwich_norms": self.sandwich_norms,
            "qkv_bias": self.qkv_bias,
            "o_bias": self.o_bias,
            "mlp_bias": self.mlp_bias,
            "moe": any(self.moe_layers),
            "attn_scale": self.attn_scale is not None,
            "embed_scale": self.embed_scale is not None,
            "logit_softcap": self.final_logit_softcap is not None,
            "norm_offset": self.norm_offset != 0.0,
            "qk_norm_full": self.qk_norm_full,
            "nope": any(r.identity for r in self.ropes),
            "moe_shared": self.shared_expert_intermediate_size > 0,
            "moe_sigmoid": self.moe_routing == "sigmoid_topk",
            "mla": self.mla is not None,
            "kv_layout": not self.uniform_kv,
            "recurrent": bool(self.recurrent_layers),
            "attn_output_gate": self.attn_output_gate,
        }
        return frozenset([f"mlp:{self.hidden_act}", *(name for name, on in flags.items() if on)])


def layer_windows(cfg, num_layers: int) -> tuple[int | None, ...]:
    """Per layer: the sliding window from `layer_types` ("sliding_attention" layers get
    `sliding_window`), else `sliding_window` on every layer when set (Mistral, Phi-3; Qwen2 only
    with `use_sliding_window`)."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" and window else None for t in types[:num_layers])
    if window and getattr(cfg, "use_sliding_window", True):
        return (int(window),) * num_layers
    return (None,) * num_layers


def base_arch(cfg, architecture: str, **fields) -> ModelArch:
    """A ModelArch with the fields every family reads the same way; `fields` override or add.
    Raises ValueError for a RoPE scaling transformers does not know."""
    heads = cfg.num_attention_heads
    if not isinstance(heads, Integral) or heads < 1:
        raise ValueError(f"config num_attention_heads must be a positive integer, got {heads!r}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    num_layers = cfg.num_hidden_layers
    params = getattr(cfg, "rope_parameters", None) or {}
    types = getattr(cfg, "layer_types", None) or []
    if types and all(t in params for t in set(types)):  # one RoPE per layer type (Gemma 3)
        kinds = sorted(set(types[:num_layers]))
        ropes = tuple(rope_spec(cfg, head_dim, t) for t in kinds)
        layer_rope = tuple(kinds.index(t) for t in types[:num_layers])
    else:
        ropes, layer_rope = (rope_spec(cfg, head_dim),), (0,) * num_layers
    values = {
        "architecture": architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_layers": num_layers,
        "num_heads": heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "ropes": ropes,
        "layer_rope": layer_rope,
        "layer_windows": layer_windows(cfg, num_layers),
        "qkv_bias": bool(getattr(cfg, "attention_bias", False)),
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
    }
    values.update(fields)
    return ModelArch(**values)
