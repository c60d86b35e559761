"""`DecoderModel`: embeddings -> decoder layers -> final norm -> LM head, over the shared layers.

A family (models/<family>.py) subclasses it to declare how its config maps onto a ModelArch
(`arch_from_config`) and how its checkpoint names map onto this layout (`rename`,
`split_experts`); the forward, the weight loading and the CPU whole-stack decode are here once.
The forward works on a flat batch of tokens from many sequences; K/V are written to and read from
a token-slot KV pool (see `kv_cache.py`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from agentrt.runtime.kernels import cpu_kernels
from agentrt.runtime.layers.attention import Attention, AttentionConfig
from agentrt.runtime.layers.mlp import GatedMLP
from agentrt.runtime.layers.moe import SparseMoE
from agentrt.runtime.layers.norm import RMSNorm
from agentrt.runtime.layers.rotary import rope_tables
from agentrt.runtime.models.config import ModelArch

PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
PACKED_MLP = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
SKIPPED = ("rotary_emb", "vision_tower", "multi_modal_projector", "vision_model")


class DecoderLayer(nn.Module):
    """forward(x, residual, k_cache, v_cache, meta, rope) -> (this layer's output, the stream before
    it): x [T, hidden] the previous layer's output (the embeddings for layer 0, with residual None),
    residual [T, hidden]; vLLM's layout, so the residual add and the next norm are one op when fused."""

    def __init__(self, arch: ModelArch, i: int):
        super().__init__()
        eps, cast = arch.rms_norm_eps, arch.norm_cast_last
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, cast)
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
            )
        )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, cast)
        self.sandwich = arch.sandwich_norms
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, cast)
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, cast)
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
            )
        else:
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, arch.hidden_act, arch.mlp_bias)

    def forward(self, x, residual, k_cache, v_cache, meta, rope=None):
        fused = meta.ops_fused
        residual, h = self.input_layernorm.add_forward(x, residual, fused)
        h = self.self_attn(h, k_cache, v_cache, meta, rope)
        if self.sandwich:  # Gemma: norm the attention output, then the MLP input; norm its output
            residual, h = self.pre_feedforward_layernorm.add_forward(
                self.post_attention_layernorm.forward_fused(h, fused), residual, fused
            )
            return self.post_feedforward_layernorm.forward_fused(self.mlp(h, fused), fused), residual
        residual, h = self.post_attention_layernorm.add_forward(h, residual, fused)
        return self.mlp(h, fused), residual


class DecoderModel(nn.Module):
    """forward(input_ids [T] int64, positions [T] int64, kv caches, metadata) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab] fp32."""

    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> ModelArch:  # pragma: no cover - per family
        raise NotImplementedError

    @classmethod
    def rename(cls, name: str) -> str:
        """A checkpoint tensor name (prefix stripped) -> this layout's name, before packing."""
        return name

    def __init__(self, arch: ModelArch, max_positions: int):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_cast_last)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.max_positions = max_positions
        self._decode_stack: tuple[list[torch.Tensor], list[int]] | None | bool = None  # see decode_stack
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

    def forward(
        self, input_ids, positions, k_caches, v_caches, meta, num_layers: int | None = None
    ) -> torch.Tensor:
        """num_layers: run only the first layers (then the final norm): a self-draft's early exit.
        The element-wise ops run fused (kernels/cpu_layer_ops.cpp) when the metadata asks for the CPU
        kernels (`cpu_kernel`, set by model_runner where they are loaded) and the activations are
        float32; the torch ops otherwise (bit-identical to the layer as written in PyTorch)."""
        x = self.embed_tokens(input_ids)
        if self.arch.embed_scale is not None:
            x = x * torch.tensor(self.arch.embed_scale, dtype=torch.float32).to(x.dtype)
        meta.prepare_rope(positions, self.rope_cos, self.rope_sin, x.dtype)
        fused = (
            bool(getattr(meta, "cpu_kernel", False)) and x.dtype == torch.float32 and x.device.type == "cpu"
        )
        meta.ops_fused = fused
        stack = None
        if fused and meta.decode_idx is not None and not meta.prefills and cpu_kernels.stack_caches(k_caches):
            stack = self.decode_stack()
        if stack is not None:  # a decode-only batch: the whole stack in one C++ op (cpu_decode_layers.cpp)
            weights, out_features = stack
            n = len(self.layers) if num_layers is None else num_layers
            return cpu_kernels.decode_layers(
                x, weights[: n * 18], k_caches[:n], v_caches[:n], meta.cos, meta.sin, meta.slot_mapping,
                meta.decode_slots, meta.decode_lens, self.norm.weight, out_features, self.arch.num_heads,
                self.arch.rms_norm_eps, self.arch.head_dim**-0.5,
            )  # fmt: skip
        residual = None
        layers = self.layers[:num_layers]
        windows = self.arch.layer_windows
        for i, (layer, k_cache, v_cache) in enumerate(zip(layers, k_caches, v_caches)):
            m = meta if windows[i] is None or getattr(meta, "swa_map", None) is None else meta.window_view()
            x, residual = layer(x, residual, k_cache, v_cache, m, self.layer_rope(i))
        return self.norm.add_forward(x, residual, fused)[1]

    def decode_stack(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """(weights, out_features) for `torch.ops.agentrt_cpu.decode_layers` (18 tensors per layer,
        that op's order), when the model has the Llama layout (ModelArch.llama_layout) and every
        projection of every layer runs a C++ kernel (Int8Linear or Int4BlockLinear after
        `pack_for_kernel`), else None. Built on the first decode step and kept (the weights are packed
        once, at load: formats.load_model)."""
        if self._decode_stack is None:
            self._decode_stack = (self.arch.llama_layout() and self._build_decode_stack()) or False
        return self._decode_stack or None

    def _build_decode_stack(self) -> tuple[list[torch.Tensor], list[int]] | None:
        none = torch.empty(0)
        weights: list[torch.Tensor] = []
        out_features: list[int] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(getattr(m, "use_kernel", False) for m in linears):
                return None
            weights.append(layer.input_layernorm.weight.detach())
            for i, m in enumerate(linears):
                if i == 2:
                    weights.append(layer.post_attention_layernorm.weight.detach())
                mins = getattr(m, "mins", None)
                weights += [
                    m.qweight,
                    m.scales,
                    none if mins is None else mins,
                    none if m.bias is None else m.bias,
                ]
            out_features = [m.out_features for m in linears]  # the same in every layer
        return weights, out_features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

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
        stacked experts) into this layout. Raises ValueError on missing or unexpected weights or
        shape mismatches."""
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
            if norm_offset and name.endswith("norm.weight"):
                value = value.float() + norm_offset
            own[name].copy_(value)
            filled.add(name)

        groups: dict[str, dict[int, torch.Tensor]] = {}
        pending = list(tensors.items())
        while pending:
            name, value = pending.pop()
            if any(s in name for s in SKIPPED):
                continue
            for prefix in PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
            name = self.rename(name)
            split = self.split_experts(name, value)
            if split is not None:
                pending.extend(split)
                continue
            parts = name.split(".")
            packed = None
            if len(parts) >= 2:
                packed = PACKED.get(parts[-2]) or PACKED_MLP.get(parts[-2])
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
