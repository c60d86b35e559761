"""Tool-call requests: validate OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (the tool
turns of `messages`: turns.py), and turn them into a `ToolPlan` (what the grammar offers, what the prompt shows
and what the parser expects).

Every check raises APIError (400) naming the request field at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import regex

from agentrt.api.errors import APIError, shown
from agentrt.api.tools.parsing import ToolCallParser
from agentrt.grammars.spec import ConstraintSpec
from agentrt.grammars.tool_calls import ToolCallFormat

_NAME = r"[A-Za-z0-9_.:\-]{1,64}"
MAX_TOOLS = 128
"""The most tools one request may offer (OpenAI's limit): each is meta-validated and rendered."""
_CHOICE_SHAPES = (
    'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
)


@dataclass
class ToolPlan:
    """What a request asks of tools: mode "none" | "auto" | "required" (a named tool_choice is
    "required" over that one tool); tools: [{"name", "description", "parameters", "strict"}]
    offered to the grammar; all_tools: every tool of the request (rendered in the prompt), in the
    request's order; constrained: calls are constrained by a grammar (else only parsed)."""

    mode: str
    tools: list[dict]
    all_tools: list[dict]
    parallel: bool
    fmt: ToolCallFormat
    constrained: bool = True

    @property
    def calls(self) -> bool:
        """The output may hold tool calls (tool_choice is not "none")."""
        return self.mode != "none"

    def constraint_value(self, answer: ConstraintSpec | None = None) -> str:
        """The JSON value of the "tool_calls" ConstraintSpec: its keys in a fixed order, each tool's
        parameters in the order the request declares them (never sorted: property order is the order
        the grammar makes the arguments follow, and the value is the compiled grammar's cache key).
        `answer`: the schema of a final answer the output may be instead of calls (`with_answer`),
        as the key "answer": {"schema", "strict"}."""
        value: dict[str, Any] = {
            "format": self.fmt.name,
            "mode": self.mode,
            "parallel": self.parallel,
            "tools": [
                {"name": t["name"], "parameters": t["parameters"], "strict": t["strict"]} for t in self.tools
            ],
        }
        if answer is not None:
            schema = json.loads(answer.value) if answer.kind == "json_schema" else {"type": "object"}
            value["answer"] = {"schema": schema, "strict": answer.strict}
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    def with_answer(self, answer: ConstraintSpec) -> ConstraintSpec:
        """The constraint of an output that is tool calls or a final answer valid against `answer`
        (a "json_schema" or "json_object" spec: the request's response schema), one grammar
        (grammars/pipeline.py: the calls as under "required", or the answer's JSON). Only under
        tool_choice "auto" with constrained calls; raises ValueError otherwise."""
        if self.mode != "auto" or not self.constrained or answer.kind not in ("json_schema", "json_object"):
            raise ValueError("calls or an answer: tool_choice 'auto', constrained calls, a JSON answer")
        return ConstraintSpec.tool_calls(self.constraint_value(answer))

    def constraint(self) -> ConstraintSpec | None:
        """The "tool_calls" constraint of the output, or None (unconstrained calls). Under
        tool_choice "none" it is free text that never opens a call (the format's call markers are
        excluded: grammars/tool_calls.py)."""
        if not self.constrained:
            return None
        if self.mode == "none":
            names = [{"name": t["name"]} for t in self.all_tools]
            value = {"format": self.fmt.name, "mode": "none", "parallel": False, "tools": names}
            return ConstraintSpec.tool_calls(json.dumps(value, ensure_ascii=False))
        return ConstraintSpec.tool_calls(self.constraint_value())

    def request_index(self, offered_index: int) -> int:
        """The index in the request's `tools` of offered tool `offered_index` (a ConstraintError's
        `tool_index` counts the offered tools, which a named tool_choice narrows to one)."""
        name = self.tools[offered_index]["name"]
        return next(i for i, t in enumerate(self.all_tools) if t["name"] == name)

    def new_parser(self) -> ToolCallParser:
        """A parser of the output that accepts calls to the offered tools only (their parameter
        schemas type the values of formats that write arguments as text)."""
        return ToolCallParser(
            self.fmt,
            names={t["name"] for t in self.tools},
            schemas={t["name"]: t["parameters"] for t in self.tools},
        )


def plan_tools(
    tools: list[dict] | None,
    tool_choice: Any,
    parallel: bool | None,
    fmt: ToolCallFormat,
    constrained: bool = True,
) -> ToolPlan | None:
    """Validate `tools` / `tool_choice` (OpenAI's shapes). None when the request has no tools and
    tool_choice is absent, "none" or "auto" (plain text). Raises APIError (400) naming the field."""
    if not tools:  # "auto" over no tools is plain text (Responses objects echo that pair)
        if tool_choice not in (None, "none", "auto"):
            raise APIError(
                'tool_choice needs tools ("auto" or "none" without tools is plain text)', param="tool_choice"
            )
        return None
    if len(tools) > MAX_TOOLS:
        raise APIError(f"at most {MAX_TOOLS} tools per request (as OpenAI), got {len(tools)}", param="tools")
    specs: list[dict] = []
    for i, t in enumerate(tools):
        specs.append(_tool_spec(f"tools[{i}]", t, {s["name"] for s in specs}))
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    parallel = True if parallel is None else parallel
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):  # a named tool: exactly one call to it (as OpenAI, vLLM, llama.cpp)
        return ToolPlan("required", [_named_tool(choice, specs)], specs, False, fmt, constrained)
    if choice not in ("none", "auto", "required"):
        raise APIError(_CHOICE_SHAPES, param="tool_choice")
    return ToolPlan(choice, specs, specs, parallel, fmt, constrained)


def _tool_spec(where: str, t: Any, seen: set[str]) -> dict:
    """One entry of `tools` as {"name", "description", "parameters", "strict"}. Raises APIError."""
    if (
        not isinstance(t, dict)
        or t.get("type", "function") != "function"
        or not isinstance(t.get("function"), dict)
    ):
        raise APIError(f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not regex.fullmatch(_NAME, name):
        raise APIError(
            f"{where}.function.name must be 1-64 letters, digits, '_', '.', ':' or '-'",
            param=f"{where}.function.name",
        )
    if name in seen:
        raise APIError(f"{where}.function.name '{name}' is given twice", param=f"{where}.function.name")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, dict):
        raise APIError(
            f"{where}.function.parameters must be a JSON Schema object", param=f"{where}.function.parameters"
        )
    if params.get("type", "object") != "object":
        # arguments are a JSON object (OpenAI's contract; frameworks json.loads them into a dict)
        raise APIError(
            f'{where}.function.parameters must describe an object ("type": "object"), got '
            f"type {shown(params.get('type'))}",
            param=f"{where}.function.parameters",
        )
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(f"{where}.function.strict must be a boolean", param=f"{where}.function.strict")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise APIError(
            f"{where}.function.description must be a string", param=f"{where}.function.description"
        )
    return {
        "name": name,
        "description": desc or "",
        "parameters": {**params, "type": "object"},
        "strict": strict,
    }


def _named_tool(choice: dict, specs: list[dict]) -> dict:
    """The tool a `{"type": "function", "function": {"name": ...}}` tool_choice names. Raises APIError."""
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError(_CHOICE_SHAPES, param="tool_choice")
    chosen = [s for s in specs if s["name"] == name]
    if not chosen:
        raise APIError(f"tool_choice names {shown(name)}, which is not one of the tools", param="tool_choice")
    return chosen[0]


def check_tool_schemas(plan: ToolPlan, max_bytes: int | None = None) -> None:
    """Check every tool's parameters against the JSON Schema meta-schema (as for response_format) and
    replace them by their canonical form (in place). `max_bytes`: the most bytes of compact JSON one
    tool's parameters may take (checked before its meta-schema check), and all of them together.
    Raises APIError naming `tools[i].function.parameters`."""
    total = 0
    for i, t in enumerate(plan.all_tools):
        try:
            value = ConstraintSpec.json_schema(t["parameters"], max_bytes=max_bytes).value
            total += len(value.encode())
            if max_bytes is not None and total > max_bytes:
                raise ValueError(
                    f"the tools' parameters up to this one are {total} bytes together, over the "
                    f"{max_bytes}-byte limit of a constraint"
                )
            t["parameters"] = json.loads(value)
        except ValueError as e:
            where = f"tools[{i}].function.parameters"
            raise APIError(f"{where}: {e}", param=where) from None
