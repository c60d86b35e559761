"""Runaway-value repair (SamplingParams.repetition_repair, agentrt/runtime/repetition.py): the
extraction workload with repair off and on, side by side, and the detector's thresholds measured.

Part "extract": the first --docs documents of ../shared/testdata/extraction (or --ids), in-process
(`LLM.extract_batch`), greedy, --max-tokens; with repair off, then on. Prints rows valid, rows cut
by max_tokens, field accuracy (fields equal to gold, as bench/extraction.py), repaired rows and
wall time per mode, and the rows whose outcome changed.

Part "thresholds": the detector alone (no matcher) over token sequences, for a grid of
(min_repeats, min_tokens): where it would act on the outputs that ran to max_tokens with repair off
(caught = it fires in a string value or array that was looping), and how many legitimate JSON texts
it would alter (false positives): the valid outputs of the repair-off run, the gold values of every
extraction document, and every valid instance of ../shared/testdata/jsonschemabench/with_tests,
serialized as the grammar writes them (compact, ", " and ": ").

    .venv/bin/python bench/runaway.py --docs 12 --max-tokens 256
    .venv/bin/python bench/runaway.py --part thresholds --outputs off.jsonl   # reuse saved outputs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata"
GRID_MAX_N = (32, 64, 96, 128)
GRID_REPEATS = (2, 3, 4)
GRID_TOKENS = (16, 24, 32)
GRID_LONG_N = (32, 48, 64)  # units this long count at 2 copies (at max_n 96, 3 copies, 24 tokens)


def field_hits(output, gold: dict) -> tuple[int, int]:
    if not isinstance(output, dict):
        return 0, len(gold)
    return sum(output.get(k) == v for k, v in gold.items()), len(gold)


def run_mode(llm, docs, schemas, max_tokens: int, repair: bool) -> tuple[list, float]:
    from agentrt.extract.types import ExtractInput
    from agentrt.runtime.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, repetition_repair=repair)
    inputs = [
        ExtractInput(d["text"], d["id"], schema=schemas[d["schema_name"]], gold=d["gold"]) for d in docs
    ]
    t0 = time.perf_counter()
    results = sorted(llm.extract_batch(inputs, None, sampling_params=params), key=lambda r: r.index)
    return results, time.perf_counter() - t0


def summarize(results) -> dict:
    ok = total = 0
    for r in results:
        a, b = field_hits(r.output if r.valid else None, r.gold)
        ok, total = ok + a, total + b
    return {
        "valid": sum(r.valid for r in results),
        "length": sum(r.finish_reason == "length" for r in results),
        "field_acc": ok / max(1, total),
        "repaired_rows": sum(bool(r.repaired) for r in results),
    }


def first_fire(ids: list[int], token_bytes, config) -> tuple[int, str] | None:
    """(token index, JSON pointer) where the detector would first close a value, or None."""
    from agentrt.runtime.repetition import RepetitionGuard

    guard = RepetitionGuard(config, token_bytes, None)
    for i, tok in enumerate(ids):
        depth = guard.push(tok)
        if depth is not None:
            return i, guard.tracker.pointer(depth)
    return None


def has_repeated_elements(x) -> bool:
    """Some array in x has 3 equal elements in a row (a loop the model stopped only at maxItems)."""
    if isinstance(x, dict):
        return any(has_repeated_elements(v) for v in x.values())
    if isinstance(x, list):
        if any(a == b == c for a, b, c in zip(x, x[1:], x[2:])):
            return True
        return any(has_repeated_elements(v) for v in x)
    return False


def legit_texts(docs, off_valid: list[str]) -> dict[str, list[str]]:
    def dump(x) -> str:
        return json.dumps(x, ensure_ascii=False)

    bench = []
    for p in sorted((DATA / "jsonschemabench" / "with_tests").glob("*.json")):
        for t in json.loads(p.read_text()).get("tests", []):
            if t.get("valid") and isinstance(t.get("data"), (dict, list, str)):
                bench.append(dump(t["data"]))
    looping = [t for t in off_valid if has_repeated_elements(json.loads(t))]
    return {
        "valid outputs (repair off) without repeated elements": [t for t in off_valid if t not in looping],
        "valid outputs (repair off) with 3+ equal elements in a row": looping,
        "gold values (extraction)": [dump(d["gold"]) for d in docs],
        "jsonschemabench instances": bench,
    }


def thresholds(tokenizer, token_bytes, runaways: list[str], legit: dict[str, list[str]]) -> None:
    from agentrt.runtime.repetition import RepetitionConfig

    enc = {
        name: [tokenizer.encode(t, add_special_tokens=False) for t in texts] for name, texts in legit.items()
    }
    run_ids = [tokenizer.encode(t, add_special_tokens=False) for t in runaways]
    print(
        f"\n## Detector thresholds: {len(runaways)} runaway outputs; legitimate texts: "
        + ", ".join(f"{len(v)} {k}" for k, v in enc.items())
    )
    print(
        "| max_n | min_repeats | min_tokens | long_n | runaways caught | tokens to detection (median) | "
        + " | ".join(f"false positives: {k}" for k in enc)
        + " |"
    )
    print("|---|---|---|---|---|---|" + "---|" * len(enc))
    grid = [(n, k, m, None) for n in GRID_MAX_N for k in GRID_REPEATS for m in GRID_TOKENS]
    grid += [(96, 3, 24, long_n) for long_n in GRID_LONG_N]
    for n, k, m, long_n in grid:
        cfg = RepetitionConfig(max_n=n, min_repeats=k, min_tokens=m, long_n=long_n)
        caught = [f for f in (first_fire(ids, token_bytes, cfg) for ids in run_ids) if f is not None]
        at = sorted(f[0] for f in caught)
        fps = [
            sum(first_fire(ids, token_bytes, cfg) is not None for ids in ids_list)
            for ids_list in enc.values()
        ]
        med = at[len(at) // 2] if at else "-"
        print(
            f"| {n} | {k} | {m} | {long_n or '-'} | {len(caught)}/{len(run_ids)} | {med} | "
            + " | ".join(map(str, fps))
            + " |"
        )
    cfg = RepetitionConfig()
    print(f"\nDefault {cfg}: where it acts on each runaway")
    for text, ids in zip(runaways, run_ids):
        print(f"  {first_fire(ids, token_bytes, cfg)}  {text[:90]!r}...")
    for name, ids_list in enc.items():
        for text, ids in zip(legit[name], ids_list):
            f = first_fire(ids, token_bytes, cfg)
            if f is not None:
                print(f"  false positive in {name} at {f}: {text[:200]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "extract", "thresholds"], default="all")
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--ids", nargs="*", help="these document ids instead of the first --docs")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--outputs", help="thresholds: JSONL of repair-off outputs ({text, finish, valid})")
    ap.add_argument("--save", help="write the repair-off outputs here (JSONL) for --outputs")
    args = ap.parse_args()
    from agentrt.runtime.repetition import vocab_bytes
    from agentrt.sdk import LLM

    all_docs = [json.loads(line) for line in (DATA / "extraction" / "docs.jsonl").read_text().splitlines()]
    docs = [d for d in all_docs if d["id"] in set(args.ids)] if args.ids else all_docs[: args.docs]
    schemas = {p.stem: json.loads(p.read_text()) for p in (DATA / "extraction" / "schemas").glob("*.json")}
    llm = LLM(max_num_seqs=args.max_num_seqs)
    info = llm.engine.grammar.info
    token_bytes = vocab_bytes(info.decoded_vocab, info.special_token_ids)
    what = f"outputs of {args.outputs}" if args.part == "thresholds" and args.outputs else f"{len(docs)} docs"
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {os.cpu_count()} CPUs, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS')}, {what}, max_tokens {args.max_tokens}, greedy"
    )
    off_rows: list[dict] = []
    if args.part in ("all", "extract"):
        off, t_off = run_mode(llm, docs, schemas, args.max_tokens, False)
        on, t_on = run_mode(llm, docs, schemas, args.max_tokens, True)
        print("| repair | rows valid | cut by max_tokens | field acc | rows repaired | wall s |")
        print("|---|---|---|---|---|---|")
        for name, res, t in (("off", off, t_off), ("on", on, t_on)):
            s = summarize(res)
            print(
                f"| {name} | {s['valid']}/{len(res)} | {s['length']} | {s['field_acc']:.3f} | "
                f"{s['repaired_rows']} | {t:.0f} |"
            )
        for a, b in zip(off, on):
            if a.text != b.text:
                print(
                    f"- {a.id}: off {a.finish_reason}/{'valid' if a.valid else 'invalid'}, on "
                    f"{b.finish_reason}/{'valid' if b.valid else 'invalid'} repaired {b.repaired}: "
                    f"{b.text[-160:]!r}"
                )
        off_rows = [{"id": r.id, "text": r.text, "finish": r.finish_reason, "valid": r.valid} for r in off]
        if args.save:
            Path(args.save).write_text("".join(json.dumps(r) + "\n" for r in off_rows))
    if args.part in ("all", "thresholds"):
        if args.outputs:
            off_rows = [json.loads(line) for line in Path(args.outputs).read_text().splitlines()]
        runaways = [r["text"] for r in off_rows if r["finish"] == "length"]
        valid = [r["text"] for r in off_rows if r["valid"]]
        thresholds(llm.tokenizer, token_bytes, runaways, legit_texts(all_docs, valid))


if __name__ == "__main__":
    main()
