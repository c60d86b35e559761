"""The Triton backend's scans of the recurrent mixers (recurrent_state.Scans): the middle stage of
recurrent_state.run_recurrent, with the state pool's rows addressed by slot in place (no gather or
scatter of states), as vLLM and SGLang run Qwen3-Next and the Mamba-2 hybrids.

- Gated DeltaNet (layers/gated_delta.py): decode through kernels/conv_step.py and
  kernels/gated_delta_decode.py; every other sequence (prefill chunks, a fresh or snapshotting single
  token) through the short convolution in torch, segment by segment on the pool's rows (its state is
  K-1 inputs; a snapshot copies them), then one kernels/gated_delta_chunk.py launch for all of them,
  which writes the recurrent snapshots itself.
- Mamba-2 (layers/mamba2.py): decode through kernels/conv_step.py and kernels/ssd_decode.py; prefill
  by the mixer's torch scan (recurrent_state.segment_scans: no chunked SSD kernel yet).

Every decoding sequence takes the kernels, one or many (min_decode_batch 1), so a row's result does
not depend on what else is in the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentrt.runtime.kernels.conv_step import conv_step
from agentrt.runtime.kernels.gated_delta_chunk import gated_delta_chunk, plan_chunks
from agentrt.runtime.kernels.gated_delta_decode import gated_delta_decode
from agentrt.runtime.kernels.ssd_decode import ssd_decode
from agentrt.runtime.layers.causal_conv import causal_conv_segment
from agentrt.runtime.layers.gated_delta import GatedDeltaNet
from agentrt.runtime.layers.mamba2 import Mamba2Mixer
from agentrt.runtime.recurrent_state import TORCH_SCANS, Scans, SeqState, segment_scans


def _conv_weight(mixer) -> torch.Tensor:
    return mixer.conv1d.weight[:, 0]  # [C, K]


def gdn_decode(mixer: GatedDeltaNet, rows, tensors: dict, slots: torch.Tensor) -> torch.Tensor:
    """Scans.decode of a Gated DeltaNet: rows of B tokens -> core [B, Hv, Dv] in the activations'
    dtype; the conv and recurrent states of `slots` updated in place."""
    mixed, _, b, a = rows
    mixed = conv_step(mixed, tensors["conv"], slots, _conv_weight(mixer), None, silu=True)
    q, k, v = mixer.split_heads(mixed)
    g, beta = mixer.gates(b, a)
    return gated_delta_decode(q, k, v, g, beta, tensors["recurrent"], slots)


def _packed(seqs: list[SeqState], device: torch.device, memo: dict):
    """(rows of `seqs` in the flat batch [R] int64, the same sequences renumbered over those R rows,
    their kernels/gated_delta_chunk.ChunkPlan), once per forward."""
    if "gdn_packed" not in memo:
        at, packed, start = [], [], 0
        for s in seqs:
            at.extend(range(s.start, s.end))
            packed.append(SeqState(start, start + s.end - s.start, s.slot, s.fresh, s.snapshots))
            start += s.end - s.start
        memo["gdn_packed"] = (torch.tensor(at, dtype=torch.int64, device=device), plan_chunks(packed, device))
    return memo["gdn_packed"]


def _conv_segments(mixer, mixed: torch.Tensor, conv: torch.Tensor, seqs: list[SeqState]) -> torch.Tensor:
    """The short convolution (and SiLU) of `seqs`' rows of `mixed`, segment by segment on the pool's
    conv rows `conv` [S, C, K-1] in place (zeroed first where fresh), each snapshot's slot given the
    K-1 inputs before its point -> [R, C], the sequences' rows in order."""
    weight, outs = _conv_weight(mixer), []
    for s in seqs:
        state = conv[s.slot]
        if s.fresh:
            state.zero_()
        pos = s.start
        for n, snap in [*s.snapshots, (s.end - s.start, None)]:
            end = s.start + n
            if end > pos:
                outs.append(causal_conv_segment(mixed[pos:end], state, weight, None))
                pos = end
            if snap is not None:
                conv[snap].copy_(state)
    return F.silu(torch.cat(outs))


def gdn_segments(mixer: GatedDeltaNet, rows, tensors: dict, seqs: list[SeqState], memo: dict):
    """Scans.segments of a Gated DeltaNet: [(rows [R] int64, core [R, Hv, Dv] float32)], every
    sequence's recurrent state through one chunked kernel launch."""
    mixed, _, b, a = rows
    at, plan = _packed(seqs, mixed.device, memo)
    q, k, v = mixer.split_heads(_conv_segments(mixer, mixed, tensors["conv"], seqs))
    g, beta = mixer.gates(b.index_select(0, at), a.index_select(0, at))
    return [(at, gated_delta_chunk(q, k, v, g, beta, tensors["recurrent"], plan))]


def mamba2_decode(mixer: Mamba2Mixer, rows, tensors: dict, slots: torch.Tensor) -> torch.Tensor:
    """Scans.decode of a Mamba-2 mixer: rows of B tokens -> core [B, H, P] float32 (the D skip
    included); the conv and recurrent states of `slots` updated in place."""
    _, xbc, dt = rows
    xbc = conv_step(xbc, tensors["conv"], slots, _conv_weight(mixer), mixer.conv1d.bias, silu=True)
    x, b, c, dt = mixer.split(xbc, dt)
    return ssd_decode(x, dt, -mixer.A_log.float().exp(), b, c, mixer.D, tensors["recurrent"], slots)


SCANS = {
    GatedDeltaNet: Scans(gdn_decode, gdn_segments, min_decode_batch=1),
    Mamba2Mixer: Scans(mamba2_decode, segment_scans, min_decode_batch=1),
}

# What the plan says of each mixer kind on this backend (run_plan: the "recurrent layers" line)
DESCRIPTIONS = {
    "gated_delta": "Gated DeltaNet by the Triton kernels (decode step, chunked prefill)",
    "mamba2": "Mamba-2 decode by the Triton kernels, its prefill by the torch SSD scan",
}


def triton_scans(mixer) -> Scans:
    """The Scans of `mixer` on the Triton backend (torch's for a mixer kind without kernels)."""
    return SCANS.get(type(mixer), TORCH_SCANS)
