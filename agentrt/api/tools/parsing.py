"""Tool calling: OpenAI's tools contract over the model's own call syntax.

A *tool-call format* is how a model family writes calls in its text:

- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``,
  one block per call. It is also the *generic* format, for chat templates with no tool support
  (the default model's): tool definitions go into the system prompt (``TOOLS_PROMPT``), earlier
  calls and tool results are written back as text in the same syntax.
- ``llama3_json`` (Llama 3.1/3.2/3.3): the output is ``{"name": "f", "parameters": {...}}``
  (optionally after ``<|python_tag|>``); several calls are separated by ``; ``.
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``.

Calls are constrained with xgrammar structural tags: each tool is a tag whose begin text holds
its name (the model cannot invent one) and whose content is the tool's parameter schema, compiled
by the same faithful JSON-Schema pipeline as ``response_format`` (unsupported keywords are a 400
naming the tool). ``required`` / a named tool: the whole output is one call (or one or more with
``parallel_tool_calls``); ``auto``: free text until the format's trigger, then a constrained call.

``ToolCallParser`` turns model text into content and calls incrementally; the same machine serves
streaming and non-streaming responses, so streamed deltas concatenate to the non-streamed result
whatever the chunking.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import regex

from agentrt.api.protocol import APIError
from agentrt.grammars.tool_calls import ToolCallFormat

TOOLS_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions, as JSON Schema
signatures, are inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call>:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>"""


def detect_format(chat_template: str | None) -> tuple[str, bool]:
    """(format name, native): the model's call format read from its chat template; native is
    whether the template itself renders tools (else the generic hermes prompt is used)."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral", "tools" in t
    if "<tool_call>" in t:
        return "hermes", "tools" in t
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json", "tools" in t
    return "hermes", False


# ---- request side ---------------------------------------------------------------------------------
@dataclass
class ToolPlan:
    """What a request asks of tools: mode "none" | "auto" | "required" (a named tool_choice is
    "required" over that one tool); tools: [{"name", "description", "parameters", "strict"}]
    offered to the grammar; all_tools: every tool of the request (rendered in the prompt)."""

    mode: str
    tools: list[dict]
    all_tools: list[dict]
    parallel: bool
    fmt: ToolCallFormat
    constrained: bool = True

    def constraint_value(self) -> str:
        """The canonical JSON value of the "tool_calls" ConstraintSpec."""
        return json.dumps({"format": self.fmt.name, "mode": self.mode, "parallel": self.parallel,
                           "tools": [{"name": t["name"], "parameters": t["parameters"], "strict": t["strict"]}
                                     for t in self.tools]}, sort_keys=True, ensure_ascii=False,
                          separators=(",", ":"))


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel: bool | None, fmt: ToolCallFormat,
               constrained: bool = True) -> ToolPlan | None:
    """Validate `tools` / `tool_choice` (OpenAI's shapes). None when the request has no tools and
    no tool_choice. Raises APIError (400) naming the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    specs, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise APIError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=where)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not regex.fullmatch(r"[A-Za-z0-9_.:\-]{1,64}", name):
            raise APIError(f"{where}.function.name must be 1-64 letters, digits, '_', '.', ':' or '-'",
                           param=f"{where}.function.name")
        if name in seen:
            raise APIError(f"{where}.function.name '{name}' is given twice", param=f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, dict):
            raise APIError(f"{where}.function.parameters must be a JSON Schema object", param=f"{where}.function.parameters")
        if params.get("type", "object") != "object":
            # arguments are a JSON object (OpenAI's contract; frameworks json.loads them into a dict)
            raise APIError(f"{where}.function.parameters must describe an object (\"type\": \"object\"), got "
                           f"type {json.dumps(params.get('type'))}", param=f"{where}.function.parameters")
        params = {**params, "type": "object"}
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(f"{where}.function.strict must be a boolean", param=f"{where}.function.strict")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise APIError(f"{where}.function.description must be a string", param=f"{where}.function.description")
        specs.append({"name": name, "description": desc or "", "parameters": params, "strict": strict})
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    parallel = True if parallel is None else parallel
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                           '"function": {"name": ...}}', param="tool_choice")
        chosen = [s for s in specs if s["name"] == name]
        if not chosen:
            raise APIError(f"tool_choice names '{name}', which is not one of the tools", param="tool_choice")
        return ToolPlan("required", chosen, specs, parallel, fmt, constrained)
    if choice not in ("none", "auto", "required"):
        raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                       '"function": {"name": ...}}', param="tool_choice")
    return ToolPlan(choice, specs, specs, parallel, fmt, constrained)


def check_tool_messages(messages: list[dict]) -> None:
    """OpenAI's rules for tool turns: `tool_calls` only on assistant messages, every `tool`
    message answers (`tool_call_id`) a call of an earlier assistant message. Raises APIError."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        if m.get("tool_calls") and m["role"] != "assistant":
            raise APIError(f"messages[{i}]: only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
        for c in m.get("tool_calls") or []:
            if c.get("id"):
                ids.add(c["id"])
        if m["role"] == "tool":
            tid = m.get("tool_call_id")
            if not tid:
                raise APIError(f"messages[{i}]: a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id")
            if tid not in ids:
                raise APIError(f"messages[{i}]: tool_call_id '{tid}' answers no tool call of an earlier assistant "
                               "message", param=f"messages[{i}].tool_call_id")


def render_messages(messages: list[dict], plan: ToolPlan | None, native: bool,
                    exclude_tools: bool = False) -> tuple[list[dict], list[dict] | None]:
    """(messages for the chat template, tools for the template or None). `messages` are OpenAI
    dicts (role, content text, tool_calls, tool_call_id, name). With a native template, tool calls
    and tool results pass through in Hugging Face's shape (arguments as objects); otherwise the
    generic format writes them as text and the tool definitions go into the system prompt."""
    show = plan is not None and not (plan.mode == "none" and exclude_tools)
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        calls = m.get("tool_calls") or []
        if native:
            msg = {"role": role, "content": content}
            if calls:
                msg["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"])}}
                    for c in calls]
            if role == "tool":
                msg["tool_call_id"] = m.get("tool_call_id")
            out.append(msg)
            continue
        if role == "assistant" and calls:
            blocks = [f'<tool_call>\n{json.dumps({"name": c["function"]["name"], "arguments": _as_object(c["function"]["arguments"])}, ensure_ascii=False)}\n</tool_call>'
                      for c in calls]
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if not show:
        return out, None
    tool_defs = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                   "parameters": t["parameters"]}} for t in plan.all_tools]
    if native:
        return out, tool_defs
    prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tool_defs))
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{prompt}".strip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _as_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


# ---- response side --------------------------------------------------------------------------------
@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class ParseEvent:
    """kind "content" (text), "call" (a call starts: index, id, name) or "args" (index, text: a
    fragment of the call's arguments JSON)."""

    kind: str
    text: str = ""
    index: int = -1
    id: str = ""
    name: str = ""


_HEAD = r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCallParser:
    """Incremental parser of model text in `fmt` into content and tool calls.

    feed(text) -> events for the text so far that is decided; finish() -> the rest. Text that may
    still become a call marker is held back until it is decided, so the events do not depend on
    how the text is chunked. A call whose head is not `{"name": ..., "arguments": ...` in that
    order (possible only without constraints) is parsed whole at its end; a block that is not a
    call at all is returned as content; a block cut off by the end of the text (max_tokens) is
    dropped, never returned as content (a call already started keeps its partial arguments, as
    OpenAI's do under finish_reason "length")."""

    fmt: ToolCallFormat
    names: set[str] | None = None  # when given, calls to other names stay content
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _state: str = "text"
    _block: str = ""  # the raw text of the current block, to give back as content if it fails
    _scan: Any = None

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        return self._run(final=False)

    def finish(self, cut_off: bool = False) -> list[ParseEvent]:
        """The rest of the events. cut_off: the text ended at max_tokens, so a trailing partial
        call marker (`<tool_`) is the start of a cut-off call: dropped, not content."""
        self._cut_off = cut_off
        return self._run(final=True)

    _cut_off: bool = False

    @property
    def content(self) -> str:
        return self._content

    _content: str = ""

    # the state machine: every branch either consumes text or returns (waiting for more)
    def _run(self, final: bool) -> list[ParseEvent]:
        ev: list[ParseEvent] = []
        while True:
            before = (self._state, len(self._buf))
            getattr(self, f"_on_{self._state}")(ev, final)
            if (self._state, len(self._buf)) == before:
                break
        if final:
            # an unfinished call block (cut by max_tokens) is neither a call nor content: dropped
            if self._state == "text" and self._buf:
                keep = _held_back(self._buf, self.fmt.marker) if self._cut_off else 0
                self._emit_text(ev, self._buf[: len(self._buf) - keep])
            self._buf, self._block, self._state = "", "", "text"
        return ev

    def _emit_text(self, ev, text: str) -> None:
        if text:
            self._content += text
            if ev and ev[-1].kind == "content":
                ev[-1].text += text
            else:
                ev.append(ParseEvent("content", text))

    def _on_text(self, ev, final):
        marker = self.fmt.marker
        i = self._buf.find(marker)
        if i < 0:
            keep = _held_back(self._buf, marker) if (not final or self._cut_off) else 0
            self._emit_text(ev, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return
        self._emit_text(ev, self._buf[:i])
        if self.fmt.marker_in_body:
            self._block, self._buf = "", self._buf[i:]
        else:
            self._block, self._buf = marker, self._buf[i + len(marker):]
        self._state = "list" if self.fmt.list_style else "obj"

    def _on_list(self, ev, final):
        s = self._buf.lstrip()
        if not s:
            return
        if s[0] != "[":
            self._state = "obj"
            return
        self._block += self._buf[:len(self._buf) - len(s) + 1]
        self._buf = s[1:]
        self._state = "obj"

    def _on_obj(self, ev, final):
        m = regex.match(_HEAD, self._buf, partial=True)
        if m is None or (m.partial and final):
            self._state = "raw"
            self._scan = None
            return
        if m.partial or (m.end() == len(self._buf) and not final):
            return  # more whitespace may follow before the arguments
        try:
            name = json.loads(m.group(1))
        except json.JSONDecodeError:
            self._state = "raw"
            return
        if self.names is not None and name not in self.names:
            self._state = "raw"
            return
        call = ToolCall(new_call_id(), name)
        self.calls.append(call)
        ev.append(ParseEvent("call", index=len(self.calls) - 1, id=call.id, name=name))
        self._buf = self._buf[m.end():]
        self._block = ""
        self._scan = _JsonScan()
        self._state = "args"

    def _on_args(self, ev, final):
        if not self._scan.started:
            self._buf = self._buf.lstrip()
        n = self._scan.feed(self._buf, final)
        if n:
            frag = self._buf[:n]
            call = self.calls[-1]
            call.arguments += frag
            if ev and ev[-1].kind == "args" and ev[-1].index == len(self.calls) - 1:
                ev[-1].text += frag
            else:
                ev.append(ParseEvent("args", frag, index=len(self.calls) - 1))
            self._buf = self._buf[n:]
        if self._scan.done:
            self._scan = _JsonScan(depth=1, in_value=True)  # the rest of the call object
            self._state = "tail"

    def _on_tail(self, ev, final):
        n = self._scan.feed(self._buf, final)
        self._buf = self._buf[n:]
        if self._scan.done:
            self._state = "after"

    def _on_raw(self, ev, final):
        s = self._buf.lstrip()
        if not s:
            return
        if self._scan is None:
            if s[0] != "{":  # not a call: give the block back as text
                self._emit_text(ev, self._block)
                self._block, self._state = "", "text"
                return
            self._block += self._buf[:len(self._buf) - len(s)]
            self._buf = s
            self._scan = _JsonScan()
        n = self._scan.feed(self._buf, final)
        self._block += self._buf[:n]
        self._buf = self._buf[n:]
        if not self._scan.done:
            return
        start = self._block.find("{")
        try:
            obj = json.loads(self._block[start:])
        except json.JSONDecodeError:
            obj = None
        name = obj.get("name") if isinstance(obj, dict) else None
        args = obj.get(self.fmt.args_key, obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
        if not isinstance(name, str) or (self.names is not None and name not in self.names):
            self._emit_text(ev, self._block)
            self._block, self._state = "", "text"
            return
        call = ToolCall(new_call_id(), name, json.dumps(args if args is not None else {}, ensure_ascii=False))
        self.calls.append(call)
        ev.append(ParseEvent("call", index=len(self.calls) - 1, id=call.id, name=name))
        ev.append(ParseEvent("args", call.arguments, index=len(self.calls) - 1))
        self._block = ""
        self._state = "after"

    def _on_after(self, ev, final):
        s = self._buf.lstrip()
        fmt = self.fmt
        if fmt.list_style or fmt.marker_in_body:
            sep = "," if fmt.list_style else ";"
            if not s:
                if final:
                    self._buf, self._state = "", "text"
                return
            if s[0] == sep:
                self._buf, self._state = s[1:], "obj"
            elif fmt.list_style and s[0] == "]":
                self._buf, self._state = s[1:], "text"
            else:
                self._state = "text"
            return
        close = fmt.close
        if s.startswith(close):
            self._buf, self._state = s[len(close):], "gap"
        elif close.startswith(s):
            if final:  # a close tag cut short
                self._buf, self._state = "", "text"
            return  # "</tool_" so far
        else:
            self._state = "text"


    def _on_gap(self, ev, final):
        """Whitespace after a call block (the separator between calls) is not content."""
        self._buf = self._buf.lstrip()
        if self._buf:
            self._state = "text"


def _held_back(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0


class _JsonScan:
    """Finds where one JSON value ends in text fed piece by piece (strings and escapes aware).
    feed(text, final) -> characters of `text` that belong to the value; `done` once it ended."""

    def __init__(self, depth: int = 0, in_value: bool = False):
        self.depth, self.started, self.in_str, self.esc, self.done = depth, in_value, False, False, False
        self.scalar = False

    def feed(self, text: str, final: bool) -> int:
        for i, c in enumerate(text):
            if self.done:
                return i
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if not self.started:
                if c.isspace():
                    continue
                self.started = True
                if c not in "{[\"":
                    self.scalar = True
            if self.scalar:
                if c in ",}] \n\t\r;":
                    self.done = True
                    return i
                continue
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    return i + 1
        if final and self.scalar:
            self.done = True
        return len(text)
