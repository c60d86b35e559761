"""Tool-call formats (how a model family writes calls) and their constraint: an xgrammar
structural tag whose tags carry each tool's name in their begin text and the tool's arguments
grammar as content. See agentrt/api/tools/ for the request and response side."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCallFormat:
    """name; marker: text that opens a block of calls in model text; marker_in_body: the marker is
    the start of the call object itself (llama3_json) rather than a wrapper; close: text that ends
    a block (hermes); args_key: the key holding the arguments; list_style: a block is a JSON list of
    calls (mistral); separator: between calls of one block (list / llama3) or between blocks;
    skip_special_tokens: whether decoded text may drop special tokens (a marker that is a special
    token must stay in the text)."""

    name: str
    marker: str
    close: str
    args_key: str
    list_style: bool = False
    separator: str = "\n"
    marker_in_body: bool = False
    skip_special_tokens: bool = True

    def tag_begin(self, tool: str) -> str:
        head = f'{{"name": {json.dumps(tool, ensure_ascii=False)}, "{self.args_key}": '
        if self.name == "hermes":
            return "<tool_call>\n" + head
        if self.name == "mistral":
            return "[TOOL_CALLS][" + head
        return head

    def tag_end(self) -> str:
        return {"hermes": "}\n</tool_call>", "mistral": "}]"}.get(self.name, "}")

    @property
    def trigger(self) -> str:
        return '{"name": ' if self.marker_in_body else self.marker


FORMATS = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>", "arguments", separator="\n"),
    "llama3_json": ToolCallFormat(
        "llama3_json",
        '{"name"',
        "",
        "parameters",
        separator="; ",
        marker_in_body=True,
        skip_special_tokens=True,
    ),
    "mistral": ToolCallFormat(
        "mistral", "[TOOL_CALLS]", "", "arguments", list_style=True, separator="", skip_special_tokens=False
    ),
}


def structural_tag(plan_value: dict, args_grammars: list[str]) -> dict:
    """The xgrammar structural tag for a "tool_calls" constraint: `plan_value` is the decoded
    ToolPlan.constraint_value(), `args_grammars[i]` the EBNF (root rule `root`) of tool i's
    arguments."""
    fmt = FORMATS[plan_value["format"]]
    tags = [
        {
            "type": "tag",
            "begin": fmt.tag_begin(t["name"]),
            "content": {"type": "grammar", "grammar": g},
            "end": fmt.tag_end(),
        }
        for t, g in zip(plan_value["tools"], args_grammars)
    ]
    parallel = plan_value["parallel"]
    if plan_value["mode"] == "required":
        sep = "" if fmt.list_style else fmt.separator
        body = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": sep,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
    else:
        body = {
            "type": "triggered_tags",
            "triggers": [fmt.trigger],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
    return {"type": "structural_tag", "format": body}
