"""Parsing of the `xml` tool-call formats (grammars/tool_calls.py): qwen3_coder
(``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n...</function>\\n</tool_call>``)
and glm45 (``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call>``).

A value is raw text up to its closing tag; the tool's parameter schema types it (values.py: strings
stay text, other types are read as JSON or Python literals). The arguments stream as a JSON object,
one parameter at a time (`{` when the call starts, `"k": v`, `, "k2": v2`, ..., `}`). A call whose name is not offered is
given back as content; markup cut off by max_tokens is dropped, a call already started keeps the
parameters it completed (the object left open, as a JSON call's partial arguments are).
"""

from __future__ import annotations

import json

from agentrt.api.tools.events import MAX_HEAD_CHARS, Machine
from agentrt.api.tools.values import property_schema, typed_value


class XmlCalls(Machine):
    def __init__(self, fmt, names=None, schemas=None):
        super().__init__(fmt, names, schemas)
        lay = fmt.xml
        self._name_open = fmt.call_begin[len(fmt.marker) :].strip()  # "<function=" / ""
        self._name_close = fmt.name_end.strip() or "\n"  # ">" / "\n"
        self._key_open = lay.open
        mid = [p for p in lay.mid.split("\n") if p]
        self._key_close, self._value_open = mid[0], (mid[1] if len(mid) > 1 else "")
        self._value_close = lay.close.strip()
        self._closes = [p for p in fmt.call_end.split("\n") if p]  # ["</function>", "</tool_call>"]
        self._block = ""  # the call's text before its name is known (given back if it is no call)
        self._key = ""
        self._nparams = 0
        self._parts: list[str] = []  # a value's text so far (the buffer keeps only what may be its close)

    def _on_text(self, ev, final):
        if self._scan_text(ev, final, (self.fmt.marker,)) is not None:
            self._block, self._state = self.fmt.marker, "fn"

    def _fail(self, ev, final):
        """Not a call: the block is content (dropped when cut off at the end)."""
        if not (final and self._cut_off):
            self._emit_text(ev, self._block)
            self._block, self._state = "", "text"

    def _on_fn(self, ev, final):
        """After the marker: `<function=` (qwen3_coder), then the name up to its close."""
        s = self._buf.lstrip() if self._name_open else self._buf
        if self._name_open and not s.startswith(self._name_open):
            if final or not self._name_open.startswith(s):
                self._fail(ev, final)
            return
        body = s[len(self._name_open) :]
        ends = [
            e for e in (self._name_close, self._key_open, *self._closes) if e != "\n" or not self._name_open
        ]
        hits = [(i, e) for e in ends if (i := body.find(e)) >= 0]
        if not hits:
            if len(body) >= MAX_HEAD_CHARS or final:
                self._fail(ev, final)
            return
        i, e = min(hits)
        name = body[:i].strip()
        if not name or not self._known(name) or "\n" in name:
            self._fail(ev, final)
            return
        self._block = ""
        self._start_call(ev, name)
        self._add_args(ev, "{")
        self._nparams = 0
        skip = len(e) if e == self._name_close else 0
        self._buf = body[i + skip :]
        self._state = "params"

    def _on_params(self, ev, final):
        s = self._buf.lstrip()
        if s.startswith(self._key_open):
            self._buf, self._state = s[len(self._key_open) :], "key"
        elif s.startswith(self._closes[0]):
            self._buf = s[len(self._closes[0]) :]
            self._end_args(ev)
            self._state = "close"
        elif (final or not (self._key_open.startswith(s) or self._closes[0].startswith(s))) and not (
            final and self._cut_off
        ):
            self._end_args(ev)  # not the format's markup: the call ends here, the rest is text
            self._state = "text"
        # else: a tag begun (or cut off: dropped)

    def _on_key(self, ev, final):
        i = self._buf.find(self._key_close, 0, MAX_HEAD_CHARS)
        if i < 0:
            if len(self._buf) >= MAX_HEAD_CHARS and not final:
                self._end_args(ev)  # no parameter name is this long: not the format's markup
                self._state = "text"
            return
        self._key = self._buf[:i].strip()
        self._buf = self._buf[i + len(self._key_close) :]
        self._state = "value_open" if self._value_open else "value"

    def _on_value_open(self, ev, final):
        s = self._buf.lstrip()
        if s.startswith(self._value_open):
            self._buf, self._state = s[len(self._value_open) :], "value"
        elif final or not self._value_open.startswith(s):
            self._buf, self._state = s, "value"  # tolerate a missing <arg_value>

    def _on_value(self, ev, final):
        self._read_value(ev, final, self._value_close, self._end_args)

    def _param(self, ev, raw: str) -> None:
        if self.fmt.xml.strip_newlines:
            raw = raw.removeprefix("\n").removesuffix("\n")
        schema = self.schemas.get(self.calls[-1].name)
        value = typed_value(raw, property_schema(schema, self._key), schema)
        key = json.dumps(self._key, ensure_ascii=False)
        sep = "" if self._nparams == 0 else ", "
        self._add_args(ev, f"{sep}{key}: {json.dumps(value, ensure_ascii=False)}")
        self._nparams += 1

    def _end_args(self, ev) -> None:
        self._add_args(ev, "}")

    def _on_close(self, ev, final):
        """The rest of the call's end (`</tool_call>` after `</function>`), then whitespace."""
        for c in self._closes[1:]:
            s = self._buf.lstrip()
            if s.startswith(c):
                self._buf = s[len(c) :]
            elif c.startswith(s) and (not final or self._cut_off):
                return  # a close tag begun (cut off at the end: dropped)
        self._state = "gap"

    def _on_gap(self, ev, final):
        self._buf = self._buf.lstrip()
        if self._buf:
            self._state = "text"

    def _at_end(self, ev):
        if self._state in ("params", "key", "value_open") and not self._cut_off:
            self._end_args(ev)
        super()._at_end(ev)
        self._block = ""
