"""Parsing of the `tagged` tool-call formats (grammars/tool_calls.py): calls whose name sits between
special tokens and whose arguments are JSON, inside a section: deepseek_v3_1
(``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``)
and kimi_k2 (``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
<|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>``). A call's
arguments stream as they come. The markup never reaches content; a call whose name is not offered
is given back as content (its text as written).
"""

from __future__ import annotations

import re

from agentrt.api.tools.events import MAX_HEAD_CHARS, JsonScan, Machine, held_back

_INDEX = re.compile(r"(.+?):\d+")


class TaggedCalls(Machine):
    def __init__(self, fmt, names=None, schemas=None):
        super().__init__(fmt, names, schemas)
        self._in_section = False
        self._scan: JsonScan | None = None
        self._markers = (fmt.section[0], fmt.call_begin) if fmt.section else (fmt.call_begin,)

    def _held_back(self, buf: str) -> int:
        return max(held_back(buf, m) for m in self._markers)

    def _on_text(self, ev, final):
        found = self._scan_text(ev, final, self._markers)
        if found is not None:
            self._in_section = found != self.fmt.call_begin
            self._state = "sec" if self._in_section else "head"

    def _expect(self, final: bool, *texts: str) -> str | None:
        """After optional whitespace: the one of `texts` the buffer starts with (consumed), "" while
        it may still become one, None when it cannot."""
        s = self._buf.lstrip()
        for t in texts:
            if s.startswith(t):
                self._buf = s[len(t) :]
                return t
        if any(t.startswith(s) for t in texts) and (not final or self._cut_off):
            return ""  # a marker begun (cut off at the end: dropped with the block)
        return None

    def _on_sec(self, ev, final):
        """Inside the section: the next call, or the section's end."""
        got = self._expect(final, self.fmt.call_begin, self.fmt.section[1])
        if got == "":
            return
        if got is None:  # not the format's markup: the rest is text
            self._state = "text"
        else:
            self._state = "head" if got == self.fmt.call_begin else "gap"

    def _on_head(self, ev, final):
        i = self._buf.find(self.fmt.name_end)
        if i < 0:
            if len(self._buf) >= MAX_HEAD_CHARS or (final and not self._cut_off):
                self._state = "text"  # not a call
            return
        head = self._buf[:i].strip()
        name = head.removeprefix(self.fmt.name_prefix)
        if self.fmt.call_index:
            m = _INDEX.fullmatch(name)
            name = m.group(1) if m else name
        if not name or not self._known(name):
            self._emit_text(ev, self.fmt.call_begin + self._buf[: i + len(self.fmt.name_end)])
            self._buf, self._state = self._buf[i + len(self.fmt.name_end) :], "text"
            return
        self._start_call(ev, name)
        self._buf = self._buf[i + len(self.fmt.name_end) :]
        self._scan, self._state = JsonScan(), "args"

    def _on_args(self, ev, final):
        if not self._scan.started:
            self._buf = self._buf.lstrip()
        n = self._scan.feed(self._buf, final)
        if n:
            self._add_args(ev, self._buf[:n])
            self._buf = self._buf[n:]
        if self._scan.done:
            self._state = "end"

    def _on_end(self, ev, final):
        got = self._expect(final, self.fmt.call_end)
        if got == "":
            return
        self._state = "sec" if self._in_section else "gap"
        if got is None and not self._in_section:
            self._state = "text"

    def _on_gap(self, ev, final):
        """Whitespace after the calls is not content."""
        self._buf = self._buf.lstrip()
        if self._buf:
            self._state = "text"
