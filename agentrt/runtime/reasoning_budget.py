"""Where a reasoning model's output stands (in its reasoning or past it) and its thinking budget.

`ReasoningTracker` follows a request's output tokens as bytes (grammars/reasoning.py
`AnswerGate`): in mode "optional" the reasoning starts when the output opens with the start marker
(after whitespace), in mode "open" it starts with the output; it ends at the first end marker, or
at the first call marker (`ReasoningParams.call_markers`: a tool call written inside the reasoning
opens the answer). Tokens from the start marker (or the output's start) through the token that
ends it are reasoning tokens (`usage.completion_tokens_details.
reasoning_tokens`). When `SamplingParams.reasoning.budget` reasoning tokens are spent, the engine
appends the tokens of `close_text` + the end marker without sampling them (as llama.cpp's
`--reasoning-budget` with `--reasoning-budget-message`), through the grammar when the request is
constrained, so the answer follows within the request's max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentrt.grammars.reasoning import AnswerGate


@dataclass(frozen=True)
class ReasoningParams:
    """A reasoning model's request (grammars/reasoning.py): `start` / `end` the format's markers;
    `mode` where the reasoning stands when the prompt ends ("open": the prompt opened it,
    "optional": the model may open it); `budget` the most reasoning tokens (None: no limit): when
    spent, `close_text` + `end` are appended without sampling (ReasoningTracker below); with
    budget 0 and mode "open" they end the prompt instead. `call_markers`: texts that open a tool
    call (tools offered, tool_choice not "none"); one written inside the reasoning ends it and
    opens the answer (grammars/reasoning.py: under a tool-call grammar none can occur there)."""

    start: str
    end: str
    mode: str = "optional"
    budget: int | None = None
    close_text: str = ""
    after_end: str = "\n\n"  # what the model writes after `end`, before the answer
    header: str = ""  # what opens an answer without reasoning (Harmony's final channel)
    call_markers: tuple[str, ...] = ()


class ReasoningTracker:
    """One request's reasoning state (engine thread only). `close_ids`: the tokens forced when the
    budget is spent (the close text and the end marker). `state`: "before" (mode "optional",
    undecided), "reasoning" or "answer"; `ended_by`: the marker that ended the reasoning (its end
    marker or a call marker, as text; None while it has not ended or never began)."""

    def __init__(self, params: ReasoningParams, close_ids: list[int]):
        self.params = params
        self.close_ids = close_ids
        markers = tuple(m.encode() for m in params.call_markers)
        self.gate = AnswerGate(params.start.encode(), params.end.encode(), params.mode, markers)
        self.num_tokens = 0  # reasoning tokens so far
        self.forced = False  # the budget closed the reasoning

    @property
    def state(self) -> str:
        return self.gate.state

    @property
    def ended_by(self) -> str | None:
        marker = self.gate.ended_by
        return None if marker is None else marker.decode()

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def due(self) -> bool:
        """The budget is spent and the reasoning is still open: force `close_ids` now."""
        budget = self.params.budget
        return self.state == "reasoning" and budget is not None and self.num_tokens >= budget

    def observe(self, token_bytes: bytes) -> None:
        """Advance by one output token's bytes (a special token's text)."""
        before = self.gate.state
        if before == "answer":
            return
        self.gate.feed(token_bytes)
        # a reasoning token: the reasoning was open, opened with it, or opened and ended in it
        if before == "reasoning" or self.gate.state == "reasoning" or self.gate.ended_by is not None:
            self.num_tokens += 1
