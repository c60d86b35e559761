"""Fault isolation for the batch-wide stages of an engine step (runtime/engine.py): an exception
raised while serving one request fails that request alone (InternalError); the others in the batch
keep their exact outputs (greedy outputs stay token-identical to running alone).

Where a step is batch-wide and what happens on an exception:
- bitmask fill (all constrained rows at once, on the mask thread): refill row by row; a matcher that
  raises fails its request.
- model forward (`ModelRunner.execute` over every chunk): rerun each chunk alone to find the ones
  that raise, fail those, and run the forward again without them (the forward is a deterministic
  function of each chunk and rewrites the same KV slots with the same values). When every chunk
  succeeds alone, the fault is the batch's (device memory, a bug in batching): it is raised, and
  AsyncEngine fails the step's requests, as before.
- penalties and bitmask application, sampling: row by row; a row that raises, or whose logits hold
  NaN (a sampler NaN/inf row), fails its request.
- per-token processing (grammar accept, jump-forward, closing path, detokenizer, stop strings,
  speculative verification): per request already (Engine._process).
- n-gram / Medusa drafting (Speculator.propose, before the step): per request; a request whose
  draft fitting raises (its matcher) fails. A draft model drafts the whole batch in one forward:
  an exception there still fails the step (not isolated).
"""

from __future__ import annotations

import logging

from agentrt.errors import InternalError
from agentrt.runtime.batch import BatchPlan, SampleRow

logger = logging.getLogger(__name__)


def internal_error(stage: str, e: BaseException) -> InternalError:
    """The InternalError a request fails with after `e` in `stage` ("sampling", "the forward"...)."""
    return InternalError(f"internal error in {stage}: {type(e).__name__}: {e}")


def fill_rows_one_by_one(grammar, sampled: list[SampleRow], bitmask, failed: dict) -> None:
    """After a batched bitmask fill raised: fill each sampled constrained row alone into `bitmask`;
    a request whose matcher raises goes into `failed` (request -> InternalError)."""
    for s in sampled:
        try:
            grammar.fill_bitmask(s.request.grammar.matcher, bitmask, s.row)
        except Exception as e:
            logger.exception("bitmask fill for %s failed", s.request.request_id)
            failed[s.request] = internal_error("the grammar matcher", e)


def find_forward_culprits(runner, plan: BatchPlan, requests: dict[int, object], failed: dict) -> bool:
    """After `runner.execute(plan.chunks)` raised: run each chunk alone; requests whose chunk raises
    go into `failed`. Returns whether any was found. `requests`: seq_key -> Request."""
    found = False
    for c in plan.chunks:
        try:
            runner.execute([c])
        except Exception as e:
            r = requests[c.seq_key]
            logger.exception("forward of %s failed", r.request_id)
            failed[r] = internal_error("the forward", e)
            found = True
    return found


def plan_without(plan: BatchPlan, failed: dict) -> BatchPlan:
    """`plan` without the chunks and rows of the failed requests (logits rows renumbered)."""
    keys = {id(r) for r in failed}
    chunks = [c for c in plan.chunks if c.seq_key not in keys]
    rows, num_rows = [], 0
    for s in plan.rows:
        if s.request in failed:
            continue
        rows.append(SampleRow(s.request, num_rows, s.num_rows, s.verify))
        num_rows += s.num_rows
    return BatchPlan(chunks, rows, num_rows, plan.num_prefill_tokens, len(chunks))
