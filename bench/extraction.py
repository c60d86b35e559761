"""Extraction workload benchmark against an agentrt (or any OpenAI-compatible) server.

Runs ../shared/testdata/extraction (docs.jsonl + schemas) with json_schema response_format over
streaming chat completions at each concurrency, and prints docs/s, valid rate (finish=stop and
jsonschema-valid with format checking), field accuracy against gold, completion tokens/s and
TTFT p50/p95.

    python bench/extraction.py                      # starts `agentrt serve` on a free port
    python bench/extraction.py --url http://127.0.0.1:8000 --model NAME
    python bench/extraction.py --llama-server /path/to/llama-server   # also llama.cpp, same GGUF
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
from openai import OpenAI

from agentrt.extract.prompt import extraction_messages
from agentrt.testing import free_port, launch_server

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata" / "extraction"


def run_doc(client: OpenAI, model: str, doc: dict, schema: dict, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, text, finish, usage = None, "", None, None
    stream = client.chat.completions.create(
        model=model,
        messages=extraction_messages(doc["text"], schema),
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        response_format={
            "type": "json_schema",
            "json_schema": {"name": doc["schema_name"], "schema": schema},
        },
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            delta = chunk.choices[0].delta.content or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - t0
            text += delta
            finish = chunk.choices[0].finish_reason or finish
    valid, fields_ok = False, 0
    if finish == "stop":
        try:
            obj = json.loads(text)
            jsonschema.validate(obj, schema, format_checker=jsonschema.FormatChecker())
            valid = True
            fields_ok = sum(obj.get(k) == v for k, v in doc["gold"].items())
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    return {
        "ttft": ttft or 0.0,
        "latency": time.perf_counter() - t0,
        "valid": valid,
        "finish": finish,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "fields_ok": fields_ok,
        "fields": len(doc["gold"]),
    }


def bench(client, model, docs, schemas, concurrency: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(
            pool.map(lambda d: run_doc(client, model, d, schemas[d["schema_name"]], max_tokens), docs)
        )
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft"] for r in results)
    return {
        "concurrency": concurrency,
        "docs": len(docs),
        "wall_s": wall,
        "docs_per_s": len(docs) / wall,
        "valid": sum(r["valid"] for r in results),
        "hit_length": sum(r["finish"] == "length" for r in results),
        "field_acc": sum(r["fields_ok"] for r in results) / max(1, sum(r["fields"] for r in results)),
        "completion_tok_per_s": sum(r["completion_tokens"] for r in results) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an already running server; default: start `agentrt serve`")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--docs", type=int, default=60)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--server-arg", action="append", default=[], help="extra `agentrt serve` argument")
    ap.add_argument(
        "--llama-server", help="also benchmark this llama.cpp llama-server binary on the same GGUF"
    )
    ap.add_argument("--gguf", help="GGUF for llama-server (default: the registered model's file)")
    ap.add_argument(
        "--llama-server-arg", action="append", default=[], help="extra llama-server argument (e.g. --jinja)"
    )
    args = ap.parse_args()
    docs = [json.loads(line) for line in (DATA / "docs.jsonl").read_text().splitlines()][: args.docs]
    schemas = {p.stem: json.loads(p.read_text()) for p in (DATA / "schemas").glob("*.json")}
    servers: list[tuple[str, list[str] | None, str | None]] = []  # (label, command, url)
    if args.url:
        servers.append(("server", None, args.url))
    else:
        servers.append(
            ("agentrt", [sys.executable, "-m", "agentrt.cli", "serve", args.model, *args.server_arg], None)
        )
    if args.llama_server:
        from agentrt.runtime.models.loader import find_registered_gguf

        gguf = args.gguf or str(find_registered_gguf(args.model))
        slots = max(args.concurrency)
        servers.append(
            (
                "llama-server",
                [
                    args.llama_server,
                    "-m",
                    gguf,
                    "-t",
                    str(os.cpu_count()),
                    "-np",
                    str(slots),
                    "-c",
                    str(4096 * slots),
                    "--host",
                    "127.0.0.1",
                    *args.llama_server_arg,
                ],
                None,
            )
        )
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {os.cpu_count()} CPUs, model {args.model}, "
        f"{len(docs)} docs, max_tokens {args.max_tokens}"
    )
    print(
        "| server | concurrency | docs/s | valid | valid docs/s | hit max_tokens | field acc | completion tok/s "
        "| TTFT p50 s | TTFT p95 s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, cmd, url in servers:
        with contextlib.ExitStack() as stack:
            if url is None:
                port = free_port()
                url = stack.enter_context(launch_server([*cmd, "--port", str(port)], port, timeout_s=300)).url
            client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600)
            run_doc(
                client, args.model, docs[0], schemas[docs[0]["schema_name"]], 16
            )  # warm-up (grammar cache)
            for c in args.concurrency:
                r = bench(client, args.model, docs, schemas, c, args.max_tokens)
                print(
                    f"| {label} | {c} | {r['docs_per_s']:.2f} | {r['valid']}/{r['docs']} | "
                    f"{r['valid'] / r['wall_s']:.2f} | {r['hit_length']} | {r['field_acc']:.2f} | "
                    f"{r['completion_tok_per_s']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
