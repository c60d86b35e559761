"""Two schemas whose compiles take minutes, then a new trivial schema every 10 s, against a running
server: how long the trivial ones wait (issue 17; before compiles ran in killable child processes,
they got 503 for minutes while the two slow compiles ran on past their limit).

    agentrt serve --port 8611 &
    python bench/slow_compiles.py http://127.0.0.1:8611
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx

MODEL = "smollm2-135m-instruct"


def body(schema: dict) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--probes", type=int, default=8)
    args = ap.parse_args()
    slow = {
        "anyOf-2000": {
            "anyOf": [
                {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                for i in range(2000)
            ]
        },
        "required-5000": {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
            "required": [f"p{i}" for i in range(5000)],
        },
    }
    results: dict[str, tuple] = {}

    def send(name: str, schema: dict) -> None:
        t = time.monotonic()
        r = httpx.post(f"{args.url}/v1/chat/completions", json=body(schema), timeout=600)
        results[name] = (r.status_code, round(time.monotonic() - t, 1), r.text[:160])

    threads = [threading.Thread(target=send, args=item) for item in slow.items()]
    for t in threads:
        t.start()
    time.sleep(2)
    for i in range(args.probes):
        t = time.monotonic()
        schema = {"type": "object", "properties": {f"q{i}_{time.time_ns()}": {"type": "integer"}}}
        r = httpx.post(f"{args.url}/v1/chat/completions", json=body(schema), timeout=600)
        took = time.monotonic() - t
        print(f"t+{2 + 10 * i:>3} s trivial schema: {r.status_code} in {took:.1f} s", flush=True)
        time.sleep(max(0.0, 10 - took))
    for t in threads:
        t.join()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
