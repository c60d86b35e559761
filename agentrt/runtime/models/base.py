"""`DecoderModel`: embeddings -> decoder layers -> final norm -> LM head, over the shared layers.

A family (models/<family>.py) subclasses it to declare how its config maps onto a ModelArch
(`arch_from_config`) and how its checkpoint names map onto this layout (`rename`,
`split_experts`); the forward and the weight loading are here once.
The forward works on a flat batch of tokens from many sequences; K/V are written to and read from
a token-slot KV pool (see `kv_cache.py`).
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.runtime.forward import TORCH_OPS, ForwardMeta, LayerOps
from agentrt.runtime.layers.attention import Attention, AttentionConfig
from agentrt.runtime.layers.gated_delta import GatedDeltaNet
from agentrt.runtime.layers.mamba2 import Mamba2Mixer
from agentrt.runtime.layers.mla import MultiHeadLatentAttention
from agentrt.runtime.layers.mlp import GatedMLP
from agentrt.runtime.layers.moe import SparseMoE
from agentrt.runtime.layers.norm import RMSNorm
from agentrt.runtime.layers.rotary import rope_tables
from agentrt.runtime.models.checkpoint_quant import checkpoint_tensors
from agentrt.runtime.models.config import ModelArch

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
PACKED_MLP = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
RECURRENT_MIXERS = {"gated_delta": GatedDeltaNet, "mamba2": Mamba2Mixer}
SKIPPED = ("rotary_emb", "vision_tower", "multi_modal_projector", "vision_model", "visual.", "mm_projector")


class DecoderLayer(nn.Module):
    """forward(x, residual, k_cache, v_cache, meta, rope) -> (this layer's output, the stream before
    it): x [T, hidden] the previous layer's output (the embeddings for layer 0, with residual None),
    residual [T, hidden]; vLLM's layout, so the residual add and the next norm are one op (`ops`:
    the run's element-wise ops, forward.LayerOps)."""

    def __init__(self, arch: ModelArch, i: int, ops: LayerOps = TORCH_OPS):
        super().__init__()
        eps, cast = arch.rms_norm_eps, arch.norm_cast_last
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, cast, ops)
        mixer = arch.layer_mixers[i] if arch.layer_mixers else "attention"
        if mixer != "attention":  # linear attention / SSM: state in the state pool, no KV
            self.linear_attn = RECURRENT_MIXERS[mixer].from_hf_config(arch.mixer_config)
            index = arch.recurrent_layers.index(i)
            self.mix = lambda h, k_cache, v_cache, meta, rope: meta.run_recurrent(self.linear_attn, index, h)
        elif arch.mla is not None:  # multi-head latent attention (layers/mla.py): DeepSeek V3, Kimi K2
            self.self_attn = MultiHeadLatentAttention(
                arch.mla, arch.hidden_size, arch.num_heads, arch.scale, ops
            )
        else:
            self.self_attn = Attention(
                AttentionConfig(
                    arch.hidden_size,
                    arch.num_heads,
                    arch.num_kv_heads,
                    arch.head_dim,
                    arch.scale,
                    arch.qkv_bias,
                    arch.o_bias,
                    arch.qk_norm,
                    eps,
                    cast,
                    arch.layer_windows[i],
                    arch.attn_sinks,
                    arch.qk_norm_full,
                    arch.attn_output_gate,
                ),
                ops,
            )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, cast, ops)
        self.sandwich = arch.sandwich_norms
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, cast, ops)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, cast, ops)
        if mixer == "attention":
            self.mix = self.self_attn.forward  # (a bound method: not registered as a module)
        if arch.is_moe_layer(i):
            self.mlp = SparseMoE(
                arch.hidden_size,
                arch.moe_intermediate_size,
                arch.num_experts,
                arch.num_experts_per_tok,
                arch.moe_routing,
                arch.moe_renormalize,
                arch.router_bias,
                arch.expert_act,
                arch.expert_bias,
                arch.swiglu_limit,
                ops,
                correction_bias=arch.moe_correction_bias,
                num_groups=arch.moe_groups,
                topk_groups=arch.moe_topk_groups,
                routed_scaling=arch.routed_scaling_factor,
                shared_intermediate=arch.shared_expert_intermediate_size,
                shared_gate=arch.shared_expert_gate,
            )
        else:
            self.mlp = GatedMLP(
                arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.mlp_bias, ops=ops
            )

    def pre_attention(self, x, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stream residual + x, its input norm) [T, hidden] each; residual None for layer 0."""
        return self.input_layernorm.add_forward(x, residual)

    def post_attention(self, h, residual) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] the attention's output (after o_proj) -> (the MLP's output, the stream)."""
        if self.sandwich:  # Gemma: norm the attention output, then the MLP input; norm its output
            residual, h = self.pre_feedforward_layernorm.add_forward(
                self.post_attention_layernorm(h), residual
            )
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        residual, h = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual

    def forward(self, x, residual, k_cache, v_cache, meta: ForwardMeta, rope=None):
        residual, h = self.pre_attention(x, residual)
        return self.post_attention(self.mix(h, k_cache, v_cache, meta, rope), residual)


class DecoderModel(nn.Module):
    """forward(input_ids [T] int64, positions [T] int64, kv caches, metadata) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab] fp32."""

    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:  # pragma: no cover - per family
        raise NotImplementedError

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {**PACKED, **PACKED_MLP}
    """checkpoint module -> (this layout's fused module, its part): q/k/v and gate/up are packed."""

    layer_class: ClassVar[type[nn.Module]] = DecoderLayer
    """The decoder layer, built as layer_class(arch, i, ops): a family whose layer is not this one's
    composition (Gemma 4) names its own."""

    @classmethod
    def rename(cls, name: str) -> str | None:
        """A checkpoint tensor name (prefix stripped) -> this layout's name, before packing; None: the
        tensor is not this model's (skipped, e.g. DeepSeek V3's multi-token-prediction layer)."""
        return name

    def __init__(self, arch: ModelArch, max_positions: int, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.arch = arch
        self.ops = ops
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(self.layer_class(arch, i, ops) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_cast_last, ops)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.max_positions = max_positions
        self.layer_cache = arch.kv_layout()[1]  # layer i -> its KV cache index (None: no KV)
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)compute the fp32 cos/sin tables [max_positions, rotary_dim // 2] of each RoPE on the
        model's device, and zero the MoE expert-load counters (call after `to_empty` when the model
        was built on the meta device). `rope_cos` / `rope_sin` are the first's (every layer's, in the
        Llama layout)."""
        device = self.embed_tokens.weight.device
        if device.type != "meta":
            for m in self.modules():
                if isinstance(m, SparseMoE):
                    m.expert_tokens.zero_()
        for i, spec in enumerate(self.arch.ropes):
            cos, sin = (
                (None, None) if device.type == "meta" else rope_tables(spec, self.max_positions, device)
            )
            suffix = "" if i == 0 else f"_{i}"
            self.register_buffer(f"rope_cos{suffix}", cos, persistent=False)
            self.register_buffer(f"rope_sin{suffix}", sin, persistent=False)

    def layer_rope(self, i: int):
        """(cos, sin) tables of layer i, None when it uses the first."""
        r = self.arch.layer_rope[i]
        return None if r == 0 else (getattr(self, f"rope_cos_{r}"), getattr(self, f"rope_sin_{r}"))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> the first layer's input [T, hidden] (scaled where the family does)."""
        x = F.embedding(input_ids, self.embed_tokens.weight)  # the module's forward, without its call
        if self.arch.embed_scale is not None:
            x = x * torch.tensor(self.arch.embed_scale, dtype=torch.float32).to(x.dtype)
        return x

    def forward(
        self, input_ids, positions, k_caches, v_caches, meta: ForwardMeta, num_layers: int | None = None
    ) -> torch.Tensor:
        """num_layers: run only the first layers (then the final norm): a self-draft's early exit."""
        x = self.embed(input_ids)
        meta.prepare_rope(positions, self.rope_cos, self.rope_sin, x.dtype)
        residual = None
        windows = self.arch.layer_windows
        for i, layer in enumerate(self.layers[:num_layers]):
            c = self.layer_cache[i]
            k_cache, v_cache = (None, None) if c is None else (k_caches[c], v_caches[c])
            x, residual = layer(
                x, residual, k_cache, v_cache, meta.layer_view(windows[i]), self.layer_rope(i)
            )
        return self.norm.add_forward(x, residual)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @classmethod
    def offset_norm(cls, name: str) -> bool:
        """Whether the loader adds `arch.norm_offset` to the weight `name` (every RMSNorm's)."""
        return name.endswith("norm.weight")

    @classmethod
    def split_experts(cls, name: str, value: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """Stacked expert tensors (`...mlp.experts.gate_up_proj` [E, 2I, H], `...down_proj` [E, H, I],
        transformers 5's layout) -> per-expert (name, tensor) pairs of this layout; None when `name` is
        not one. Families whose checkpoints stack differently override it (gpt-oss)."""
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)", name)
        if m is None:
            return None
        return [(f"{m[1]}.{e}.{m[2]}.weight", value[e]) for e in range(value.shape[0])]

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights (separate q/k/v and gate/up projections, per-expert or
        stacked experts; MXFP4 / block-FP8 ones de-quantized to the model's dtype as
        `arch.checkpoint_quant` says) into this layout. Raises ValueError on missing or unexpected
        weights, shape mismatches, or quantized tensors that do not fit their format."""
        own = dict(self.named_parameters())
        filled: set[str] = set()
        norm_offset = self.arch.norm_offset

        def put(name: str, value: torch.Tensor) -> None:
            if name not in own:
                raise ValueError(f"unexpected weight '{name}'")
            if own[name].shape != value.shape:
                raise ValueError(
                    f"weight '{name}' has shape {tuple(value.shape)}, expected {tuple(own[name].shape)}"
                )
            if norm_offset and self.offset_norm(name):
                value = value.float() + norm_offset
            own[name].copy_(value)
            filled.add(name)

        groups: dict[str, dict[int, torch.Tensor]] = {}
        # the checkpoint's tensors, last first, each quantized one de-quantized to the model's dtype
        # as it is reached (checkpoint_quant.py); split experts are taken before the next
        tensors = checkpoint_tensors(tensors, self.arch.checkpoint_quant, self.embed_tokens.weight.dtype)
        source = ((name, tensors[name]) for name in reversed(list(tensors)))
        pending: list[tuple[str, torch.Tensor]] = []
        while pending or (item := next(source, None)) is not None:
            name, value = pending.pop() if pending else item
            if any(s in name for s in SKIPPED):
                continue
            for prefix in PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
            name = self.rename(name)
            if name is None:
                continue
            split = self.split_experts(name, value)
            if split is not None:
                pending.extend(split)
                continue
            parts = name.split(".")
            packed = None
            if len(parts) >= 2:
                packed = self.packed_modules_mapping.get(parts[-2])
            if packed is None:
                put(name, value)
                continue
            key = ".".join([*parts[:-2], packed[0], parts[-1]])
            groups.setdefault(key, {})[packed[1]] = value
        for key, found in groups.items():
            count = 3 if ".qkv_proj." in key else 2
            missing = [i for i in range(count) if i not in found]
            if missing:
                names = ("q_proj", "k_proj", "v_proj") if count == 3 else ("gate_proj", "up_proj")
                raise ValueError(f"weights for '{key}' lack {[names[i] for i in missing]}")
            put(key, torch.cat([found[i] for i in range(count)], dim=0))
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            filled.add("lm_head.weight")
        missing = set(own) - filled
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
