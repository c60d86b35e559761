"""Granite 4 (`GraniteMoeHybridForCausalLM`, transformers `modeling_granitemoehybrid.py`): per
`layer_types`, a Mamba-2 mixer (layers/mamba2.py, its state in the state pool; "mamba" /
"linear_attention") or attention ("attention" / "full_attention", RoPE only with
`position_embedding_type: rope`, else none: Granite 4.0-H's NoPE), then a MoE block (softmax over the
top-k router logits) beside an always-on shared SwiGLU MLP, or that shared MLP alone when
`num_local_experts` is 0 (the dense Granite 4.0 models). Plain RMSNorms (cast, then weighted).

The four Granite multipliers, each exact in real arithmetic:
- `attention_multiplier` is the softmax scale (`attn_scale`);
- `embedding_multiplier` multiplies the embeddings at run time (`embed_scale`: the embedding is the
  LM head too when tied, so it cannot be folded into it);
- `residual_multiplier` (every branch's output is scaled by it before the residual add) is folded at
  load into the last projection of each branch: the mixer's `out_proj`, attention's `o_proj`, the
  experts' and the shared MLP's `down_proj` (weights and biases);
- `logits_scaling` (logits are divided by it) is folded at load into the final norm's weight (the
  LM head is linear in its input; the norm weight is never tied, the head may be).
Folding multiplies the loaded weight in float32 and rounds once to the model's dtype, so a bf16
checkpoint run in bf16 rounds as often as transformers' separate multiply; the products differ from
it only by that rounding's order.

Checkpoints name the mixer `mamba.`, the MoE block `block_sparse_moe.` with stacked experts
`input_linear` [E, 2I, H] (gate rows, then up) / `output_linear` [E, H, I] and the router
`router.layer`, the shared MLP `shared_mlp.input_linear` / `output_linear`; transformers 5's own
names (`experts.gate_up_proj`, `router.weight`) are read too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from agentrt.runtime.layers.rotary import RopeSpec
from agentrt.runtime.models.base import DecoderModel
from agentrt.runtime.models.config import ModelArch, base_arch

MIXERS = {
    "mamba": "mamba2",
    "linear_attention": "mamba2",
    "attention": "attention",
    "full_attention": "attention",
}
RENAMES = (  # checkpoint (original or transformers 5) -> this layout, before expert splitting
    (re.compile(r"\.mamba\."), ".linear_attn."),
    (re.compile(r"\.block_sparse_moe\.router\.(layer\.)?weight$"), ".mlp.gate.weight"),
    (
        re.compile(r"\.block_sparse_moe\.(input_linear\.weight|experts\.gate_up_proj)$"),
        ".mlp.experts.gate_up_proj",
    ),
    (
        re.compile(r"\.block_sparse_moe\.(output_linear\.weight|experts\.down_proj)$"),
        ".mlp.experts.down_proj",
    ),
)


def _multiplier(cfg, name: str, default: float | None = 1.0) -> float | None:
    """Config multiplier `name` as a float; `default` when absent or null."""
    value = getattr(cfg, name, None)
    return default if value is None else float(value)


@dataclass(frozen=True)
class GraniteArch(ModelArch):
    """ModelArch plus the two Granite multipliers folded into the weights at load (module
    docstring): `residual_multiplier`, `logits_scaling`."""

    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


class GraniteMoeHybridForCausalLM(DecoderModel):
    @classmethod
    def arch_from_config(cls, cfg, architecture: str) -> GraniteArch:
        """Raises ValueError naming `layer_types` when it does not name a known mixer for every layer,
        or naming `logits_scaling` when it is 0."""
        n = cfg.num_hidden_layers
        types = list(getattr(cfg, "layer_types", None) or [])[:n]
        unknown = sorted({t for t in types if t not in MIXERS})
        if unknown or len(types) != n:
            raise ValueError(
                f"{architecture}: layer_types must name {n} layers of {sorted(MIXERS)}, got {unknown or types}"
            )
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{architecture}: hidden_act '{act}' is not supported (silu is)")
        logits_scaling = _multiplier(cfg, "logits_scaling")
        if logits_scaling == 0.0:
            raise ValueError(f"{architecture}: logits_scaling must not be 0 (the logits are divided by it)")
        embed = _multiplier(cfg, "embedding_multiplier")
        experts = getattr(cfg, "num_local_experts", 0) or 0
        shared = cfg.shared_intermediate_size
        moe = {}
        if experts:
            moe = {
                "num_experts": experts,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.intermediate_size,
                "moe_layers": (True,) * n,
                "moe_routing": "topk_softmax",
                "shared_expert_intermediate_size": shared,
            }
        arch = base_arch(
            cfg,
            architecture,
            intermediate_size=shared,  # the dense MLP, when there are no experts
            o_bias=bool(getattr(cfg, "attention_bias", False)),
            attn_scale=_multiplier(cfg, "attention_multiplier", None),
            embed_scale=None if embed == 1.0 else embed,
            layer_mixers=tuple(MIXERS[t] for t in types),
            mixer_config=cfg,
            **moe,
        )
        fields = {f: getattr(arch, f) for f in arch.__dataclass_fields__}
        if getattr(cfg, "position_embedding_type", None) != "rope":
            fields["ropes"] = (RopeSpec.nope(arch.head_dim),)
        return GraniteArch(
            **fields,
            residual_multiplier=_multiplier(cfg, "residual_multiplier"),
            logits_scaling=logits_scaling,
        )

    def rename(self, name: str) -> str:
        """DecoderModel.rename, of this model (not the class): the shared MLP is the MoE block's
        shared experts, or the dense MLP when the model has no experts."""
        for pattern, target in RENAMES:
            name = pattern.sub(target, name)
        shared = ".mlp.shared_experts." if self.arch.num_experts else ".mlp."
        name = name.replace(".shared_mlp.input_linear.", f"{shared}gate_up_proj.")
        return name.replace(".shared_mlp.output_linear.", f"{shared}down_proj.")

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """DecoderModel's load, then the residual multiplier and the logits scaling folded in (module
        docstring). Raises ValueError as DecoderModel.load_hf_state_dict does."""
        super().load_hf_state_dict(tensors)
        self._fold_multipliers()

    @torch.no_grad()
    def _fold_multipliers(self) -> None:
        arch: GraniteArch = self.arch
        scale = arch.residual_multiplier
        outputs = (".linear_attn.out_proj.", ".self_attn.o_proj.", "down_proj.")
        for name, p in self.named_parameters():
            if scale != 1.0 and name.startswith("layers.") and any(s in name for s in outputs):
                p.copy_(p.float() * scale)
        if arch.logits_scaling != 1.0:
            self.norm.weight.copy_(self.norm.weight.float() / arch.logits_scaling)
