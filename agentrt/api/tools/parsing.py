"""Tool-call parsing: model text in a tool-call format -> content and OpenAI tool calls, incrementally.

``ToolCallParser`` turns model text into content and calls piece by piece; the same machine serves
streaming and non-streaming responses, so streamed deltas concatenate to the non-streamed result
whatever the chunking. One machine per style of format (grammars/tool_calls.py): ``JsonCalls``
here (hermes, llama3_json with or without ``<|python_tag|>`` and Llama's built-in
``<|python_tag|>NAME.call(k=v)``, mistral's list and ``[ARGS]`` styles, phi4_mini, the lists of
granite and nemotron_json), ``TaggedCalls``
(parse_tagged.py: deepseek_v3_1, kimi_k2, harmony), ``XmlCalls`` (parse_xml.py: qwen3_coder, glm45),
``DsmlCalls`` (parse_dsml.py: deepseek_v3_2, minimax_m2), ``PythonicCalls`` (parse_pythonic.py),
``Gemma4Calls`` (parse_gemma4.py). (The request side:
validation.py and rendering.py beside this module.)
"""

from __future__ import annotations

import json
from typing import Any

import regex

from agentrt.api.tools.events import MAX_HEAD_CHARS, JsonScan, Machine, ParseEvent, ToolCall, new_call_id
from agentrt.api.tools.parse_dsml import DsmlCalls
from agentrt.api.tools.parse_gemma4 import Gemma4Calls
from agentrt.api.tools.parse_pythonic import KeywordArgs, PythonicCalls
from agentrt.api.tools.parse_tagged import TaggedCalls
from agentrt.api.tools.parse_xml import XmlCalls

__all__ = ["JsonCalls", "ParseEvent", "ToolCall", "ToolCallParser", "new_call_id"]

_MAX_HEAD_CHARS = MAX_HEAD_CHARS  # (the name tests/runtime/test_bounded_work_fake.py reads)
_HEAD = r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
_PYTHON_TAG = "<|python_tag|>"
_BUILTIN_HEAD = regex.compile(r"\s*([A-Za-z_][\w\-]{0,63})\.call\(")
_V11_HEAD = regex.compile(r"\s*([A-Za-z0-9_.:\-]{1,64})\s*(?:\[CALL_ID\][A-Za-z0-9_\-]{0,64})?\[ARGS\]")


class ToolCallParser:
    """Incremental parser of model text in `fmt` into content and tool calls.

    feed(text) -> events for the text so far that is decided; finish() / close() -> the rest. Text
    that may still become a call marker is held back until it is decided, so the events do not
    depend on how the text is chunked. A block that is not a call at all is returned as content; a
    block cut off by the end of the text (max_tokens) is dropped, never returned as content (a call
    already started keeps its partial arguments, as OpenAI's do under finish_reason "length").
    `names`: when given, calls to other names stay content; `schemas`: tool name -> parameters
    schema, which types the argument values of the XML formats (strings raw, the rest JSON)."""

    def __init__(self, fmt, names: set[str] | None = None, schemas: dict | None = None):
        machine = {
            "json": JsonCalls,
            "tagged": TaggedCalls,
            "xml": XmlCalls,
            "dsml": DsmlCalls,
            "pythonic": PythonicCalls,
            "gemma4": Gemma4Calls,
        }[fmt.style]
        self.fmt = fmt
        self._m: Machine = machine(fmt, names, schemas)

    def feed(self, text: str) -> list[ParseEvent]:
        return self._m.feed(text)

    def finish(self, cut_off: bool = False) -> list[ParseEvent]:
        return self._m.finish(cut_off)

    def close(self, finish_reason: str, closed_by_budget: bool = False) -> tuple[list[ParseEvent], str]:
        return self._m.close(finish_reason, closed_by_budget)

    @property
    def calls(self) -> list[ToolCall]:
        return self._m.calls

    @property
    def content(self) -> str:
        return self._m.content


class JsonCalls(KeywordArgs):
    """JSON call objects after a marker. A call whose head is not `{"name": ..., "arguments": ...`
    in that order (possible only without constraints) is parsed whole at its end. After the marker
    a JSON list of calls is read too (mistral's style, tolerated for every format), for mistral
    `name[ARGS]{...}` (its newer style, optionally `name[CALL_ID]id[ARGS]`), and after Llama's
    `<|python_tag|>` a built-in tool's `NAME.call(k=v, ...)` (its template's form; the keyword
    arguments read as the pythonic format's)."""

    _after_call = "after"

    def __init__(self, fmt, names=None, schemas=None):
        super().__init__(fmt, names, schemas)
        self._block = ""  # the raw text of the current block, to give back as content if it fails
        self._scan: Any = None
        self._in_list = False
        self._bare_args = False  # the current call is mistral's name[ARGS]{...}
        self._markers = (fmt.marker, _PYTHON_TAG) if fmt.marker_in_body else (fmt.marker,)

    def _held_back(self, buf: str) -> int:
        return max(_held(buf, m) for m in self._markers)

    def _at_end(self, ev):
        super()._at_end(ev)
        self._block = ""

    def _on_text(self, ev, final):
        found = self._scan_text(ev, final, self._markers)
        if found is None:
            return
        self._in_list = False
        if found == _PYTHON_TAG:  # Llama's tag before a call: not content when a call follows
            self._block, self._state = found, "obj"
        elif self.fmt.marker_in_body:
            self._block, self._buf, self._state = "", found + self._buf, "obj"
        else:
            self._block, self._state = found, "list"

    def _on_list(self, ev, final):
        s = self._buf.lstrip()
        if not s:
            return
        if s[0] == "[":
            self._block += self._buf[: len(self._buf) - len(s) + 1]
            self._buf, self._in_list = s[1:], True
        elif s[0] != "{" and self.fmt.marker == "[TOOL_CALLS]":  # mistral's name[ARGS]{...}
            self._state = "v11"
            return
        self._state = "obj"

    def _on_v11(self, ev, final):
        """mistral `[TOOL_CALLS]name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]`): the name."""
        m = _V11_HEAD.match(self._buf[:MAX_HEAD_CHARS], partial=True)
        if m is not None and m.partial and len(self._buf) < MAX_HEAD_CHARS and not final:
            return
        if m is None or m.partial or not self._known(m.group(1)):
            if not (final and self._cut_off and m is not None):
                self._state = "raw"  # not a call (a cut-off one is dropped)
            return
        self._start_call(ev, m.group(1))
        self._buf, self._block = self._buf[m.end() :], ""
        self._scan, self._state, self._bare_args = JsonScan(), "args", True

    def _on_obj(self, ev, final):
        if self._block == _PYTHON_TAG:  # Llama: a JSON call or a built-in call follows the tag
            s = self._buf.lstrip()
            if not s and not final:
                return
            if s and s[0] != "{":
                self._state = "builtin"
                return
        m = regex.match(_HEAD, self._buf[:MAX_HEAD_CHARS], partial=True)
        if m is not None and m.partial and len(self._buf) >= MAX_HEAD_CHARS:
            m = None  # no tool name is this long: parse the block whole (bounded work per feed)
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
        if not self._known(name):
            self._state = "raw"
            return
        self._start_call(ev, name)
        self._buf = self._buf[m.end() :]
        self._block = ""
        self._scan = JsonScan()
        self._state = "args"

    def _on_builtin(self, ev, final):
        """Llama `<|python_tag|>NAME.call(`: the name (then `KeywordArgs` reads the arguments)."""
        m = _BUILTIN_HEAD.match(self._buf[:MAX_HEAD_CHARS], partial=True)
        if m is not None and m.partial and len(self._buf) < MAX_HEAD_CHARS and not final:
            return
        if m is None or m.partial or not self._known(m.group(1)):
            if not (final and self._cut_off and m is not None):
                self._state = "raw"  # not a call: the tag and the text are content
            return
        self._block = ""
        self._open_call(ev, m.group(1))

    def _on_args(self, ev, final):
        if not self._scan.started:
            self._buf = self._buf.lstrip()
        n = self._scan.feed(self._buf, final)
        if n:
            self._add_args(ev, self._buf[:n])
            self._buf = self._buf[n:]
        if self._scan.done:
            if self._bare_args:  # mistral [ARGS]: the call ends with its arguments
                self._bare_args, self._state = False, "text"
                return
            self._scan = JsonScan(depth=1, in_value=True)  # the rest of the call object
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
                self._give_back(ev)
                return
            self._block += self._buf[: len(self._buf) - len(s)]
            self._buf = s
            self._scan = JsonScan()
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
        args = (
            obj.get(self.fmt.args_key, obj.get("arguments", obj.get("parameters")))
            if isinstance(obj, dict)
            else None
        )
        if not isinstance(name, str) or not self._known(name):
            self._give_back(ev)
            return
        self._start_call(ev, name)
        self._add_args(ev, json.dumps(args if args is not None else {}, ensure_ascii=False))
        self._block = ""
        self._state = "after"

    def _give_back(self, ev):
        self._emit_text(ev, self._block)
        self._block, self._state = "", "text"

    def _on_after(self, ev, final):
        s = self._buf.lstrip()
        fmt = self.fmt
        if self._in_list or fmt.marker_in_body:
            sep = "," if self._in_list else ";"
            if not s:
                if final:
                    self._buf, self._state = "", "text"
                return
            if s[0] == sep:
                self._buf, self._state = s[1:], "obj"
            elif self._in_list and s[0] == "]":
                self._buf, self._in_list = s[1:], False
                self._state = "close" if fmt.close else "text"
            else:
                self._state = "text"
            return
        self._state = "close" if fmt.close else "text"

    def _on_close(self, ev, final):
        s = self._buf.lstrip()
        close = self.fmt.close
        if s.startswith(close):
            self._buf, self._state = s[len(close) :], "gap"
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


def _held(buf: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0
