"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral, SmolLM2) written in torch.

RMSNorm (Zhang & Sennrich 2019), rotary position embeddings (Su et al. 2021, "RoFormer") with
linear and Llama 3 frequency scaling (Meta's Llama 3.1 reference), grouped-query attention
(Ainslie et al. 2023), SwiGLU MLP (Shazeer 2020). The forward works on a flat batch of tokens
from many sequences; K/V are written to and read from a token-slot KV pool (see `kv_cache.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.runtime.attention import AttentionMetadata

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class LlamaArch:
    """Shape hyper-parameters read from a Hugging Face config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, object], ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    mlp_bias: bool

    @classmethod
    def from_hf_config(cls, cfg) -> LlamaArch:
        """Raises ValueError naming the architecture (or RoPE type) when it is not supported."""
        archs = list(getattr(cfg, "architectures", None) or [])
        model_type = getattr(cfg, "model_type", "")
        known = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        arch = archs[0] if archs else known.get(model_type, model_type or "unknown")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture '{arch}': agentrt runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        legacy = getattr(cfg, "rope_scaling", None)
        if legacy and not rope.get("rope_type"):
            rope.update(legacy)
        theta = rope.pop("rope_theta", None) or getattr(cfg, "rope_theta", 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported RoPE scaling '{rope_type}' in {arch}")
        rope["rope_type"] = rope_type
        rope.pop("type", None)
        heads = cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=tuple(sorted(rope.items())),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        )


def rope_inv_freq(arch: LlamaArch) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] fp32, with linear or Llama 3 scaling applied."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = dict(arch.rope_scaling)
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # kernel(x, weight, eps) in place of the torch ops (models/triton_linear.py sets the
        # batch-invariant Triton one)
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x)), or (x, norm(x)) when residual is None; x [T, D].
        fused: one C++ op (kernels/cpu_layer_ops.cpp; float32 CPU), else the torch ops above."""
        if fused:
            if residual is None:
                return x, torch.ops.agentrt_cpu.rms_norm(x, self.weight, self.eps)
            return torch.ops.agentrt_cpu.add_rms_norm(residual, x, self.weight, self.eps)
        residual = x if residual is None else residual + x
        return residual, self(residual)


class Attention(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)

    def forward(self, x, k_cache, v_cache, meta: AttentionMetadata, fused: bool = False) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if fused:  # rotate q and k, write k and v to the pool: one C++ op
            q, k = torch.ops.agentrt_cpu.rope_store(
                qkv, meta.cos, meta.sin, k_cache, v_cache, meta.slot_mapping, self.num_heads
            )
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            q, k = meta.rope_and_store(q, k, v, k_cache, v_cache)
        out = meta.attend(q, k, v, k_cache, v_cache)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.inter = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused:
            return self.down_proj(torch.ops.agentrt_cpu.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x, residual, k_cache, v_cache, meta, fused: bool = False):
        """x [T, hidden]: the previous layer's output (the embeddings for layer 0, with residual
        None); residual [T, hidden]: the stream before it. Returns (this layer's output, the stream
        before it), vLLM's layout, so the residual add and the next norm are one op when fused."""
        residual, h = self.input_layernorm.add_forward(x, residual, fused)
        h = self.self_attn(h, k_cache, v_cache, meta, fused)
        residual, h = self.post_attention_layernorm.add_forward(h, residual, fused)
        return self.mlp(h, fused), residual


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T] int64, positions [T] int64, kv caches, metadata) -> hidden [T, hidden];
    compute_logits(hidden [N, hidden]) -> [N, vocab] fp32."""

    def __init__(self, arch: LlamaArch, max_positions: int):
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.max_positions = max_positions
        self._decode_stack: tuple[list[torch.Tensor], list[int]] | None | bool = None  # see decode_stack
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)compute the fp32 cos/sin tables [max_positions, head_dim // 2] on the model's device
        (call after `to_empty` when the model was built on the meta device)."""
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            self.register_buffer("rope_cos", None, persistent=False)
            self.register_buffer("rope_sin", None, persistent=False)
            return
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, rope_inv_freq(self.arch).to(device))
        self.register_buffer("rope_cos", freqs.cos(), persistent=False)
        self.register_buffer("rope_sin", freqs.sin(), persistent=False)

    def forward(
        self, input_ids, positions, k_caches, v_caches, meta: AttentionMetadata, num_layers: int | None = None
    ) -> torch.Tensor:
        """num_layers: run only the first layers (then the final norm): a self-draft's early exit.
        The element-wise ops run fused (kernels/cpu_layer_ops.cpp) when the metadata asks for the CPU
        kernels (`cpu_kernel`, set by model_runner where they are loaded) and the activations are
        float32; the torch ops otherwise (bit-identical to the layer as written in PyTorch)."""
        x = self.embed_tokens(input_ids)
        meta.prepare_rope(positions, self.rope_cos, self.rope_sin, x.dtype)
        fused = (
            bool(getattr(meta, "cpu_kernel", False)) and x.dtype == torch.float32 and x.device.type == "cpu"
        )
        stack = self.decode_stack() if fused and meta.decode_idx is not None and not meta.prefills else None
        if stack is not None:  # a decode-only batch: the whole stack in one C++ op (cpu_decode_layers.cpp)
            weights, out_features = stack
            n = len(self.layers) if num_layers is None else num_layers
            return torch.ops.agentrt_cpu.decode_layers(
                x, weights[: n * 18], k_caches[:n], v_caches[:n], meta.cos, meta.sin, meta.slot_mapping,
                meta.decode_slots, meta.decode_lens, self.norm.weight, out_features, self.arch.num_heads,
                self.arch.rms_norm_eps, self.arch.head_dim**-0.5,
            )  # fmt: skip
        residual = None
        for layer, k_cache, v_cache in zip(self.layers[:num_layers], k_caches, v_caches):
            x, residual = layer(x, residual, k_cache, v_cache, meta, fused)
        return self.norm.add_forward(x, residual, fused)[1]

    def decode_stack(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """(weights, out_features) for `torch.ops.agentrt_cpu.decode_layers` (18 tensors per layer,
        that op's order), when every projection of every layer runs a C++ kernel (Int8Linear or
        Int4BlockLinear after `pack_for_kernel`), else None. Built on the first decode step and kept
        (the weights are packed once, at load: formats.load_model)."""
        if self._decode_stack is None:
            self._decode_stack = self._build_decode_stack() or False
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
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights (separate q/k/v and gate/up projections) into the fused
        layout. Raises ValueError on missing or unexpected weights or shape mismatches."""
        own = dict(self.named_parameters())
        filled: set[str] = set()

        def put(name: str, value: torch.Tensor) -> None:
            if name not in own:
                raise ValueError(f"unexpected weight '{name}'")
            if own[name].shape != value.shape:
                raise ValueError(
                    f"weight '{name}' has shape {tuple(value.shape)}, expected {tuple(own[name].shape)}"
                )
            own[name].copy_(value)
            filled.add(name)

        groups: dict[str, dict[str, torch.Tensor]] = {}
        for name, value in tensors.items():
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                if f".{part}." in name:
                    fused = "qkv_proj" if part[0] in "qkv" else "gate_up_proj"
                    key = name.replace(part, fused)
                    groups.setdefault(key, {})[part] = value
                    break
            else:
                put(name, value)
        for key, parts in groups.items():
            order = ("q_proj", "k_proj", "v_proj") if "qkv_proj" in key else ("gate_proj", "up_proj")
            missing = [p for p in order if p not in parts]
            if missing:
                raise ValueError(f"weights for '{key}' lack {missing}")
            put(key, torch.cat([parts[p] for p in order], dim=0))
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            filled.add("lm_head.weight")
        missing = set(own) - filled
        if missing:
            raise ValueError(f"checkpoint lacks weights: {sorted(missing)[:5]}")
