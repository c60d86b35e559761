"""Tool-call parsing: model text in a tool-call format -> content and OpenAI tool calls, incrementally.

``ToolCallParser`` turns model text into content and calls piece by piece; the same machine serves
streaming and non-streaming responses, so streamed deltas concatenate to the non-streamed result
whatever the chunking. (The formats themselves: agentrt/grammars/tool_calls.py; the request side:
validation.py and rendering.py beside this module.)
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import regex

from agentrt.grammars.tool_calls import ToolCallFormat


@dataclass
class ToolCall:
    """One parsed call: `arguments` is the JSON text of its arguments object."""

    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict:
        """The call as an OpenAI `tool_calls` entry of a message."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParseEvent:
    """kind "content" (text), "call" (a call starts: index, id, name) or "args" (index, text: a
    fragment of the call's arguments JSON)."""

    kind: str
    text: str = ""
    index: int = -1
    id: str = ""
    name: str = ""


_MAX_HEAD_CHARS = 4096
"""The call head (`{"name": "...", "arguments": `) is matched incrementally while shorter than this."""

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

    def close(self, finish_reason: str, closed_by_budget: bool = False) -> tuple[list[ParseEvent], str]:
        """`finish` at the end of an output that ended with `finish_reason`: the rest of the events,
        and the finish_reason to report ("tool_calls" when calls were made and the output stopped).
        closed_by_budget: max_tokens_policy "close" ended the output (RequestOutput.closed_by_budget);
        when it ended in free text (nothing after the last call but whitespace counts as a call's
        end) the text was cut, not closed: reported as "length", as without tools."""
        if closed_by_budget and finish_reason == "stop" and self._in_free_text():
            finish_reason = "length"
        events = self.finish(cut_off=finish_reason == "length")
        return events, "tool_calls" if self.calls and finish_reason == "stop" else finish_reason

    def _in_free_text(self) -> bool:
        """Whether the text so far ends in free text: outside a call block, with text other than
        whitespace since the last call (or no call at all)."""
        if self._state != "text":
            return False
        return not self.calls or bool((self._content[self._content_at_call :] + self._buf).strip())

    _content_at_call: int = 0  # len(content) when the last call started

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
            self._emit_text(ev, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return
        self._emit_text(ev, self._buf[:i])
        if self.fmt.marker_in_body:
            self._block, self._buf = "", self._buf[i:]
        else:
            self._block, self._buf = marker, self._buf[i + len(marker) :]
        self._state = "list" if self.fmt.list_style else "obj"

    def _on_list(self, ev, final):
        s = self._buf.lstrip()
        if not s:
            return
        if s[0] != "[":
            self._state = "obj"
            return
        self._block += self._buf[: len(self._buf) - len(s) + 1]
        self._buf = s[1:]
        self._state = "obj"

    def _on_obj(self, ev, final):
        m = regex.match(_HEAD, self._buf[:_MAX_HEAD_CHARS], partial=True)
        if m is not None and m.partial and len(self._buf) >= _MAX_HEAD_CHARS:
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
        if self.names is not None and name not in self.names:
            self._state = "raw"
            return
        call = ToolCall(new_call_id(), name)
        self.calls.append(call)
        self._content_at_call = len(self._content)
        ev.append(ParseEvent("call", index=len(self.calls) - 1, id=call.id, name=name))
        self._buf = self._buf[m.end() :]
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
            self._block += self._buf[: len(self._buf) - len(s)]
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
        args = (
            obj.get(self.fmt.args_key, obj.get("arguments", obj.get("parameters")))
            if isinstance(obj, dict)
            else None
        )
        if not isinstance(name, str) or (self.names is not None and name not in self.names):
            self._emit_text(ev, self._block)
            self._block, self._state = "", "text"
            return
        call = ToolCall(new_call_id(), name, json.dumps(args if args is not None else {}, ensure_ascii=False))
        self.calls.append(call)
        self._content_at_call = len(self._content)
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
                if c not in '{["':
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
