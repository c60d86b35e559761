"""Causal depthwise short convolution with a carried state: the input convolution of the linear-attention
and SSM mixers (Gated DeltaNet's q/k/v conv, Mamba-2's xBC conv; transformers `causal_conv1d_fn` /
`causal_conv1d_update`, the `causal-conv1d` package's semantics).

The state of one sequence is the last K-1 inputs before the segment, [channels, K-1] (oldest first),
zeros at the start of a sequence; consuming a segment of n tokens in one call or in any split gives the
same outputs (each output is a K-term dot product over the same inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def causal_conv_segment(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [n, C] (n consecutive tokens of one sequence), conv_state [C, K-1] (the K-1 inputs before x,
    any float dtype; updated in place to the K-1 inputs ending with x's last token), weight [C, K]
    (nn.Conv1d's [C, 1, K] squeezed; tap K-1 multiplies the current token), bias [C] or None ->
    [n, C] in weight's dtype, before the activation. The sum is computed in weight's dtype
    (transformers casts the inputs to it too)."""
    n, channels = x.shape
    width = weight.shape[1]
    if n == 1:
        return causal_conv_step(x, conv_state[None], weight, bias)
    full = torch.cat([conv_state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)  # [C, K-1+n]
    out = F.conv1d(full[None], weight[:, None, :], bias, groups=channels)[0]  # [C, n]
    if width > 1:
        conv_state.copy_(full[:, -(width - 1) :])
    return out.t()


def causal_conv_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One token of B sequences at once: x [B, C], conv_state [B, C, K-1] (updated in place) ->
    [B, C] in weight's dtype, before the activation."""
    state = conv_state.to(weight.dtype)
    xt = x.to(weight.dtype)
    out = (state * weight[:, :-1]).sum(-1) + xt * weight[:, -1]
    if bias is not None:
        out = out + bias
    if weight.shape[1] > 1:
        conv_state.copy_(torch.cat([conv_state[..., 1:], xt[..., None].to(conv_state.dtype)], dim=-1))
    return out


class RecurrentMixer(nn.Module):
    """A recurrent token mixer (layers/gated_delta.py, layers/mamba2.py) in three stages, so that a
    batch of sequences projects and finishes its rows in one call each and only the scan runs per
    sequence (runtime/recurrent_state.run_recurrent): `project(x [T, hidden]) -> rows`;
    `scan(rows of n consecutive tokens of one sequence, conv_state, recurrent_state, fresh) -> core
    [n, ...]` float32, the states updated in place (read as zeros when `fresh`); `scan_decode(rows of
    B sequences' one token, conv_states [B, ...], recurrent_states [B, ...]) -> core [B, ...]`;
    `finish(core [T, ...], rows, dtype) -> [T, hidden]`."""

    def forward_segment(
        self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor, fresh: bool
    ) -> torch.Tensor:
        """x [n, hidden]: n consecutive tokens of one sequence -> [n, hidden] in x's dtype (`scan`'s
        states and rules); a sequence split into any segments gives the outputs of one segment
        within float32 rounding."""
        rows = self.project(x)
        return self.finish(self.scan(rows, conv_state, recurrent_state, fresh), rows, x.dtype)

    def forward_decode(
        self, x: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor
    ) -> torch.Tensor:
        """One token of each of B sequences: x [B, hidden] and the B sequences' states (updated in
        place) -> [B, hidden]."""
        rows = self.project(x)
        return self.finish(self.scan_decode(rows, conv_state, recurrent_state), rows, x.dtype)
