"""Typed hand-offs between the engine's stages (runtime/engine.py):
schedule -> `list[ScheduledChunk]` -> prepare -> `BatchPlan` -> forward -> `ForwardOutput`
-> sample -> `SampleOutput` -> process -> `list[RequestOutput]`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.request import Request, TokenLogprob


class SampleRow(NamedTuple):
    """A request that gets new tokens this step and its logits rows [row, row + num_rows):
    one row for a sampled token, len(draft) + 1 for a speculative verify chunk (`verify`)."""

    request: Request
    row: int
    num_rows: int
    verify: bool


@dataclass
class BatchPlan:
    """One step's forward, laid out: `chunks` for the model runner (one per scheduled request),
    `rows` the requests that get tokens (in logits-row order), `num_rows` logits rows in all,
    `num_prefill_tokens` prompt (or recomputed) tokens computed, `num_seqs` sequences in the batch."""

    chunks: list[SeqChunk]
    rows: list[SampleRow]
    num_rows: int
    num_prefill_tokens: int
    num_seqs: int

    @property
    def sampled(self) -> list[SampleRow]:
        """Rows whose next token is sampled (not verified)."""
        return [s for s in self.rows if not s.verify]


class ForwardOutput(NamedTuple):
    """logits [num_rows, vocab] float32 (penalties and bitmasks applied by the sample stage);
    hidden [num_rows, hidden_size] (Medusa only) or None; bitmask [num_rows, ceil(vocab / 32)]
    int32 of the `constrained_rows` (filled while the forward ran), or None."""

    logits: torch.Tensor
    hidden: torch.Tensor | None
    bitmask: torch.Tensor | None
    constrained_rows: list[int]


class SampleOutput(NamedTuple):
    """token_ids[i]: the token sampled for `BatchPlan.sampled[i]` (-1 when every token was masked);
    logprobs[i]: its TokenLogprob, for the rows whose request asked for logprobs."""

    token_ids: list[int]
    logprobs: dict[int, TokenLogprob] | None = None
