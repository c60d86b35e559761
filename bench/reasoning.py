"""Reasoning models: what reasoning costs around a constraint, and how often a thinking model ends
with a valid answer under a tight budget (issue 36).

Part 1 (model-free): parser cost per streamed token (p50/p99 us): the reasoning parser, the
output parser (reasoning then hermes tool calls), and each tool-call format's parser (two calls
after some prose), fed one token's text (the default model's tokenizer) at a time.
Part 2 (the default model's tokenizer, 49k tokens): mask cost per token (fill_next_token_bitmask,
p50/p99 us) of each extraction schema plain, and wrapped as `reasoning answer`: inside the
reasoning (free text) and after the end marker (the schema), walking a valid instance; and every
tool-call format's grammar (3 tools) under auto, before and after the trigger, and under required
(`--part tools` runs that table alone).
Part 3 (the scripted fake model): a long-thinking model (it never closes its reasoning by itself)
over the extraction workload's schemas and documents: the share of valid final answers with a
thinking budget at tight max_tokens, with the length policy (no reserve) and with
max_tokens_policy "close" (the reserve for the end marker and the answer's shortest completion).

    python bench/reasoning.py [--part 1|2|3|tools|all]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "testdata"

THOUGHT = (
    "Let me read the document carefully and find each field. The date could be written in several "
    "ways, so I will check the whole text before I decide. "
) * 20


def _pieces(tok, text: str) -> list[str]:
    """`text` as a stream delivers it: each token's new text, decoded with the tokens before it
    (a character split over tokens arrives whole with its last token)."""
    ids, out, seen = tok.encode(text, add_special_tokens=False), [], ""
    for i in range(len(ids)):
        now = tok.decode(ids[: i + 1])
        if now.endswith("\ufffd"):
            out.append("")
            continue
        out.append(now[len(seen) :])
        seen = now
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _schemas() -> dict[str, dict]:
    return {
        p.stem: json.loads(p.read_text()) for p in sorted((SHARED / "extraction" / "schemas").glob("*.json"))
    }


def part1() -> None:
    from transformers import AutoTokenizer

    from agentrt.api.output_text import OutputParser
    from agentrt.api.tools import plan_tools
    from agentrt.grammars.reasoning import FORMATS, ReasoningParser
    from agentrt.grammars.tool_calls import FORMATS as TOOLS
    from agentrt.runtime.config import default_cache_dir
    from agentrt.runtime.models.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct", default_cache_dir())))
    call = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    print("part 1: parser cost per streamed token (us)")
    print("| parser | format | tokens | p50 | p99 |\n|---|---|---|---|---|")
    for name, fmt in FORMATS.items():
        text = THOUGHT[:1500] + fmt.end + "\n\nThe answer is Paris." + call
        pieces = _pieces(tok, text)
        for label, make in [
            ("reasoning", lambda fmt=fmt: ReasoningParser(fmt, "open")),
            (
                "reasoning + hermes calls",
                lambda fmt=fmt: OutputParser((fmt, "open"), plan_tools(tools, "auto", None, TOOLS["hermes"])),
            ),
        ]:
            times = []
            for _ in range(5):
                parser = make()
                for p in pieces:
                    t0 = time.perf_counter_ns()
                    parser.feed(p)
                    times.append((time.perf_counter_ns() - t0) / 1000)
            print(f"| {label} | {name} | {len(pieces)} | {pct(times, 0.5):.1f} | {pct(times, 0.99):.1f} |")
    print("\n| tool-call format | tokens | p50 | p99 | calls parsed |\n|---|---|---|---|---|")
    prose = "I will look this up for you. " * 4
    args = {"city": "Paris", "unit": "celsius", "days": 3}
    for name, fmt in TOOLS.items():
        text = prose + fmt.render_calls([("get_weather", args), ("get_time", {"city": "Paris"})])
        pieces = _pieces(tok, text)
        names = [
            {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
            for n in ("get_weather", "get_time")
        ]
        plan = plan_tools(names, "auto", None, fmt)
        times, calls = [], 0
        for _ in range(5):
            parser = plan.new_parser()
            for p in pieces:
                t0 = time.perf_counter_ns()
                parser.feed(p)
                times.append((time.perf_counter_ns() - t0) / 1000)
            parser.close("stop")
            calls = len(parser.calls)
        print(f"| {name} | {len(pieces)} | {pct(times, 0.5):.1f} | {pct(times, 0.99):.1f} | {calls} |")


def part2() -> None:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from agentrt.grammars.reasoning import FORMATS
    from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
    from agentrt.grammars.xgrammar_backend import GrammarBackend
    from agentrt.runtime.config import default_cache_dir
    from agentrt.runtime.models.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct", default_cache_dir())))
    backend = GrammarBackend(tok, len(tok), (tok.eos_token_id,), GrammarConfig())
    bitmask = xgr.allocate_token_bitmask(1, len(tok))
    docs = [json.loads(line) for line in (SHARED / "extraction" / "docs.jsonl").read_text().splitlines()]
    instance = {}
    for d in docs:
        instance.setdefault(d["schema_name"], d["gold"])
    think = FORMATS["think"]
    print("\npart 2: mask cost per token (us), default model's tokenizer")
    print("| schema | plain p50 / p99 | reasoning: inside p50 / p99 | reasoning: answer p50 / p99 |")
    print("|---|---|---|---|")
    for name, schema in _schemas().items():
        value = instance.get(name)
        if value is None:
            continue
        answer = json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
        plain = ConstraintSpec.json_schema(schema)
        wrapped = ConstraintSpec(plain.kind, plain.value, plain.strict, think.as_json("open"))
        row = [name]
        for spec, text, split in [
            (plain, answer, None),
            (wrapped, THOUGHT[:800] + "</think>\n\n" + answer, 800),
        ]:
            compiled = backend.compile(spec)
            matcher = backend.new_matcher(compiled, [])
            ids = tok.encode(text, add_special_tokens=False)
            inside, after, chars = [], [], 0
            for t in ids:
                t0 = time.perf_counter_ns()
                matcher.fill_next_token_bitmask(bitmask, 0)
                dt = (time.perf_counter_ns() - t0) / 1000
                (inside if split is not None and chars < split else after).append(dt)
                if not matcher.accept_token(t):
                    raise SystemExit(f"{name}: token {t} rejected at char {chars}")
                chars += len(tok.decode([t]))
            if split is not None:
                row.append(f"{pct(inside, 0.5):.0f} / {pct(inside, 0.99):.0f}")
            row.append(f"{pct(after, 0.5):.0f} / {pct(after, 0.99):.0f}")
        print("| " + " | ".join(row) + " |")
    _tool_masks(backend, tok, bitmask)
    backend.shutdown()


def _tool_masks(backend, tok, bitmask, reps: int = 5) -> None:
    """Mask cost of every tool-call format's grammar over 3 tools (each format writes one call in its
    own syntax, `render_calls`): under `auto` (the lazy grammar: free text, then the call once the
    trigger is written) before and after the trigger, and under `required` (the call from the
    start). Each text is walked `reps` times; p50 / p99 over all its tokens' fills (us). llama3_json
    is measured in both call forms: its JSON call and a built-in tool's `<|python_tag|>NAME.call(...)`."""
    from agentrt.api.tools import plan_tools
    from agentrt.grammars.tool_calls import FORMATS as TOOLS

    def fn(name: str, props: dict, required: list[str]) -> dict:
        params = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    tools = [
        fn(
            "get_weather",
            {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            ["city", "unit"],
        ),
        fn("get_time", {"timezone": {"type": "string"}}, ["timezone"]),
        fn("brave_search", {"query": {"type": "string"}, "count": {"type": "integer"}}, ["query"]),
    ]
    prose = "I will look up the weather in Paris for you now, one moment please, it will not take long. "
    weather = ("get_weather", {"city": "Paris", "unit": "celsius"})
    cases = [(name, fmt, fmt.render_calls([weather])) for name, fmt in TOOLS.items()]
    builtin = '<|python_tag|>brave_search.call(query="weather in Paris")'
    cases.insert(2, ("llama3_json (python_tag built-in)", TOOLS["llama3_json"], builtin))
    print(f"\ntool-call grammars, 3 tools, {reps} walks each: mask cost per token (us)")
    print(
        "| format | tokens: prose / call | auto: before the trigger p50 / p99 | auto: the call p50 / p99 "
        "| required: the call p50 / p99 |"
    )
    print("|---|---|---|---|---|")
    for label, fmt, call in cases:
        n_call = len(tok.encode(call, add_special_tokens=False))
        row = [label, f"{len(tok.encode(prose + call, add_special_tokens=False)) - n_call} / {n_call}"]
        for mode, text in [("auto", prose + call), ("required", call)]:
            start = len(text) - len(call)
            compiled = backend.compile(plan_tools(tools, mode, None, fmt).constraint())
            ids = tok.encode(text, add_special_tokens=False)
            before, inside, refused = [], [], None
            for _ in range(reps):
                matcher = backend.new_matcher(compiled, [])
                chars = 0
                for t in ids:
                    t0 = time.perf_counter_ns()
                    matcher.fill_next_token_bitmask(bitmask, 0)
                    (before if chars < start else inside).append((time.perf_counter_ns() - t0) / 1000)
                    if not matcher.accept_token(t):
                        refused = f"refused at char {chars}"
                        break
                    chars += len(tok.decode([t]))
            if mode == "auto":
                row.append(f"{pct(before, 0.5):.1f} / {pct(before, 0.99):.1f}")
            row.append(refused or f"{pct(inside, 0.5):.1f} / {pct(inside, 0.99):.1f}")
        print("| " + " | ".join(row) + " |")


def tool_masks() -> None:
    """`_tool_masks` alone (part 2's last table): `--part tools`."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from agentrt.grammars.spec import GrammarConfig
    from agentrt.grammars.xgrammar_backend import GrammarBackend
    from agentrt.runtime.config import default_cache_dir
    from agentrt.runtime.models.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct", default_cache_dir())))
    backend = GrammarBackend(tok, len(tok), (tok.eos_token_id,), GrammarConfig())
    _tool_masks(backend, tok, xgr.allocate_token_bitmask(1, len(tok)))
    backend.shutdown()


def part3(max_tokens: int, budget: int) -> None:
    import jsonschema

    from agentrt.extract.prompt import extraction_messages
    from agentrt.grammars.reasoning import FORMATS, ReasoningParser
    from agentrt.grammars.spec import ConstraintSpec
    from agentrt.runtime.request import ReasoningParams, SamplingParams
    from agentrt.testing import fake_engine

    think = FORMATS["think"]
    engine = fake_engine(max_model_len=8192, num_kv_slots=65536)
    tok = engine.tokenizer
    schemas = _schemas()
    docs = [json.loads(line) for line in (SHARED / "extraction" / "docs.jsonl").read_text().splitlines()]
    print(
        f"\npart 3: scripted long-thinking model, budget {budget}, max_tokens {max_tokens}, {len(docs)} docs"
    )
    print("| policy | valid answers | mean output tokens | answer cut |\n|---|---|---|---|")
    for policy in ("length", "close"):
        valid, lengths, cut = 0, [], 0
        for i, d in enumerate(docs):
            schema = schemas[d["schema_name"]]
            messages = extraction_messages(d["text"], schema)
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "<think>\n"
            prompt = tok.encode(text, add_special_tokens=False)[-3000:]
            engine.runner.script(prompt, THOUGHT)
            plain = ConstraintSpec.json_schema(schema)
            spec = ConstraintSpec(plain.kind, plain.value, plain.strict, think.as_json("open"))
            params = SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=max_tokens,
                max_tokens_policy=policy,
                reasoning=ReasoningParams(think.start, think.end, "open", budget),
            )
            req = engine.add_request(prompt, params, spec)
            final = None
            while final is None:
                final = next(
                    (o for o in engine.step() if o.finished and o.request_id == req.request_id), None
                )
            parser = ReasoningParser(think, "open")
            parser.feed(final.text)
            parser.finish()
            lengths.append(len(final.token_ids))
            cut += final.finish_reason == "length"
            try:
                jsonschema.validate(json.loads(parser.content), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        print(f"| {policy} | {valid}/{len(docs)} | {statistics.mean(lengths):.0f} | {cut} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", choices=["1", "2", "3", "tools", "all"])
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--budget", type=int, default=256)
    args = ap.parse_args()
    if args.part in ("1", "all"):
        part1()
    if args.part in ("2", "all"):
        part2()
    if args.part in ("3", "all"):
        part3(args.max_tokens, args.budget)
    if args.part == "tools":
        tool_masks()


if __name__ == "__main__":
    main()
