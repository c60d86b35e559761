"""Parsing of the `pythonic` tool-call format (grammars/tool_calls.py; Gemma 3 with vLLM's pythonic
template, Llama 3.2's and 4's pythonic variants): a Python list of calls with keyword arguments,
``[get_weather(city="Paris", days=2), get_time()]``.

A ``[`` starts a call list only when a name and ``(`` follow and then ``)`` or ``key=``; anything else
is content. Values are JSON literals (what the grammar writes) or Python literals (``True``,
``None``, ``'x'``); the arguments stream as a JSON object, one keyword at a time. The keyword
arguments are read by ``KeywordArgs``, which Llama's built-in calls ``<|python_tag|>NAME.call(k=v)``
share (parsing.JsonCalls).
"""

from __future__ import annotations

import json

import regex

from agentrt.api.tools.events import MAX_HEAD_CHARS, Machine
from agentrt.api.tools.values import literal

_FIRST = regex.compile(r"\s*([A-Za-z_][\w.\-]{0,63})\s*\(\s*(?:\)|[A-Za-z_]\w*\s*=)")
_NEXT = regex.compile(r"\s*([A-Za-z_][\w.\-]{0,63})\s*\(")
_KEY = regex.compile(r"\s*([A-Za-z_]\w{0,127})\s*=")


class KeywordArgs(Machine):
    """The keyword arguments of a call, `k=v, ...)`, streamed as a JSON object: `_open_call(ev, name)`
    with the buffer at the call's `(` starts the call; after its `)` the state is `_after_call`."""

    _after_call = "text"

    def __init__(self, fmt, names=None, schemas=None):
        super().__init__(fmt, names, schemas)
        self._key = ""
        self._nparams = 0
        self._val = _ValueScan()
        self._parts: list[str] = []  # a value's text so far

    def _open_call(self, ev, name: str) -> None:
        self._start_call(ev, name)
        self._add_args(ev, "{")
        self._nparams = 0
        self._buf = self._buf[self._buf.index("(") + 1 :]
        self._state = "kw"

    def _on_kw(self, ev, final):
        s = self._buf.lstrip()
        if s.startswith(")"):
            self._buf = s[1:]
            self._end_args(ev)
            self._state = self._after_call
            return
        m = _KEY.match(s[:256], partial=True)
        if m is not None and m.partial and not final:
            return
        if m is None or m.partial:
            self._broken(ev, final)
            return
        self._key, self._buf = m.group(1), s[m.end() :]
        self._val, self._parts = _ValueScan(), []
        self._state = "val"

    def _on_val(self, ev, final):
        i = self._val.feed(self._buf)
        if i < 0:  # the scan keeps its state: the text so far moves out of the buffer
            self._parts.append(self._buf)
            self._buf = ""
            if final and not self._cut_off:
                self._param(ev, "".join(self._parts))
                self._end_args(ev)
                self._state = "text"
            return
        self._param(ev, "".join(self._parts) + self._buf[:i])
        self._parts = []
        self._buf = self._buf[i:]
        self._state = "kwsep"

    def _on_kwsep(self, ev, final):
        s = self._buf.lstrip()
        if not s:
            if final:
                self._broken(ev, final)
            return
        if s[0] == ",":
            self._buf, self._state = s[1:], "kw"
        elif s[0] == ")":
            self._buf = s[1:]
            self._end_args(ev)
            self._state = self._after_call
        else:
            self._broken(ev, final)

    def _broken(self, ev, final) -> None:
        """Not the format's syntax inside a call: the call ends, the rest is text (cut off: dropped)."""
        if final and self._cut_off:
            return
        self._end_args(ev)
        self._state = "text"

    def _param(self, ev, text: str) -> None:
        if not text.strip():
            return  # `k=` with no value (cut short)
        ok, value = literal(text.strip())
        value = value if ok else text.strip()
        sep = "" if self._nparams == 0 else ", "
        key = json.dumps(self._key, ensure_ascii=False)
        self._add_args(ev, f"{sep}{key}: {json.dumps(value, ensure_ascii=False)}")
        self._nparams += 1

    def _end_args(self, ev) -> None:
        self._add_args(ev, "}")

    def _at_end(self, ev):
        if self._state == "kw" and not self._cut_off:
            self._end_args(ev)
        super()._at_end(ev)


class PythonicCalls(KeywordArgs):
    _after_call = "between"

    def _on_text(self, ev, final):
        if self._scan_text(ev, final, ("[",)) is not None:
            self._state = "head"

    def _on_head(self, ev, final):
        """After `[`: a call list when `name(` and then `)` or `key=` follow."""
        m = _FIRST.match(self._buf[:MAX_HEAD_CHARS], partial=True)
        if m is not None and m.partial and not final:
            return
        if m is None or m.partial or not self._known(m.group(1)):
            if not (final and self._cut_off and m is not None):
                self._emit_text(ev, "[")  # not a call list
                self._state = "text"
            return
        self._open_call(ev, m.group(1))

    def _on_between(self, ev, final):
        s = self._buf.lstrip()
        if not s:
            if final:
                self._state = "text"
            return
        if s[0] == "]":
            self._buf, self._state = s[1:], "gap"
        elif s[0] == ",":
            self._buf, self._state = s[1:], "next"
        else:
            self._buf, self._state = s, "text"

    def _on_next(self, ev, final):
        m = _NEXT.match(self._buf[:MAX_HEAD_CHARS], partial=True)
        if m is not None and m.partial and not final:
            return
        if m is None or m.partial or not self._known(m.group(1)):
            if not (final and self._cut_off):
                self._state = "text"
            return
        self._open_call(ev, m.group(1))

    def _on_gap(self, ev, final):
        self._buf = self._buf.lstrip()
        if self._buf:
            self._state = "text"


class _ValueScan:
    """Finds where a Python / JSON literal ends: at a `,` or `)` outside strings and brackets.
    feed(text) -> the index in `text` (the text after what was fed before), or -1."""

    def __init__(self):
        self.quote, self.esc, self.depth = "", False, 0

    def feed(self, text: str) -> int:
        for i, c in enumerate(text):
            if self.quote:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == self.quote:
                    self.quote = ""
            elif c in "\"'":
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                if self.depth == 0:
                    return i
                self.depth -= 1
            elif c == "," and self.depth == 0:
                return i
        return -1
