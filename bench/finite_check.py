"""Cost of the finite-output check (grammars/finite.py: check_finite, which also computes the
forced-text bound) on large grammars, model-free:

- `object-N`: xgrammar's printed grammar of {"type": "object", "properties": {p0..pN-1: {"type":
  "string"}}, "required": [all]} (the conversion's own time is printed beside it);
- `chain-N`: `root ::= r0`, `ri ::= "x" ri+1`, ..., a chain of N rules whose shortest derivations
  resolve one rule per pass of a naive fixpoint.

    python bench/finite_check.py [--finite PATH/TO/finite.py] [--sizes 1000 4000 20000]

`--finite` loads another copy of the module (e.g. `git show REV:agentrt/grammars/finite.py`) to
compare before and after on the same grammars.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _module(path: str | None):
    if path is None:
        from agentrt.grammars import finite

        return finite
    spec = importlib.util.spec_from_file_location("finite_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--finite", help="path of the finite.py to measure (default: this checkout's)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 4000, 20000])
    ap.add_argument("--chain-sizes", type=int, nargs="*", default=[1000, 4000, 20000])
    args = ap.parse_args()
    import xgrammar as xgr

    from agentrt.grammars.pipeline import schema_ebnf

    finite = _module(args.finite)
    ws = {"any_whitespace": False, "indent": None}
    schema_ebnf({"type": "object"}, None, [], ws)  # (first-use imports are not the conversion's time)
    print("| grammar | EBNF chars | rules | conversion s | check_finite s | bound |")
    print("|---|---|---|---|---|---|")
    for n in args.sizes:
        props = {f"p{i}": {"type": "string"} for i in range(n)}
        schema = {"type": "object", "properties": props, "required": list(props)}
        t0 = time.perf_counter()
        printed = str(xgr.Grammar.from_ebnf(schema_ebnf(schema, None, [], ws)))
        t1 = time.perf_counter()
        bound = finite.check_finite(printed)
        t2 = time.perf_counter()
        rules = printed.count("\n") + 1
        print(
            f"| object-{n} | {len(printed):,} | {rules:,} | {t1 - t0:.2f} | {t2 - t1:.2f} | {tuple(bound)} |"
        )
    for n in args.chain_sizes:
        ebnf = (
            "root ::= r0\n"
            + "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(n - 1))
            + f'r{n - 1} ::= "z"\n'
        )
        printed = str(xgr.Grammar.from_ebnf(ebnf))
        t1 = time.perf_counter()
        bound = finite.check_finite(printed)
        t2 = time.perf_counter()
        print(
            f"| chain-{n} | {len(printed):,} | {n + 1:,} | - | {t2 - t1:.2f} | {tuple(bound)} |", flush=True
        )


if __name__ == "__main__":
    main()
