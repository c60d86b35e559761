"""Logit processing and sampling for a batch of requests with per-request parameters.

Order: logit_bias -> repetition penalty (CTRL, arXiv 1909.05858: divide positive logits, multiply
negative ones, over prompt and output tokens) -> presence/frequency penalties (OpenAI API, over
output tokens) -> grammar bitmask (by the caller) -> temperature -> top-k -> top-p (nucleus,
Holtzman et al. 2019, arXiv 1904.09751) -> min-p (arXiv 2407.01082) -> sample with the request's
own torch.Generator (seeded per request, so a seed reproduces regardless of batch company).
"""

from __future__ import annotations

import torch

from agentrt.runtime.logprobs import logprob_tensors, read_host, rows_of, token_logprob
from agentrt.runtime.request import Request, TokenLogprob


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> dict[int, Exception]:
    """In place on logits [B, V] fp32, row i for requests[i]. Returns {row: exception} for rows
    whose penalties raised (that request fails; the other rows are done)."""
    failed: dict[int, Exception] = {}
    for i, r in enumerate(requests):
        try:
            _penalize(logits, i, r)
        except Exception as e:  # noqa: BLE001 (one request's fault stays its own: runtime/isolation.py)
            failed[i] = e
    return failed


def _penalize(logits: torch.Tensor, i: int, r: Request) -> None:
    device = logits.device
    p = r.params
    if p.logit_bias:
        ids = torch.tensor([int(k) for k in p.logit_bias], dtype=torch.int64, device=device)
        vals = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=device)
        logits[i].index_add_(0, ids, vals)
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.int64, device=device)
        seen = logits[i, ids]
        logits[i, ids] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
        out = torch.tensor(r.output_ids, dtype=torch.int64, device=device)
        counts = torch.bincount(out, minlength=logits.shape[1]).to(logits.dtype)
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], grammar) -> None:
    """The one place the engine masks logits with a grammar bitmask: logits [B, V] fp32/bf16 in
    place, bitmask [B, ceil(V / 32)] int32 on the CPU (as the matchers fill it), only `rows`
    (indices into B) masked; `grammar` is the GrammarBackend (the xgrammar adapter). Raises
    ValueError when the bitmask does not cover the logits (never leaves logits unmasked).

    Per device:
    - CUDA (Triton available): our kernel, one launch for all rows (runtime/kernels/bitmask.py);
    - anything else (CPU): xgrammar's C++ kernel via `grammar.apply_bitmask`.

    Why xgrammar's kernel off CUDA: measured on this repo's 2-core EPYC dev box (OMP_NUM_THREADS=1,
    logits [16, 49152] fp32, random bitmask, median of 50 calls): xgrammar's CPU kernel 2.4 ms for
    16 rows / 1.2 ms for 8; a vectorized torch unpack + masked_fill 12.6-18 ms / 4.3-7.8 ms; our
    torch reference (row loop) 18-38 ms / 8-20 ms; our Triton kernel under TRITON_INTERPRET 1.2 s.
    Why ours on CUDA rather than xgrammar's Triton kernel (same design: unpack 32 bits per word,
    store -inf): ours runs on CPU CI under TRITON_INTERPRET and is compared there with its torch
    reference and with xgrammar's result on every test run (tests/runtime/test_kernels.py), while
    xgrammar's Triton path cannot run without a GPU (it reads torch.cuda device properties first:
    "Torch not compiled with CUDA enabled"); ours also refuses a bitmask narrower than the logits,
    where xgrammar's apply warns and leaves the tail unmasked. GPU timing of the two is not
    measured yet (no GPU in this session): if bench/gpu.py shows xgrammar's faster, switch the
    CUDA branch to `grammar.apply_bitmask` (it dispatches to xgrammar's Triton kernel there)."""
    if bitmask.shape[-1] * 32 < logits.shape[-1]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}")
    if logits.is_cuda:
        from agentrt.runtime.kernels import triton_usable

        if triton_usable(logits.device):
            from agentrt.runtime.kernels.bitmask import apply_token_bitmask

            host = torch.tensor(rows, dtype=torch.int32)
            apply_token_bitmask(
                logits,
                bitmask.to(logits.device, non_blocking=True),
                host.to(logits.device, non_blocking=True),
            )
            return
    grammar.apply_bitmask(logits, bitmask, rows)


def _filter(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """row [V] logits already divided by temperature -> row with filtered entries at -inf.
    Tensor ops only: no host sync."""
    if 0 < top_k < row.shape[0]:
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (always keeps the first)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False  # the most likely token always stays (top_p may round to 0 in fp32)
        row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    if min_p > 0.0:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return row


def sample(
    logits: torch.Tensor,
    requests: list[Request],
    errors: dict[int, str] | None = None,
    logprobs: dict[int, TokenLogprob] | None = None,
) -> list[int]:
    """logits [B, V] fp32 (penalties and masks applied) -> one token id per row.

    temperature 0 = greedy argmax. Raises nothing: a row with every token masked returns -1 (the
    caller finishes that request with an error), as does a sampled row with no finite logit; a
    row whose parameters overflow fp32 (a tiny temperature or penalty) falls back to the argmax of
    its logits. A row holding NaN (a broken forward) or whose sampling raised also returns -1,
    with the reason in `errors[row]` when `errors` is given (the caller fails that request with an
    InternalError). Every row is computed on the logits' device and read back with one host sync
    for the batch (the step's only one).
    With `logprobs` given, the rows whose request asked (SamplingParams.logprobs not None) get
    `logprobs[row]`: the sampled token's TokenLogprob (runtime/logprobs.py: log-softmax of these
    logits, i.e. before temperature and the top-k/top-p/min-p filters), read back in that same sync."""
    # one pass over the vocabulary for the greedy rows (argmax and the checks were five: ~0.4 ms a
    # token at batch 1 on the CPU): argmax takes a NaN as the maximum, so a row holding NaN has a NaN
    # at its argmax, and a row whose argmax is -inf is -inf everywhere
    best, greedy = logits.max(dim=-1)  # the first maximum's index, as argmax
    tokens = greedy if all(r.params.is_greedy for r in requests) else greedy.clone()
    has_nan = torch.isnan(best)
    failed = best == float("-inf")  # every token masked
    no_finite = None
    raised: dict[int, str] = {}
    for i, r in enumerate(requests):
        p = r.params
        if p.is_greedy:  # 0 (or a value too small for fp32 division) is greedy
            continue
        if no_finite is None:
            no_finite = ~torch.isfinite(logits).any(dim=-1)
        try:
            probs = torch.softmax(_filter(logits[i] / p.temperature, p.top_k, p.top_p, p.min_p), dim=-1)
            valid = torch.isfinite(probs).all() & (probs.sum() > 0)
            failed[i] |= ~valid & no_finite[i]  # nothing to fall back to (NaN / inf logits)
            fallback = torch.nn.functional.one_hot(greedy[i], logits.shape[1]).to(probs.dtype)
            # an invalid row draws from its argmax one-hot: the generator advances either way
            tokens[i] = torch.multinomial(torch.where(valid, probs, fallback), 1, generator=r.generator)[0]
        except Exception as e:  # noqa: BLE001 (one row's fault stays its own: runtime/isolation.py)
            raised[i] = f"sampling raised {type(e).__name__}: {e}"
    flags = torch.stack([tokens, failed.long(), has_nan.long()])
    want = (
        [i for i, r in enumerate(requests) if r.params.logprobs is not None] if logprobs is not None else []
    )
    if not want:
        ids, bad, nan = flags.tolist()
    else:  # the asked-for rows' logprobs travel with the sampled ids: still one host read
        k = max(requests[i].params.logprobs for i in want)
        lt = logprob_tensors(logits[want], list(range(len(want))), tokens[want], k)
        host, chosen, values, top_ids = read_host(flags, lt.chosen, lt.top_values, lt.top_ids)
        ids, bad, nan = ([int(x) for x in row] for row in rows_of(host, 3))
        values, top_ids = rows_of(values, len(want)), rows_of(top_ids, len(want))
        for j, i in enumerate(want):
            logprobs[i] = token_logprob(ids[i], chosen[j], values[j], top_ids[j], requests[i].params.logprobs)
    for i, n in enumerate(nan):
        if n:
            raised.setdefault(i, "the logits hold NaN")
    if errors is not None:
        errors.update(raised)
    return [-1 if b or i in raised else t for i, (t, b) in enumerate(zip(ids, bad))]


def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """logits [N, V] fp32 (masks and logit_bias applied) -> probabilities [N, V] fp32 under a
    request's temperature (> 0), top-k, top-p and min-p: the distribution `sample` draws from.
    A row with every token masked comes back all zero."""
    rows = [_filter(row / params.temperature, params.top_k, params.top_p, params.min_p) for row in logits]
    probs = torch.softmax(torch.stack(rows), dim=-1)
    return torch.nan_to_num(probs, nan=0.0)
