"""Host cost of turning output tokens into text, per token: a full decode of the whole output at
every step vs the incremental detokenizer (runtime/detokenizer.py), on the default model's
tokenizer and this repository's README as the text.

    .venv/bin/python bench/detokenize.py [--tokens 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agentrt.runtime.config import default_cache_dir
from agentrt.runtime.detokenizer import IncrementalDetokenizer
from agentrt.runtime.models.loader import resolve_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct", default_cache_dir())))
    ids = tok.encode((ROOT / "README.md").read_text() * 4)[: args.tokens]
    n = len(ids)
    t = time.perf_counter()
    for i in range(1, n + 1):
        tok.decode(ids[:i], skip_special_tokens=True)
    full = time.perf_counter() - t
    tail = time.perf_counter()
    for _ in range(20):
        tok.decode(ids, skip_special_tokens=True)
    tail = (time.perf_counter() - tail) / 20
    det = IncrementalDetokenizer(True)
    t = time.perf_counter()
    for i in range(1, n + 1):
        det.update(tok, ids[:i])
    inc = time.perf_counter() - t
    print(
        f"| tokens | full decode ms/token (mean) | full decode ms at token {n} | incremental ms/token (mean) |"
    )
    print("| --- | --- | --- | --- |")
    print(f"| {n} | {full / n * 1e3:.3f} | {tail * 1e3:.3f} | {inc / n * 1e3:.4f} |")


if __name__ == "__main__":
    main()
