"""Which tool-call format a chat template implies, read from the markers in its text.

``detect(template)`` -> ``Detected``: the format (a name in grammars/tool_calls.FORMATS), whether the
template renders the tool definitions and the assistant's earlier calls itself, and, for a template
written for a call syntax no parser here reads (the R1 distills, Command-R7B), that
syntax's name: such a model gets the generic prompt (hermes), with a start-up
warning naming both (rendering.ToolPrompt.for_template), never silently garbled calls.

The table (first match wins; README "Tool-call formats"):

| template marker                                   | format          |
|---------------------------------------------------|-----------------|
| ``<function=`` + ``<parameter=``                  | qwen3_coder     |
| ``<arg_key>``                                     | glm45           |
| ``<|channel|>`` + ``<|call|>``                    | harmony         |
| ``｜DSML｜``                                       | deepseek_v3_2   |
| ``<minimax:tool_call>`` + ``<invoke name=``       | minimax_m2      |
| ``<TOOLCALL>``                                    | nemotron_json   |
| ``<|tool_call>`` + ``call:`` (Gemma 4)              | gemma4          |
| ``<｜tool▁sep｜>`` (without R1's ```` ```json ````)  | deepseek_v3_1   |
| ``<|tool_calls_section_begin|>`` / ``tool_declare`` | kimi_k2       |
| ``[TOOL_CALLS]`` + ``[ARGS]``                     | mistral_v11     |
| ``[TOOL_CALLS]``                                  | mistral         |
| ``<|tool_call|>`` + ``available_tools``           | granite         |
| ``<|tool_call|>`` + ``<|/tool_call|>``            | phi4_mini       |
| "python list of the function calls"               | pythonic        |
| ``<tool_call>``                                   | hermes          |
| ``<|python_tag|>`` / ``ipython``                  | llama3_json     |
| none of these                                     | hermes, generic |
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOOL_ROLE = re.compile(r"""[!=]=\s*['"]tool['"]""")


@dataclass(frozen=True)
class Detected:
    """name: the call format; native: the template renders tool turns itself (else the generic
    prompt); tools_in_template: it renders the tool definitions (else the format's own tools
    prompt goes into the system message); calls_in_template: it renders the assistant's earlier
    calls (else they are written as text in the format's syntax); single_call_turns: it takes one
    call per assistant message (Llama 3.x: a turn with several is split); tool_responses: it takes
    tool results as `tool_responses` ({name, response}) on the assistant message that made the
    calls, not as tool messages (Gemma 4's first template; rendering.py moves them there);
    unsupported: the call syntax of a template no parser reads (the model gets the generic prompt)."""

    name: str
    native: bool
    tools_in_template: bool = True
    calls_in_template: bool = True
    single_call_turns: bool = False
    tool_responses: bool = False
    unsupported: str | None = None


# templates whose tool syntax has no parser here: (markers that must all appear, name)
UNSUPPORTED = (
    (
        ("<｜tool▁sep｜>", "```json"),
        "deepseek_r1 (<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME ```json ...)",
    ),
    (("<|START_ACTION|>",), "command_r (<|START_ACTION|>[...]<|END_ACTION|>)"),
)


def detect(template: str | None) -> Detected:
    """The tool-call set-up a chat template implies (module docstring's table)."""
    t = template or ""
    renders_tools = "tools" in t
    renders_calls = "tool_calls" in t
    if "<function=" in t and "<parameter=" in t:
        return Detected("qwen3_coder", True)
    if "<arg_key>" in t:
        return Detected("glm45", True)
    if "<|channel|>" in t and "<|call|>" in t:
        return Detected("harmony", True)
    if "｜DSML｜" in t:
        return Detected("deepseek_v3_2", True, tools_in_template=renders_tools)
    if "<minimax:tool_call>" in t and "<invoke name=" in t:
        return Detected("minimax_m2", True, tools_in_template=renders_tools)
    if "<TOOLCALL>" in t:
        return Detected("nemotron_json", renders_tools, calls_in_template=renders_calls)
    if "<|tool_call>" in t and "call:" in t:  # a template that reads role "tool" messages says so
        results = "tool_responses" in t and not _TOOL_ROLE.search(t)
        return Detected("gemma4", True, tools_in_template=renders_tools, tool_responses=results)
    for markers, name in UNSUPPORTED:
        if all(m in t for m in markers):
            return Detected("hermes", False, unsupported=name)
    if "<｜tool▁sep｜>" in t:  # V3.1's template renders calls and results, not the tool list
        return Detected("deepseek_v3_1", True, tools_in_template=renders_tools)
    if "<|tool_calls_section_begin|>" in t or "tool_declare" in t:
        return Detected("kimi_k2", True, calls_in_template=renders_calls)
    if "[TOOL_CALLS]" in t:
        return Detected("mistral_v11" if "[ARGS]" in t else "mistral", renders_tools)
    if "<|tool_call|>" in t and "available_tools" in t:  # Granite 3.x: renders no earlier calls
        return Detected("granite", renders_tools, calls_in_template=renders_calls)
    if "<|tool_call|>" in t and "<|/tool_call|>" in t:
        return Detected("phi4_mini", renders_tools)
    if "python list of the function calls" in t:
        return Detected("pythonic", renders_tools)
    if "<tool_call>" in t:
        return Detected("hermes", renders_tools)
    if "<|python_tag|>" in t or "ipython" in t:
        return Detected("llama3_json", renders_tools, single_call_turns="single tool-call" in t)
    return Detected("hermes", False)
