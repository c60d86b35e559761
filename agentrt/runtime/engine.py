"""The engine: request admission, continuous batching step loop, token processing.

Each `step()` admits waiting requests while KV slots last, runs one forward over every running
sequence (prefill of new prompts + one decode token for the others), masks constrained rows with
their grammar bitmask, samples, and reports new text. Requests join and leave between steps.
When the KV pool runs out mid-decode the newest running request is preempted: its KV is freed and
it is requeued first in line; on readmission its prompt and output so far are recomputed, so it
continues exactly where it stopped (its matcher and generator are kept).
With speculative decoding (runtime/speculation.py) a decoding request's chunk is a verify chunk:
its last token plus a draft (a chain or a Medusa tree), with logits at every position; the
accepted tokens go through the same per-token processing as sampled ones. The KV pool is
token-granular, so keeping the accepted path of a tree is a matter of which slots stay with the
request: no KV is copied.
"""

from __future__ import annotations

import itertools
import logging
import random
import time

import torch

from agentrt.errors import (
    AgentrtError,
    ConstraintError,
    ContextLengthError,
    InternalError,
    InvalidRequestError,
)
from agentrt.grammars.spec import ConstraintSpec
from agentrt.grammars.xgrammar_backend import CompiledConstraint, GrammarBackend
from agentrt.prefix_cache import RadixCache
from agentrt.runtime.batch import BatchPlan, ForwardOutput, SampleOutput, SampleRow
from agentrt.runtime.config import EngineConfig
from agentrt.runtime.constraint_steps import ConstraintSteps
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.isolation import (
    fill_rows_one_by_one,
    find_forward_culprits,
    internal_error,
    plan_without,
)
from agentrt.runtime.kv_tiers import KVTiers, kv_fingerprint
from agentrt.runtime.metrics import EngineMetrics, EngineStats, LoadGauges
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.output_processor import OutputProcessor
from agentrt.runtime.request import Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprob
from agentrt.runtime.sampler import apply_bitmask, apply_penalties, sample
from agentrt.runtime.scheduler import ScheduledChunk, Scheduler

logger = logging.getLogger(__name__)


class Engine:
    """Synchronous engine; not thread-safe (AsyncEngine drives it from one thread)."""

    def __init__(self, config: EngineConfig | None = None, runner: ModelRunner | None = None):
        """`runner`: a model runner to use instead of loading `config.model` (tests pass a fake one
        with deterministic logits and no weights, see agentrt/testing/)."""
        self.config = config or EngineConfig()
        self.runner = runner or ModelRunner(
            self.config.model,
            self.config.cache,
            self.config.scheduler.max_num_seqs,
            self.config.speculative,
            self.config.scheduler.max_num_batched_tokens,
        )
        self.tokenizer = self.runner.tokenizer
        self.stop_ids = self.runner.stop_ids
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.arch.vocab_size
        self.grammar = GrammarBackend(self.tokenizer, self.vocab_size, self.stop_ids, self.config.grammar)
        cache = RadixCache() if self.config.cache.enable_prefix_cache else None
        self.tiers = self._make_tiers() if cache is not None else None
        self.scheduler = Scheduler(self.config.scheduler, self.runner.kv, cache, self.tiers)
        self.grammar_wait: list[Request] = []
        self.stats = EngineStats()
        self.metrics = EngineMetrics(self.stats, self._load)
        self.output = OutputProcessor(self.tokenizer, self.stop_ids, self.max_model_len)
        self._ids = itertools.count()
        self._failed: dict[Request, AgentrtError] = {}  # this step's requests failed by a fault
        self.constraints = ConstraintSteps(
            self.grammar, self.stop_ids, self.tokenizer, self.config.grammar, self.stats
        )
        self.speculator = None
        if self.config.speculative.method is not None:
            from agentrt.runtime.speculation import Speculator

            self.speculator = Speculator(
                self.config.speculative, self.runner, self.config.model.model, self.grammar, self.stats
            )

    def _make_tiers(self) -> KVTiers | None:
        """The host and disk KV tiers under the prefix cache, when configured."""
        c = self.config.cache
        if not c.kv_host_bytes and not c.kv_disk_dir:
            return None
        fingerprint, describe = kv_fingerprint(self.runner, c.kv_tier_block_tokens, c.kv_tier_compress)
        tiers = KVTiers(
            self.runner.kv,
            block_tokens=c.kv_tier_block_tokens,
            host_bytes=c.kv_host_bytes,
            disk_dir=c.kv_disk_dir,
            disk_bytes=c.kv_disk_bytes,
            fingerprint=fingerprint,
            describe=describe,
            compress=c.kv_tier_compress,
        )
        logger.info(
            "KV tiers: host %s, disk %s (%d blocks found), blocks of %d tokens (%d bytes each before %s)",
            f"{c.kv_host_bytes:,} bytes" if c.kv_host_bytes else "off",
            f"{c.kv_disk_dir} up to {c.kv_disk_bytes:,} bytes"
            if tiers.disk is not None and tiers.disk.enabled
            else "off",
            len(tiers.disk) if tiers.disk is not None else 0,
            c.kv_tier_block_tokens,
            tiers.block_bytes,
            c.kv_tier_compress,
        )
        return tiers

    def close(self) -> None:
        """Finish the KV tiers' pending stores and stop their threads (the engine is not used after)."""
        if self.tiers is not None:
            self.tiers.close()

    # ---- admission -------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, int]:
        """(context limit, prompt length) after validating a request's prompt and sampling values.
        Raises InvalidRequestError (param names the field) or ContextLengthError (see add_request);
        cheap, so callers may check before compiling a constraint."""
        params.validate(self.vocab_size)
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise InvalidRequestError(
                f"prompt has token ids outside the vocabulary [0, {self.vocab_size})", param="prompt"
            )
        limit = min(self.max_model_len, self.runner.kv.num_slots)
        n = len(prompt_ids)
        if n >= limit:
            raise ContextLengthError(
                f"prompt has {n} tokens, which leaves no room in the context limit of {limit} tokens",
                param="prompt",
                num_prompt_tokens=n,
                limit=limit,
            )
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ContextLengthError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({n} tokens) exceeds the context limit "
                f"of {limit} tokens",
                param="max_tokens",
                num_prompt_tokens=n,
                limit=limit,
            )
        return limit, n

    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        constraint: ConstraintSpec | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> Request:
        """Validate and enqueue (`make_request` + `enqueue`). Raises InvalidRequestError naming the
        field for an empty prompt or invalid sampling values, ContextLengthError for a prompt
        (+ max_tokens) beyond the context limit or the KV pool. A constraint compiles in the
        background (status WAITING_FOR_GRAMMAR); a compile failure finishes the request with
        finish_reason "error" and a ConstraintError. `cache_salt` keeps a tenant's prefix cache
        apart from others'."""
        req = self.make_request(prompt_ids, params or SamplingParams(), constraint, request_id, cache_salt)
        self.enqueue(req)
        return req

    def make_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: ConstraintSpec | None = None,
        request_id: str | None = None,
        cache_salt: str = "",
    ) -> Request:
        """A validated Request (not enqueued; touches no engine state, so any thread may call it).
        Raises as `check_request`."""
        limit, n = self.check_request(prompt_ids, params)
        req = Request(
            request_id or f"req-{next(self._ids)}", list(prompt_ids), params, constraint, cache_salt
        )
        req.max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        req.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        return req

    def enqueue(self, req: Request, compiled: CompiledConstraint | None = None) -> RequestOutput | None:
        """Queue a request from `make_request` (engine thread). With a constraint: `compiled` when
        the caller already has it (compiled once per request), else the compile is submitted and the
        request waits for it. Returns the final output when the request fails at once (a
        max_tokens_policy the constraint cannot meet), else None."""
        out = None
        self.constraints.start_reasoning(req)
        if req.constraint is not None and compiled is None:
            req.compile_future = self.grammar.submit(req.constraint)
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.grammar_wait.append(req)
        elif req.constraint is not None:
            out = self._start_constrained(req, compiled)
        else:
            self.scheduler.add(req)
        return out

    def abort(self, request_id: str, error: AgentrtError | None = None) -> RequestOutput | None:
        """Cancel a request wherever it is; frees its KV (into the prefix cache), radix-tree locks
        and grammar state. Its final output has finish_reason "abort", or "error" and `error` when
        given (e.g. a RequestTimeoutError); None when no such request is unfinished."""
        for r in [*self.grammar_wait, *self.scheduler.waiting, *self.scheduler.running]:
            if r.request_id == request_id:
                if error is not None:
                    r.error = error
                return self._finish(r, "abort" if error is None else "error")
        return None

    def fail_all(self, error: AgentrtError) -> list[RequestOutput]:
        """Finish every request with finish_reason "error" and `error` (an InternalError after an
        unexpected engine failure, a ServiceUnavailableError at shutdown)."""
        outputs = []
        for r in [*self.grammar_wait, *self.scheduler.waiting, *self.scheduler.running]:
            r.error = error
            outputs.append(self._finish(r, "error"))
        return outputs

    def has_work(self) -> bool:
        return bool(self.grammar_wait) or self.scheduler.has_work()

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> prepare -> forward -> sample -> process (runtime/batch.py has the
        hand-off types). Returns outputs of requests that produced text or finished in it (a
        speculating request may report several in one step)."""
        outputs = self._collect_grammars()
        spec = self.speculator
        self._failed = {}
        proposed = (
            spec.propose(self.scheduler.running, self.max_model_len, self._failed) if spec is not None else []
        )
        base_lens = {r: r.num_tokens for r in proposed}
        try:
            scheduled = self._schedule()
            if scheduled:
                plan = self._prepare(scheduled)
                plan, fwd = self._forward_isolated(plan, scheduled)
                outputs += self._process(plan, fwd, self._sample(plan, fwd))
            elif self.grammar_wait:
                time.sleep(0.001)
            else:
                self.scheduler.wait_for_loads(0.005)  # only lower-tier loads pending: do not spin
            outputs += [self._fail(r) for r in self._failed if r.status is not RequestStatus.FINISHED]
        finally:
            for r in proposed:
                spec.settle(r, base_lens[r])
        return outputs

    def _schedule(self) -> list[ScheduledChunk]:
        """The scheduler's chunks for this step (admission, chunked prefill, preemption)."""
        before = self.scheduler.num_preemptions
        scheduled = self.scheduler.schedule()
        self.stats.num_preemptions += self.scheduler.num_preemptions - before
        return scheduled

    def _prepare(self, scheduled: list[ScheduledChunk]) -> BatchPlan:
        """Lay out the forward: a SeqChunk per scheduled request (a verify chunk: its last token
        plus every draft node, with a tree mask unless the draft is a chain) and the logits rows of
        the requests that get tokens. Counts prompt tokens at first scheduling."""
        chunks, rows = [], []
        num_prefill = num_rows = 0
        for c in scheduled:
            r = c.request
            if not r.prompt_counted:
                r.prompt_counted = True
                self.stats.num_prompt_tokens += r.num_prompt_tokens
                self.stats.num_cached_prompt_tokens += r.cache.num_cached_tokens or 0
            slots = r.slots[: c.context_len + c.num_new]
            tree = r.spec.draft
            if c.sample and tree is not None:
                chunks.append(self.speculator.verify_chunk(r, c.context_len, slots))
            else:
                ids = r.token_ids[c.context_len : c.context_len + c.num_new]
                chunks.append(
                    SeqChunk(
                        ids,
                        c.context_len,
                        slots,
                        c.sample,
                        seq_key=id(r),
                        state_slot=r.cache.state_slot,
                        snapshots=c.snapshots,
                    )
                )
                jumped = min(r.pending_jump_forward, c.num_new)  # forced output tokens are not prefill
                r.pending_jump_forward -= jumped
                n = c.num_new - jumped
                if n > 1 or not c.sample:
                    num_prefill += n
            if c.sample:
                verify = tree is not None
                rows.append(SampleRow(r, num_rows, len(tree) + 1 if verify else 1, verify))
                num_rows += rows[-1].num_rows
        self.stats.num_computed_prefill_tokens += num_prefill
        return BatchPlan(chunks, rows, num_rows, num_prefill, len(scheduled))

    def _forward_isolated(self, plan: BatchPlan, scheduled: list[ScheduledChunk]):
        """(plan, `_forward(plan)`); when the forward raises, the chunks that raise alone are failed
        and the rest run again without them (runtime/isolation.py). Raises when no chunk is at
        fault alone."""
        try:
            return plan, self._forward(plan)
        except Exception:
            requests = {id(c.request): c.request for c in scheduled}
            if not find_forward_culprits(self.runner, plan, requests, self._failed):
                raise
            plan = plan_without(plan, self._failed)
            return plan, self._forward(plan)

    def _fail(self, r: Request) -> RequestOutput:
        """Finish r with this step's fault (`self._failed[r]`, an InternalError)."""
        r.error = self._failed[r]
        return self._finish(r, "error")

    def _forward(self, plan: BatchPlan) -> ForwardOutput:
        """Run the model over the plan. The bitmasks of sampled constrained rows are filled on a
        grammar thread while the forward runs (their matchers are final for this step; on a GPU
        the launches return at once, on CPU torch frees the GIL); verify rows carry the masks
        filled while drafting."""
        sampled = [s for s in plan.sampled if s.request.grammar is not None]
        constrained = [s.row for s in sampled]
        masks = (
            self.grammar.fill_bitmasks_async(
                [s.request.grammar.matcher for s in sampled], constrained, plan.num_rows
            )
            if sampled
            else None
        )
        want_hidden = self.speculator is not None and self.speculator.heads is not None
        try:
            result = self.runner.execute(plan.chunks, return_hidden=want_hidden)
            logits, hidden = result if want_hidden else (result, None)
        finally:
            mask_error = masks.exception() if masks is not None else None  # matchers are idle again
        bitmask = masks.result() if masks is not None and mask_error is None else None
        if mask_error is not None:  # one matcher's fault: refill row by row, fail who raises
            logger.warning("batched bitmask fill failed (%s): filling row by row", mask_error)
            bitmask = self.grammar.allocate_bitmask(plan.num_rows)
            fill_rows_one_by_one(self.grammar, sampled, bitmask, self._failed)
        if self.speculator is not None:
            bitmask = self.speculator.add_draft_bitmasks(plan, bitmask, constrained)
        return ForwardOutput(logits, hidden, bitmask, constrained)

    def _sample(self, plan: BatchPlan, fwd: ForwardOutput) -> SampleOutput:
        """Penalties and bitmasks on every row (in place: verification reads the same logits), then
        one sampler call for the sampled rows."""
        logits = fwd.logits
        row_requests = [s.request for s in plan.rows for _ in range(s.num_rows)]
        for i, e in apply_penalties(logits, row_requests).items():
            self._failed.setdefault(row_requests[i], internal_error("the logit penalties", e))
        if fwd.bitmask is not None:
            try:
                apply_bitmask(logits, fwd.bitmask, fwd.constrained_rows, self.grammar)  # one batched apply
            except Exception:  # noqa: BLE001 (row by row: a row that cannot be masked fails its request)
                for row in fwd.constrained_rows:
                    try:
                        apply_bitmask(logits, fwd.bitmask, [row], self.grammar)
                    except Exception as e:  # noqa: BLE001 (that request fails)
                        self._failed.setdefault(row_requests[row], internal_error("the grammar bitmask", e))
        sampled = plan.sampled
        if not sampled:
            return SampleOutput([])
        errors: dict[int, str] = {}
        logprobs: dict[int, TokenLogprob] = {}
        rows = [s.row for s in sampled]
        if rows != list(range(logits.shape[0])):  # every row sampled, in order: no copy
            logits = logits[rows]
        ids = sample(logits, [s.request for s in sampled], errors, logprobs)
        for i, why in errors.items():
            self._failed.setdefault(sampled[i].request, InternalError(f"internal error in sampling: {why}"))
        return SampleOutput(ids, logprobs)

    def _process(self, plan: BatchPlan, fwd: ForwardOutput, sampled: SampleOutput) -> list[RequestOutput]:
        """Feed each request its new token(s) (sampled, or verified draft tokens + a bonus token);
        one request's failure finishes it alone. Then Medusa candidates for the next step."""
        self.stats.num_steps += 1
        self.stats.batch_sizes.append(plan.num_seqs)
        self.stats.prefill_sizes.append(plan.num_prefill_tokens)
        logprobs = sampled.logprobs or {}
        num_sampled = 0  # index into sampled.token_ids of the next sampled row
        outputs, medusa = [], []
        for s in plan.rows:
            r = s.request
            last_row = None
            i = num_sampled
            num_sampled += not s.verify
            if r in self._failed:  # a fault in a batch-wide stage: this request alone fails
                outputs.append(self._fail(r))
                continue
            try:
                if not s.verify:
                    tok = sampled.token_ids[i]
                    before = r.num_tokens
                    out = [self._process_token(r, tok, logprobs.get(i))]
                    if r.token_ids[before:] == [tok]:
                        last_row = s.row
                else:
                    out, last_row = self.speculator.process_verified(
                        r, fwd.logits[s.row : s.row + s.num_rows], s.row, self._process_token
                    )
            except Exception as e:  # one request's failure (e.g. detokenizing) must not end the others
                logger.exception("request %s failed", r.request_id)
                r.error = InternalError(f"internal error: {type(e).__name__}: {e}")
                out = [self._finish(r, "error")]
            outputs.extend(o for o in out if o is not None)
            if fwd.hidden is not None and last_row is not None and r.status is not RequestStatus.FINISHED:
                medusa.append((r, last_row))
        if medusa:
            try:
                self.speculator.medusa_candidates(
                    [r for r, _ in medusa], fwd.hidden[[row for _, row in medusa]]
                )
            except Exception:  # drafts are an optimisation: this step's requests go on without them
                logger.exception("Medusa candidates failed; continuing without drafts")
                for r, _ in medusa:
                    r.spec.medusa_topk = None
        return outputs

    def _load(self) -> LoadGauges:
        """Live load for /metrics (read on the HTTP thread at scrape time: plain reads)."""
        kv, cache = self.runner.kv, self.scheduler.cache
        cached = cache.evictable_tokens if cache is not None else 0
        return LoadGauges(
            max(0, kv.num_slots - kv.num_free - cached) / kv.num_slots,  # racy reads: never below 0
            len(self.scheduler.running),
            len(self.scheduler.waiting) + len(self.grammar_wait),
            cached / kv.num_slots,
            self.runner.expert_load(),
            self.tiers,
        )

    def _collect_grammars(self) -> list[RequestOutput]:
        """Queue the requests whose constraint has compiled; a compile error (ConstraintError) or
        any fault while setting up the matcher fails that request alone."""
        outputs = []
        for r in list(self.grammar_wait):
            if not r.compile_future.done():
                continue
            self.grammar_wait.remove(r)
            try:
                out = self._start_constrained(r, r.compile_future.result())
            except AgentrtError as e:
                r.error = e
                out = self._finish(r, "error")
            except Exception as e:  # a bug in a compile path: this request fails, nothing else
                logger.exception("constraint set-up for %s failed", r.request_id)
                r.error = InternalError(
                    f"internal error while compiling the constraint: {type(e).__name__}: {e}"
                )
                out = self._finish(r, "error")
            if out is not None:
                outputs.append(out)
        return outputs

    def _start_constrained(self, r: Request, compiled: CompiledConstraint) -> RequestOutput | None:
        """Give r its constraint state (ConstraintSteps.start) and queue it; the final output if it
        fails."""
        error = self.constraints.start(r, compiled)
        if error is not None:
            r.error = error
            return self._finish(r, "error")
        self.scheduler.add(r)
        return None

    # ---- per-token processing ------------------------------------------------------------------
    def _process_token(
        self, r: Request, tok: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput | None:
        """One new token for r: latency metrics, the grammar (closing guard, jump-forward), then the
        output processor's stop checks, text and emission. `logprob`: the sampled token's, when r
        asked for logprobs (a token the length policy puts in its place, jump-forward tokens and
        the closing tokens of a runaway-value repair get TokenLogprob.forced). Returns r's output
        (None: nothing new)."""
        if tok < 0:
            r.error = ConstraintError("the constraint admits no continuation here (every token is masked)")
            return self._finish(r, "error")
        self._observe_latency(r)
        accepted = self.constraints.accept(r, tok, logprob)
        if accepted is None:
            r.error = InternalError(f"token {tok} was rejected by the grammar matcher")
            return self._finish(r, "error")
        tok, logprob, reason = accepted
        r.append_output([tok], None if logprob is None else [logprob])
        self.stats.num_generated_tokens += 1
        if reason is None:
            self.constraints.after_token(r, tok)
        reason = self.output.update(r, reason)
        if reason is not None:
            return self._finish(r, reason)
        return self.output.emit(r, final=False)

    def _observe_latency(self, r: Request) -> None:
        """Time to r's first token, or since its last one (inter-token latency), into the metrics."""
        now = time.monotonic()
        if r.first_token_time is None:
            r.first_token_time = now
            self.metrics.ttft.observe(now - r.arrival_time)
        else:
            self.metrics.itl.observe(now - r.last_token_time)
        r.last_token_time = now

    def _finish(self, r: Request, reason: str) -> RequestOutput:
        """Leave every queue; KV goes to the prefix cache (or is freed); grammar state is dropped."""
        if r in self.grammar_wait:
            self.grammar_wait.remove(r)
            r.compile_future.cancel()  # no longer waited for: a compile nobody needs is cancelled
        else:  # a failed request's KV may be what failed: not shared through the prefix cache
            self.scheduler.finish(r, insert=reason != "error")
        self.constraints.release(r)
        if self.speculator is not None:
            self.speculator.release(r)
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        self.stats.num_finished[reason] += 1
        self.metrics.e2e.observe(time.monotonic() - r.arrival_time)
        return self.output.emit(r, final=True)

    # ---- offline helper ----------------------------------------------------------------------
    def generate(
        self, requests: list[tuple[list[int], SamplingParams, ConstraintSpec | None]]
    ) -> list[RequestOutput]:
        """Run requests to completion (blocking); returns final outputs in input order. Every
        request is validated before any is queued: an invalid one raises (as `add_request`) and
        none of the batch runs."""
        reqs = [self.make_request(ids, params or SamplingParams(), spec) for ids, params, spec in requests]
        final: dict[str, RequestOutput] = {}
        for r in reqs:
            out = self.enqueue(r)
            if out is not None:
                final[r.request_id] = out
        while len(final) < len(reqs):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in reqs]
