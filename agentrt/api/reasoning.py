"""A served reasoning model on the API side: which format its chat template implies
(`ReasoningSetup.for_template`, `--reasoning-format` to override), and per request where its
reasoning stands after the rendered prompt, with the thinking budget the request asked for
(`thinking_token_budget`, or `reasoning_effort` / Responses `reasoning.effort` / Messages
`thinking.budget_tokens` mapped onto it).

A budget of 0 turns reasoning off for the request: the prompt ends with the empty block the
family's own templates write for that (`<think>\\n\\n</think>\\n\\n`, or the close text and end
marker when the template had opened it), so the model answers at once."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from agentrt.api.errors import APIError, shown
from agentrt.grammars.reasoning import (
    ReasoningFormat,
    ReasoningMode,
    detect_reasoning,
    reasoning_format,
    unsupported_reasoning,
)
from agentrt.runtime.request import ReasoningParams

logger = logging.getLogger(__name__)

EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": None}
"""reasoning_effort -> thinking budget in tokens (None: unbounded, up to max_tokens)."""


@dataclass(frozen=True)
class RequestReasoning:
    """One request's reasoning: the format, where it stands after the prompt ("off": the prompt
    closed it, so the output is all answer) and its budget (None: unbounded)."""

    fmt: ReasoningFormat
    mode: ReasoningMode
    budget: int | None
    close_text: str

    def params(self, call_markers: tuple[str, ...] = ()) -> ReasoningParams | None:
        """The engine's side (SamplingParams.reasoning; None when the mode is "off"). `call_markers`:
        the texts that open a call of the request's tools (api/output_text.py `call_markers`)."""
        if self.mode == "off":
            return None
        return ReasoningParams(
            self.fmt.start,
            self.fmt.end,
            self.mode,
            self.budget,
            self.close_text,
            self.fmt.after_end,
            self.fmt.header,
            tuple(call_markers),
        )

    @property
    def spec_value(self) -> str:
        """ConstraintSpec.reasoning: a constraint then applies to the answer after the reasoning
        ("" when the mode is "off": from the first token)."""
        return "" if self.mode == "off" else self.fmt.as_json(self.mode)


@dataclass(frozen=True)
class ReasoningSetup:
    """How a server treats reasoning: `fmt` the model's format (None: a model that does not
    reason), `close_text` forced before the end marker when a thinking budget is spent (llama.cpp's
    --reasoning-budget-message), `keep_special` the markers are special tokens (kept in the decoded
    text so that they can be parsed)."""

    fmt: ReasoningFormat | None = None
    close_text: str = ""
    keep_special: bool = False

    @classmethod
    def for_template(
        cls, chat_template: str | list | None, name: str = "auto", close_text: str = "", tokenizer=None
    ) -> ReasoningSetup:
        """The set-up for a model's chat template. name: "auto" (read from the template), "none",
        or a format name (grammars/reasoning.py FORMATS or a vLLM alias). Raises ValueError on an
        unknown name. A template in a reasoning format agentrt does not parse is logged as a
        warning naming the fallback (its reasoning is returned as content)."""
        text = chat_template if isinstance(chat_template, str) else repr(chat_template or "")
        if name == "auto":
            fmt = detect_reasoning(text)
            other = unsupported_reasoning(text)
            if fmt is None and other is not None:
                logger.warning(
                    "the chat template writes reasoning in the %s format, which agentrt does not parse: "
                    "its reasoning is returned as content and constraints start at the first token",
                    other,
                )
        else:
            fmt = reasoning_format(name)
        special = set(getattr(tokenizer, "all_special_tokens", None) or [])
        markers = f"{fmt.start}{fmt.end}{fmt.separator}{fmt.header}" if fmt is not None else ""
        keep = any(t and t in markers for t in special)
        return cls(fmt, close_text, keep)

    def for_request(self, prompt: str, budget: int | None) -> tuple[str, RequestReasoning | None]:
        """(the prompt to run, the request's reasoning; None when the model does not reason) for a
        rendered chat prompt. A budget of 0 closes the reasoning in the prompt itself (see the
        module docstring): the mode is then "off"."""
        if self.fmt is None:
            return prompt, None
        mode = self.fmt.mode(prompt)
        if budget == 0 and mode != "off":
            block = self.fmt.empty_block(self.close_text if mode == "open" else "")
            prompt, mode = prompt + (block[len(self.fmt.start) :] if mode == "open" else block), "off"
        return prompt, RequestReasoning(self.fmt, mode, budget, self.close_text)


def thinking_budget(
    budget: int | None, effort: str | None, budget_param: str, effort_param: str
) -> int | None:
    """The request's thinking budget from an explicit budget or an effort (not both). Raises
    APIError naming the field for a negative budget, an unknown effort, or both given."""
    if budget is not None and effort is not None:
        raise APIError(f"give one of {budget_param} and {effort_param}", param=effort_param)
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise APIError(f"{budget_param} must be an integer >= 0, got {shown(budget)}", param=budget_param)
        return budget
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise APIError(
            f"{effort_param} must be one of {', '.join(EFFORT_BUDGETS)}, got {shown(effort)}",
            param=effort_param,
        )
    return EFFORT_BUDGETS[effort]
