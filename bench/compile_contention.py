"""Latency of a plain request while a large constraint compiles, by compile-thread priority.

    python bench/compile_contention.py --nice 0     # compile threads at the engine's priority
    python bench/compile_contention.py --nice 10    # the default (GrammarConfig.compile_nice)

Loads the default model; runs a plain 16-token greedy request alone, then the same request while a
JSON Schema with 300 `pattern` properties compiles (~5 s alone on the 2-core dev box), and prints
the medians. Numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.runtime.config import EngineConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.request import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(EngineConfig(grammar=GrammarConfig(compile_nice=args.nice, compile_timeout_s=300)))
    prompt = engine.tokenizer.encode("Write one short sentence about the sea.")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def plain() -> float:
        t = time.perf_counter()
        engine.generate([(prompt, params, None)])
        return time.perf_counter() - t

    plain()  # warm-up
    alone = [plain() for _ in range(args.runs)]
    busy, compile_s = [], []
    for k in range(args.runs):
        schema = {
            "type": "object",
            "properties": {
                f"p{i}_{k}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},40}}$"} for i in range(300)
            },
        }
        t = time.perf_counter()
        fut = engine.grammar.submit(ConstraintSpec.json_schema(schema))
        time.sleep(0.2)  # the compile is running
        lat = [plain() for _ in range(2)]  # while the compile runs (it may finish first)
        fut.result()
        compile_s.append(time.perf_counter() - t)
        busy.append(statistics.median(lat) if lat else float("nan"))
    print(
        f"nice {args.nice}: plain request alone {statistics.median(alone):.2f} s, while compiling "
        f"{statistics.median(busy):.2f} s (median of {args.runs}); compile wall {statistics.median(compile_s):.1f} s"
    )
    engine.grammar.shutdown()


if __name__ == "__main__":
    main()
