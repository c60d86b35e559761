"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads", arXiv 2401.10774): K extra heads on the target's last hidden state; head
k (0-based) predicts the token k + 2 positions ahead (the model's own LM head predicts the next).
Each head is `num_layers` residual blocks x + SiLU(W x + b) followed by an LM head.

Checkpoint layout (the original Medusa repository's `medusa_lm_head.safetensors` beside a
`config.json` with `medusa_num_heads` and `medusa_num_layers`): keys `{k}.{j}.linear.weight`,
`{k}.{j}.linear.bias` for block j of head k and `{k}.{num_layers}.weight` for its LM head. Heads
trained here set `"shared_lm_head": true` in config.json and store no `{k}.{L}.weight`: they reuse
the target's LM head (its 576 x 49152 matrix per head would make the file 100x larger), as Hydra and
EAGLE do.

Training (Medusa-1: the target frozen) by self-distillation: the target generates the responses,
and head k learns to predict, from the hidden state at position t, the token at t + k + 2
(`train_heads`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS_FILE = "medusa_lm_head.safetensors"


class ResBlock(nn.Module):
    """x + SiLU(linear(x)); the linear starts at zero (identity), as in Medusa."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """forward(hidden [B, hidden_size], lm_head) -> logits [num_heads, B, vocab] fp32. `lm_head`, used
    by heads without their own LM head (shared_lm_head), is the target's LM head: its weight
    [vocab, hidden_size] or the module itself (a quantized LM head has no dense weight: the module
    maps [..., hidden_size] to [..., vocab] in its input's dtype)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int,
        num_layers: int = 1,
        shared_lm_head: bool = True,
    ):
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"Medusa needs >= 1 head and layer, got {num_heads} heads, {num_layers} layers")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers, self.shared_lm_head = num_heads, num_layers, shared_lm_head
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers))) for _ in range(num_heads)
        )
        self.lm_heads = (
            None
            if shared_lm_head
            else nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
        )

    def forward(self, hidden: torch.Tensor, lm_head: torch.Tensor | nn.Module | None = None) -> torch.Tensor:
        outs = []
        for k, block in enumerate(self.blocks):
            h = block(hidden)
            if self.lm_heads is not None:
                outs.append(self.lm_heads[k](h).float())
            elif isinstance(lm_head, torch.Tensor):
                outs.append(F.linear(h, lm_head).float())
            else:
                outs.append(lm_head(h).float())
        return torch.stack(outs)

    # ---- checkpoint ------------------------------------------------------------------------
    def save(self, directory: str | Path, extra_config: dict | None = None, dtype=torch.float16) -> None:
        """Write config.json + medusa_lm_head.safetensors (original key layout) into `directory`."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for k, block in enumerate(self.blocks):
            for j, res in enumerate(block):
                tensors[f"{k}.{j}.linear.weight"] = res.linear.weight.detach().to(dtype).contiguous()
                tensors[f"{k}.{j}.linear.bias"] = res.linear.bias.detach().to(dtype).contiguous()
            if self.lm_heads is not None:
                tensors[f"{k}.{self.num_layers}.weight"] = (
                    self.lm_heads[k].weight.detach().to(dtype).contiguous()
                )
        save_file(tensors, str(d / WEIGHTS_FILE))
        config = {
            "medusa_num_heads": self.num_heads,
            "medusa_num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "shared_lm_head": self.shared_lm_head,
            **(extra_config or {}),
        }
        (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path, hidden_size: int, vocab_size: int) -> MedusaHeads:
        """Heads from a Medusa checkpoint directory (config.json + medusa_lm_head.safetensors).
        Raises ValueError when files are missing or shapes do not fit the target model, or naming
        the file when only the pickle checkpoint medusa_lm_head.pt is there (never unpickled)."""
        d = Path(directory)
        if not (d / "config.json").exists():
            raise ValueError(f"Medusa heads directory {d} has no config.json")
        config = json.loads((d / "config.json").read_text())
        if (d / WEIGHTS_FILE).exists():
            from safetensors.torch import load_file

            tensors = load_file(str(d / WEIGHTS_FILE))
        elif (d / "medusa_lm_head.pt").exists():
            raise ValueError(
                f"{d / 'medusa_lm_head.pt'} is a pickle checkpoint: agentrt loads Medusa heads only from "
                f"{WEIGHTS_FILE} (unpickling a file can run code hidden in it); convert it to safetensors "
                "with a tool you trust"
            )
        else:
            raise ValueError(f"Medusa heads directory {d} has no {WEIGHTS_FILE}")
        tensors = {k.removeprefix("medusa_head."): v for k, v in tensors.items()}
        num_heads = int(config.get("medusa_num_heads", 0))
        num_layers = int(config.get("medusa_num_layers", 1))
        shared = bool(config.get("shared_lm_head", False))
        heads = cls(hidden_size, vocab_size, num_heads, num_layers, shared)
        own = {}
        for k in range(num_heads):
            for j in range(num_layers):
                own[f"{k}.{j}.linear.weight"] = heads.blocks[k][j].linear.weight
                own[f"{k}.{j}.linear.bias"] = heads.blocks[k][j].linear.bias
            if not shared:
                own[f"{k}.{num_layers}.weight"] = heads.lm_heads[k].weight
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise ValueError(f"Medusa checkpoint {d} lacks {missing[:4]}")
        with torch.no_grad():
            for name, param in own.items():
                if tuple(tensors[name].shape) != tuple(param.shape):
                    raise ValueError(
                        f"Medusa weight {name} has shape {tuple(tensors[name].shape)}, the model "
                        f"needs {tuple(param.shape)} (hidden {hidden_size}, vocab {vocab_size})"
                    )
                param.copy_(tensors[name].float())
        return heads


def head_targets(token_ids: list[int], num_heads: int, start: int) -> torch.Tensor:
    """Targets [num_heads, T] int64 for the hidden states at positions 0..T-1 of `token_ids`:
    head k at position t learns token t + k + 2; -100 (ignored) where that lies beyond the sequence
    or before `start` (the first response position: prompt tokens are not trained on)."""
    n = len(token_ids)
    ids = torch.tensor(token_ids, dtype=torch.int64)
    out = torch.full((num_heads, n), -100, dtype=torch.int64)
    for k in range(num_heads):
        shift = k + 2
        if n > shift:
            out[k, : n - shift] = ids[shift:]
        out[k, : max(0, start - 1)] = -100  # positions whose next token is still the prompt
    return out


def train_heads(
    heads: MedusaHeads,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lm_head_weight: torch.Tensor,
    epochs: int = 3,
    lr: float = 1e-3,
    batch_size: int = 256,
    seed: int = 0,
    holdout: float = 0.1,
    log=print,
) -> dict:
    """Medusa-1 training on cached hidden states: hidden [T, hidden_size] fp32 (the frozen target's
    final-norm output), targets [num_heads, T] int64 (`head_targets`, -100 ignored). AdamW with a
    cosine schedule; the last `holdout` fraction of positions is held out. Returns
    {"train_loss": [...per head], "holdout_top1": [...per head]} (top-1 accuracy)."""
    g = torch.Generator().manual_seed(seed)
    n = hidden.shape[0]
    split = int(n * (1 - holdout))
    train_idx = torch.arange(split)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    steps = max(1, epochs * math.ceil(split / batch_size))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    w = lm_head_weight.detach().float()
    losses = [0.0] * heads.num_heads
    heads.train()
    for epoch in range(epochs):
        order = train_idx[torch.randperm(split, generator=g)]
        total = [0.0] * heads.num_heads
        count = 0
        for b in range(0, split, batch_size):
            idx = order[b : b + batch_size]
            logits = heads(hidden[idx], w)  # [K, B, V]
            loss_k = [
                F.cross_entropy(logits[k], targets[k, idx], ignore_index=-100) for k in range(heads.num_heads)
            ]
            loss_k = [x if torch.isfinite(x) else x.new_zeros(()) for x in loss_k]  # a batch all ignored
            # Medusa weighs far heads less (lambda_k = 0.8^k)
            loss = sum(0.8**k * x for k, x in enumerate(loss_k))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total = [t + float(x.detach()) for t, x in zip(total, loss_k)]
            count += 1
        losses = [t / max(1, count) for t in total]
        log(f"epoch {epoch + 1}/{epochs}: loss per head " + " ".join(f"{x:.3f}" for x in losses))
    heads.eval()
    top1 = []
    with torch.no_grad():
        hold = torch.arange(split, n)
        logits = heads(hidden[hold], w) if len(hold) else None
        for k in range(heads.num_heads):
            if logits is None:
                top1.append(float("nan"))
                continue
            t = targets[k, hold]
            valid = t >= 0
            acc = (
                (logits[k].argmax(-1)[valid] == t[valid]).float().mean()
                if valid.any()
                else torch.tensor(float("nan"))
            )
            top1.append(float(acc))
    return {"train_loss": losses, "holdout_top1": top1}
