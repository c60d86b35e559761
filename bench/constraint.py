"""Constraint engine benchmark.

Part 1 (model-free, JSONSchemaBench sample): per split, compiled / refused rate and p50/p99 compile
time for agentrt (faithful-schema rewrite + xgrammar) and raw xgrammar on the same tokenizer;
mask cost per token (fill_next_token_bitmask, p50/p99 us) walking each schema's first valid
instance. Part 2 (default model): decode tokens/s constrained vs unconstrained at batch 1 and 16,
and the share of output tokens forced by jump-forward.

    python bench/constraint.py [--part 1|2|all] [--docs 16]
"""

from __future__ import annotations

import argparse
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


def part1(tokenizer):
    import xgrammar as xgr

    from agentrt.grammars.json_schema import canonical_json, normalize_schema
    from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
    from agentrt.grammars.xgrammar_backend import GrammarBackend

    backend = GrammarBackend(tokenizer, 49152, (2,), GrammarConfig(compile_threads=1, cache_size=1))
    raw = xgr.GrammarCompiler(backend.info, max_threads=1, cache_enabled=False)
    rows = {}
    mask_ours, mask_raw = [], []
    for f in sorted((SHARED / "jsonschemabench" / "with_tests").glob("*.json")):
        doc = json.loads(f.read_text())
        split = f.name.split("__")[0]
        row = rows.setdefault(split, {"n": 0, "ours_ok": 0, "raw_ok": 0, "ours_ms": [], "raw_ms": []})
        row["n"] += 1
        t0 = time.perf_counter()
        try:
            ours = backend._compile(ConstraintSpec.json_schema(doc["schema"]))
            row["ours_ok"] += 1
            row["ours_ms"].append((time.perf_counter() - t0) * 1e3)
        except ValueError:
            ours = None
        t0 = time.perf_counter()
        try:
            raw_g = raw.compile_json_schema(json.dumps(doc["schema"]), any_whitespace=False, strict_mode=False)
            row["raw_ok"] += 1
            row["raw_ms"].append((time.perf_counter() - t0) * 1e3)
        except Exception:  # noqa: BLE001 (xgrammar raises several types)
            raw_g = None
        valid = [t["data"] for t in doc["tests"] if t["valid"]]
        if ours is None or raw_g is None or not valid:
            continue
        text = canonical_json(valid[0], normalize_schema(doc["schema"]).schema)
        ids = tokenizer.encode(text, add_special_tokens=False)
        for compiled, sink in ((ours.grammar, mask_ours), (raw_g, mask_raw)):
            m = xgr.GrammarMatcher(compiled)
            bm = xgr.allocate_token_bitmask(1, 49152)
            for t in ids:
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(bm, 0)
                sink.append((time.perf_counter() - t0) * 1e6)
                if not m.accept_token(t):
                    break
    print("| split | schemas | agentrt compiled | raw xgrammar compiled | agentrt compile p50 / p99 ms | "
          "raw compile p50 / p99 ms |")
    print("|---|---|---|---|---|---|")
    tot = {"n": 0, "ours_ok": 0, "raw_ok": 0, "ours_ms": [], "raw_ms": []}
    for split, r in sorted(rows.items()) + [("all", tot)]:
        if split != "all":
            for k in tot:
                tot[k] += r[k]
        print(f"| {split} | {r['n']} | {r['ours_ok']} ({r['ours_ok'] / r['n']:.0%}) | "
              f"{r['raw_ok']} ({r['raw_ok'] / r['n']:.0%}) | {pct(r['ours_ms'], .5):.1f} / {pct(r['ours_ms'], .99):.1f} | "
              f"{pct(r['raw_ms'], .5):.1f} / {pct(r['raw_ms'], .99):.1f} |")
    print(f"\nmask cost per token (us), {len(mask_ours)} tokens: agentrt p50 {pct(mask_ours, .5):.1f} "
          f"p99 {pct(mask_ours, .99):.1f}; raw xgrammar p50 {pct(mask_raw, .5):.1f} p99 {pct(mask_raw, .99):.1f}")
    backend.shutdown()


def part2(model_dir: str, n_docs: int):
    from transformers import AutoTokenizer

    from agentrt.extraction import extraction_messages
    from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
    from agentrt.runtime.engine import Engine
    from agentrt.runtime.request import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    docs = [json.loads(x) for x in (SHARED / "extraction" / "docs.jsonl").read_text().splitlines()][:n_docs]
    schemas = {d["schema_name"]: json.loads((SHARED / "extraction" / "schemas" / f"{d['schema_name']}.json")
                                            .read_text()) for d in docs}

    def prompt(d):
        msgs = extraction_messages(d["text"], schemas[d["schema_name"]])
        return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)

    prompts = [prompt(d) for d in docs]
    print("| batch | mode | output tokens | decode s | tokens/s | vs unconstrained | forced by jump-forward |")
    print("|---|---|---|---|---|---|---|")
    for jf in (True, False):
        eng = Engine(EngineConfig(model=ModelConfig(model=model_dir, device="cpu", dtype="float32"),
                                  cache=CacheConfig(kv_cache_bytes=512 << 20, enable_prefix_cache=True),
                                  grammar=GrammarConfig(jump_forward=jf)))
        for batch in (1, 16):
            for constrained in ([False, True] if jf else [True]):
                rate_base = None
                outs_tokens = 0
                t_total = 0.0
                before = eng.stats.num_jump_forward_tokens
                for i in range(0, len(docs), batch):
                    group = list(range(i, min(i + batch, len(docs))))
                    # warm the prefix cache so only decode is timed
                    eng.generate([(prompts[j], SamplingParams(temperature=0, max_tokens=1), None) for j in group])
                    reqs = []
                    for j in group:
                        spec = ConstraintSpec.json_schema(schemas[docs[j]["schema_name"]]) if constrained else None
                        if spec is not None:
                            eng.grammar.compile(spec)
                        # unconstrained: same length budget, no early stop, so both decode ~120 tokens
                        reqs.append((prompts[j], SamplingParams(temperature=0, max_tokens=120,
                                                                ignore_eos=not constrained), spec))
                    t0 = time.perf_counter()
                    outs = eng.generate(reqs)
                    t_total += time.perf_counter() - t0
                    outs_tokens += sum(len(o.token_ids) for o in outs)
                forced = eng.stats.num_jump_forward_tokens - before
                rate = outs_tokens / t_total
                if not constrained:
                    part2.base[batch] = rate
                rate_base = part2.base.get(batch)
                mode = "unconstrained" if not constrained else f"json_schema, jump-forward {'on' if jf else 'off'}"
                rel = f"{rate / rate_base:.2f}x" if rate_base and constrained else "1.00x"
                print(f"| {batch} | {mode} | {outs_tokens} | {t_total:.1f} | {rate:.1f} | {rel} | "
                      f"{forced} ({forced / max(outs_tokens, 1):.0%}) |")
        eng.grammar.shutdown()


part2.base = {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="all", choices=["1", "2", "all"])
    ap.add_argument("--docs", type=int, default=16)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from agentrt.runtime.config import default_cache_dir
    from agentrt.runtime.models.loader import resolve_model_dir

    model_dir = str(resolve_model_dir("smollm2-135m-instruct", default_cache_dir()))
    if args.part in ("1", "all"):
        part1(AutoTokenizer.from_pretrained(model_dir))
    if args.part in ("2", "all"):
        part2(model_dir, args.docs)


if __name__ == "__main__":
    main()
