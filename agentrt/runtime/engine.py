"""The engine: request admission, continuous batching step loop, token processing.

Each `step()` admits waiting requests while KV slots last, runs one forward over every running
sequence (prefill of new prompts + one decode token for the others), masks constrained rows with
their grammar bitmask, samples, and reports new text. Requests join and leave between steps.
When the KV pool runs out mid-decode the newest running request is preempted: its KV is freed and
it is requeued first in line; on readmission its prompt and output so far are recomputed, so it
continues exactly where it stopped (its matcher and generator are kept).
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass

import torch

from agentrt.grammars.spec import ConstraintSpec
from agentrt.grammars.xgrammar_backend import GrammarBackend
from agentrt.runtime.config import EngineConfig
from agentrt.runtime.model_runner import ModelRunner, SeqChunk
from agentrt.runtime.request import Request, RequestOutput, RequestStatus, SamplingParams
from agentrt.runtime.sampler import apply_penalties, sample

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters since start. batch_sizes holds the number of sequences of each recent step."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    batch_sizes: deque | None = None

    def __post_init__(self):
        self.batch_sizes = deque(maxlen=4096)


class Engine:
    """Synchronous engine; not thread-safe (AsyncEngine drives it from one thread)."""

    def __init__(self, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.runner = ModelRunner(self.config.model, self.config.cache)
        self.tokenizer = self.runner.tokenizer
        self.stop_ids = self.runner.stop_ids
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.arch.vocab_size
        self.grammar = GrammarBackend(self.tokenizer, self.vocab_size, self.stop_ids, self.config.grammar)
        self.grammar_wait: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = EngineStats()
        self._ids = itertools.count()

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    constraint: ConstraintSpec | None = None, request_id: str | None = None) -> Request:
        """Validate and enqueue. Raises ValueError naming the field for an empty prompt, invalid
        sampling values, a prompt (+ max_tokens) beyond the context limit or the KV pool.
        A constraint compiles in the background (status WAITING_FOR_GRAMMAR); a compile failure
        finishes the request with finish_reason "error"."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size})")
        limit = min(self.max_model_len, self.runner.kv.num_slots)
        n = len(prompt_ids)
        if n >= limit:
            raise ValueError(f"prompt has {n} tokens, which leaves no room in the context limit of {limit} tokens")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ValueError(
                f"max_tokens ({params.max_tokens}) plus the prompt ({n} tokens) exceeds the context limit "
                f"of {limit} tokens"
            )
        req = Request(request_id or f"req-{next(self._ids)}", list(prompt_ids), params, constraint)
        req.max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        req.generator = torch.Generator(device=self.runner.device).manual_seed(seed)
        if constraint is not None:
            req.compile_future = self.grammar.submit(constraint)
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.grammar_wait.append(req)
        else:
            self.waiting.append(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request wherever it is; frees its KV and grammar state."""
        for queue in (self.grammar_wait, self.waiting, self.running):
            for r in queue:
                if r.request_id == request_id:
                    queue.remove(r)
                    return self._finish(r, "abort")
        return None

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request with finish_reason "error" (after an unexpected engine failure)."""
        outputs = []
        for queue in (self.grammar_wait, self.waiting, self.running):
            for r in list(queue):
                if queue is not self.running:
                    queue.remove(r)
                r.error = message
                outputs.append(self._finish(r, "error"))
        return outputs

    def has_work(self) -> bool:
        return bool(self.grammar_wait or self.waiting or self.running)

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + forward + sampling step; returns outputs of requests that produced
        text or finished in it."""
        outputs = self._collect_grammars()
        self._ensure_decode_room()
        new = self._admit()
        batch = self.running + new
        if not batch:
            if self.grammar_wait:
                time.sleep(0.001)
            return outputs
        self.running = batch
        for r in new:
            r.status = RequestStatus.RUNNING
        chunks = []
        for r in batch:
            all_ids = r.prompt_ids + r.output_ids
            chunk_ids = all_ids[len(r.slots) :]
            slots = self.runner.kv.allocate(len(chunk_ids))
            assert slots is not None, "admission and preemption keep room for every scheduled token"
            context_len = len(r.slots)
            r.slots.extend(slots)
            chunks.append(SeqChunk(chunk_ids, context_len, r.slots))
            if context_len == 0:
                self.stats.num_prompt_tokens += len(chunk_ids)
        logits = self.runner.execute(chunks)
        apply_penalties(logits, batch)
        constrained = [i for i, r in enumerate(batch) if r.matcher is not None]
        if constrained:
            bitmask = self.grammar.allocate_bitmask(len(batch))
            for i in constrained:
                self.grammar.fill_bitmask(batch[i].matcher, bitmask, i)
            self.grammar.apply_bitmask(logits, bitmask, constrained)
        tokens = sample(logits, batch)
        self.stats.num_steps += 1
        self.stats.batch_sizes.append(len(batch))
        for r, tok in zip(list(batch), tokens):
            out = self._process_token(r, tok)
            if out is not None:
                outputs.append(out)
        return outputs

    def _collect_grammars(self) -> list[RequestOutput]:
        outputs = []
        for r in list(self.grammar_wait):
            if not r.compile_future.done():
                continue
            self.grammar_wait.remove(r)
            try:
                compiled = r.compile_future.result()
            except ValueError as e:
                r.error = str(e)
                outputs.append(self._finish(r, "error"))
                continue
            r.matcher = self.grammar.new_matcher(compiled, r.params.stop_token_ids)
            r.status = RequestStatus.WAITING
            self.waiting.append(r)
        return outputs

    def _ensure_decode_room(self) -> None:
        """Preempt the newest running requests until every running one has a slot for its token."""
        kv = self.runner.kv
        while self.running and kv.num_free < len(self.running):
            victim = self.running.pop()
            kv.free(victim.slots)
            victim.slots = []
            victim.status = RequestStatus.WAITING
            self.waiting.appendleft(victim)
            self.stats.num_preemptions += 1
            logger.info("preempted %s (KV pool full)", victim.request_id)

    def _admit(self) -> list[Request]:
        cfg = self.config.scheduler
        kv = self.runner.kv
        free = kv.num_free - len(self.running)
        budget = cfg.max_num_batched_tokens
        new: list[Request] = []
        while self.waiting and len(self.running) + len(new) < cfg.max_num_seqs:
            r = self.waiting[0]
            need = r.num_tokens  # prompt + any output to recompute after preemption
            if need + 1 > free or (new and need > budget):
                break
            self.waiting.popleft()
            new.append(r)
            free -= need + 1  # its prefill now and a decode slot next step
            budget -= need
        return new

    # ---- per-token processing ------------------------------------------------------------------
    def _process_token(self, r: Request, tok: int) -> RequestOutput | None:
        if tok < 0:
            r.error = "every token was masked: the constraint admits no continuation"
            return self._finish(r, "error")
        if r.first_token_time is None:
            r.first_token_time = time.monotonic()
        r.output_ids.append(tok)
        self.stats.num_generated_tokens += 1
        p = r.params
        reason = None
        if r.matcher is not None:
            if not r.matcher.accept_token(tok):
                r.error = f"token {tok} was rejected by the grammar matcher"
                return self._finish(r, "error")
            if r.matcher.is_terminated():
                reason = "stop"
        elif (tok in self.stop_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
        text_ids = r.output_ids[:-1] if reason == "stop" else r.output_ids
        text = self.tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
        if p.stop and reason is None:
            cut = min((i for i in (text.find(s, max(0, len(r.text) - len(s) + 1)) for s in p.stop) if i >= 0),
                      default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        if reason is None and (len(r.output_ids) >= r.max_tokens or r.num_tokens >= self.max_model_len):
            reason = "length"
        r.text = text
        if reason is not None:
            return self._finish(r, reason)
        return self._emit(r, final=False)

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
                             final, r.finish_reason, r.error)

    def _finish(self, r: Request, reason: str) -> RequestOutput:
        if r in self.running:
            self.running.remove(r)
        if r.slots:
            self.runner.kv.free(r.slots)
            r.slots = []
        r.matcher = None
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
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
