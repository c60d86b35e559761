"""The Mamba-2 mixer (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality", arXiv 2405.21060) of the Nemotron-H and Granite 4 hybrids, as
transformers 5.x computes it (`NemotronHMamba2Mixer`, `GraniteMoeHybridMambaLayer`: the same mixer).

in_proj gives the gate z, xBC and dt; xBC goes through a causal depthwise conv and SiLU and splits
into x [H, P] (H heads of P channels), B and C [G, N] (G groups of heads share them; N the state size).
Per head h, with a state S [P, N] (zeros at the start of a sequence), each token does

    dt = clamp(softplus(dt_raw + dt_bias), time_step_limit)
    S <- exp(dt A) S + dt x B^T          (A = -exp(A_log) < 0, a scalar per head)
    y = S C + D x

then y * silu(z) through an RMSNorm per group of heads (norm after the gate) and out_proj. Prefill runs
the SSD chunked form (chunks of 64 tokens, the last one shorter: quadratic attention-like inside a
chunk, the state carried by a sequential scan between chunks); decode (one token) the recurrence.
Both are torch code of our own, checked against transformers' torch references in
tests/runtime/test_recurrent_layers.py.

One divergence from transformers: the time-step limit is applied on every path. transformers (and
mamba_ssm's `selective_state_update`) clamp dt in the chunked scan only, so with a finite limit their
decode differs from their own prefill; here a sequence gives the same outputs however it is split.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from agentrt.runtime.layers.causal_conv import RecurrentMixer, causal_conv_segment, causal_conv_step

CHUNK_SIZE = 64


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of the SSD recurrence for any leading dims: x [..., H, P], dt [..., H] (after softplus
    and limits), a [H] (A, negative), b, c [..., G, N], state [..., H, P, N] float32 (updated in place)
    -> y [..., H, P] float32, without the D skip."""
    heads, groups = x.shape[-2], b.shape[-2]
    b = b.float().repeat_interleave(heads // groups, dim=-2)  # [..., H, N]
    c = c.float().repeat_interleave(heads // groups, dim=-2)
    dt = dt.float()
    state.mul_((dt * a).exp()[..., None, None])
    state.add_((x.float() * dt[..., None]).unsqueeze(-1) * b.unsqueeze(-2))
    return (state @ c.unsqueeze(-1)).squeeze(-1)


def _chunk_terms(x, dt, a, b, c):
    """Chunks x [M, H, L, P], dt [M, H, L], a [H], b, c [M, G, L, N] (float32) -> the intra-chunk
    output [M, H, L, P], the decay from the chunk start [M, G, H/G, L, 1] (the start state is read as
    that times C S^T), the state the chunk writes from a zero start [M, H, P, N], and the whole
    chunk's decay [M, H]. Decays are exp of differences of the cumulative log decay, taken in float64
    (in float32 a difference of two sums near -500 keeps only ~3e-5 of precision: measured 8e-5
    relative output error under strong decay, 2e-7 this way), masked to 0 above the diagonal."""
    num_chunks, groups, length, _ = b.shape
    heads = (num_chunks, groups, -1, length)  # heads viewed per group, so B and C broadcast
    cum = (dt * a[:, None]).view(heads).double().cumsum(-1)  # float64: exact differences below
    xdt = (x * dt[..., None]).view(*heads, x.shape[-1])
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).float().masked_fill(~causal, float("-inf")).exp()
    y_diag = ((c @ b.transpose(-1, -2))[:, :, None] * decay) @ xdt  # [M, G, H/G, L, P]
    to_end = (cum[..., -1:] - cum).float().exp()
    written = (xdt * to_end[..., None]).transpose(-1, -2) @ b[:, :, None]
    flat = (num_chunks, -1)
    y_diag, written = (t.reshape(*flat, *t.shape[-2:]) for t in (y_diag, written))
    cum = cum.float()
    return y_diag, cum.exp()[..., None], written, cum[..., -1].exp().reshape(flat)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> torch.Tensor:
    """The SSD chunked form over n tokens of one sequence: x [n, H, P], dt [n, H], a [H], b, c [n, G, N],
    state [H, P, N] float32 (updated in place) -> y [n, H, P] float32, without the D skip. Full chunks
    of `chunk_size` tokens and one shorter remainder chunk, no padding."""
    n = x.shape[0]
    num_full, rest = divmod(n, chunk_size)

    def chunks(t: torch.Tensor, start: int, count: int, size: int) -> torch.Tensor:
        """[n, H, ...] -> [count, H, size, ...] contiguous (chunk-major: each chunk's block is dense)."""
        part = t[start : start + count * size].float()
        return part.reshape(count, size, *t.shape[1:]).transpose(1, 2).contiguous()

    pieces, c_chunks = [], []
    for start, count, size in ((0, num_full, chunk_size), (n - rest, 1, rest)):
        if count and size:
            x_c, dt_c, b_c, c_c = (chunks(t, start, count, size) for t in (x, dt, b, c))
            pieces.append(_chunk_terms(x_c, dt_c, a.float(), b_c, c_c))
            c_chunks.append(c_c)
    out = []
    s = state.float()
    groups = b.shape[1]
    for c_m, (y_diag, start_decay, written, chunk_decay) in zip(c_chunks, pieces):
        for m in range(y_diag.shape[0]):
            read = start_decay[m] * (c_m[m][:, None] @ s.view(groups, -1, *s.shape[1:]).transpose(-1, -2))
            out.append(y_diag[m] + read.reshape(y_diag.shape[1:]))
            s = s * chunk_decay[m, :, None, None] + written[m]
    state.copy_(s)
    return torch.cat(out, dim=1).transpose(0, 1)


class GroupedGatedRMSNorm(nn.Module):
    """forward(x [T, D], gate [T, D]) -> [T, D] in x's dtype: weight * rmsnorm(x * silu(gate)), the norm
    over each group of `group_size` features in float32 (transformers `NemotronHRMSNormGated`: gate
    before the norm, norm per group of heads)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float() * F.silu(gate.float())
        h = h.view(*h.shape[:-1], -1, self.group_size)
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).view(x.shape)
        return self.weight * h.to(x.dtype)


class Mamba2Mixer(RecurrentMixer):
    """The Mamba-2 mixer of one decoder layer, parameters named as the checkpoints name them (`mixer.`
    + `in_proj.weight` [I + conv_dim + H, hidden] (+ `.bias`), `conv1d.weight` [conv_dim, 1, K]
    (+ `.bias`), `dt_bias`, `A_log`, `D` [H], `norm.weight` [I], `out_proj.weight` (+ `.bias`)).

    Shapes: H heads of P channels (I = H P), G groups sharing B and C of N state channels
    (conv_dim = I + 2 G N); `time_step_limit` (lo, hi) clamps dt (None or (0, inf): no limit).

    State of one sequence (`state_shapes`): "conv" [conv_dim, K-1] float32 (the conv's last inputs),
    "recurrent" [H, P, N] float32 (S above); 4 * (conv_dim (K-1) + H P N) bytes.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        head_dim: int,
        state_size: int,
        n_groups: int = 1,
        conv_kernel: int = 4,
        eps: float = 1e-5,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        time_step_limit: tuple[float, float] | None = None,
        activation: str = "silu",
        chunk_size: int = CHUNK_SIZE,
    ):
        super().__init__()
        for name, value in (
            ("mamba num_heads", num_heads),
            ("mamba head_dim", head_dim),
            ("ssm_state_size", state_size),
            ("n_groups", n_groups),
            ("conv_kernel", conv_kernel),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")
        if num_heads % n_groups:
            raise ValueError(f"mamba num_heads {num_heads} is not a multiple of n_groups {n_groups}")
        if activation not in ("silu", "swish"):
            raise ValueError(f"Mamba-2 activation '{activation}' is not supported (silu only)")
        self.num_heads, self.head_dim, self.state_size, self.n_groups = (
            num_heads,
            head_dim,
            state_size,
            n_groups,
        )
        self.intermediate = num_heads * head_dim
        self.conv_dim = self.intermediate + 2 * n_groups * state_size
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        lo, hi = time_step_limit if time_step_limit is not None else (0.0, math.inf)
        self.time_step_limit = None if (lo <= 0.0 and hi == math.inf) else (float(lo), float(hi))
        self.in_proj = nn.Linear(hidden, self.intermediate + self.conv_dim + num_heads, bias=use_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=use_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GroupedGatedRMSNorm(self.intermediate, self.intermediate // n_groups, eps)
        self.out_proj = nn.Linear(self.intermediate, hidden, bias=use_bias)

    @classmethod
    def from_hf_config(cls, cfg) -> Mamba2Mixer:
        """From a Nemotron-H config (`mamba_num_heads`, `mamba_head_dim`, `ssm_state_size`, `n_groups`,
        `conv_kernel`, `use_bias`, `use_conv_bias`, `layer_norm_epsilon`, `mamba_hidden_act`) or a
        Granite 4 (granitemoehybrid) config (`mamba_n_heads`, `mamba_d_head`, `mamba_d_state`,
        `mamba_n_groups`, `mamba_d_conv`, `mamba_proj_bias`, `mamba_conv_bias`, `rms_norm_eps`,
        `hidden_act`); both give `time_step_limit`."""
        limit = getattr(cfg, "time_step_limit", None)
        limit = tuple(limit) if limit is not None else None
        if hasattr(cfg, "mamba_n_heads"):
            return cls(
                hidden=cfg.hidden_size,
                num_heads=cfg.mamba_n_heads,
                head_dim=cfg.mamba_d_head,
                state_size=cfg.mamba_d_state,
                n_groups=cfg.mamba_n_groups,
                conv_kernel=cfg.mamba_d_conv,
                eps=cfg.rms_norm_eps,
                use_bias=cfg.mamba_proj_bias,
                use_conv_bias=cfg.mamba_conv_bias,
                time_step_limit=limit,
                activation=cfg.hidden_act,
            )
        return cls(
            hidden=cfg.hidden_size,
            num_heads=cfg.mamba_num_heads,
            head_dim=cfg.mamba_head_dim,
            state_size=cfg.ssm_state_size,
            n_groups=cfg.n_groups,
            conv_kernel=cfg.conv_kernel,
            eps=cfg.layer_norm_epsilon,
            use_bias=cfg.use_bias,
            use_conv_bias=cfg.use_conv_bias,
            time_step_limit=limit,
            activation=cfg.mamba_hidden_act,
        )

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """One sequence's state: {"conv": ((conv_dim, K-1), float32), "recurrent": ((H, P, N), float32)}."""
        return {
            "conv": ((self.conv_dim, self.conv_kernel - 1), torch.float32),
            "recurrent": ((self.num_heads, self.head_dim, self.state_size), torch.float32),
        }

    def split(self, xbc: torch.Tensor, dt: torch.Tensor):
        """Activated conv output [T, conv_dim], raw dt [T, H] -> x [T, H, P], B, C [T, G, N], dt [T, H]
        float32 (softplus, limits)."""
        t = xbc.shape[0]
        gn = self.n_groups * self.state_size
        x, b, c = xbc.split([self.intermediate, gn, gn], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if self.time_step_limit is not None:
            dt = dt.clamp(*self.time_step_limit)
        x = x.reshape(t, self.num_heads, self.head_dim)
        shape = (t, self.n_groups, self.state_size)
        return x, b.reshape(shape), c.reshape(shape), dt

    # The forward in three stages (as GatedDeltaNet's): project(x [T, hidden]) -> rows;
    # scan(rows of one segment, states) -> core [n, H, P] float32 (the D skip included);
    # finish(core [T, H, P], rows, dtype) -> [T, hidden].
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> rows (gate [T, I], xBC [T, conv_dim], raw dt [T, H])."""
        return tuple(self.in_proj(x).split([self.intermediate, self.conv_dim, self.num_heads], dim=-1))

    def scan(
        self, rows, conv_state: torch.Tensor, recurrent_state: torch.Tensor, fresh: bool
    ) -> torch.Tensor:
        """`project`'s rows of n consecutive tokens of one sequence -> core [n, H, P] float32;
        conv_state [conv_dim, K-1] and recurrent_state [H, P, N] (float32, `state_shapes`) hold the state
        before them (read as zeros when `fresh`) and are updated in place to the state after the last.
        n == 1 runs the recurrence, n > 1 the chunked form."""
        _, xbc, dt = rows
        if fresh:
            conv_state.zero_()
            recurrent_state.zero_()
        xbc = F.silu(causal_conv_segment(xbc, conv_state, self.conv1d.weight[:, 0], self.conv1d.bias))
        xs, b, c, dt = self.split(xbc, dt)
        a = -self.A_log.float().exp()
        if xbc.shape[0] == 1:
            y = ssd_step(xs[0], dt[0], a, b[0], c[0], recurrent_state)[None]
        else:
            y = ssd_chunked(xs, dt, a, b, c, recurrent_state, self.chunk_size)
        return y + xs.float() * self.D.float()[:, None]

    def scan_decode(self, rows, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> torch.Tensor:
        """One token of each of B sequences: rows of [B] tokens, conv_state [B, conv_dim, K-1],
        recurrent_state [B, H, P, N] (float32, updated in place) -> core [B, H, P] float32."""
        _, xbc, dt = rows
        xbc = F.silu(causal_conv_step(xbc, conv_state, self.conv1d.weight[:, 0], self.conv1d.bias))
        xs, b, c, dt = self.split(xbc, dt)
        y = ssd_step(xs, dt, -self.A_log.float().exp(), b, c, recurrent_state)
        return y + xs.float() * self.D.float()[:, None]

    def finish(self, core: torch.Tensor, rows, dtype: torch.dtype) -> torch.Tensor:
        """core [T, H, P] float32 and the rows it came from -> [T, hidden] in `dtype` (gated norm, out_proj)."""
        y = self.norm(core.to(dtype).reshape(core.shape[0], self.intermediate), rows[0])
        return self.out_proj(y)
