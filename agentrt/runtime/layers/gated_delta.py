"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta
Rule", arXiv 2412.06464): the linear-attention mixer of Qwen3-Next and Qwen3.5 / Qwen3.6, as
transformers 5.x computes it (`Qwen3NextGatedDeltaNet`, `Qwen3_5GatedDeltaNet`).

Per value head h, with a state S [Dk, Dv] (zeros at the start of a sequence), each token does

    S <- exp(g_t) * S                       (gated decay, g_t <= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T   (delta rule: write the correction, learning rate beta_t)
    o_t = S^T q_t

with q, k L2-normalised and q scaled by Dk^-0.5. Prefill runs the equivalent chunked form (chunks of
64 tokens, the last one shorter): inside a chunk the delta-rule updates are folded into one triangular
solve (the WY / UT representation of DeltaNet, Yang et al. 2024, arXiv 2406.06484), and a sequential
scan carries S from chunk to chunk. Decode (one token) runs the recurrence. Both are torch code of
our own, checked against transformers' torch references in tests/runtime/test_recurrent_layers.py.

The layer works on one sequence at a time (`forward_segment`) or one token of many (`forward_decode`);
the caller owns the per-sequence state (`state_shapes`) and passes it in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.runtime.layers.causal_conv import RecurrentMixer, causal_conv_segment, causal_conv_step

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of the gated delta rule for any leading dims: q, k [..., H, Dk] (normalised, q
    scaled), v [..., H, Dv], g (log decay) and beta [..., H], state [..., H, Dk, Dv] float32, updated
    in place -> o [..., H, Dv] float32."""
    state.mul_(g.float().exp()[..., None, None])
    k = k.float()
    kv = (k.unsqueeze(-2) @ state).squeeze(-2)  # [..., H, Dv]: what the state predicts for k
    delta = (v.float() - kv) * beta.float()[..., None]
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (q.float().unsqueeze(-2) @ state).squeeze(-2)


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """The recurrence over n tokens of one sequence: q, k [n, H, Dk], v [n, H, Dv], g, beta [n, H],
    state [H, Dk, Dv] float32 (updated in place) -> o [n, H, Dv] float32. The reference the chunked
    form and the kernels are tested against."""
    return torch.stack([gated_delta_step(q[t], k[t], v[t], g[t], beta[t], state) for t in range(q.shape[0])])


def _chunk_terms(q, k, v, g, beta):
    """Intra-chunk terms for chunks [N, H, L, .] (q, k, v float32; g, beta [N, H, L]): the query with
    its decay from the chunk start, the key with its decay to the chunk end, the UT-transformed values
    u and keys w (u - w S is what each token writes given the chunk's start state S), the causal
    intra-chunk scores and the whole chunk's decay."""
    length = q.shape[-2]
    # [N, H, L]: log decay from the chunk start through token i, in float64 so that the differences
    # below are exact (float32 sums near -500 keep ~3e-5 of precision)
    cum64 = g.double().cumsum(-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    decay = (cum64[..., :, None] - cum64[..., None, :]).float().masked_fill(~causal, float("-inf")).exp()
    cum = cum64.float()
    k_beta = k * beta[..., None]
    # (I + strictly_lower(beta_i k_i.k_j decay_ij)) X = rhs; unitriangular: the diagonal is not read
    system = (k_beta @ k.transpose(-1, -2)) * decay
    # The inverse against an identity then two matmuls: measured 13 + 25 ms against 1.5 s for one
    # solve with the 256-wide right-hand side (torch 2.13 CPU, 2 threads, 256 chunks of 64)
    eye = torch.eye(length, dtype=q.dtype, device=q.device).expand_as(system)
    inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    u = inverse @ (v * beta[..., None])
    w = inverse @ (k_beta * cum.exp()[..., None])
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum64[..., -1:] - cum64).float().exp()[..., None]
    return q_decayed, k_decayed, u, w, scores, cum[..., -1].exp()


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The chunked form over n tokens of one sequence (shapes as `gated_delta_recurrent`): full chunks
    of `chunk_size` tokens and one shorter remainder chunk, no padding. state [H, Dk, Dv] float32 is
    updated in place -> o [n, H, Dv] float32."""
    n = q.shape[0]
    num_full, rest = divmod(n, chunk_size)

    def chunks(t: torch.Tensor, start: int, count: int, size: int) -> torch.Tensor:
        """[n, H, ...] -> [count, H, size, ...] contiguous (chunk-major: each chunk's block is dense)."""
        part = t[start : start + count * size].float()
        return part.reshape(count, size, *t.shape[1:]).transpose(1, 2).contiguous()

    pieces = []
    for start, count, size in ((0, num_full, chunk_size), (n - rest, 1, rest)):
        if count and size:
            pieces.append(_chunk_terms(*(chunks(t, start, count, size) for t in (q, k, v, g, beta))))
    out = []
    s = state.float()
    for q_d, k_d, u, w, scores, chunk_decay in pieces:
        for c in range(q_d.shape[0]):
            v_new = u[c] - w[c] @ s  # [H, L, Dv]: what each token of the chunk writes
            out.append(q_d[c] @ s + scores[c] @ v_new)
            s = s * chunk_decay[c, :, None, None] + k_d[c].transpose(-1, -2) @ v_new
    state.copy_(s)
    return torch.cat(out, dim=1).transpose(0, 1)


class GatedRMSNorm(nn.Module):
    """forward(x [T, D], gate [T, D]) -> [T, D] in x's dtype: weight * rmsnorm(x) * silu(gate), the
    norm over each row in float32 (transformers `Qwen3NextRMSNormGated`: norm before the gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(RecurrentMixer):
    """The Gated DeltaNet mixer of one decoder layer, parameters named as the checkpoints name them
    (`linear_attn.` + `in_proj_qkvz.weight`, `in_proj_ba.weight` for Qwen3-Next; `in_proj_qkv`,
    `in_proj_z`, `in_proj_b`, `in_proj_a` for Qwen3.5 (`split_projections=True`); `conv1d.weight`
    [conv_dim, 1, K], `dt_bias` [Hv], `A_log` [Hv], `norm.weight` [Dv] (plain weight, not Gemma's 1+w),
    `out_proj.weight`).

    Shapes: Hk key heads of Dk, Hv value heads of Dv (Hv a multiple of Hk; value head j reads key
    head j // (Hv / Hk)); conv_dim = 2 Hk Dk + Hv Dv. Qwen3-Next's fused projections are grouped by
    key head ([q_i k_i v_i z_i] per key head i, then [b_i a_i]); Qwen3.5's are flat.

    State of one sequence (`state_shapes`): "conv" [conv_dim, K-1] float32 (the conv's last inputs),
    "recurrent" [Hv, Dk, Dv] float32 (S above); 4 * (conv_dim (K-1) + Hv Dk Dv) bytes.
    """

    def __init__(
        self,
        hidden: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        eps: float = 1e-6,
        split_projections: bool = False,
        activation: str = "silu",
        chunk_size: int = CHUNK_SIZE,
    ):
        super().__init__()
        for name, value in (
            ("linear_num_key_heads", num_k_heads),
            ("linear_num_value_heads", num_v_heads),
            ("linear_key_head_dim", head_k_dim),
            ("linear_value_head_dim", head_v_dim),
            ("linear_conv_kernel_dim", conv_kernel),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads {num_v_heads} is not a multiple of linear_num_key_heads {num_k_heads}"
            )
        if activation not in ("silu", "swish"):
            raise ValueError(f"Gated DeltaNet activation '{activation}' is not supported (silu only)")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.split_projections = split_projections
        if split_projections:
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    @classmethod
    def from_hf_config(cls, cfg, split_projections: bool | None = None) -> GatedDeltaNet:
        """From a Qwen3-Next / Qwen3.5 text config (`linear_num_key_heads`, `linear_num_value_heads`,
        `linear_key_head_dim`, `linear_value_head_dim`, `linear_conv_kernel_dim`, `rms_norm_eps`,
        `hidden_act`); `split_projections` defaults to True for a `qwen3_5*` model_type."""
        if split_projections is None:
            split_projections = str(getattr(cfg, "model_type", "")).startswith("qwen3_5")
        return cls(
            hidden=cfg.hidden_size,
            num_k_heads=cfg.linear_num_key_heads,
            num_v_heads=cfg.linear_num_value_heads,
            head_k_dim=cfg.linear_key_head_dim,
            head_v_dim=cfg.linear_value_head_dim,
            conv_kernel=cfg.linear_conv_kernel_dim,
            eps=cfg.rms_norm_eps,
            split_projections=split_projections,
            activation=cfg.hidden_act,
        )

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """One sequence's state: {"conv": ((conv_dim, K-1), float32), "recurrent": ((Hv, Dk, Dv), float32)}."""
        return {
            "conv": ((self.conv_dim, self.conv_kernel - 1), torch.float32),
            "recurrent": ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
        }

    def _project(self, x: torch.Tensor):
        """x [T, hidden] -> mixed q|k|v [T, conv_dim] (flat, conv input order), z [T, Hv, Dv], b, a [T, Hv]."""
        t = x.shape[0]
        if self.split_projections:
            z = self.in_proj_z(x).view(t, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        hk, dk = self.num_k_heads, self.head_k_dim
        per_k = self.num_v_heads // hk
        qkvz = self.in_proj_qkvz(x).view(t, hk, 2 * dk + 2 * per_k * self.head_v_dim)
        q, k, v, z = qkvz.split([dk, dk, per_k * self.head_v_dim, per_k * self.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, hk, 2 * per_k).split([per_k, per_k], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        z = z.reshape(t, self.num_v_heads, self.head_v_dim)
        return mixed, z, b.reshape(t, self.num_v_heads), a.reshape(t, self.num_v_heads)

    def split_heads(self, mixed: torch.Tensor):
        """Activated conv output [T, conv_dim] -> views q, k [T, Hk, Dk], v [T, Hv, Dv] (raw: not
        normalised, key heads not repeated; the last dim contiguous)."""
        t = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        heads_k = (t, self.num_k_heads, self.head_k_dim)
        return q.view(heads_k), k.view(heads_k), v.view(t, self.num_v_heads, self.head_v_dim)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`project`'s b, a [T, Hv] -> g (log decay, -exp(A_log) softplus(a + dt_bias)), beta
        (sigmoid(b)), both [T, Hv] float32."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, b.float().sigmoid()

    def _qkv_gates(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Activated conv output [T, conv_dim], b, a -> q, k [T, Hv, Dk] (normalised, q scaled, key heads
        repeated per value head), v [T, Hv, Dv], g, beta [T, Hv] float32."""
        q, k, v = self.split_heads(mixed)
        q = l2norm(q.float()) * self.head_k_dim**-0.5
        k = l2norm(k.float())
        if self.num_v_heads != self.num_k_heads:
            rep = self.num_v_heads // self.num_k_heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        return (q, k, v.float(), *self.gates(b, a))

    def _output(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Core output o [T, Hv, Dv] float32, gate z [T, Hv, Dv] -> [T, hidden] in `dtype`."""
        t = o.shape[0]
        o = self.norm(o.to(dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.view(t, self.value_dim))

    # The forward in three stages, so that a batch of sequences projects (and finishes) its rows in one
    # call each and only the scan runs per sequence (recurrent_state.run_recurrent):
    # project(x [T, hidden]) -> rows; scan(rows of one segment, states) -> core [n, Hv, Dv] float32;
    # finish(core [T, Hv, Dv], rows, dtype) -> [T, hidden].
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> rows (mixed q|k|v [T, conv_dim], z [T, Hv, Dv], b, a [T, Hv])."""
        return self._project(x)

    def scan(
        self, rows, conv_state: torch.Tensor, recurrent_state: torch.Tensor, fresh: bool
    ) -> torch.Tensor:
        """`project`'s rows of n consecutive tokens of one sequence -> core output [n, Hv, Dv] float32;
        conv_state [conv_dim, K-1] and recurrent_state [Hv, Dk, Dv] (float32, `state_shapes`) hold the
        state before them (read as zeros when `fresh`) and are updated in place to the state after
        the last. n == 1 runs the recurrence, n > 1 the chunked form."""
        mixed, _, b, a = rows
        if fresh:
            conv_state.zero_()
            recurrent_state.zero_()
        mixed = F.silu(causal_conv_segment(mixed, conv_state, self.conv1d.weight[:, 0], None))
        q, k, v, g, beta = self._qkv_gates(mixed, b, a)
        if mixed.shape[0] == 1:
            return gated_delta_step(q[0], k[0], v[0], g[0], beta[0], recurrent_state)[None]
        return gated_delta_chunked(q, k, v, g, beta, recurrent_state, self.chunk_size)

    def scan_decode(self, rows, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> torch.Tensor:
        """One token of each of B sequences: rows of [B] tokens, conv_state [B, conv_dim, K-1],
        recurrent_state [B, Hv, Dk, Dv] (float32, updated in place) -> core [B, Hv, Dv] float32."""
        mixed, _, b, a = rows
        mixed = F.silu(causal_conv_step(mixed, conv_state, self.conv1d.weight[:, 0], None))
        q, k, v, g, beta = self._qkv_gates(mixed, b, a)
        return gated_delta_step(q, k, v, g, beta, recurrent_state)

    def finish(self, core: torch.Tensor, rows, dtype: torch.dtype) -> torch.Tensor:
        """core [T, Hv, Dv] float32 and the rows it came from -> [T, hidden] in `dtype`."""
        return self._output(core, rows[1], dtype)
