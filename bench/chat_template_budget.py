"""The chat template budget (runtime/chat_template.py, runtime/template_sandbox.py; issue 56 item 2):
what the budgeted render costs on a real template and how fast it refuses hostile ones.

Part "overhead": a real template (default Qwen3-0.6B's, from ../shared/testdata/chat_templates)
on a 20-turn conversation with 4 tools: median milliseconds of transformers' apply_chat_template
(the plain render, no budget), of ChatRenderer.render (the budgeted one), and of the budgeted render
with a line tracer (`sys.settrace`, local tracing of the template's frames only) around it: the
design the loop hook replaced. Both renders' texts are checked equal.

Part "refusal": time to the budget error (default budget: 1 s, 16 MiB) of two nested range(100000)
loops, of a macro building 300 MB (with the Python heap's peak, tracemalloc), of 100,000 one-word
messages through the same Qwen3 template (and the plain render of those, for comparison), and how
soon a render stops once its cancel Event is set.

    .venv/bin/python bench/chat_template_budget.py
    .venv/bin/python bench/chat_template_budget.py --template Qwen3-4B-Thinking-2507 --repeat 500
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import threading
import time
import tracemalloc
from pathlib import Path

from agentrt.errors import AgentrtError
from agentrt.runtime.chat_template import ChatRenderer, TemplateBudget
from agentrt.testing import byte_tokenizer

TEMPLATES = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata" / "chat_templates"
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HUGE = (
    "{% macro big() %}{% for i in range(100000) %}{{ 'x' * 3000 }}{% endfor %}{% endmacro %}"
    "{% set s = big() %}{{ s|length }}"
)


def conversation(turns: int) -> tuple[list[dict], list[dict]]:
    """A system prompt, `turns` user / assistant pairs (the last assistant turn a tool call and
    its result), and 4 tools."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "Look something up about a city. " * 3,
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                    "required": ["city"],
                },
            },
        }
        for i in range(4)
    ]
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(turns - 1):
        messages.append({"role": "user", "content": f"Question {i}: " + "what about the weather? " * 8})
        messages.append({"role": "assistant", "content": f"Answer {i}: " + "it is sunny and warm. " * 12})
    messages.append({"role": "user", "content": "And in Paris?"})
    call = {"type": "function", "function": {"name": "tool_0", "arguments": {"city": "Paris"}}}
    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    messages.append({"role": "tool", "content": '{"sky": "clear"}'})
    return messages, tools


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def traced(fn):
    """`fn` run under a line tracer on the compiled template's frames ("<template>")."""

    def local(frame, event, arg):
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename == "<template>" else None

    def run():
        previous = sys.gettrace()
        sys.settrace(calls)
        try:
            return fn()
        finally:
            sys.settrace(previous)

    return run


def refusal(renderer: ChatRenderer, messages: list[dict], cancel=None) -> tuple[float, str]:
    t = time.perf_counter()
    try:
        renderer.render(messages, cancel=cancel)
        return time.perf_counter() - t, "rendered"
    except AgentrtError as e:
        return time.perf_counter() - t, type(e).__name__ + ": " + e.message[:90]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--template", default="Qwen-Qwen3-0.6B", help="a file name under chat_templates/, no .jinja"
    )
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=300)
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    tok = byte_tokenizer()
    tok.chat_template = (TEMPLATES / f"{args.template}.jinja").read_text()
    renderer = ChatRenderer(tok)
    messages, tools = conversation(args.turns)

    def plain():
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    def budgeted():
        return renderer.render(messages, tools)

    text = budgeted()
    assert text == plain(), "the budgeted render differs from apply_chat_template"
    print(f"\n[overhead] {args.template}, {args.turns} turns + 4 tools: {len(text):,} characters")
    a = median_ms(plain, args.repeat)
    b = median_ms(budgeted, args.repeat)
    c = median_ms(traced(budgeted), args.repeat)
    print(f"  apply_chat_template (no budget)       {a:7.3f} ms")
    print(f"  ChatRenderer.render (budgeted)        {b:7.3f} ms  x{b / a:.2f}")
    print(f"  budgeted + line tracer (settrace)     {c:7.3f} ms  x{c / a:.2f}")

    print("\n[refusal] default budget", TemplateBudget())
    hostile = ChatRenderer(byte_tokenizer())
    hostile.tokenizer.chat_template = LOOP
    seconds, what = refusal(hostile, [{"role": "user", "content": "hi"}])
    print(f"  nested range(100000) loops     {seconds:6.3f} s  {what}")
    hostile.tokenizer.chat_template = HUGE
    tracemalloc.start()
    seconds, what = refusal(hostile, [{"role": "user", "content": "hi"}])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"  a macro building 300 MB        {seconds:6.3f} s  peak {peak / 2**20:.1f} MiB  {what}")
    many = [{"role": "user", "content": "hi"}] * 100_000
    t = time.perf_counter()
    tok.apply_chat_template(many, tokenize=False, add_generation_prompt=True)
    print(f"  100,000 messages, plain render {time.perf_counter() - t:6.3f} s  (no budget)")
    seconds, what = refusal(renderer, many)
    print(f"  100,000 messages, budgeted     {seconds:6.3f} s  {what}")
    hostile.tokenizer.chat_template = LOOP
    slow = ChatRenderer(hostile.tokenizer, TemplateBudget(time_s=60.0))
    cancel = threading.Event()
    timer = threading.Timer(0.2, cancel.set)
    timer.start()
    seconds, what = refusal(slow, [{"role": "user", "content": "hi"}], cancel)
    print(f"  cancel set at 0.200 s          {seconds:6.3f} s  {what}")


if __name__ == "__main__":
    main()
