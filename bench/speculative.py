"""Speculative decoding benchmark: tokens/s and mean accepted length per proposer, in one run.

In-process engines (no HTTP), one per method, each run on the same requests in the same order:
- none (plain decoding), ngram (prompt lookup), draft (self-draft: the target's first
  `--draft-layers` layers + its LM head), medusa (the heads shipped for the default model);
- workloads: extraction (../shared/testdata/extraction, JSON Schema constrained, the documents the
  shipped Medusa heads were NOT trained on: odd positions in docs.jsonl) and free text (the
  held-out half of FREE_TEXT below), greedy;
- batch 1 (one request at a time) and batch 8 (8 requests in flight).

Reported: completion tokens/s (wall), speed-up over none, mean accepted length (tokens emitted per
verify pass = accepted draft tokens + 1), acceptance rate (accepted / drafted tokens) and how many
outputs differ from plain greedy decoding (must be 0: speculation is exact).

    python bench/speculative.py                          # default sizes
    python bench/speculative.py --docs 8 --free 8 --methods none ngram
    python bench/speculative.py --write-medusa-prompts out.jsonl   # the heads' training prompts
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentrt.extract.prompt import extraction_messages

DATA = ROOT.parent / "shared" / "testdata" / "extraction"

# Free-text instructions (written for this benchmark). Even positions train the shipped Medusa
# heads, odd positions are the benchmark's free-text workload.
FREE_TEXT = [
    "Explain what a hash table is in three sentences.",
    "Write a short poem about the sea at night.",
    "Give me five tips for staying focused while studying.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What are the main differences between a cat and a dog as pets?",
    "Describe how photosynthesis works to a ten-year-old.",
    "List the planets of the solar system in order from the sun.",
    "Write a polite email declining a meeting invitation.",
    "Explain the difference between weather and climate.",
    "What is recursion? Give a simple example in Python.",
    "Write a short story about a robot who learns to paint.",
    "Give three reasons why sleep is important for health.",
    "How do I make a cup of tea? Answer step by step.",
    "Explain what an API is to someone who does not program.",
    "Write a haiku about autumn leaves.",
    "What causes the seasons on Earth?",
    "Describe a typical day of a software engineer.",
    "Give me a recipe for a simple tomato pasta.",
    "Explain why the sky is blue.",
    "Write a limerick about a cat who loves cheese.",
    "What are the benefits of regular exercise?",
    "Explain how a bicycle stays upright when moving.",
    "Write a short motivational message for a friend starting a new job.",
    "What is the difference between a list and a tuple in Python?",
    "Describe the water cycle in simple terms.",
    "Give four ideas for a rainy weekend at home.",
    "Explain what machine learning is in two paragraphs.",
    "Write a thank-you note to a teacher.",
    "What should I pack for a three-day hiking trip?",
    "Explain how vaccines help the immune system.",
    "Write a dialogue between a customer and a barista.",
    "What are prime numbers? List the first ten.",
    "Describe the city of Paris to someone who has never been there.",
    "Give advice on how to learn a new language.",
    "Explain what a database index is and why it helps.",
    "Write a product description for a reusable water bottle.",
    "What is the greenhouse effect?",
    "Explain the rules of chess briefly.",
    "Write a short speech for a friend's birthday.",
    "How does a refrigerator keep food cold?",
    "Compare trains and planes for travel within Europe.",
    "Explain what HTTP status codes 200, 404 and 500 mean.",
    "Write a bedtime story about a sleepy dragon.",
    "What are good habits for writing clean code?",
    "Describe how to plant a tree.",
    "Explain the difference between RAM and storage.",
    "Write a short review of an imaginary restaurant.",
    "What is the Pythagorean theorem? Give an example.",
]


def extraction_requests(odd: bool, limit: int, tokenizer):
    """(prompt ids, schema) for extraction docs at odd (benchmark) or even (training) positions."""
    docs = [json.loads(line) for line in (DATA / "docs.jsonl").read_text().splitlines()]
    docs = [d for i, d in enumerate(docs) if i % 2 == (1 if odd else 0)][:limit]
    schemas = {p.stem: json.loads(p.read_text()) for p in (DATA / "schemas").glob("*.json")}
    out = []
    for d in docs:
        schema = schemas[d["schema_name"]]
        text = tokenizer.apply_chat_template(
            extraction_messages(d["text"], schema), add_generation_prompt=True, tokenize=False
        )
        out.append((tokenizer.encode(text, add_special_tokens=False), schema))
    return out


def write_medusa_prompts(path: Path) -> None:
    """The training prompts of the shipped heads: even-position extraction docs (with their schema)
    and even-position FREE_TEXT instructions."""
    docs = [json.loads(line) for line in (DATA / "docs.jsonl").read_text().splitlines()]
    schemas = {p.stem: json.loads(p.read_text()) for p in (DATA / "schemas").glob("*.json")}
    with path.open("w") as f:
        for d in docs[0::2]:
            schema = schemas[d["schema_name"]]
            f.write(json.dumps({"messages": extraction_messages(d["text"], schema), "schema": schema}) + "\n")
        for p in FREE_TEXT[0::2]:
            f.write(json.dumps({"messages": [{"role": "user", "content": p}]}) + "\n")


def run(engine, requests, batch: int, max_tokens: int):
    """Run (ids, spec) requests `batch` at a time; returns (outputs, wall seconds)."""
    from agentrt.runtime.request import SamplingParams

    outs = []
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch):
        group = requests[i : i + batch]
        outs += engine.generate(
            [(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), spec) for ids, spec in group]
        )
    return outs, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram", "draft", "medusa"])
    ap.add_argument("--docs", type=int, default=16, help="held-out extraction docs (of 30)")
    ap.add_argument("--free", type=int, default=16, help="held-out free-text prompts (of 24)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, default=4, help="draft tokens per verify pass (ngram, draft)")
    ap.add_argument("--draft-layers", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--write-medusa-prompts", type=Path)
    args = ap.parse_args()
    if args.write_medusa_prompts:
        write_medusa_prompts(args.write_medusa_prompts)
        return
    import torch

    from agentrt.grammars.spec import ConstraintSpec
    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SpecConfig
    from agentrt.runtime.engine import Engine

    def engine_for(method: str) -> Engine:
        spec = {
            "none": SpecConfig(),
            "ngram": SpecConfig(method="ngram", num_speculative_tokens=args.k),
            "draft": SpecConfig(
                method="draft", num_speculative_tokens=args.k, draft_layers=args.draft_layers
            ),
            "medusa": SpecConfig(method="medusa"),
        }[method]
        return Engine(
            EngineConfig(
                model=ModelConfig(device="cpu", dtype=args.dtype),
                cache=CacheConfig(kv_cache_bytes=256 << 20),
                speculative=spec,
            )
        )

    first = engine_for(args.methods[0])
    tok = first.tokenizer
    workloads = {
        "extraction": [
            (ids, ConstraintSpec.json_schema(s)) for ids, s in extraction_requests(True, args.docs, tok)
        ],
        "free text": [
            (
                tok.encode(
                    tok.apply_chat_template(
                        [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                    ),
                    add_special_tokens=False,
                ),
                None,
            )
            for p in FREE_TEXT[1::2][: args.free]
        ],
    }
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), default model {args.dtype}, greedy, max_tokens {args.max_tokens}, "
        f"k {args.k}, self-draft layers {args.draft_layers}"
    )
    print(
        "| workload | batch | method | tokens | tokens/s | speed-up | mean accepted length | acceptance rate "
        "| outputs != plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base: dict = {}
    for method in args.methods:
        engine = first if method == args.methods[0] else engine_for(method)
        for name, reqs in workloads.items():
            for batch in args.batches:
                s = engine.stats
                before = (s.num_spec_steps, s.num_draft_tokens, s.num_accepted_tokens)
                outs, wall = run(engine, reqs, batch, args.max_tokens)
                steps, drafted, accepted = (
                    a - b
                    for a, b in zip((s.num_spec_steps, s.num_draft_tokens, s.num_accepted_tokens), before)
                )
                ntok = sum(len(o.token_ids) for o in outs)
                key = (name, batch)
                if method == "none":
                    base[key] = ([o.token_ids for o in outs], ntok / wall)
                ref = base.get(key)
                diff = sum(a != b.token_ids for a, b in zip(ref[0], outs)) if ref else "-"
                speed = f"{ntok / wall / ref[1]:.2f}x" if ref else "-"
                mal = f"{(accepted + steps) / steps:.2f}" if steps else "-"
                rate = f"{accepted / drafted:.1%}" if drafted else "-"
                print(
                    f"| {name} | {batch} | {method} | {ntok} | {ntok / wall:.1f} | {speed} | {mal} | {rate} "
                    f"| {diff} |",
                    flush=True,
                )
        engine.grammar.shutdown()


if __name__ == "__main__":
    main()
