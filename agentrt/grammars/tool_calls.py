"""Tool-call formats (how a model family writes calls) and their constraint: an xgrammar
structural tag whose tags carry each tool's name in their begin text and the tool's arguments
grammar as content. See agentrt/api/tools/ for the request and response side.

Styles of format (``ToolCallFormat.style``):

- ``json``: a JSON call object ``{"name": ..., "arguments": {...}}`` after a marker (hermes
  ``<tool_call>``, phi4_mini ``<|tool_call|>``; one list of every call of the turn: mistral
  ``[TOOL_CALLS][...]`` as Mistral's templates write it, granite ``<|tool_call|>[...]`` (Granite
  3.x), nemotron_json ``<TOOLCALL>[...]</TOOLCALL>`` (Nemotron Nano v2)) or alone (llama3_json,
  calls separated by ``; ``, optionally after ``<|python_tag|>``; a Llama built-in tool also as
  ``<|python_tag|>NAME.call(k=v)``); mistral's newer ``[TOOL_CALLS]name[ARGS]{...}`` is parsed by
  the same machine (mistral_v11 is its grammar);
- ``tagged``: the name between special tokens, then the arguments as JSON, inside a section
  (deepseek_v3_1 ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>
  <｜tool▁calls▁end｜>``, kimi_k2 ``<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>``);
- ``xml``: the arguments as parameters, strings raw (qwen3_coder ``<tool_call>\\n<function=name>\\n
  <parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>``, glm45 ``<tool_call>name\\n
  <arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``);
- ``dsml`` (DeepSeek V3.2): XML parameters inside a section, each with a ``string`` attribute
  saying how its value is written (``true``: raw text, ``false``: JSON): ``<｜DSML｜function_calls>
  \\n<｜DSML｜invoke name="name">\\n<｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>
  \\n</｜DSML｜invoke>\\n</｜DSML｜function_calls>``;
  MiniMax M2's is the same markup without the prefix nor the attribute (strings raw, other values
  JSON): ``<minimax:tool_call>\\n<invoke name="name">\\n<parameter name="k">v</parameter>\\n</invoke>
  \\n</minimax:tool_call>``;
- ``pythonic``: a Python list of calls with keyword arguments, ``[f(a=1, b="x"), g()]`` (Gemma 3);
- ``gemma4`` (Gemma 4): ``<|tool_call>call:name{k:<|"|>v<|"|>,n:2}<tool_call|>``, calls back to back,
  strings between ``<|"|>`` (no escaping), keys bare at every depth (grammars/tool_args_gemma4.py).

harmony (gpt-oss) is tagged without a section: ``<|channel|>commentary to=functions.NAME
<|constrain|>json<|message|>{...}`` then the stop token ``<|call|>``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from agentrt.grammars.tool_args import (
    DSML,
    DSML_XML,
    GLM_XML,
    MINIMAX_XML,
    QWEN_XML,
    XmlLayout,
    calls_list_ebnf,
    lit,
    pythonic_arguments_ebnf,
    rename,
    xml_arguments_ebnf,
)
from agentrt.grammars.tool_args_gemma4 import gemma4_arguments_ebnf, gemma4_members

HARMONY_CALL = "<|channel|>commentary to=functions."
"""How gpt-oss opens a call (Harmony): the commentary channel, addressed to the function."""

PYTHON_TAG = "<|python_tag|>"
"""Llama 3.x's tag before a call in its ipython environment (a JSON call or a built-in tool's)."""

LLAMA_BUILTIN_TOOLS = ("brave_search", "wolfram_alpha", "code_interpreter")
"""Llama 3.1/3.3's built-in tools: its template writes a call to one (named in the template's
`builtin_tools`) as ``<|python_tag|>NAME.call(key="value", ...)``, every other call as JSON; a tool
of the request with one of these names may be called either way."""

_BUILTIN_ROOT = "llama_builtin_call_root"
_MISTRAL_ID = "(" + lit(', "id": "') + " [A-Za-z0-9]{9} " + lit('"') + ")?"
"""EBNF: the 9-character call id Mistral's templates write after a call's arguments (optional)."""

JSON_LISTS = {
    "mistral": (("[TOOL_CALLS][", "[TOOL_CALLS] ["), _MISTRAL_ID),
    "granite": (("<|tool_call|>[",), ""),
    "nemotron_json": (("<TOOLCALL>[",), ""),
}
"""The formats whose calls of a turn are one JSON list after the marker (and before the format's
close): format -> (the openings the grammar allows, what an item may hold after its arguments:
an EBNF expression, "" for nothing). Mistral Small 3.1's template writes a space before the list
and both Mistral templates a 9-character id in each item."""


@dataclass(frozen=True)
class ToolCallFormat:
    """name; marker: text that opens a block of calls in model text; marker_in_body: the marker is
    the start of the call object itself (llama3_json) rather than a wrapper; close: text that ends
    a block (hermes); args_key: the key holding the arguments; list_style: a block is a JSON list of
    calls (mistral, granite, nemotron_json: JSON_LISTS); separator: between calls of one block
    (list / llama3) or between blocks; skip_special_tokens: whether decoded text may drop special
    tokens (a marker that is a special token must stay in the text); style: json / tagged / xml /
    dsml / pythonic / gemma4 (module docstring);
    section: (begin, end) around the calls (tagged, dsml); call_begin / name_end / call_end: the text
    before a call's name, between the name and its arguments, after the arguments (tagged, xml, dsml,
    gemma4);
    name_prefix: before the name inside call_begin..name_end (kimi_k2 "functions."); call_index: a
    ":N" index follows the name (kimi_k2); xml: how a parameter is written (xml, dsml)."""

    name: str
    marker: str
    close: str
    args_key: str = "arguments"
    list_style: bool = False
    separator: str = "\n"
    marker_in_body: bool = False
    skip_special_tokens: bool = True
    style: str = "json"
    section: tuple[str, str] | None = None
    call_begin: str = ""
    name_end: str = ""
    call_end: str = ""
    name_prefix: str = ""
    call_index: bool = False
    xml: XmlLayout | None = None

    def tag_begin(self, tool: str) -> str:
        """The text of a call up to its arguments (kimi_k2: up to its ":" index)."""
        if self.style != "json":
            return f"{self.call_begin}{self.name_prefix}{tool}" + (":" if self.call_index else self.name_end)
        if self.name == "mistral_v11":
            return f"[TOOL_CALLS]{tool}[ARGS]"
        head = f'{{"name": {json.dumps(tool, ensure_ascii=False)}, "{self.args_key}": '
        if self.name in JSON_LISTS:
            return f"{self.marker}[{head}"
        return {"hermes": "<tool_call>\n", "phi4_mini": "<|tool_call|>"}.get(self.name, "") + head

    def tag_end(self) -> str:
        if self.style != "json":
            return self.call_end
        ends = {
            "hermes": "}\n</tool_call>",
            "mistral_v11": "",
            "phi4_mini": "}<|/tool_call|>",
        }
        if self.name in JSON_LISTS:
            return "}]" + self.close
        return ends.get(self.name, "}")

    @property
    def trigger(self) -> str:
        """The text that starts calls in free text (tool_choice "auto"; stop strings end there)."""
        if self.marker_in_body:
            return '{"name": '
        if self.section is not None:
            return self.section[0]
        return self.marker

    def render_calls(self, calls: list[tuple[str, dict]], first_index: int = 0) -> str:
        """The text of `calls` ([(name, arguments object)]) as the model writes them in this format
        (one block; kimi_k2 numbers them from `first_index`)."""
        if not calls:
            return ""
        if self.style in ("xml", "dsml", "pythonic", "gemma4"):
            calls = [(n, a if isinstance(a, dict) else {}) for n, a in calls]
        if self.style == "pythonic":
            items = ", ".join(f"{n}({', '.join(f'{k}={_js(v)}' for k, v in a.items())})" for n, a in calls)
            return f"[{items}]"
        if self.name in JSON_LISTS:
            items = ", ".join(f'{{"name": {_js(n)}, "arguments": {_js(a)}}}' for n, a in calls)
            return f"{self.marker}[{items}]{self.close}"
        parts = []
        for i, (n, a) in enumerate(calls):
            begin = self.tag_begin(n)
            if self.call_index:
                begin += f"{first_index + i}{self.name_end}"
            if self.xml is not None:
                body = self.xml.sep.join(self.xml.render(k, v) for k, v in a.items())
            elif self.style == "gemma4":
                body = gemma4_members(a)
            else:
                body = _js(a)
            parts.append(begin + body + self.tag_end())
        sep = "" if self.section is not None else self.separator
        text = sep.join(parts)
        return f"{self.section[0]}{text}{self.section[1]}" if self.section is not None else text


def _js(value) -> str:
    return json.dumps(value, ensure_ascii=False)


DEEPSEEK = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
)
KIMI = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)

FORMATS = {
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>", "arguments", separator="\n"),
    "llama3_json": ToolCallFormat(
        "llama3_json",
        '{"name"',
        "",
        "parameters",
        separator="; ",
        marker_in_body=True,
        skip_special_tokens=False,  # <|python_tag|> (a special token) opens a built-in call
    ),
    "mistral": ToolCallFormat(
        "mistral", "[TOOL_CALLS]", "", "arguments", list_style=True, separator="", skip_special_tokens=False
    ),
    "mistral_v11": ToolCallFormat(
        "mistral_v11",
        "[TOOL_CALLS]",
        "",
        "arguments",
        list_style=True,
        separator="",
        skip_special_tokens=False,
    ),
    "phi4_mini": ToolCallFormat(
        "phi4_mini", "<|tool_call|>", "<|/tool_call|>", "arguments", separator="", skip_special_tokens=False
    ),
    # Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (no close; Granite 4 is hermes)
    "granite": ToolCallFormat(
        "granite", "<|tool_call|>", "", "arguments", list_style=True, separator="", skip_special_tokens=False
    ),
    # Nemotron Nano v2 (Nemotron-H): `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`
    "nemotron_json": ToolCallFormat(
        "nemotron_json",
        "<TOOLCALL>",
        "</TOOLCALL>",
        "arguments",
        list_style=True,
        separator="",
        skip_special_tokens=False,
    ),
    "qwen3_coder": ToolCallFormat(
        "qwen3_coder",
        "<tool_call>",
        "</tool_call>",
        style="xml",
        call_begin="<tool_call>\n<function=",
        name_end=">\n",
        call_end="</function>\n</tool_call>",
        xml=QWEN_XML,
        skip_special_tokens=False,
    ),
    "glm45": ToolCallFormat(
        "glm45",
        "<tool_call>",
        "</tool_call>",
        style="xml",
        call_begin="<tool_call>",
        name_end="\n",
        call_end="</tool_call>",
        xml=GLM_XML,
        skip_special_tokens=False,
    ),
    "deepseek_v3_1": ToolCallFormat(
        "deepseek_v3_1",
        DEEPSEEK[0],
        DEEPSEEK[1],
        style="tagged",
        section=DEEPSEEK[:2],
        call_begin=DEEPSEEK[2],
        name_end=DEEPSEEK[3],
        call_end=DEEPSEEK[4],
        separator="",
        skip_special_tokens=False,
    ),
    "kimi_k2": ToolCallFormat(
        "kimi_k2",
        KIMI[0],
        KIMI[1],
        style="tagged",
        section=KIMI[:2],
        call_begin=KIMI[2],
        name_end=KIMI[3],
        call_end=KIMI[4],
        name_prefix="functions.",
        call_index=True,
        separator="",
        skip_special_tokens=False,
    ),
    # DeepSeek V3.2: as its template writes calls (after "\n\n" following the content)
    "deepseek_v3_2": ToolCallFormat(
        "deepseek_v3_2",
        f"<{DSML}function_calls>",
        f"</{DSML}function_calls>",
        style="dsml",
        section=(f"<{DSML}function_calls>", f"\n</{DSML}function_calls>"),
        call_begin=f'\n<{DSML}invoke name="',
        name_end='">\n',
        call_end=f"\n</{DSML}invoke>",
        xml=DSML_XML,
        separator="",
        skip_special_tokens=False,
    ),
    # MiniMax M2: as its template writes calls (a newline after each tag)
    "minimax_m2": ToolCallFormat(
        "minimax_m2",
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        style="dsml",
        section=("<minimax:tool_call>", "\n</minimax:tool_call>"),
        call_begin='\n<invoke name="',
        name_end='">\n',
        call_end="</invoke>",
        xml=MINIMAX_XML,
        separator="",
        skip_special_tokens=False,
    ),
    "pythonic": ToolCallFormat("pythonic", "[", "]", style="pythonic", separator=", "),
    # Gemma 4: as its template writes calls (back to back, no separator)
    "gemma4": ToolCallFormat(
        "gemma4",
        "<|tool_call>",
        "<tool_call|>",
        style="gemma4",
        call_begin="<|tool_call>call:",
        name_end="{",
        call_end="}<tool_call|>",
        separator="",
        skip_special_tokens=False,
    ),
    # gpt-oss: a call is a message on the commentary channel to its recipient; <|call|> (a stop
    # token) ends it and the turn, so one call per output
    "harmony": ToolCallFormat(
        "harmony",
        HARMONY_CALL,
        "",
        style="tagged",
        call_begin=HARMONY_CALL,
        name_end=" <|constrain|>json<|message|>",
        call_end="",
        separator="",
        skip_special_tokens=False,
    ),
}


def arguments_ebnf(fmt_name: str, tool: dict, dropped: list[str], ws: dict, schema_ebnf) -> str:
    """EBNF (root `root`) of `tool`'s arguments ({"name", "parameters", "strict"}) in format
    `fmt_name`: the JSON grammar of its parameters (`schema_ebnf`, the pipeline's faithful JSON
    Schema grammar, passed in to keep this module below the pipeline), or XML parameters / Python
    keyword arguments built from it (grammars/tool_args.py), or Gemma 4's values
    (grammars/tool_args_gemma4.py)."""
    fmt = FORMATS[fmt_name]
    if fmt.style in ("xml", "dsml"):
        return xml_arguments_ebnf(
            tool["parameters"], tool["strict"], dropped, ws, schema_ebnf, fmt.xml, fmt.name
        )
    if fmt.style == "pythonic":
        return pythonic_arguments_ebnf(tool["parameters"], tool["strict"], dropped, ws, schema_ebnf, fmt.name)
    if fmt.style == "gemma4":
        return gemma4_arguments_ebnf(tool["parameters"], tool["strict"], dropped, ws, schema_ebnf)
    ebnf = schema_ebnf(tool["parameters"], tool["strict"], dropped, ws)
    if fmt.name == "llama3_json" and tool["name"] in LLAMA_BUILTIN_TOOLS:
        ebnf += _builtin_call_rules(tool, dropped, ws, schema_ebnf)
    return ebnf


def _builtin_call_rules(tool: dict, json_dropped: list[str], ws: dict, schema_ebnf) -> str:
    """The rules (root `_BUILTIN_ROOT`) of a Llama built-in tool's keyword arguments `k=<JSON value>`
    (its `NAME.call(...)` form), to append to its JSON arguments grammar; "" where they would
    enforce less than the JSON grammar (a property name that is no identifier, a keyword on the
    arguments object a keyword list drops): then only the JSON call is offered."""
    dropped: list[str] = []
    try:
        kwargs = pythonic_arguments_ebnf(
            tool["parameters"], tool["strict"], dropped, ws, schema_ebnf, "llama3_json"
        )
    except ValueError:
        return ""
    if set(dropped) - set(json_dropped):
        return ""
    rules, _ = rename(kwargs, _BUILTIN_ROOT[: -len("root")])  # its root becomes _BUILTIN_ROOT
    return "\n" + rules


def structural_tag(plan_value: dict, args_grammars: list[str]) -> dict:
    """The xgrammar structural tag for a "tool_calls" constraint: `plan_value` is the decoded
    ToolPlan.constraint_value(), `args_grammars[i]` the EBNF (root rule `root`) of tool i's
    arguments (`arguments_ebnf`)."""
    fmt = FORMATS[plan_value["format"]]
    tools = plan_value["tools"]
    if plan_value["mode"] == "none":  # free text that never opens a call
        return {
            "type": "structural_tag",
            "format": {"type": "any_text", "excludes": call_markers(fmt, tools)},
        }
    parallel = plan_value["parallel"] and fmt.name != "harmony"  # a Harmony call ends the turn
    required = plan_value["mode"] == "required"
    if fmt.style == "pythonic":
        return _pythonic_tag(tools, args_grammars, parallel, required)
    if fmt.name == "llama3_json":
        return _llama_tag(fmt, tools, args_grammars, parallel, required)
    if fmt.name in JSON_LISTS:
        return _json_list_tag(fmt, tools, args_grammars, parallel, required)
    tags = [_tag(fmt, t["name"], g) for t, g in zip(tools, args_grammars)]
    if fmt.section is not None:
        inner = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
        section = {"type": "tag", "begin": fmt.section[0], "content": inner, "end": fmt.section[1]}
        if required:
            return {"type": "structural_tag", "format": section}
        body = {
            "type": "triggered_tags",
            "triggers": [fmt.section[0]],
            "tags": [section],
            "at_least_one": False,
            "stop_after_first": not parallel,
        }
        return {"type": "structural_tag", "format": body}
    if required:
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


def call_markers(fmt: ToolCallFormat, tools: list[dict]) -> list[str]:
    """The texts that open a call in `fmt` (what tool_choice "none" excludes from the output):
    the section or call marker, or for pythonic `[name(` of each tool."""
    if fmt.style == "pythonic":
        return [f"[{t['name']}(" for t in tools]
    if fmt.section is not None:
        return [fmt.section[0]]
    if fmt.marker_in_body:  # a bare JSON call (llama3_json): an object naming a tool, not any {"name"
        return [fmt.tag_begin(t["name"]) for t in tools] + [PYTHON_TAG]
    return [fmt.trigger]


def _tag(fmt: ToolCallFormat, name: str, args: str) -> dict:
    content: dict = {"type": "grammar", "grammar": args}
    if fmt.call_index:  # kimi_k2: functions.NAME:INDEX<|tool_call_argument_begin|>{...}
        content = {
            "type": "sequence",
            "elements": [
                {"type": "regex", "pattern": "[0-9]{1,6}"},
                {"type": "const_string", "value": fmt.name_end},
                content,
            ],
        }
    return {"type": "tag", "begin": fmt.tag_begin(name), "content": content, "end": fmt.tag_end()}


def _llama_tag(
    fmt: ToolCallFormat, tools: list[dict], args: list[str], parallel: bool, required: bool
) -> dict:
    """Llama 3.x: JSON calls `{"name": ..., "parameters": ...}` separated by "; ", the first
    optionally after `<|python_tag|>`; a built-in tool (LLAMA_BUILTIN_TOOLS, its arguments grammar
    carrying the keyword rules of `_builtin_call_rules`) also as `<|python_tag|>NAME.call(k=v, ...)`,
    one call alone (the template ends the message with <|eom_id|> after it). Under "auto" the tag
    is a trigger too: once written, a call follows."""
    json_tags = [_tag(fmt, t["name"], g) for t, g in zip(tools, args)]
    builtin = []
    for t, g in zip(tools, args):
        if f"{_BUILTIN_ROOT} ::=" in g:
            rules, _ = rename(g, "b_")
            kwargs = f"root ::= b_{_BUILTIN_ROOT}\n{rules}"
            content = {"type": "grammar", "grammar": kwargs}
            builtin.append(
                {"type": "tag", "begin": f"{PYTHON_TAG}{t['name']}.call(", "content": content, "end": ")"}
            )
    if required:
        calls = {
            "type": "tags_with_separator",
            "tags": json_tags,
            "separator": fmt.separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
        tag = {"type": "optional", "content": {"type": "const_string", "value": PYTHON_TAG}}
        body: dict = {"type": "sequence", "elements": [tag, calls]}
        if builtin:
            body = {"type": "or", "elements": [body, *builtin]}
        return {"type": "structural_tag", "format": body}
    tagged = [{**t, "begin": PYTHON_TAG + t["begin"]} for t in json_tags]
    body = {
        "type": "triggered_tags",
        "triggers": [fmt.trigger, PYTHON_TAG],
        "tags": json_tags + tagged + builtin,
        "at_least_one": False,
        "stop_after_first": not parallel,
    }
    return {"type": "structural_tag", "format": body}


def _json_list_tag(
    fmt: ToolCallFormat, tools: list[dict], args: list[str], parallel: bool, required: bool
) -> dict:
    """Every call of the turn in one JSON list after the marker (JSON_LISTS), as the family's
    template writes it: mistral (Nemo, Small 3.1) `[TOOL_CALLS][{"name": ..., "arguments": {...},
    "id": "<9 characters>"}, ...]` (Small 3.1's template puts a space before the list; the id is
    optional), granite `<|tool_call|>[...]`, nemotron_json `<TOOLCALL>[...]</TOOLCALL>`. A tag per
    tool (and opening) for the first call, the further calls (parallel) in its content; the list
    (and the format's close) then ends the output."""
    openings, item_tail = JSON_LISTS[fmt.name]
    end = f'{item_tail} "}}"'.strip()
    more = None
    if parallel:
        heads = [(f'{{"name": {_js(t["name"])}, "arguments": ', g) for t, g in zip(tools, args)]
        more = calls_list_ebnf(heads, tail=end, separator=", ")
    tags = []
    for opening in openings:
        for t, g in zip(tools, args):
            elements = [{"type": "grammar", "grammar": g}, {"type": "grammar", "grammar": f"root ::= {end}"}]
            if more is not None:
                elements.append({"type": "grammar", "grammar": more})
            begin = opening + fmt.tag_begin(t["name"])[len(fmt.marker) + 1 :]
            tags.append(
                {
                    "type": "tag",
                    "begin": begin,
                    "content": {"type": "sequence", "elements": elements},
                    "end": "]" + fmt.close,
                }
            )
    return _one_list(tags, [fmt.trigger], required)


def _pythonic_tag(tools: list[dict], args: list[str], parallel: bool, required: bool) -> dict:
    """One list `[f(...), g(...)]`: a tag per tool for the first call (its begin `[f(` is the
    trigger: free text may hold other brackets), the further calls (parallel) in its content."""
    more = calls_list_ebnf([(t["name"] + "(", g) for t, g in zip(tools, args)]) if parallel else None
    tags = []
    for t, g in zip(tools, args):
        elements = [{"type": "grammar", "grammar": g}, {"type": "const_string", "value": ")"}]
        if more is not None:
            elements.append({"type": "grammar", "grammar": more})
        tags.append(
            {
                "type": "tag",
                "begin": f"[{t['name']}(",
                "content": {"type": "sequence", "elements": elements},
                "end": "]",
            }
        )
    return _one_list(tags, [f"[{t['name']}(" for t in tools], required)


def _one_list(tags: list[dict], triggers: list[str], required: bool) -> dict:
    """The structural tag of a format whose calls are one list (one of `tags` opens it, its content
    holds the further calls): exactly one list when `required`, else free text in which one of
    `triggers` opens it."""
    if required:
        body = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True}
    else:
        body = {"type": "triggered_tags", "triggers": triggers, "tags": tags, "at_least_one": False}
    return {"type": "structural_tag", "format": {**body, "stop_after_first": True}}
