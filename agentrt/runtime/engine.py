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
from collections import deque
from dataclasses import dataclass, field

import torch

from agentrt.errors import (
    AgentrtError,
    ConstraintError,
    ContextLengthError,
    InternalError,
    InvalidRequestError,
)
from agentrt.grammars.jump_forward import forced_token_ids
from agentrt.grammars.length_policy import ClosingGuard
from agentrt.grammars.spec import ConstraintSpec
from agentrt.grammars.xgrammar_backend import CompiledConstraint, GrammarBackend
from agentrt.prefix_cache import RadixCache
from agentrt.runtime.config import EngineConfig
from agentrt.runtime.detokenizer import IncrementalDetokenizer
from agentrt.runtime.metrics import EngineMetrics
from agentrt.runtime.model_runner import ModelRunner, SeqChunk
from agentrt.runtime.request import Request, RequestOutput, RequestStatus, SamplingParams
from agentrt.runtime.sampler import apply_bitmask, apply_penalties, sample
from agentrt.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters since start (tests read these). batch_sizes: sequences in each recent step;
    prefill_sizes: prefill tokens in each recent step. Speculation: mean accepted length =
    (num_accepted_tokens + num_spec_steps) / num_spec_steps."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_computed_prefill_tokens: int = 0
    num_generated_tokens: int = 0
    num_jump_forward_tokens: int = 0
    num_spec_steps: int = 0  # verify passes (per request)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_cut_by_grammar: int = 0  # draft nodes the request's grammar rejected before verification
    accepted_per_position: list = field(default_factory=list)  # passes accepting a token at depth d + 1
    drafted_per_position: list = field(default_factory=list)  # passes drafting depth d + 1
    batch_sizes: deque = field(default_factory=lambda: deque(maxlen=4096))
    prefill_sizes: deque = field(default_factory=lambda: deque(maxlen=4096))


class Engine:
    """Synchronous engine; not thread-safe (AsyncEngine drives it from one thread)."""

    def __init__(self, config: EngineConfig | None = None, runner: ModelRunner | None = None):
        """`runner`: a model runner to use instead of loading `config.model` (tests pass a fake one
        with deterministic logits and no weights, see agentrt/runtime/testing.py)."""
        self.config = config or EngineConfig()
        self.runner = runner or ModelRunner(self.config.model, self.config.cache,
                                            self.config.scheduler.max_num_seqs, self.config.speculative)
        self.tokenizer = self.runner.tokenizer
        self.stop_ids = self.runner.stop_ids
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.arch.vocab_size
        self.grammar = GrammarBackend(self.tokenizer, self.vocab_size, self.stop_ids, self.config.grammar)
        cache = RadixCache() if self.config.cache.enable_prefix_cache else None
        self.scheduler = Scheduler(self.config.scheduler, self.runner.kv, cache)
        self.grammar_wait: list[Request] = []
        self.stats = EngineStats()
        self.metrics = EngineMetrics()
        self._ids = itertools.count()
        self.speculator = None
        if self.config.speculative.method is not None:
            from agentrt.runtime.speculation import Speculator

            self.speculator = Speculator(self.config.speculative, self.runner, self.config.model.model,
                                         self.grammar, self.stats, self.metrics)

    # ---- admission -------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> tuple[int, int]:
        """(context limit, prompt length) after validating a request's prompt and sampling values.
        Raises InvalidRequestError (param names the field) or ContextLengthError (see add_request);
        cheap, so callers may check before compiling a constraint."""
        params.validate(self.vocab_size)
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise InvalidRequestError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size})",
                                      param="prompt")
        limit = min(self.max_model_len, self.runner.kv.num_slots)
        n = len(prompt_ids)
        if n >= limit:
            raise ContextLengthError(f"prompt has {n} tokens, which leaves no room in the context limit of "
                                     f"{limit} tokens", param="prompt", num_prompt_tokens=n, limit=limit)
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ContextLengthError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({n} tokens) exceeds the context limit "
                f"of {limit} tokens", param="max_tokens", num_prompt_tokens=n, limit=limit)
        return limit, n

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    constraint: ConstraintSpec | None = None, request_id: str | None = None,
                    cache_salt: str = "") -> Request:
        """Validate and enqueue (`make_request` + `enqueue`). Raises InvalidRequestError naming the
        field for an empty prompt or invalid sampling values, ContextLengthError for a prompt
        (+ max_tokens) beyond the context limit or the KV pool. A constraint compiles in the
        background (status WAITING_FOR_GRAMMAR); a compile failure finishes the request with
        finish_reason "error" and a ConstraintError. `cache_salt` keeps a tenant's prefix cache
        apart from others'."""
        req = self.make_request(prompt_ids, params or SamplingParams(), constraint, request_id, cache_salt)
        self.enqueue(req)
        return req

    def make_request(self, prompt_ids: list[int], params: SamplingParams, constraint: ConstraintSpec | None = None,
                     request_id: str | None = None, cache_salt: str = "") -> Request:
        """A validated Request (not enqueued; touches no engine state, so any thread may call it).
        Raises as `check_request`."""
        limit, n = self.check_request(prompt_ids, params)
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, constraint, cache_salt)
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
        if req.constraint is not None and compiled is None:
            req.compile_future = self.grammar.submit(req.constraint)
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.grammar_wait.append(req)
        elif req.constraint is not None:
            out = self._start_constrained(req, compiled)
        else:
            self.scheduler.add(req)
        self._update_gauges()
        return out

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; frees its KV (into the prefix cache) and grammar state."""
        for r in [*self.grammar_wait, *self.scheduler.waiting, *self.scheduler.running]:
            if r.request_id == request_id:
                return self._finish(r, "abort")
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
        """Run one scheduling + forward + sampling step; returns outputs of requests that produced
        text or finished in it (a speculating request may report several in one step)."""
        outputs = self._collect_grammars()
        spec = self.speculator
        proposed = spec.propose(self.scheduler.running, self.max_model_len) if spec is not None else []
        base_lens = {r: r.num_tokens for r in proposed}
        preempted_before = self.scheduler.num_preemptions
        scheduled = self.scheduler.schedule()
        self.metrics.preemptions.inc(self.scheduler.num_preemptions - preempted_before)
        try:
            if scheduled:
                outputs += self._run_scheduled(scheduled)
            elif self.grammar_wait:
                time.sleep(0.001)
        finally:
            for r in proposed:
                spec.settle(r, base_lens[r])
        return outputs

    def _run_scheduled(self, scheduled) -> list[RequestOutput]:
        spec = self.speculator
        chunks, batch = [], []  # batch: (request, first logits row, rows) of the sampled chunks
        num_prefill = num_rows = 0
        for c in scheduled:
            r = c.request
            if not r.prompt_counted:
                r.prompt_counted = True
                self._count_prompt(r)
            slots = r.slots[: c.context_len + c.num_new]
            if c.sample and r.draft is not None:  # verify: the last token + every draft node
                tree = r.draft
                ids = [r.output_ids[-1], *tree.token_ids]
                positions = [c.context_len, *(c.context_len + d for d in tree.depths)]
                mask = None if tree.is_chain else tree.attention_mask()
                chunks.append(SeqChunk(ids, c.context_len, slots, True, len(ids), positions, mask, id(r)))
            else:
                ids = (r.prompt_ids + r.output_ids)[c.context_len : c.context_len + c.num_new]
                chunks.append(SeqChunk(ids, c.context_len, slots, c.sample, seq_key=id(r)))
                jumped = min(r.pending_jump_forward, c.num_new)  # forced output tokens are not prefill
                r.pending_jump_forward -= jumped
                n = c.num_new - jumped
                if n > 1 or not c.sample:
                    num_prefill += n
            if c.sample:
                batch.append((r, num_rows, len(ids) if r.draft is not None else 1))
                num_rows += batch[-1][2]
        self.stats.num_computed_prefill_tokens += num_prefill
        self.metrics.computed_prefill_tokens.inc(num_prefill)
        plain = [(r, row) for r, row, _ in batch if r.draft is None]
        constrained = [row for r, row in plain if r.matcher is not None]
        # mask overlap: the matchers are final for this step, so their bitmasks are filled while
        # the forward pass runs (on a GPU the launches return at once; on CPU torch frees the GIL)
        masks = self.grammar.fill_bitmasks_async([r.matcher for r, row in plain if r.matcher is not None],
                                                 constrained, num_rows) if constrained else None
        want_hidden = spec is not None and spec.heads is not None
        hidden = None
        try:
            result = self.runner.execute(chunks, return_hidden=want_hidden)
            logits, hidden = result if want_hidden else (result, None)
        finally:
            bitmask = masks.result() if masks is not None else None  # matchers are idle again
        for r, row, n in batch:  # speculative rows carry the masks filled while drafting
            if r.draft is not None and r.draft_bitmask is not None:
                if bitmask is None:
                    bitmask = self.grammar.allocate_bitmask(num_rows)
                bitmask[row : row + n] = r.draft_bitmask
                constrained.extend(range(row, row + n))
        apply_penalties(logits, [r for r, _, n in batch for _ in range(n)])
        if bitmask is not None:
            apply_bitmask(logits, bitmask, constrained, self.grammar)  # one batched apply
        tokens = dict(zip((r for r, _ in plain), sample(logits[[row for _, row in plain]], [r for r, _ in plain]))) \
            if plain else {}
        self.stats.num_steps += 1
        self.stats.batch_sizes.append(len(scheduled))
        self.stats.prefill_sizes.append(num_prefill)
        outputs, medusa = [], []
        for r, row, n in batch:
            last_row = None
            try:
                if r.draft is None:
                    before = len(r.output_ids)
                    out = [self._process_token(r, tokens[r])]
                    if r.output_ids[before:] == [tokens[r]]:
                        last_row = row
                else:
                    out, last_row = self._process_verified(r, logits[row : row + n], row)
            except Exception as e:  # one request's failure (e.g. detokenizing) must not end the others
                logger.exception("request %s failed", r.request_id)
                r.error = InternalError(f"internal error: {type(e).__name__}: {e}")
                out = [self._finish(r, "error")]
            outputs.extend(o for o in out if o is not None)
            if want_hidden and last_row is not None and r.status is not RequestStatus.FINISHED:
                medusa.append((r, last_row))
        if medusa:
            spec.medusa_candidates([r for r, _ in medusa], hidden[[row for _, row in medusa]])
        self._update_gauges()
        return outputs

    def _process_verified(self, r: Request, logits: torch.Tensor, row: int) -> tuple[list, int | None]:
        """Verify r's draft on its rows' logits [len(draft) + 1, V] and feed the accepted tokens +
        the bonus token through `_process_token` one at a time, stopping at the first that ends the
        request or that the length policy / jump-forward changes (later tokens were verified for
        a different sequence). Only the KV slots of the path actually taken stay with r. Returns
        (outputs, the logits row of the last token when every token went in unchanged, else None)."""
        spec = self.speculator
        tree = r.draft
        argmax, masked = torch.stack([torch.argmax(logits, dim=-1), torch.isneginf(logits).all(dim=-1).long()]).tolist()
        greedy = [-1 if m else g for g, m in zip(argmax, masked)]  # one host sync for the rows
        accepted, bonus = spec.verify(r, logits, greedy)
        spec.account(tree, accepted)
        ctx = len(r.slots) - 1 - len(tree)
        base, node_slots = r.slots[:ctx], r.slots[ctx:]
        path = [0, *(1 + a for a in accepted)]
        seq = [*(tree.token_ids[a] for a in accepted), bonus]
        r.draft = None
        outs, used, complete = [], 0, False
        try:
            for i, tok in enumerate(seq):
                r.slots = base + [node_slots[j] for j in path[: i + 1]]
                used = i + 1
                before = len(r.output_ids)
                outs.append(self._process_token(r, tok))
                if r.status is RequestStatus.FINISHED or r.output_ids[before:] != [tok]:
                    break
            else:
                complete = True
        finally:
            keep = set(path[:used])
            self.runner.kv.free([s for j, s in enumerate(node_slots) if j not in keep])
        return outs, (row + path[-1] if complete else None)

    def _count_prompt(self, r: Request) -> None:
        """At a request's first scheduling: account its prompt tokens and prefix-cache hits."""
        self.stats.num_prompt_tokens += len(r.prompt_ids)
        self.stats.num_cached_prompt_tokens += r.num_cached_tokens or 0
        self.metrics.on_admit(len(r.prompt_ids), r.num_cached_tokens or 0)

    def _update_gauges(self) -> None:
        kv = self.runner.kv
        self.metrics.kv_usage.set(1.0 - kv.num_free / kv.num_slots)
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting) + len(self.grammar_wait))

    def _collect_grammars(self) -> list[RequestOutput]:
        outputs = []
        for r in list(self.grammar_wait):
            if not r.compile_future.done():
                continue
            self.grammar_wait.remove(r)
            try:
                compiled = r.compile_future.result()
            except ValueError as e:
                r.error = e if isinstance(e, AgentrtError) else ConstraintError(str(e))
                outputs.append(self._finish(r, "error"))
                continue
            out = self._start_constrained(r, compiled)
            if out is not None:
                outputs.append(out)
        return outputs

    def _start_constrained(self, r: Request, compiled: CompiledConstraint) -> RequestOutput | None:
        """Give r its matcher (and closing guard) and queue it; the final output if it fails."""
        r.matcher = self.grammar.new_matcher(compiled, r.params.stop_token_ids)
        if r.params.max_tokens_policy == "close":
            r.closing = ClosingGuard(self.grammar.planner, self.stop_ids[0])
            need = r.closing.start(r.matcher)
            if need is None:
                r.error = ConstraintError(
                    "max_tokens_policy 'close' is not available for this constraint: the closing-path "
                    f"planner found no way to complete it from its start: {self.grammar.planner.failure}",
                    param="max_tokens_policy")
                return self._finish(r, "error")
            if need > r.max_tokens:
                r.error = InvalidRequestError(f"max_tokens {r.max_tokens} is below the {need} tokens the "
                                              "constraint needs to close (max_tokens_policy 'close')",
                                              param="max_tokens")
                return self._finish(r, "error")
        self.scheduler.add(r)
        return None

    # ---- per-token processing ------------------------------------------------------------------
    def _process_token(self, r: Request, tok: int) -> RequestOutput | None:
        if tok < 0:
            r.error = ConstraintError("the constraint admits no continuation here (every token is masked)")
            return self._finish(r, "error")
        now = time.monotonic()
        if r.first_token_time is None:
            r.first_token_time = now
            self.metrics.ttft.observe(now - r.arrival_time)
        else:
            self.metrics.itl.observe(now - r.last_token_time)
        r.last_token_time = now
        self.metrics.generation_tokens.inc()
        p = r.params
        reason = None
        if r.matcher is not None:
            if not r.matcher.accept_token(tok):
                r.error = InternalError(f"token {tok} was rejected by the grammar matcher")
                return self._finish(r, "error")
            if r.closing is not None and not r.matcher.is_terminated():
                forced_before = r.closing.num_forced
                tok = r.closing.keep(r.matcher, tok, r.max_tokens - len(r.output_ids) - 1)
                if r.closing.num_forced > forced_before:
                    r.num_forced_tokens += 1
                    self.metrics.length_forced_tokens.inc()
            if r.matcher.is_terminated():
                reason = "stop"
        r.output_ids.append(tok)
        self.stats.num_generated_tokens += 1
        if r.matcher is not None and reason is None and self.config.grammar.jump_forward:
            self._jump_forward(r)
        if r.matcher is None and ((tok in self.stop_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            reason = "stop"
        text_ids = r.output_ids[:-1] if reason == "stop" else r.output_ids
        cut = -1
        if reason is None:  # a window of new tokens, not the whole output (see runtime/detokenizer.py)
            if r.detokenizer is None:
                r.detokenizer = IncrementalDetokenizer(p.skip_special_tokens)
            text = r.detokenizer.update(self.tokenizer, text_ids)
            if p.stop:
                cut = min((i for i in (text.find(s, max(0, len(r.text) - len(s) + 1)) for s in p.stop) if i >= 0),
                          default=-1)
                if cut >= 0:
                    text, reason = text[:cut], "stop"
            if reason is None and (len(r.output_ids) >= r.max_tokens or r.num_tokens >= self.max_model_len):
                reason = "length"
        if reason is not None and cut < 0:  # the final text: one full decode, exactly as the tokenizer says
            text = self.tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
        r.text = text
        if reason is not None:
            return self._finish(r, reason)
        return self._emit(r, final=False)

    def _jump_forward(self, r: Request) -> None:
        """Append the tokens of the text the grammar forces next without sampling them (see
        `forced_token_ids`); their KV is computed with the next step's chunk."""
        if r.closing is not None and r.closing.plan:
            return  # following a closing path: its tokens are already the forced ones
        forced = r.matcher.find_jump_forward_string()
        if not forced:
            return
        ids = forced_token_ids(self.tokenizer, self.grammar.planner.token_texts, r.output_ids[-1], forced)
        ids = ids[: max(0, r.max_tokens - len(r.output_ids) - 1)]
        for i, t in enumerate(ids):
            if not r.matcher.accept_token(t):  # cannot happen for a forced string; stay safe
                ids = ids[:i]
                break
        if r.closing is not None:  # length-safe: keep only what leaves a closing path that fits
            while ids:
                need = r.closing.start(r.matcher)
                if need is not None and need <= r.max_tokens - len(r.output_ids) - len(ids):
                    break
                r.matcher.rollback(1)
                ids.pop()
        if ids:
            r.output_ids.extend(ids)
            r.num_jump_forward_tokens += len(ids)
            r.pending_jump_forward += len(ids)
            self.stats.num_jump_forward_tokens += len(ids)
            self.metrics.jump_forward_tokens.inc(len(ids))

    def _emit(self, r: Request, final: bool) -> RequestOutput | None:
        text = r.text
        upto = len(text)
        if not final:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                upto = len(text.rstrip("\ufffd"))
            for s in r.params.stop:  # hold back a possible start of a stop string
                for k in range(min(len(s) - 1, upto), 0, -1):
                    if text[:upto].endswith(s[:k]):
                        upto -= k
                        break
        delta = text[r.sent_len : upto] if upto > r.sent_len else ""
        if not delta and not final:
            return None
        r.sent_len = max(r.sent_len, upto)
        return RequestOutput(r.request_id, text[:upto], delta, list(r.output_ids), len(r.prompt_ids),
                             final, r.finish_reason, r.error, r.num_cached_tokens or 0)

    def _finish(self, r: Request, reason: str) -> RequestOutput:
        """Leave every queue; KV goes to the prefix cache (or is freed); grammar state is dropped."""
        if r in self.grammar_wait:
            self.grammar_wait.remove(r)
        else:
            self.scheduler.finish(r)
        r.matcher = None
        if self.speculator is not None:
            self.speculator.release(r)
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        self.metrics.finished.labels(reason).inc()
        self.metrics.e2e.observe(time.monotonic() - r.arrival_time)
        return self._emit(r, final=True)

    # ---- offline helper ----------------------------------------------------------------------
    def generate(self, requests: list[tuple[list[int], SamplingParams, ConstraintSpec | None]]) -> list[RequestOutput]:
        """Run requests to completion (blocking); returns final outputs in input order."""
        reqs = [self.add_request(ids, params, spec) for ids, params, spec in requests]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(reqs):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r.request_id] for r in reqs]
