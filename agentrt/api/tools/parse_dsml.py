"""Parsing of the `dsml` style of tool-call format (grammars/tool_calls.py): DeepSeek V3.2's

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="K" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="K2" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    ...
    </｜DSML｜function_calls>

and MiniMax M2's, the same markup without the `｜DSML｜` prefix, the section named
`<minimax:tool_call>` and no `string` attribute (`TAGS`),

as their chat templates write them: a parameter's `string` attribute says how its value is written
("true": the raw text is the string; "false": JSON, read as a Python literal when it is not JSON,
kept as text when it is neither); a parameter without the attribute is typed by the tool's schema
(values.py). The arguments stream as a JSON object, one parameter at a time (`{` when the call
starts, `"k": v`, `, "k2": v2`, ..., `}`). An invoke outside a section is read too. A call whose
name is not offered is given back as content (its markup as written); markup cut off by max_tokens
is dropped, a call already started keeps the parameters it completed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import regex

from agentrt.api.tools.events import MAX_HEAD_CHARS, Machine, held_back
from agentrt.api.tools.values import literal, property_schema, typed_value
from agentrt.grammars.tool_args import DSML

# an invoke's head after its tag (` name="NAME">`)
_NAME = regex.compile(r'\s+name="([^"<>\n]{1,256})"\s*>')


@dataclass(frozen=True)
class Tags:
    """One format's markup: the section's tags, an invoke's opening (before ` name=`) and closing
    tags, a parameter's closing tag and `param`, a parameter's head (its key and optional string
    attribute)."""

    section: str
    section_end: str
    invoke: str
    invoke_end: str
    param_end: str
    param: regex.Pattern

    @classmethod
    def of(cls, prefix: str, section: str) -> Tags:
        """The tags named `<{prefix}invoke`, `<{prefix}parameter` inside `<{section}>`."""
        return cls(
            f"<{section}>",
            f"</{section}>",
            f"<{prefix}invoke",
            f"</{prefix}invoke>",
            f"</{prefix}parameter>",
            regex.compile(
                rf'\s*<{prefix}parameter\s+name="([^"<>\n]{{1,256}})"(?:\s+string="(true|false)")?\s*>'
            ),
        )


TAGS = {
    "deepseek_v3_2": Tags.of(DSML, f"{DSML}function_calls"),
    "minimax_m2": Tags.of("", "minimax:tool_call"),
}
"""format name -> its markup."""


class DsmlCalls(Machine):
    def __init__(self, fmt, names=None, schemas=None):
        super().__init__(fmt, names, schemas)
        self._tags = TAGS[fmt.name]
        self._in_section = False
        self._block = ""  # the markup since the section (or last call) while no call is decided
        self._key = ""
        self._string: str | None = None  # the parameter's string attribute
        self._nparams = 0
        self._parts: list[str] = []  # a value's text so far (the buffer keeps what may be its close)

    def _held_back(self, buf: str) -> int:
        t = self._tags
        return max(held_back(buf, t.section), held_back(buf, t.invoke))

    def _on_text(self, ev, final):
        t = self._tags
        found = self._scan_text(ev, final, (t.section, t.invoke))
        if found is not None:
            self._in_section = found == t.section
            self._block, self._state = found, "sec" if self._in_section else "name"

    def _fail(self, ev, final):
        """Not a call: the markup read is content (dropped when cut off at the end)."""
        if not (final and self._cut_off):
            self._emit_text(ev, self._block)
            self._block, self._state = "", "text"

    def _on_sec(self, ev, final):
        """Inside the section: the next invoke, or the section's end."""
        s = self._buf.lstrip()
        t = self._tags
        for tag in (t.invoke, t.section_end):
            if s.startswith(tag):
                self._block += self._buf[: len(self._buf) - len(s) + len(tag)]
                self._buf = s[len(tag) :]
                self._state = "name" if tag == t.invoke else "gap"
                if tag == t.section_end:
                    self._block = ""
                return
        if final or not (t.invoke.startswith(s) or t.section_end.startswith(s)):
            self._fail(ev, final)  # not the format's markup: the rest is text

    def _on_name(self, ev, final):
        m = _NAME.match(self._buf, partial=True)
        if m is not None and m.partial and not final:
            return
        if m is None or m.partial or not self._known(m.group(1)):
            if m is not None and not m.partial:  # an unknown tool: its head is content too
                self._block += self._buf[: m.end()]
                self._buf = self._buf[m.end() :]
            self._fail(ev, final)
            return
        self._block = ""
        self._start_call(ev, m.group(1))
        self._add_args(ev, "{")
        self._nparams = 0
        self._buf, self._state = self._buf[m.end() :], "params"

    def _on_params(self, ev, final):
        s = self._buf.lstrip()
        t = self._tags
        if s.startswith(t.invoke_end):
            self._buf = s[len(t.invoke_end) :]
            self._add_args(ev, "}")
            self._state = "sec" if self._in_section else "gap"
            return
        m = t.param.match(self._buf[:MAX_HEAD_CHARS], partial=True)
        if m is not None and not m.partial:
            self._key, self._string = m.group(1), m.group(2)
            self._buf, self._state = self._buf[m.end() :], "value"
            return
        maybe = (m is not None and len(self._buf) < MAX_HEAD_CHARS) or t.invoke_end.startswith(s)
        if maybe and (not final or self._cut_off):
            return  # a tag begun (cut off at the end: dropped)
        self._add_args(ev, "}")  # not the format's markup: the call ends here, the rest is text
        self._state = "text"

    def _on_value(self, ev, final):
        self._read_value(ev, final, self._tags.param_end, lambda e: self._add_args(e, "}"))

    def _param(self, ev, raw: str) -> None:
        schema = self.schemas.get(self.calls[-1].name)
        if self._string == "true":
            value = raw
        elif self._string == "false":
            ok, value = literal(raw)
            value = value if ok else raw
        else:
            value = typed_value(raw, property_schema(schema, self._key), schema)
        key = json.dumps(self._key, ensure_ascii=False)
        sep = "" if self._nparams == 0 else ", "
        self._add_args(ev, f"{sep}{key}: {json.dumps(value, ensure_ascii=False)}")
        self._nparams += 1

    def _on_gap(self, ev, final):
        """Whitespace after the calls is not content."""
        self._buf = self._buf.lstrip()
        if self._buf:
            self._state = "text"

    def _at_end(self, ev):
        if self._state == "params" and not self._cut_off:
            self._add_args(ev, "}")
        super()._at_end(ev)
        self._block = ""
