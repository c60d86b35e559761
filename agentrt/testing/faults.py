"""Fault injection for the fault-isolation tests (issue 17): make one request's work raise inside a
real Engine."""

from __future__ import annotations

FAULT_KINDS = ("matcher", "accept", "jump_forward", "forward", "nan", "penalties", "detokenizer")
"""What `FaultInjector` can make raise for one request: its bitmask fill ("matcher"), its grammar
accept, its jump-forward search, the model forward of a batch holding its chunk, NaN in its
logits row (a broken sampler input), its logit penalties, its detokenizer / stop-string update."""


class InjectedFault(RuntimeError):
    """The exception a `FaultInjector` raises."""


class FaultInjector:
    """Makes one request's work raise inside a real `Engine` (fake or real runner), from its
    `after_tokens`-th output token on; a context manager that undoes every patch on exit.

    engine: the Engine; request_id: the victim; kind: one of FAULT_KINDS. Other requests are
    untouched, so a test can check they finish exactly as they would alone."""

    def __init__(self, engine, request_id: str, kind: str, after_tokens: int = 1):
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS}, got {kind!r}")
        self.engine, self.request_id, self.kind, self.after = engine, request_id, kind, after_tokens
        self.num_raised = 0
        self._undo: list = []

    def _victim(self):
        e = self.engine
        for r in [*e.grammar_wait, *e.scheduler.waiting, *e.scheduler.running]:
            if r.request_id == self.request_id:
                return r
        return None

    def _due(self, r) -> bool:
        return r is not None and r.request_id == self.request_id and r.num_output_tokens >= self.after

    def _raise(self, what: str):
        self.num_raised += 1
        raise InjectedFault(f"injected {what} fault")

    def _patch(self, owner, name: str, make) -> None:
        import types

        real, had = getattr(owner, name), name in vars(owner)
        setattr(owner, name, make(real))
        self._undo.append((owner, name, real, had or isinstance(owner, (type, types.ModuleType))))

    def __enter__(self):  # -> FaultInjector
        patches = {
            "matcher": self._patch_matcher,
            "accept": self._patch_constraint_state,
            "jump_forward": self._patch_constraint_state,
            "forward": self._patch_forward,
            "nan": self._patch_nan,
            "penalties": self._patch_penalties,
            "detokenizer": self._patch_detokenizer,
        }
        patches[self.kind]()
        return self

    def _patch_matcher(self) -> None:
        """The victim's bitmask fill raises, batched (a failed future) and per row."""
        import concurrent.futures

        def batch_fill(real):
            def fill(matchers, rows, batch):
                v = self._victim()
                if self._due(v) and v.grammar is not None and any(m is v.grammar.matcher for m in matchers):
                    fut = concurrent.futures.Future()
                    fut.set_exception(InjectedFault("injected batched bitmask fault"))
                    return fut
                return real(matchers, rows, batch)

            return fill

        def row_fill(real):
            def fill(matcher, bitmask, row):
                v = self._victim()
                if self._due(v) and v.grammar is not None and matcher is v.grammar.matcher:
                    self._raise("matcher")
                return real(matcher, bitmask, row)

            return fill

        self._patch(self.engine.grammar, "fill_bitmasks_async", batch_fill)
        self._patch(self.engine.grammar, "fill_bitmask", row_fill)

    def _patch_constraint_state(self) -> None:
        """ConstraintState.accept or .jump_forward (self.kind) raises for the victim's state."""
        from agentrt.runtime.constraint_state import ConstraintState

        kind = self.kind

        def method(real):
            def call(state, *args, **kwargs):
                v = self._victim()
                if self._due(v) and v.grammar is state:
                    self._raise(kind)
                return real(state, *args, **kwargs)

            return call

        self._patch(ConstraintState, kind, method)

    def _patch_forward(self) -> None:
        """The runner's forward raises for a batch holding one of the victim's chunks."""

        def execute(real):
            def run(chunks, *args, **kwargs):
                v = self._victim()
                if self._due(v) and any(c.seq_key == id(v) for c in chunks):
                    self._raise("forward")
                return real(chunks, *args, **kwargs)

            return run

        self._patch(self.engine.runner, "execute", execute)

    def _patch_nan(self) -> None:
        """The victim's logits rows come out of the engine's forward as NaN."""

        def forward(real):
            def run(plan):
                out = real(plan)
                for s in plan.rows:
                    if self._due(s.request):
                        self.num_raised += 1
                        out.logits[s.row : s.row + s.num_rows] = float("nan")
                return out

            return run

        self._patch(self.engine, "_forward", forward)

    def _patch_penalties(self) -> None:
        """The sampler's logit penalties raise for the victim."""
        from agentrt.runtime import sampler

        def penalize(real):
            def run(logits, i, r):
                if self._due(r):
                    self._raise("penalties")
                return real(logits, i, r)

            return run

        self._patch(sampler, "_penalize", penalize)

    def _patch_detokenizer(self) -> None:
        """The output processor's detokenizer / stop-string update raises for the victim."""

        def update(real):
            def run(r, reason):
                if self._due(r):
                    self._raise("detokenizer")
                return real(r, reason)

            return run

        self._patch(self.engine.output, "update", update)

    def __exit__(self, *exc) -> None:
        for owner, name, real, restore in reversed(self._undo):
            if restore:
                setattr(owner, name, real)
            else:
                delattr(owner, name)  # an instance attribute we added: the class's method shows again
        self._undo.clear()
