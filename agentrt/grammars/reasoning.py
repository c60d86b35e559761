"""Reasoning ("thinking") in model output: the formats families write it in, which one a chat
template implies, where a request's reasoning stands when its prompt ends (open, optional or off),
the grammar that lets the reasoning run free and constrains only the answer after it, and the
incremental parser that splits model text into reasoning and answer.

A reasoning model writes `<think> ... </think>` (Qwen3, QwQ, DeepSeek-R1 / V3.1+, GLM-4.5+, MiniMax-M2,
SmolLM3, Nemotron, Kimi-K2-Thinking), `[THINK] ... [/THINK]` (Magistral) or `<|channel>thought ...
<channel|>` (Gemma 4) before its answer. Its chat template may open the block itself (the generation
prompt ends with `<think>\\n`: QwQ, R1, Qwen3-Thinking), close it empty to turn reasoning off
(`<think>\\n\\n</think>\\n\\n` with Qwen3's `enable_thinking: false`), or leave it to the model. A
constraint on such a request is the sequence `reasoning answer` (xgrammar's structural tag, as its
builtin reasoning tags): the reasoning is any text without the end marker, then the end marker, at
most a few whitespace characters, then the constrained answer. The end marker is the only way out
of the reasoning, so the answer can neither be skipped nor written inside it, and the
end-of-sequence token is masked until the answer is complete.

A tool call can never be lost in the reasoning (vLLM #39056: a call written inside `<think>` stays
reasoning there). Under a tool-call grammar (tool_choice "auto", "required" or named) the format's
call markers (grammars/tool_calls.py `call_markers`) are excluded from the reasoning's free text as
the end marker is: the model ends its reasoning before it calls, and the call is constrained like
any other. Without a grammar (`tool_call_constraint` off) nothing can stop the model, so a call
marker written inside the reasoning ends it there (`call_markers` of `ReasoningParser` and
`AnswerGate`): the call and what follows are the answer, as vLLM's fix (PR #35687) reads a
`<tool_call>` inside `<think>`.

What reads the answer (the unique-strings check, runaway repair, stop strings) reads it from where
`AnswerGate` says it begins, never the reasoning before it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

ReasoningMode = Literal["open", "optional", "off"]
"""Where a request's reasoning stands when its prompt ends: "open" (the prompt opened the block:
the output starts inside the reasoning), "optional" (the model may open it), "off" (the prompt
closed it, or the model has no reasoning format)."""

ANSWER_SEPARATOR = "[ \\t\\r\\n]{0,4}"
"""What the grammar allows between the end marker and the answer (EBNF): Qwen3 writes "\\n\\n"."""


@dataclass(frozen=True)
class ReasoningFormat:
    """How a family marks its reasoning: `start` opens it, `end` closes it (plain text in the
    model's vocabulary, a single added token in most)."""

    name: str
    start: str
    end: str
    separator: str = ""
    """Text between the end marker and the answer, exact (Harmony's "<|start|>assistant": a new
    message); "" for a few whitespace characters (ANSWER_SEPARATOR)."""
    header: str = ""
    """Text that opens a plain answer (Harmony's final channel, "<|channel|>final<|message|>"), not
    a tool call's answer (whose format opens its own channel); dropped from the content."""
    empty: str = ""
    """The closed empty block the family's own template writes to turn reasoning off, ending with
    `end` (Gemma 4: "<|channel>thought\n<channel|>"); "" = the default below."""

    def empty_block(self, close_text: str = "") -> str:
        """A closed, empty reasoning block, then the separator: what ends a prompt to turn the
        reasoning off (Qwen3 writes "<think>\n\n</think>\n\n"; a format's own `empty`, the close
        text before its end marker)."""
        if self.empty:
            return self.empty.removesuffix(self.end) + close_text + self.end
        if self.separator:
            return f"{self.start}{close_text}{self.end}{self.separator}"
        return f"{self.start}\n{close_text}\n{self.end}\n\n"

    @property
    def after_end(self) -> str:
        """What follows the end marker before the answer, as a model writes it (a closing path's
        bridge, runtime/constraint_steps.py)."""
        return self.separator or "\n\n"

    def mode(self, prompt: str) -> ReasoningMode:
        """The request's mode from its rendered prompt (the chat template's output, generation
        prompt included): "off" when the prompt ends with the end marker (an empty block, reasoning
        turned off), "open" when it ends with the start marker, else "optional"."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return "off"
        if tail.endswith(self.start):
            return "open"
        return "optional"

    def structural_tag(
        self,
        mode: ReasoningMode,
        answer_ebnf: str,
        tool_calls: bool = False,
        call_markers: tuple[str, ...] | list[str] = (),
    ) -> dict:
        """xgrammar's structural tag for "reasoning, then the answer" (`answer_ebnf`: the answer's
        grammar, root rule `root`; `tool_calls`: it is a tool-call grammar, which opens its own
        channel, so no `header`; `call_markers`: the texts that open a call, excluded from the
        reasoning like the end marker, so that a call comes after the reasoning, never inside it).
        Raises ValueError for mode "off" (no reasoning to wrap)."""
        if mode == "off":
            raise ValueError("reasoning mode 'off' has no reasoning to constrain around")
        excludes = [self.end, *(m for m in call_markers if m and m != self.end)]
        text = {"type": "any_text", "excludes": excludes}
        block: dict = {
            "type": "tag",
            "begin": "" if mode == "open" else self.start,
            "content": text,
            "end": self.end,
        }
        if self.separator:
            block = {
                "type": "sequence",
                "elements": [block, {"type": "const_string", "value": self.separator}],
            }
        else:
            separator = {"type": "grammar", "grammar": f"root ::= {ANSWER_SEPARATOR}"}
            block = {"type": "sequence", "elements": [block, separator]}
        if mode == "optional":
            if not self.separator:  # whitespace may come before the start marker (the parser skips it)
                lead = {"type": "grammar", "grammar": f"root ::= {ANSWER_SEPARATOR}"}
                block = {"type": "sequence", "elements": [lead, block]}
            block = {"type": "or", "elements": [block, {"type": "const_string", "value": ""}]}
        elements = [block]
        if self.header and not tool_calls:
            elements.append({"type": "const_string", "value": self.header})
        elements.append({"type": "grammar", "grammar": answer_ebnf})
        return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}

    def as_json(self, mode: ReasoningMode) -> str:
        """The `reasoning` value of a ConstraintSpec (grammars/spec.py): this format and the mode."""
        return json.dumps({"format": self.name, "mode": mode})

    @classmethod
    def from_json(cls, value: str) -> tuple[ReasoningFormat, ReasoningMode]:
        """(format, mode) of a ConstraintSpec's `reasoning` value. Raises KeyError for an unknown
        format."""
        d = json.loads(value)
        return FORMATS[d["format"]], d["mode"]


FORMATS = {
    "think": ReasoningFormat("think", "<think>", "</think>"),
    "magistral": ReasoningFormat("magistral", "[THINK]", "[/THINK]"),
    # gpt-oss: the analysis channel is the reasoning, the final channel the answer
    "harmony": ReasoningFormat(
        "harmony",
        "<|channel|>analysis<|message|>",
        "<|end|>",
        separator="<|start|>assistant",
        header="<|channel|>final<|message|>",
    ),
    # Gemma 4: a thought channel before the answer; its template closes it empty when thinking is off
    "gemma4": ReasoningFormat(
        "gemma4", "<|channel>thought", "<channel|>", empty="<|channel>thought\n<channel|>"
    ),
}
ALIASES = {"deepseek_r1": "think", "qwen3": "think", "glm45": "think", "minimax": "think"}
"""vLLM's reasoning-parser names accepted by --reasoning-format for the same format."""


def reasoning_format(name: str) -> ReasoningFormat | None:
    """The format named `name` (or a vLLM alias); None for "none". Raises ValueError naming the
    choices for an unknown name."""
    if name == "none":
        return None
    found = FORMATS.get(ALIASES.get(name, name))
    if found is None:
        names = ", ".join(["auto", "none", *FORMATS, *ALIASES])
        raise ValueError(f"unknown reasoning format '{name}' ({names})")
    return found


def detect_reasoning(chat_template: str | None) -> ReasoningFormat | None:
    """The reasoning format a chat template implies (None: a model that does not reason, or one
    whose format agentrt does not parse, see `unsupported_reasoning`)."""
    t = chat_template or ""
    if "<|channel|>" in t and "<|start|>" in t:
        return FORMATS["harmony"]
    if "[THINK]" in t and "[/THINK]" in t:
        return FORMATS["magistral"]
    if "<|channel>" in t and "<channel|>" in t:
        return FORMATS["gemma4"]
    if "<think>" in t and "</think>" in t:
        return FORMATS["think"]
    return None


UNSUPPORTED_REASONING: tuple[tuple[str, str], ...] = ()
"""(a marker in a chat template, the name of its reasoning format) for the formats agentrt does not
parse; none today (Gemma 4's thought channel, the last one, is `gemma4`)."""


def unsupported_reasoning(chat_template: str | None) -> str | None:
    """The name of a reasoning format the template uses that agentrt does not parse (its reasoning
    is then returned as content), else None (UNSUPPORTED_REASONING)."""
    t = chat_template or ""
    return next((name for marker, name in UNSUPPORTED_REASONING if marker in t), None)


class ReasoningParser:
    """Splits model text into reasoning and answer, incrementally: `feed(text)` -> (reasoning,
    content) decided so far, `finish()` -> the rest. Text that may still become a marker is held
    back until it is decided, so the pieces concatenate to the same result whatever the chunking.
    The markers themselves are in neither part; whitespace around the reasoning and at the start
    of the answer is dropped (Qwen3 writes "<think>\\n" and "</think>\\n\\n"). In mode "optional" the
    reasoning is recognised only at the start of the output (after whitespace); in "off" all text
    is content. The format's separator and answer header (Harmony's "<|start|>assistant" and final
    channel) are dropped where they open the answer. Output cut inside the reasoning leaves content
    empty, and a piece of the end marker it was cut in ("</thi", two characters or more) out of the
    reasoning. `call_markers`: texts that open a tool call (tools offered, tool_choice not "none"); one
    written inside the reasoning ends it there and opens the answer with itself (the module
    docstring: a call is never lost in the reasoning; under a grammar none can occur there)."""

    def __init__(self, fmt: ReasoningFormat, mode: ReasoningMode, call_markers: tuple[str, ...] = ()):
        self.fmt = fmt
        self._markers = tuple(m for m in call_markers if m)
        self._state = {"open": "reasoning", "optional": "before", "off": "head"}[mode]
        self._buf = ""
        self._lead = True  # dropping whitespace at the start of the current part
        self.reasoning = ""
        self.content = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state in ("reasoning", "before")

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _emit(self, part: str, text: str, out: list[str]) -> None:
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        out[0 if part == "reasoning" else 1] += text

    def _run(self, final: bool) -> tuple[str, str]:
        out = ["", ""]
        while self._buf:
            buf = self._buf
            if self._state == "before":
                stripped = buf.lstrip()
                if stripped.startswith(self.fmt.start):
                    self._buf = stripped[len(self.fmt.start) :]
                    self._state, self._lead = "reasoning", True
                    continue
                if not final and self.fmt.start.startswith(stripped):
                    break  # whitespace, or a prefix of the start marker: undecided
                self._state = "head"
                continue
            if self._state in ("sep", "head"):  # the separator / the answer's header, when written
                prefix = self.fmt.separator if self._state == "sep" else self.fmt.header
                if prefix and buf.startswith(prefix):
                    self._buf = buf[len(prefix) :]
                elif prefix and not final and prefix.startswith(buf):
                    break  # undecided
                self._state = "head" if self._state == "sep" else "content"
                continue
            if self._state == "content":
                self._emit("content", buf, out)
                self._buf = ""
                break
            at, marker = _first_marker(buf, (self.fmt.end, *self._markers))
            if at >= 0:
                self._emit("reasoning", buf[:at].rstrip(), out)
                if marker == self.fmt.end:
                    self._buf = buf[at + len(marker) :]
                    self._state, self._lead = "sep", True
                else:  # a call inside the reasoning: it ends the reasoning and opens the answer
                    self._buf = buf[at:]
                    self._state, self._lead = "content", True
                continue
            # held back: a partial marker and the whitespace before it (dropped at the marker)
            held = max(_partial_suffix(buf, m) for m in (self.fmt.end, *self._markers))
            if final:  # cut inside the end marker (max_tokens): its piece ("</thi") is not reasoning
                cut = _partial_suffix(buf, self.fmt.end)
                held = cut if cut >= 2 else 0
            body = buf[: len(buf) - held]
            self._emit("reasoning", body.rstrip(), out)
            self._buf = "" if final else buf[len(body.rstrip()) :]
            break
        self.reasoning += out[0]
        self.content += out[1]
        return out[0], out[1]


def free_answer(reasoning: str, tag: dict) -> dict:
    """A copy of `tag` (an answer's xgrammar structural tag, e.g. tool calls under tool_choice
    "auto") whose free text (`any_text`, `triggered_tags`) never holds the start marker when the
    model may open a reasoning (`reasoning`: a ConstraintSpec's value, mode "optional"): an output
    that opens with it is the reasoning (ReasoningParser reads it so), so the grammar must not take
    it for an answer that happens to begin that way, nor a call inside it for the answer's call.
    Otherwise `tag` itself."""
    if not reasoning:
        return tag
    fmt, mode = ReasoningFormat.from_json(reasoning)
    if mode != "optional":
        return tag

    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items()}
        if out.get("type") in ("any_text", "triggered_tags"):
            out["excludes"] = [*out.get("excludes", []), fmt.start]
        return out

    return walk(tag)


def _first_marker(text, markers):
    """(index, marker) of the earliest occurrence in `text` (str or bytes) of one of `markers` (the
    first of them on a tie); (-1, None) when none occurs."""
    best, found = -1, None
    for m in markers:
        at = text.find(m)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, m
    return best, found


class AnswerGate:
    """Where a reasoning model's answer begins in its output, followed token by token on bytes
    (special tokens as their text): what the per-request checks that read the answer (the
    unique-strings check, runaway repair, the thinking budget's tracker) use to skip the reasoning.
    `state`: "before" (mode "optional", nothing decided yet), "reasoning" or "answer". The output
    opens the reasoning with the start marker (after whitespace) in mode "optional", is inside it
    from the start in mode "open", and is all answer in mode "off"; the reasoning ends at the first
    end marker or at the first call marker (`call_markers`: a call written inside the reasoning
    opens the answer with itself, as ReasoningParser reads it). `ended_by`: the marker that ended
    the reasoning (None: it did not, or there was none). A value object: `copy` before feeding a
    gate that is shared."""

    __slots__ = ("_end", "_keep", "_markers", "_start", "_tail", "ended_by", "state")

    def __init__(self, start: bytes, end: bytes, mode: ReasoningMode, call_markers: tuple[bytes, ...] = ()):
        self._start, self._end = start, end
        self._markers = (end, *(m for m in call_markers if m and m != end))
        self._keep = max(len(m) for m in self._markers) - 1  # bytes that may start a marker
        self.state = {"open": "reasoning", "optional": "before", "off": "answer"}[mode]
        self._tail = b""  # bytes not decided yet: the start of a marker, or leading whitespace
        self.ended_by: bytes | None = None

    @classmethod
    def for_spec(cls, reasoning: str, call_markers: tuple[str, ...] = ()) -> AnswerGate | None:
        """The gate of a ConstraintSpec's `reasoning` value (None for "": no reasoning)."""
        if not reasoning:
            return None
        fmt, mode = ReasoningFormat.from_json(reasoning)
        return cls(fmt.start.encode(), fmt.end.encode(), mode, tuple(m.encode() for m in call_markers))

    def copy(self) -> AnswerGate:
        g = object.__new__(AnswerGate)
        for name in AnswerGate.__slots__:
            setattr(g, name, getattr(self, name))
        return g

    def feed(self, data: bytes) -> bytes:
        """Advance over one token's bytes; returns the answer's bytes among them: all of `data` in
        the answer; after the end marker (from a call marker, the marker included) in the token
        that ends the reasoning; the undecided bytes held back before and `data` when the output
        turns out to open with its answer (leading whitespace dropped); b"" in the reasoning."""
        if self.state == "answer":
            return data
        tail = self._tail + data
        if self.state == "before":
            stripped = tail.lstrip()
            if stripped.startswith(self._start):
                self.state, tail = "reasoning", stripped[len(self._start) :]
            elif self._start.startswith(stripped):
                self._tail = stripped  # whitespace or a prefix of the start marker: undecided
                return b""
            else:
                self.state, self._tail = "answer", b""
                return stripped
        at, marker = _first_marker(tail, self._markers)
        if at >= 0:
            self.state, self._tail, self.ended_by = "answer", b"", marker
            return tail[at + len(marker) :] if marker == self._end else tail[at:]
        self._tail = tail[-self._keep :] if self._keep else b""
        return b""


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
