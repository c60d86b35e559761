"""Start time to the first error for a model agentrt does not run (issue 35's figure, issue 51 item 8).

The Gemma 3 270M GGUF (`gemma3-270m`, installed by `make install`) with Gemma 3 removed from the
registry (the child process deletes its entries from registry.ARCHITECTURES before running the CLI),
so that the file is a model of an unsupported architecture. Each run is a fresh process with a fresh,
empty AGENTRT_CACHE (no earlier conversion to reuse) and reports:

- `serve`: `agentrt serve FILE.gguf` until it exits with its error (wall seconds of the process, and
  the seconds from the end of the imports serve needs - agentrt.cli, the app, the engine, uvicorn,
  transformers' auto classes - until the CLI returns its error); serve runs the whole `agentrt
  check` first (cli.checked_before_load, issue 51 item 7);
- `serve, the metadata check only`: the same without that check (as serve ran before it): the
  loader reads the architecture from the GGUF's metadata before converting
  (`gguf_meta.require_supported_gguf`, issue 35);
- `serve, no check` (`--before`): without either, as serve ran before issue 35: the whole GGUF is
  converted, then the model build refuses the architecture;
- `check`: `agentrt check FILE.gguf` (reads the header and the tokenizer, converts nothing).

    OMP_NUM_THREADS=2 .venv/bin/python bench/first_error.py [--repeats 3] [--before] [--gguf PATH]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import sys, time
from agentrt.runtime.models import gguf_meta, loader, registry
for name in [k for k, v in registry.ARCHITECTURES.items() if v[0] == "gemma3"]:
    del registry.ARCHITECTURES[name]
registry.SUPPORTED_ARCHITECTURES = tuple(registry.ARCHITECTURES)
import uvicorn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
import agentrt.api.app, agentrt.cli, agentrt.runtime.async_engine
if sys.argv[1] in ("metadata", "before") and hasattr(agentrt.cli, "checked_before_load"):
    agentrt.cli.checked_before_load = lambda args: True  # serve without the whole check first
if sys.argv[1] == "before":
    loader.require_supported_gguf = lambda path: gguf_meta.gguf_hf_config(gguf_meta.read_gguf(path))
print(f"IMPORTED {time.time():.6f}", file=sys.stderr, flush=True)
try:
    rc = agentrt.cli.main(sys.argv[2:])
finally:
    print(f"DONE {time.time():.6f}", file=sys.stderr, flush=True)
sys.exit(rc)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(mode: str, argv: list[str], timeout_s: float) -> dict:
    """One child process: wall seconds in all and after the imports, exit status, its last error line."""
    with tempfile.TemporaryDirectory(prefix="agentrt-first-error-") as cache:
        env = {**os.environ, "AGENTRT_CACHE": cache, "PYTHONPATH": str(ROOT)}
        start = time.time()
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode, *argv],
            check=False,
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        end = time.time()
    imported = re.search(r"IMPORTED (\d+\.\d+)", out.stderr)
    done = re.search(r"DONE (\d+\.\d+)", out.stderr)
    text = out.stderr + out.stdout
    lines = [ln.strip() for ln in text.splitlines() if "[error]" in ln or ln.startswith("agentrt: error")]
    return {
        "wall_s": end - start,
        "after_imports_s": float(done.group(1)) - float(imported.group(1))
        if imported and done
        else float("nan"),
        "imports_s": float(imported.group(1)) - start if imported else float("nan"),
        "rc": out.returncode,
        "error": (lines[0] if lines else text.strip().splitlines()[-1])[:90],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: the registered gemma3-270m)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--before",
        action="store_true",
        help="also serve with no check at all (the whole GGUF converted first)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = p.parse_args()
    if args.gguf is None:
        sys.path.insert(0, str(ROOT))
        from agentrt.runtime.models.loader import find_registered_gguf

        args.gguf = find_registered_gguf("gemma3-270m")
    gguf = str(args.gguf)
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; {gguf} ({args.gguf.stat().st_size / 1e6:.0f} MB)"
    )

    def serve() -> list[str]:
        return ["serve", gguf, "--device", "cpu", "--port", str(free_port())]

    cases = [("serve", "after", serve), ("serve, the metadata check only", "metadata", serve)]
    if args.before:
        cases.append(("serve, no check", "before", serve))
    cases.append(("check", "after", lambda: ["check", gguf, "--device", "cpu"]))
    print("| command | runs | wall s (min-max) | after imports s (min-max) | imports s | exit | error |")
    print("|---|---|---|---|---|---|---|")
    for label, mode, argv in cases:
        runs = [run_once(mode, argv(), args.timeout) for _ in range(args.repeats)]
        walls = [r["wall_s"] for r in runs]
        after = [r["after_imports_s"] for r in runs]
        imports = statistics.median(r["imports_s"] for r in runs)
        rcs = sorted({r["rc"] for r in runs})
        print(
            f"| {label} | {len(runs)} | {min(walls):.1f}-{max(walls):.1f} | {min(after):.2f}-{max(after):.2f} "
            f"| {imports:.1f} | {','.join(map(str, rcs))} | {runs[-1]['error']} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
