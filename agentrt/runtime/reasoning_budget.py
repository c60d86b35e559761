"""Where a reasoning model's output stands (in its reasoning or past it) and its thinking budget.

`ReasoningTracker` follows a request's output tokens as bytes: in mode "optional" the reasoning
starts when the output opens with the start marker (after whitespace), in mode "open" it starts
with the output; it ends at the first end marker. Tokens from the start marker (or the output's
start) through the end marker are reasoning tokens (`usage.completion_tokens_details.
reasoning_tokens`). When `SamplingParams.reasoning.budget` reasoning tokens are spent, the engine
appends the tokens of `close_text` + the end marker without sampling them (as llama.cpp's
`--reasoning-budget` with `--reasoning-budget-message`), through the grammar when the request is
constrained, so the answer follows within the request's max_tokens.
"""

from __future__ import annotations

from agentrt.runtime.request import ReasoningParams


class ReasoningTracker:
    """One request's reasoning state (engine thread only). `close_ids`: the tokens forced when the
    budget is spent (the close text and the end marker)."""

    def __init__(self, params: ReasoningParams, close_ids: list[int]):
        self.params = params
        self.close_ids = close_ids
        self._start, self._end = params.start.encode(), params.end.encode()
        self.state = "reasoning" if params.mode == "open" else "before"
        self.num_tokens = 0  # reasoning tokens so far
        self.forced = False  # the budget closed the reasoning
        self._tail = b""  # output bytes that may still be the start of a marker

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def due(self) -> bool:
        """The budget is spent and the reasoning is still open: force `close_ids` now."""
        budget = self.params.budget
        return self.state == "reasoning" and budget is not None and self.num_tokens >= budget

    def observe(self, token_bytes: bytes) -> None:
        """Advance by one output token's bytes (b"" for a special token)."""
        if self.state == "answer":
            return
        tail = self._tail + token_bytes
        if self.state == "before":
            stripped = tail.lstrip()
            if stripped.startswith(self._start):
                self.state, tail = "reasoning", stripped[len(self._start) :]
            elif self._start.startswith(stripped):
                self._tail = stripped  # whitespace or a prefix of the start marker: undecided
                return
            else:
                self.state = "answer"
                return
        self.num_tokens += 1
        if self._end in tail:
            self.state, self._tail = "answer", b""
        else:
            self._tail = tail[-(len(self._end) - 1) :] if len(self._end) > 1 else b""
