"""The chat template rendered on sample conversations, as serving renders requests, before a request
does: `agentrt serve` refuses to start on an error and `agentrt check` reports the same findings.

A template that does not compile, that raises on every conversation, or that loops would otherwise
pass start-up and answer every chat request with a 400 (or never answer). Each sample goes through
the serving path: tool turns through the server's ToolPrompt (the template's own tool syntax, or
the generic prompt), then the budgeted render of runtime/chat_template.py.

    plain        one user message
    system       a system message and a user message
    multi-turn   user, assistant, user
    tools        a tool definition, a call and its result
    reasoning    an earlier turn's reasoning_content, enable_thinking

Errors: the template does not compile, spends its budget on a sample, or renders none of them
(every chat request would get a 400). A sample it refuses while others render is a warning
naming the sample and the template's message (a tool-use template that needs `tools` refuses the
plain one: requests without tools get a 400).
"""

from __future__ import annotations

import time
from typing import NamedTuple

from agentrt.api.errors import APIError
from agentrt.api.tools import ToolPrompt, plan_tools
from agentrt.errors import AgentrtError, ChatTemplateError, TemplateBudgetError
from agentrt.runtime.chat_template import ChatRenderer, TemplateBudget

OK, WARNING, ERROR = "ok", "warning", "error"

_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
_CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}

# (name, messages, with tools, chat_template_kwargs)
SAMPLES: tuple[tuple[str, list[dict], bool, dict], ...] = (
    ("plain", [{"role": "user", "content": "What is the capital of France?"}], False, {}),
    (
        "system",
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}],
        False,
        {},
    ),
    (
        "multi-turn",
        [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name a city in France."},
        ],
        False,
        {},
    ),
    (
        "tools",
        [
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "call_0", "content": '{"sky": "clear"}'},
        ],
        True,
        {},
    ),
    (
        "reasoning",
        [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
            {"role": "user", "content": "And 3 + 3?"},
        ],
        False,
        {"enable_thinking": True},
    ),
)


class TemplateFinding(NamedTuple):
    """One result: `level` ok / warning / error, `message` what was found."""

    level: str
    message: str


def template_findings(
    tokenizer, budget: TemplateBudget | None = None, tool_prompt: ToolPrompt | None = None
) -> list[TemplateFinding]:
    """The chat template of `tokenizer` rendered on SAMPLES within `budget` (module docstring), tool
    turns through `tool_prompt` (default: the template's own format, as `--tool-call-format auto`).
    An empty list when the tokenizer has no chat template (the caller says so). Never raises for a
    broken template: each problem is a finding naming the sample and the template's error."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    budget = budget or TemplateBudget()
    renderer = ChatRenderer(tokenizer, budget)
    prompt = tool_prompt or ToolPrompt.for_template(tokenizer.chat_template)
    plan = plan_tools([_TOOL], "auto", None, prompt.fmt)
    refused: list[tuple[str, str]] = []  # (sample, the template's message)
    rendered: list[str] = []
    start = time.perf_counter()
    for name, messages, with_tools, kwargs in SAMPLES:
        turns, tools = prompt.render(messages, plan if with_tools else None)
        try:
            renderer.render(turns, tools, True, kwargs)
        except TemplateBudgetError as e:  # one is enough: the next sample would spend it again
            return [TemplateFinding(ERROR, f"spends its budget on the {name} sample: {e.message}")]
        except ChatTemplateError as e:
            refused.append((name, e.reason))
        except (AgentrtError, APIError) as e:  # InternalError: it does not compile
            return [TemplateFinding(ERROR, e.message.removeprefix("the chat template "))]
        else:
            rendered.append(name)
    if not rendered:
        name, reason = refused[0]
        samples = ", ".join(n for n, _ in refused)
        return [
            TemplateFinding(
                ERROR,
                f"renders none of the samples ({samples}): every chat request would get a 400; "
                f"on the {name} sample: {reason}",
            )
        ]
    ms = (time.perf_counter() - start) * 1e3
    tools = f" ({prompt.fmt.name} {'template' if prompt.native else 'generic'} prompt)"
    samples = ", ".join(n + (tools if n == "tools" else "") for n in rendered)
    budget_text = f"budget {budget.time_s:g} s, {budget.max_bytes:,} bytes"
    findings = [TemplateFinding(OK, f"renders the samples {samples} in {ms:.0f} ms ({budget_text})")]
    for name, reason in refused:
        findings.append(
            TemplateFinding(WARNING, f"refuses the {name} sample (such requests get a 400): {reason}")
        )
    return findings
