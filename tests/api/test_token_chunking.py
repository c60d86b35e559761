""" "Correct at any chunking" with real tokenizers (issue 36): every tool-call format's streaming
parser, and the reasoning parser, fed one real token's text at a time, as the server feeds them.

A realistic output (text with multi-byte UTF-8, then calls whose arguments hold "café ✓ 日本",
an emoji, "𠜎" (four byte-fallback tokens in Gemma 3) and markup-like text) is encoded with the default model's byte-level BPE tokenizer
(SmolLM2) and with Gemma 3's SentencePiece byte-fallback tokenizer, then decoded token by token with
the server's incremental detokenizer (runtime/detokenizer.py: an incomplete UTF-8 sequence is held
back until its last byte arrives; the final text is one full decode, as runtime/output_processor.py
does). Each delta is fed to the parser; the events, merged, must equal the one-shot parse of the
whole text. Where the tokenizer round-trips the text (all but Gemma's, which reads DeepSeek V3.1's
"▁" as a space), the calls are also the ones written.
"""

from __future__ import annotations

import json

import pytest

from agentrt.api.output_text import OutputParser
from agentrt.api.tools import ToolCallParser, plan_tools
from agentrt.grammars.reasoning import FORMATS as REASONING
from agentrt.grammars.reasoning import ReasoningParser
from agentrt.grammars.tool_calls import FORMATS
from agentrt.runtime.detokenizer import IncrementalDetokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "note": {"type": "string"},
        "opts": {"type": "object", "properties": {"hourly": {"type": "boolean"}}},
    },
}
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
W = ("get_weather", {"city": "café ✓ 日本", "days": 2, "note": "🌦️ 𠜎 <b>x</b>\nñ", "opts": {"hourly": True}})
T = ("get_time", {})
PROSE = "Sure — café ✓ 日本 🌦️ 𠜎. Let me check.\n"


def _scripts():
    """(id, format, text): each format's own writing of prose and calls, and the other syntaxes
    its parser reads (Llama's <|python_tag|>, Mistral's [ARGS] and list styles, Qwen3's layout)."""
    for name, fmt in FORMATS.items():
        calls = [W] if name == "harmony" else [W, T]  # a Harmony call ends the turn
        yield name, name, PROSE + fmt.render_calls(calls)
    args = json.dumps(W[1], ensure_ascii=False)
    yield (
        "qwen3-tool_call",
        "hermes",
        f'{PROSE}<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>',
    )
    yield "llama3-python_tag", "llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {args}}}'
    yield (
        "mistral-args",
        "mistral",
        f"{PROSE}[TOOL_CALLS]get_weather[ARGS]{args}[TOOL_CALLS]get_time[ARGS]{{}}",
    )
    yield (
        "mistral_v11-list",
        "mistral_v11",
        f'{PROSE}[TOOL_CALLS][{{"name": "get_weather", "arguments": {args}, "id": "abcDEF123"}}]',
    )
    yield "pythonic-python-literals", "pythonic", "[get_weather(city='café ✓ 日本', opts={'hourly': True})]"
    yield (
        "deepseek_v3_2-untyped",
        "deepseek_v3_2",
        PROSE
        + '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="days">3'
        "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>",
    )


SCRIPTS = list(_scripts())


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tok(request):
    """The default model's tokenizer and Gemma 3's (tests/conftest.py fixtures)."""
    fixture = "tokenizer" if request.param == "smollm2" else "sentencepiece_tokenizer"
    return request.getfixturevalue(fixture)


def token_deltas(tokenizer, text: str, skip_special_tokens: bool = False) -> tuple[str, list[str]]:
    """(the decoded text, its deltas one token at a time) as the server makes them: the incremental
    detokenizer's text after each token, the last one a full decode; each delta is the new text
    since the previous one (never a partial UTF-8 sequence)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(skip_special_tokens)
    sent, deltas = "", []
    for i in range(1, len(ids) + 1):
        if i < len(ids):
            now = detok.update(tokenizer, ids[:i])
        else:
            now = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert now.startswith(sent), (sent, now)  # what was sent is never taken back
        assert "\ufffd" not in now[len(sent) :] or "\ufffd" in text
        deltas.append(now[len(sent) :])
        sent = now
    assert len(deltas) > 10
    return sent, deltas


def _merged(events) -> list[tuple]:
    """The events with adjacent pieces of one kind (content, or one call's arguments) joined, and
    without the random call ids: what must not depend on the chunking."""
    out: list[list] = []
    for e in events:
        if out and e.kind != "call" and out[-1][0] == e.kind and out[-1][2] == e.index:
            out[-1][1] += e.text
        else:
            out.append([e.kind, e.text, e.index, e.name])
    return [tuple(x) for x in out]


def _tool_events(fmt: str, pieces: list[str]):
    p = ToolCallParser(FORMATS[fmt], names=set(SCHEMAS), schemas=SCHEMAS)
    events = [e for piece in pieces for e in p.feed(piece)]
    events += p.close("stop")[0]
    return _merged(events), [(c.name, c.arguments) for c in p.calls], p.content


@pytest.mark.parametrize("fmt,text", [pytest.param(f, t, id=i) for i, f, t in SCRIPTS])
def test_tool_parsers_one_real_token_at_a_time(tok, fmt, text):
    decoded, deltas = token_deltas(tok, text, FORMATS[fmt].skip_special_tokens)
    whole = _tool_events(fmt, [decoded])
    assert _tool_events(fmt, deltas) == whole
    assert _tool_events(fmt, list(decoded)) == whole  # and one character at a time
    if decoded == text:
        _, calls, content = whole
        assert calls, "the calls were read"
        assert content.strip() in ("", PROSE.strip())
    else:  # Gemma 3's SentencePiece reads DeepSeek V3.1's "▁" (U+2581) as a space
        assert fmt == "deepseek_v3_1" and "▁" in text


def test_the_typed_arguments_survive_token_chunking(tok):
    """The arguments read back through real tokens are the values written, in every format whose
    text the tokenizer round-trips."""
    for _, fmt, text in SCRIPTS:
        if fmt == "harmony" or not text.startswith(PROSE) or "get_weather" not in text:
            continue
        decoded, deltas = token_deltas(tok, text, FORMATS[fmt].skip_special_tokens)
        if decoded != text:
            continue
        _, calls, _ = _tool_events(fmt, deltas)
        first = json.loads(calls[0][1])
        if "days" in first and first.get("city"):
            assert first["city"] == "café ✓ 日本", (fmt, first)


# ---- reasoning ------------------------------------------------------------------------------

THOUGHT = "The user wants café ✓ 日本 🌦️ 𠜎 weather.\nCheck <b>tools</b> first: 2 < 3."
ANSWER = "It is sunny in café ✓ 日本 🌦️ 𠜎."


def _reasoning_texts():
    """(id, format, mode, text): a block the template opened (mode "open"), one the model opens
    ("optional"), and text with no reasoning ("off")."""
    for name, fmt in REASONING.items():
        after = fmt.separator + fmt.header if fmt.separator else "\n\n"
        body = f"\n{THOUGHT}\n{fmt.end}{after}{ANSWER}"
        yield f"{name}-open", name, "open", body
        yield f"{name}-optional", name, "optional", f"{fmt.start}{body}"
        yield f"{name}-off", name, "off", ANSWER + fmt.end


def _reasoning(fmt: str, mode: str, pieces: list[str]) -> tuple[str, str]:
    p = ReasoningParser(REASONING[fmt], mode)
    parts = [p.feed(piece) for piece in pieces] + [p.finish()]
    reasoning, content = "".join(r for r, _ in parts), "".join(c for _, c in parts)
    assert (reasoning, content) == (p.reasoning, p.content)
    return reasoning, content


@pytest.mark.parametrize("fmt,mode,text", [pytest.param(f, m, t, id=i) for i, f, m, t in _reasoning_texts()])
def test_reasoning_parser_one_real_token_at_a_time(tok, fmt, mode, text):
    decoded, deltas = token_deltas(tok, text)
    whole = _reasoning(fmt, mode, [decoded])
    assert _reasoning(fmt, mode, deltas) == whole
    assert _reasoning(fmt, mode, list(decoded)) == whole
    assert decoded == text
    if mode == "off":
        assert whole == ("", text)
    else:
        assert whole == (THOUGHT, ANSWER)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_reasoning_then_calls_one_real_token_at_a_time(tok, fmt):
    """The server's chain (api/output_text.OutputParser: the reasoning parser's answer fed on to the
    tool-call parser) at token chunking: reasoning, prose, then calls in every format (gpt-oss:
    its analysis channel, then a call on the commentary channel)."""
    f = FORMATS[fmt]
    harmony = fmt == "harmony"
    think = REASONING["harmony" if harmony else "think"]
    calls = [W] if harmony else [W, T]
    after = think.separator if harmony else "\n\n" + PROSE
    text = f"{THOUGHT}{think.end}{after}" + f.render_calls(calls)
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in SCHEMAS.items()]
    plan = plan_tools(tools, "auto", None, f)
    decoded, deltas = token_deltas(tok, text, f.skip_special_tokens)

    def run(pieces):
        parser = OutputParser((think, "open"), plan)
        events = [e for p in pieces for e in parser.feed(p)] + parser.close("stop")[0]
        return (
            _merged(events),
            parser.reasoning,
            parser.content,
            [(c.name, c.arguments) for c in parser.calls],
        )

    whole = run([decoded])
    assert run(deltas) == whole
    _, reasoning, content, got = whole
    assert reasoning == THOUGHT
    if decoded == text:
        assert content == ("" if harmony else PROSE)
        assert [(n, json.loads(a)) for n, a in got] == calls
