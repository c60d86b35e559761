"""Token logprobs (OpenAI's `logprobs` / `top_logprobs`) from the logits the sampler sees.

Definition (request.TokenLogprob): log-softmax of a row's logits after logit_bias, penalties and
the grammar bitmask, before temperature / top-k / top-p / min-p. Only the rows of requests that
asked are computed (torch ops on [rows, V] float32, on the logits' device); the results travel to
the host in the same single read as the sampled ids (`read_host`), so asking adds no host sync to
a sampled step, and a step whose requests did not ask does no work here at all.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from agentrt.runtime.request import TokenLogprob


class LogprobTensors(NamedTuple):
    """Device tensors over R logits rows: `chosen` [T] float32, the logprobs of T (row, token) pairs;
    `top_values` / `top_ids` [R, k] float32 / int64, each row's k most likely tokens (k = 0: [R, 0]);
    `best` [R] float32, each row's largest logprob (that of its argmax)."""

    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor
    best: torch.Tensor


def logprob_tensors(
    logits: torch.Tensor, token_rows: torch.Tensor | list[int], token_ids: torch.Tensor | list[int], k: int
) -> LogprobTensors:
    """Log-softmax of every row of `logits` [R, V] (float32/bf16, masked tokens at -inf): the
    logprob of `token_ids[i]` at row `token_rows[i]` (`chosen`, one per pair), and each row's top k
    (0 <= k, capped at V) and largest value. Tensor ops only: no host sync. Token ids below 0 (a
    failed row) read token 0's value; the caller discards them."""
    device = logits.device
    token_rows = torch.as_tensor(token_rows, dtype=torch.int64, device=device)
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64, device=device)
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp[token_rows, token_ids.clamp(min=0)]
    k = min(k, lp.shape[-1])
    if k > 0:
        top = torch.topk(lp, k, dim=-1)
        values, ids = top.values, top.indices
        best = values[:, 0]
    else:
        values = lp.new_empty(lp.shape[0], 0)
        ids = torch.empty(lp.shape[0], 0, dtype=torch.int64, device=device)
        best = lp.amax(dim=-1)
    return LogprobTensors(chosen, values, ids, best)


def read_host(*tensors: torch.Tensor) -> list[list[float]]:
    """Every tensor flattened, as Python floats, in one device-to-host read (one sync). Integer
    tensors must hold values below 2^53 in magnitude (token ids, flags): exact in float64."""
    flat = [t.reshape(-1).to(torch.float64) for t in tensors]
    values = torch.cat(flat).tolist() if flat else []
    out, at = [], 0
    for t in flat:
        out.append(values[at : at + t.numel()])
        at += t.numel()
    return out


def token_logprob(
    token_id: int, logprob: float, values: list[float], ids: list[float], k: int
) -> TokenLogprob:
    """A TokenLogprob from host values: the first k of `values` / `ids` (a row's top, most likely
    first), dropping tokens at -inf (masked) and non-finite values."""
    top = tuple((int(i), v) for v, i in zip(values[:k], ids[:k]) if math.isfinite(v))
    return TokenLogprob(int(token_id), logprob, top)


def rows_of(flat: list[float], num_rows: int) -> list[list[float]]:
    """A flat host list of num_rows equal rows, split back into rows."""
    if num_rows == 0:
        return []
    width = len(flat) // num_rows
    return [flat[i * width : (i + 1) * width] for i in range(num_rows)]
