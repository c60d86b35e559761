"""A choice's model text as the APIs show it: a reasoning model's reasoning first (grammars/
reasoning.py `ReasoningParser`), then the answer as content and tool calls (tools/parsing.py
`ToolCallParser`), as one stream of ParseEvents. Kind "reasoning" carries reasoning text; the
answer's events are the tool-call parser's ("content", "call", "args"). The same machine serves
streamed and non-streamed responses, so streamed deltas concatenate to the non-streamed result
whatever the chunking. A call written inside the reasoning ends it (`call_markers`)."""

from __future__ import annotations

from agentrt.api.tools import ParseEvent, ToolCallParser, ToolPlan
from agentrt.grammars.reasoning import ReasoningFormat, ReasoningMode, ReasoningParser
from agentrt.grammars.tool_calls import call_markers as format_call_markers


def call_markers(plan: ToolPlan | None) -> tuple[str, ...]:
    """The texts that open a call of `plan` (none without tools or under tool_choice "none"): a
    reasoning ends at the first of them (grammars/reasoning.py: a call is never lost in the
    reasoning; under a tool-call grammar the reasoning cannot hold one)."""
    if plan is None or not plan.calls:
        return ()
    return tuple(format_call_markers(plan.fmt, plan.tools))


class OutputParser:
    """Reasoning (when `reasoning` is given: the format and the request's mode) then the answer,
    parsed into tool calls when `plan` is given (else content)."""

    def __init__(self, reasoning: tuple[ReasoningFormat, ReasoningMode] | None, plan: ToolPlan | None):
        self.thinking = ReasoningParser(*reasoning, call_markers(plan)) if reasoning is not None else None
        self.tools: ToolCallParser | None = plan.new_parser() if plan is not None else None
        self._content = ""

    @property
    def reasoning(self) -> str:
        """The reasoning text so far ("" when none)."""
        return self.thinking.reasoning if self.thinking is not None else ""

    @property
    def content(self) -> str:
        """The answer's text so far, tool calls left out."""
        return self.tools.content if self.tools is not None else self._content

    @property
    def calls(self) -> list:
        return self.tools.calls if self.tools is not None else []

    def feed(self, text: str) -> list[ParseEvent]:
        if self.thinking is None:
            return self._answer(text)
        reasoning, answer = self.thinking.feed(text)
        return self._events(reasoning, answer)

    def close(self, finish_reason: str, closed_by_budget: bool = False) -> tuple[list[ParseEvent], str]:
        """The rest of the events at the end of an output that ended with `finish_reason`, and the
        finish_reason to report (ToolCallParser.close: "tool_calls" when calls were made)."""
        events: list[ParseEvent] = []
        if self.thinking is not None:
            events = self._events(*self.thinking.finish())
        if self.tools is None:
            return events, finish_reason
        rest, finish = self.tools.close(finish_reason, closed_by_budget)
        return events + rest, finish

    def _events(self, reasoning: str, answer: str) -> list[ParseEvent]:
        events = [ParseEvent("reasoning", reasoning)] if reasoning else []
        return events + self._answer(answer)

    def _answer(self, text: str) -> list[ParseEvent]:
        if not text:
            return []
        if self.tools is not None:
            return self.tools.feed(text)
        self._content += text
        return [ParseEvent("content", text)]
