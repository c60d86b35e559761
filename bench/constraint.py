"""Constraint engine benchmark.

Part 1 (model-free): per split (the JSONSchemaBench sample with its instances, the
JSON-Schema-Test-Suite 2020-12 groups), compiled share before (git HEAD before issue 21, constant
BEFORE) and now, next to raw xgrammar and llguidance (when installed: `pip install llguidance`; its
matcher compiles lazily, so its compile time is the matcher's creation) on the same tokenizer;
agentrt's instance verdicts (right / wrong, conformance.check_schema), p50/p99 compile time, the
refusals by keyword; mask cost per token (fill_next_token_bitmask, p50/p99 us) walking each
JSONSchemaBench schema's first valid instance. Part 2 (default model): decode tokens/s constrained vs unconstrained at batch 1 and 16,
and the share of output tokens forced by jump-forward. Part 3 (model-free): cost of the
finite-output check (grammars/finite.py) on each JSONSchemaBench schema's EBNF.

    python bench/constraint.py [--part 1|2|3|all] [--docs 16] [--compile-timeout 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "testdata"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _llguidance(tokenizer):
    """(compile, mask) functions for llguidance when it is installed, else None."""
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        return None
    import torch

    ll_tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=49152)
    defaults = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def compile_schema(schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
        m = llguidance.LLMatcher(ll_tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def mask_walk(grammar, ids, sink):
        m = llguidance.LLMatcher(ll_tok, grammar)
        bm = torch.full((1, 49152 // 32), -1, dtype=torch.int32)
        for t in ids:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(m, bm, 0)
            sink.append((time.perf_counter() - t0) * 1e6)
            if not m.consume_token(t):
                break

    return compile_schema, mask_walk


# compiled share at git HEAD 8082f53 (before issue 21's automata and object grammars), measured
# with this script's split definitions: JSONSchemaBench sample 122 of 150, test suite 163 of 383
BEFORE = {"JSONSchemaBench sample": 122, "JSON-Schema-Test-Suite groups": 163}


def _splits():
    """(split name, [(name, schema, tests)]) for the two conformance splits."""
    bench = []
    for f in sorted((SHARED / "jsonschemabench" / "with_tests").glob("*.json")):
        doc = json.loads(f.read_text())
        bench.append((f.name, doc["schema"], doc["tests"]))
    suite = []
    for f in sorted((SHARED / "json-schema-test-suite").glob("*.json")):
        for i, g in enumerate(json.loads(f.read_text())):
            suite.append((f"{f.stem}[{i}]", g["schema"], g["tests"]))
    return [("JSONSchemaBench sample", bench), ("JSON-Schema-Test-Suite groups", suite)]


def part1(tokenizer, compile_timeout_s: float = 30.0):
    import xgrammar as xgr

    from agentrt.grammars.conformance import Counts, check_schema
    from agentrt.grammars.json_schema import canonical_json, normalize_schema
    from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
    from agentrt.grammars.xgrammar_backend import GrammarBackend

    config = GrammarConfig(compile_threads=1, cache_size=4, compile_timeout_s=compile_timeout_s)
    backend = GrammarBackend(tokenizer, 49152, (2,), config)
    raw = xgr.GrammarCompiler(backend.info, max_threads=1, cache_enabled=False)
    llg = _llguidance(tokenizer)
    print(
        "| split | schemas | agentrt before | agentrt after | raw xgrammar | llguidance | "
        "agentrt verdicts right / wrong | agentrt compile p50 / p99 ms | raw xgrammar p50 / p99 ms | "
        "llguidance p50 / p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    masks = {"agentrt": [], "raw xgrammar": [], "llguidance": []}
    for split, docs in _splits():
        ours, row = Counts(), {"raw_ok": 0, "llg_ok": 0, "raw_ms": [], "llg_ms": []}
        for name, schema, tests in docs:
            c = check_schema(backend, schema, tests, name)
            ours.add(c)
            t0 = time.perf_counter()
            try:
                raw_g = raw.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=False)
                row["raw_ok"] += 1
                row["raw_ms"].append((time.perf_counter() - t0) * 1e3)
            except Exception:  # noqa: BLE001 (xgrammar raises several types)
                raw_g = None
            llg_g = None
            if llg is not None:
                t0 = time.perf_counter()
                try:
                    llg_g = llg[0](schema)
                    row["llg_ok"] += 1
                    row["llg_ms"].append((time.perf_counter() - t0) * 1e3)
                except Exception:  # noqa: BLE001
                    llg_g = None
            valid = [t["data"] for t in tests if t["valid"]]
            if not c.compiled or raw_g is None or not valid or split != "JSONSchemaBench sample":
                continue
            compiled = backend.compile(ConstraintSpec.json_schema(schema))  # cached by check_schema
            text = canonical_json(valid[0], normalize_schema(schema).schema)
            ids = tokenizer.encode(text, add_special_tokens=False)
            for engine, grammar in (("agentrt", compiled.grammar), ("raw xgrammar", raw_g)):
                m = xgr.GrammarMatcher(grammar)
                bm = xgr.allocate_token_bitmask(1, 49152)
                for t in ids:
                    t0 = time.perf_counter()
                    m.fill_next_token_bitmask(bm, 0)
                    masks[engine].append((time.perf_counter() - t0) * 1e6)
                    if not m.accept_token(t):
                        break
            if llg_g is not None:
                llg[1](llg_g, ids, masks["llguidance"])
        n = len(docs)
        right = ours.accepted_valid + ours.rejected_invalid
        wrong = ours.accepted_invalid + ours.rejected_valid - ours.rejected_valid_escaped
        ms = [x * 1e3 for x in ours.compile_s]
        print(
            f"| {split} | {n} | {BEFORE[split]} ({BEFORE[split] / n:.0%}) | {ours.compiled} "
            f"({ours.compiled / n:.0%}) | {row['raw_ok']} ({row['raw_ok'] / n:.0%}) | "
            + (f"{row['llg_ok']} ({row['llg_ok'] / n:.0%})" if llg is not None else "not installed")
            + f" | {right} / {wrong} (+{ours.rejected_valid_escaped} escaped-string limit) | "
            f"{pct(ms, 0.5):.1f} / {pct(ms, 0.99):.1f} | "
            f"{pct(row['raw_ms'], 0.5):.1f} / {pct(row['raw_ms'], 0.99):.1f} | "
            f"{pct(row['llg_ms'], 0.5):.1f} / {pct(row['llg_ms'], 0.99):.1f} |"
        )
        refusals: dict[str, int] = {}
        for r in ours.refusals:
            kw = r.split("keyword '", 1)[1].split("'", 1)[0] if "keyword '" in r else "other"
            refusals[kw] = refusals.get(kw, 0) + 1
        print(f"  refused, by keyword: {sorted(refusals.items(), key=lambda kv: -kv[1])}")
    print(
        "\nmask cost per token (us), walking the first valid instance of every JSONSchemaBench schema all compile:"
    )
    print("| engine | tokens | p50 | p99 | max |\n|---|---|---|---|---|")
    for name, xs in masks.items():
        if xs:
            print(f"| {name} | {len(xs)} | {pct(xs, 0.5):.1f} | {pct(xs, 0.99):.1f} | {max(xs):.0f} |")
    backend.shutdown()


def part2(model_dir: str, n_docs: int):
    from transformers import AutoTokenizer

    from agentrt.extract.prompt import extraction_messages
    from agentrt.grammars.spec import ConstraintSpec
    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
    from agentrt.runtime.engine import Engine
    from agentrt.runtime.request import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    docs = [json.loads(x) for x in (SHARED / "extraction" / "docs.jsonl").read_text().splitlines()][:n_docs]
    schemas = {
        d["schema_name"]: json.loads(
            (SHARED / "extraction" / "schemas" / f"{d['schema_name']}.json").read_text()
        )
        for d in docs
    }

    def prompt(d):
        msgs = extraction_messages(d["text"], schemas[d["schema_name"]])
        return tok.encode(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )

    prompts = [prompt(d) for d in docs]
    eng = Engine(
        EngineConfig(
            model=ModelConfig(model=model_dir, device="cpu", dtype="float32"),
            cache=CacheConfig(kv_cache_bytes=512 << 20, enable_prefix_cache=True),
        )
    )
    specs = [ConstraintSpec.json_schema(schemas[d["schema_name"]]) for d in docs]
    for spec in specs:
        eng.grammar.compile(spec)
    eng.generate([(p, SamplingParams(temperature=0, max_tokens=1), None) for p in prompts])  # warm prefixes

    def set_jump_forward(on: bool) -> None:
        eng.config = dataclasses.replace(
            eng.config, grammar=dataclasses.replace(eng.config.grammar, jump_forward=on)
        )

    print(
        "Each document group is decoded three ways in turn (constrained without jump-forward, then "
        "unconstrained with exactly as many tokens per request (ignore_eos), then constrained with "
        "jump-forward), so the three rows do the same steps with the same batch shapes and share "
        "the machine's drift.\n"
    )
    print("| batch | mode | output tokens | s | tokens/s | vs unconstrained | forced by jump-forward |")
    print("|---|---|---|---|---|---|---|")
    modes = ("json_schema, jump-forward off", "unconstrained", "json_schema, jump-forward on")
    for batch in (1, 16):
        acc = {m: [0, 0.0, 0] for m in modes}
        for i in range(0, len(docs), batch):
            group = list(range(i, min(i + batch, len(docs))))
            lengths = {}
            for mode in modes:
                set_jump_forward(mode.endswith("on"))
                if mode == "unconstrained":
                    reqs = [
                        (
                            prompts[j],
                            SamplingParams(temperature=0, max_tokens=lengths[j], ignore_eos=True),
                            None,
                        )
                        for j in group
                    ]
                else:
                    reqs = [
                        (prompts[j], SamplingParams(temperature=0, max_tokens=120), specs[j]) for j in group
                    ]
                before = eng.stats.num_jump_forward_tokens
                t0 = time.perf_counter()
                outs = eng.generate(reqs)
                acc[mode][1] += time.perf_counter() - t0
                acc[mode][0] += sum(len(o.token_ids) for o in outs)
                acc[mode][2] += eng.stats.num_jump_forward_tokens - before
                if mode.endswith("off"):
                    lengths = {j: len(o.token_ids) for j, o in zip(group, outs)}
        base = acc["unconstrained"][0] / acc["unconstrained"][1]
        for mode in ("unconstrained", *modes[::2]):
            n, secs, f = acc[mode]
            print(
                f"| {batch} | {mode} | {n} | {secs:.1f} | {n / secs:.1f} | {n / secs / base:.3f}x | "
                f"{f} ({f / max(n, 1):.0%}) |"
            )
    eng.grammar.shutdown()


def part3():
    from agentrt.grammars.finite import unproductive_rules
    from agentrt.grammars.pipeline import schema_ebnf

    times, sizes, refused = [], [], 0
    for path in sorted((SHARED / "jsonschemabench" / "schemas").glob("*.json")):
        try:
            ebnf = schema_ebnf(
                json.loads(path.read_text()), None, [], {"any_whitespace": False, "indent": None}
            )
        except ValueError:
            refused += 1
            continue
        t0 = time.perf_counter()
        bad = unproductive_rules(ebnf)
        times.append(time.perf_counter() - t0)
        sizes.append(len(ebnf))
        assert bad == [], (path.name, bad)  # none of these real schemas lacks a finite instance
    big = max(range(len(sizes)), key=sizes.__getitem__)
    print(f"\n### Finite-output check, {len(times)} JSONSchemaBench schemas ({refused} refused before)\n")
    print("| p50 ms | p99 ms | max ms | largest EBNF (chars) | its check ms |")
    print("|---|---|---|---|---|")
    print(
        f"| {pct(times, 0.5) * 1e3:.2f} | {pct(times, 0.99) * 1e3:.1f} | {max(times) * 1e3:.0f} | {sizes[big]} "
        f"| {times[big] * 1e3:.0f} |"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", choices=["1", "2", "3", "all"])
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument(
        "--compile-timeout",
        type=float,
        default=30.0,
        help="part 1: seconds a compile may take before it counts as refused (the server's default: 30)",
    )
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from agentrt.runtime.config import default_cache_dir
    from agentrt.runtime.models.loader import resolve_model_dir

    model_dir = str(resolve_model_dir("smollm2-135m-instruct", default_cache_dir()))
    if args.part in ("1", "all"):
        part1(AutoTokenizer.from_pretrained(model_dir), args.compile_timeout)
    if args.part in ("2", "all"):
        part2(model_dir, args.docs)
    if args.part in ("3", "all"):
        part3()


if __name__ == "__main__":
    main()
