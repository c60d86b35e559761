"""Parsing of the `gemma4` tool-call format (grammars/tool_calls.py), as Gemma 4's chat template
writes calls:

    <|tool_call>call:NAME{key:value,...}<tool_call|>

several back to back. A value is ``<|"|>text<|"|>`` (a string, no escaping), a bare number,
``true`` / ``false`` / ``null`` (and Python's ``True`` / ``False`` / ``None``, which the template
writes for a None; a bare word that is none of these is kept as text), ``[v,...]`` or
``{key:v,...}``; keys are bare at every depth, or between ``<|"|>`` (as the template writes the keys
of tool declarations). Whitespace between tokens is skipped.

The arguments stream as a JSON object while they are read: ``{`` when the call starts, ``"key": ``
with the first character of its value (a key without a value is never written), a string's text as
it comes (only what may begin ``<|"|>`` is held back), a bare value whole once it ends, the closing
brackets. A call whose name is not offered is given back as content (its text as written); text
that is not this syntax inside a call ends the call there (its open brackets closed), the rest is
text; a call cut off by max_tokens keeps what it streamed.
"""

from __future__ import annotations

import json

import regex

from agentrt.api.tools.events import MAX_HEAD_CHARS, Machine, held_back
from agentrt.api.tools.values import literal
from agentrt.grammars.tool_args_gemma4 import MAX_KEY_CHARS, QUOTE

MARKER, END = "<|tool_call>", "<tool_call|>"
_HEAD = regex.compile(r"\s*call:([A-Za-z0-9_.:\-]{1,256})\s*\{")
_KEY = regex.compile(
    rf'(?:<\|"\|>((?:(?!<\|"\|>).){{0,{MAX_KEY_CHARS}}})<\|"\|>|([^\s:,{{}}\[\]<>](?:[^:,{{}}\[\]<>\r\n]{{0,{MAX_KEY_CHARS - 2}}}[^\s:,{{}}\[\]<>])?))\s*:',
    regex.DOTALL,
)
_BARE = regex.compile(r"[^\s,\]}<]*")
_MAX_KEY = MAX_KEY_CHARS + 50  # a key's text, its quotes and the spaces before its ":"


class Gemma4Calls(Machine):
    def __init__(self, fmt, names=None, schemas=None):
        super().__init__(fmt, names, schemas)
        self._block = ""  # the marker while the call's head is not decided
        self._stack: list[list] = []  # open containers: [closer, members so far]
        self._key = ""  # the key whose value comes next (objects)
        self._parts: list[str] = []  # a bare value's text so far

    def _on_text(self, ev, final):
        if self._scan_text(ev, final, (MARKER,)) is not None:
            self._block, self._state = MARKER, "head"

    def _on_head(self, ev, final):
        m = _HEAD.match(self._buf[:MAX_HEAD_CHARS], partial=True)
        if m is not None and m.partial and len(self._buf) < MAX_HEAD_CHARS and not final:
            return
        if m is None or m.partial or not self._known(m.group(1)):
            if final and self._cut_off and m is not None:
                self._buf, self._state = "", "text"  # a head cut off: dropped
                return
            if m is not None and not m.partial:  # an unknown tool: its head is content too
                self._block += self._buf[: m.end()]
                self._buf = self._buf[m.end() :]
            self._emit_text(ev, self._block)
            self._block, self._state = "", "text"
            return
        self._block = ""
        self._start_call(ev, m.group(1))
        self._add_args(ev, "{")
        self._stack = [["}", 0]]
        self._buf, self._state = self._buf[m.end() :], "key"

    def _waiting(self, s: str, final: bool, *texts: str) -> bool:
        """Whether `s` may still become one of `texts` (wait for more, or drop when cut off)."""
        return any(t.startswith(s) for t in texts) and (not final or self._cut_off)

    def _on_key(self, ev, final):
        """In an object: a key, or its end."""
        s = self._buf.lstrip()
        if not s:
            self._buf = s
            if final:
                self._broken(ev, final)
            return
        if s[0] == "}":
            self._buf = s[1:]
            self._close(ev)
            return
        if self._waiting(s, final, END):  # `<tool_` so far: perhaps the call's end, early
            self._buf = s
            return
        m = _KEY.match(s[:_MAX_KEY], partial=True)
        if m is not None and m.partial and len(s) < _MAX_KEY and not final:
            self._buf = s
            return
        if m is None or m.partial:
            self._buf = s
            self._broken(ev, final)
            return
        self._key = m.group(1) if m.group(1) is not None else m.group(2)
        self._buf, self._state = s[m.end() :], "value"

    def _on_value(self, ev, final):
        s = self._buf.lstrip()
        self._buf = s
        top = self._stack[-1]
        if not s:
            if final:
                self._broken(ev, final)
            return
        if top[0] == "]" and top[1] == 0 and s[0] == "]":  # an empty array
            self._buf = s[1:]
            self._close(ev)
            return
        if s.startswith(QUOTE):
            self._begin_value(ev, '"')
            self._buf, self._state = s[len(QUOTE) :], "str"
        elif s[0] in "{[":
            self._begin_value(ev, s[0])
            self._stack.append(["}" if s[0] == "{" else "]", 0])
            self._buf, self._state = s[1:], "key" if s[0] == "{" else "value"
        elif s[0] == "<":
            if not self._waiting(s, final, QUOTE, END):
                self._broken(ev, final)
        else:
            self._parts, self._state = [], "bare"

    def _begin_value(self, ev, text: str) -> None:
        """The next member's separator and key (objects), then `text`: the value's first text."""
        closer, count = self._stack[-1]
        sep = ", " if count else ""
        if closer == "}":
            sep += json.dumps(self._key, ensure_ascii=False) + ": "
        self._stack[-1][1] += 1
        self._add_args(ev, sep + text)

    def _on_str(self, ev, final):
        i = self._buf.find(QUOTE)
        if i >= 0:
            self._add_args(ev, _escaped(self._buf[:i]) + '"')
            self._buf, self._state = self._buf[i + len(QUOTE) :], "after"
            return
        keep = 0 if final else held_back(self._buf, QUOTE)
        if final and self._cut_off:
            keep = len(self._buf)  # the end of a cut string may be a cut delimiter: not read
        self._add_args(ev, _escaped(self._buf[: len(self._buf) - keep]))
        self._buf = self._buf[len(self._buf) - keep :]
        if final and not self._cut_off:  # the output stopped inside the string: it ends there
            self._add_args(ev, '"')
            self._state = "after"

    def _on_bare(self, ev, final):
        m = _BARE.match(self._buf)
        self._parts.append(self._buf[: m.end()])
        self._buf = self._buf[m.end() :]
        if not self._buf and not final:
            return  # the value may go on
        if final and self._cut_off and not self._buf:
            self._state = "cut"  # a value cut off: not read
            return
        text = "".join(self._parts)
        self._parts = []
        if not text:
            self._broken(ev, final)
            return
        ok, value = literal(text)
        self._begin_value(ev, json.dumps(value if ok else text, ensure_ascii=False))
        self._state = "after"

    def _on_after(self, ev, final):
        """After a value: `,` then the next member, or the container's end."""
        s = self._buf.lstrip()
        self._buf = s
        if not s:
            if final:
                self._broken(ev, final)
            return
        closer = self._stack[-1][0]
        if self._waiting(s, final, END):
            return
        if s[0] == ",":
            self._buf, self._state = s[1:], "key" if closer == "}" else "value"
        elif s[0] == closer:
            self._buf = s[1:]
            self._close(ev)
        else:
            self._broken(ev, final)

    def _close(self, ev) -> None:
        self._add_args(ev, self._stack.pop()[0])
        self._state = "after" if self._stack else "end"

    def _broken(self, ev, final) -> None:
        """Not this syntax inside a call: the call ends (its brackets closed; `<tool_call|>` here is
        its end), the rest is text. Cut off by max_tokens: left as streamed."""
        if final and self._cut_off:
            self._state = "cut"
            return
        ended = self._buf.startswith(END)  # the call's end before its brackets closed
        self._buf = self._buf.removeprefix(END)
        while self._stack:
            self._add_args(ev, self._stack.pop()[0])
        self._state = "gap" if ended else "text"

    def _on_end(self, ev, final):
        s = self._buf.lstrip()
        if s.startswith(END):
            self._buf, self._state = s[len(END) :], "gap"
        elif not self._waiting(s, final, END):
            self._state = "text"  # no end marker: the call ended with its arguments

    def _on_gap(self, ev, final):
        """Whitespace after a call is not content."""
        self._buf = self._buf.lstrip()
        if self._buf:
            self._state = "text"

    def _on_cut(self, ev, final):
        """A call cut off by max_tokens: the rest is dropped."""
        self._buf = ""

    def _at_end(self, ev):
        self._stack, self._parts, self._block = [], [], ""
        super()._at_end(ev)


def _escaped(text: str) -> str:
    """`text` as the inside of a JSON string (pieces escaped apart concatenate to the whole's)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
