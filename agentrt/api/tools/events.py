"""What tool-call parsing produces (``ToolCall``, ``ParseEvent``) and the incremental machine every
format's parser is built on (``Machine``): text is fed piece by piece, each state consumes what it
can decide and waits for more otherwise, so the events never depend on how the text was chunked.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass


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


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


MAX_HEAD_CHARS = 4096
"""A call's head (its name and what surrounds it) is matched incrementally while shorter than this;
longer, the block is not a call (no tool name is this long): bounded work per feed."""


class Machine:
    """The incremental parser of one format: `fmt` (grammars/tool_calls.ToolCallFormat), `names`
    (when given, calls to other names stay content), `schemas` (tool name -> parameters schema, for
    formats whose argument values are typed by it). Subclasses define `_on_<state>(ev, final)`
    handlers, starting in state "text"; each consumes from `_buf` or returns (waiting for more).
    `_at_end(ev)` runs once after the final pass."""

    def __init__(self, fmt, names: set[str] | None = None, schemas: dict | None = None):
        self.fmt, self.names, self.schemas = fmt, names, schemas or {}
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._state = "text"
        self._content = ""
        self._content_at_call = 0  # len(content) when the last call started
        self._cut_off = False

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        return self._run(final=False)

    def finish(self, cut_off: bool = False) -> list[ParseEvent]:
        """The rest of the events. cut_off: the text ended at max_tokens, so a trailing partial
        call marker is the start of a cut-off call: dropped, not content."""
        self._cut_off = cut_off
        return self._run(final=True)

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

    @property
    def content(self) -> str:
        return self._content

    def _run(self, final: bool) -> list[ParseEvent]:
        ev: list[ParseEvent] = []
        while True:
            before = (self._state, len(self._buf))
            getattr(self, f"_on_{self._state}")(ev, final)
            if (self._state, len(self._buf)) == before:
                break
        if final:
            self._at_end(ev)
        return ev

    def _at_end(self, ev: list[ParseEvent]) -> None:
        """After the final pass: text left in state "text" is content (less a partial marker when
        cut off); an unfinished block (cut by max_tokens) is neither a call nor content: dropped."""
        if self._state == "text" and self._buf:
            keep = self._held_back(self._buf) if self._cut_off else 0
            self._emit_text(ev, self._buf[: len(self._buf) - keep])
        self._buf, self._state = "", "text"

    def _held_back(self, buf: str) -> int:
        """Length of the end of `buf` that may still become a marker."""
        return held_back(buf, self.fmt.marker)

    def _emit_text(self, ev: list[ParseEvent], text: str) -> None:
        if text:
            self._content += text
            if ev and ev[-1].kind == "content":
                ev[-1].text += text
            else:
                ev.append(ParseEvent("content", text))

    def _scan_text(self, ev: list[ParseEvent], final: bool, markers: tuple[str, ...]) -> str | None:
        """State "text": emit the text before the first of `markers` and drop the marker from the
        buffer (returns it), or emit all but what may still become a marker (returns None)."""
        hits = [(i, m) for m in markers if (i := self._buf.find(m)) >= 0]
        if not hits:
            keep = max(held_back(self._buf, m) for m in markers) if (not final or self._cut_off) else 0
            self._emit_text(ev, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return None
        i, m = min(hits, key=lambda h: (h[0], -len(h[1])))
        self._emit_text(ev, self._buf[:i])
        self._buf = self._buf[i + len(m) :]
        return m

    def _start_call(self, ev: list[ParseEvent], name: str) -> ToolCall:
        call = ToolCall(new_call_id(), name)
        self.calls.append(call)
        self._content_at_call = len(self._content)
        ev.append(ParseEvent("call", index=len(self.calls) - 1, id=call.id, name=name))
        return call

    def _read_value(self, ev: list[ParseEvent], final: bool, close: str, end_args) -> None:
        """State "value" of the XML-like formats: a parameter's raw text up to `close`, kept in
        `_parts` with only what may begin `close` left in the buffer. At `close`: `_param(ev, text)`
        and state "params"; when the output stopped inside the value (not cut off): the value so far,
        then `end_args(ev)` and state "text"."""
        i = self._buf.find(close)
        if i < 0:
            if final and not self._cut_off:  # the output stopped inside the last value
                self._param(ev, "".join(self._parts) + self._buf)
                self._parts, self._buf = [], ""
                end_args(ev)
                self._state = "text"
            elif len(self._buf) >= len(close):  # keep only what may begin the close tag
                cut = len(self._buf) - len(close) + 1
                self._parts.append(self._buf[:cut])
                self._buf = self._buf[cut:]
            return
        self._param(ev, "".join(self._parts) + self._buf[:i])
        self._parts = []
        self._buf = self._buf[i + len(close) :]
        self._state = "params"

    def _add_args(self, ev: list[ParseEvent], frag: str) -> None:
        if not frag:
            return
        self.calls[-1].arguments += frag
        index = len(self.calls) - 1
        if ev and ev[-1].kind == "args" and ev[-1].index == index:
            ev[-1].text += frag
        else:
            ev.append(ParseEvent("args", frag, index=index))

    def _known(self, name: str) -> bool:
        return self.names is None or name in self.names


def held_back(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0


class JsonScan:
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
