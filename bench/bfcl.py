"""BFCL tool-calling benchmark through the HTTP API (simple_python and parallel).

Each question goes to /v1/chat/completions with its functions as `tools`, once per configuration:
tool_choice `auto` and `required`, each with the runtime's tool-call constraint on and off
(`"tool_call_constraint": false`: the same prompt, the output only parsed). Reported per category
and configuration:

- call rate: responses with at least one tool call;
- valid-call rate: responses whose calls all name an offered function and whose arguments parse
  as JSON and validate against the function's schema, over all responses (target 100% with
  constraints under `required`);
- AST accuracy: BFCL's AST match (function names, every argument value among the possible answers,
  optional arguments may be omitted; parallel: the calls match the answers one to one, any order);
- requests/s at the given concurrency.

`parallel_tool_calls` is false for simple_python (one call expected) and true for parallel.

BFCL's type names (dict, float, tuple, any) are mapped to JSON Schema here, not in the server.

    python bench/bfcl.py                       # starts `agentrt serve`, 100 simple + 50 parallel
    python bench/bfcl.py --simple 400 --parallel 200 --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema

from agentrt.testing import agentrt_server

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "testdata" / "bfcl"
_TYPES = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "list": "array",
    "int": "integer",
    "str": "string",
    "bool": "boolean",
}


def to_json_schema(p):
    """BFCL parameter schema -> JSON Schema (dict -> object, float -> number, tuple -> array,
    any -> no type); keys JSON Schema does not know are dropped only where they would be invalid."""
    if isinstance(p, list):
        return [to_json_schema(x) for x in p]
    if not isinstance(p, dict):
        return p
    out = {}
    for k, v in p.items():
        if k == "type":
            if v == "any":
                continue
            out[k] = _TYPES.get(v, v)
        elif k == "properties":
            out[k] = {name: to_json_schema(s) for name, s in v.items()}
        elif k in ("items", "additionalProperties"):
            out[k] = to_json_schema(v)
        elif k == "required":
            out[k] = [r for r in v if r in p.get("properties", {})]
        elif k == "optional":
            continue
        else:
            out[k] = v
    return out


def load(category: str, limit: int) -> list[dict]:
    qs = [json.loads(line) for line in (DATA / f"BFCL_v4_{category}.json").read_text().splitlines()][:limit]
    answers = {
        a["id"]: a["ground_truth"]
        for a in map(
            json.loads, (DATA / "possible_answer" / f"BFCL_v4_{category}.json").read_text().splitlines()
        )
    }
    for q in qs:
        q["answer"] = answers[q["id"]]
        q["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": f["name"],
                    "description": f.get("description", ""),
                    "parameters": to_json_schema(f["parameters"]),
                },
            }
            for f in q["function"]
        ]
    return qs


def _norm(v):
    """BFCL's string standardization: lowercase, no spaces or common punctuation."""
    if isinstance(v, str):
        return re.sub(r"[ ,./\-_*^]", "", v).lower()
    if isinstance(v, list):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    return v


def _value_ok(value, allowed: list, schema: dict) -> bool:
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    for a in allowed:
        if a == "":
            continue
        if schema.get("type") == "number" and isinstance(a, int) and not isinstance(a, bool):
            a = float(a)
        if _norm(value) == _norm(a) and type(value) is type(a):
            return True
        if (
            isinstance(value, (list, tuple))
            and isinstance(a, (list, tuple))
            and _norm(list(value)) == _norm(list(a))
        ):
            return True
    return False


def ast_match_one(name: str, args: dict, answer: dict, tools: dict) -> bool:
    """One call against one possible answer {function name: {param: [allowed values]}}."""
    ((want_name, params),) = answer.items()
    if name != want_name or not isinstance(args, dict):
        return False
    props = tools[name]["parameters"].get("properties", {})
    for k, v in args.items():
        if k not in params or not _value_ok(v, params[k], props.get(k, {})):
            return False
    return all(k in args for k, allowed in params.items() if "" not in allowed)


def ast_match(calls: list[tuple[str, dict]], answers: list[dict], tools: dict) -> bool:
    if len(calls) != len(answers):
        return False
    left = list(answers)
    for name, args in calls:  # greedy one-to-one matching (answers are distinct in BFCL)
        for i, a in enumerate(left):
            if ast_match_one(name, args, a, tools):
                del left[i]
                break
        else:
            return False
    return True


def run_one(
    client: httpx.Client,
    url: str,
    model: str,
    q: dict,
    choice: str,
    constrained: bool,
    max_tokens: int,
    close: bool = False,
) -> dict:
    body = {
        "model": model,
        "messages": q["question"][0],
        "tools": q["tools"],
        "tool_choice": choice,
        "temperature": 0,
        "max_tokens": max_tokens,
        "tool_call_constraint": constrained,
        # simple questions want exactly one call, parallel ones several
        "parallel_tool_calls": len(q["answer"]) > 1 or q["id"].startswith("parallel"),
    }
    if constrained and close:  # the length-safe policy: a call cut by max_tokens is closed validly
        body["max_tokens_policy"] = "close"
    resp = client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    if resp.status_code != 200:
        return {"error": resp.text[:200], "calls": [], "valid": False, "ast": False}
    msg = resp.json()["choices"][0]["message"]
    tools = {t["function"]["name"]: t["function"] for t in q["tools"]}
    calls, valid = [], True
    for c in msg.get("tool_calls") or []:
        name = c["function"]["name"]
        try:
            args = json.loads(c["function"]["arguments"])
            if name not in tools:
                raise ValueError(name)
            jsonschema.validate(args, tools[name]["parameters"])
        except (ValueError, jsonschema.ValidationError):
            valid = False
            args = None
        calls.append((name, args))
    valid = valid and bool(calls)
    return {"calls": calls, "valid": valid, "ast": valid and ast_match(calls, q["answer"], tools)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an already running server; default: start `agentrt serve`")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--simple", type=int, default=100, help="simple_python questions (of 400)")
    ap.add_argument("--parallel", type=int, default=50, help="parallel questions (of 200)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--close",
        action="store_true",
        help='constrained runs use max_tokens_policy "close" (calls cut by max_tokens are closed)',
    )
    ap.add_argument("--choices", nargs="+", default=["auto", "required"], choices=["auto", "required"])
    args = ap.parse_args()
    sets = {"simple_python": load("simple_python", args.simple), "parallel": load("parallel", args.parallel)}
    print(
        f"# {time.strftime('%Y-%m-%d')} {platform.machine()} {os.cpu_count()} CPUs, model {args.model}, "
        f"concurrency {args.concurrency}, max_tokens {args.max_tokens}, greedy, close policy {args.close}"
    )
    print(
        "| category | n | tool_choice | constrained | call rate | valid-call rate | AST accuracy | requests/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(agentrt_server(args.model, timeout_s=300)).url
        with httpx.Client() as client, ThreadPoolExecutor(args.concurrency) as pool:
            for cat, qs in sets.items():
                if not qs:
                    continue
                for choice in args.choices:
                    for constrained in (True, False):  # side by side, same server, same run
                        t0 = time.perf_counter()
                        res = list(
                            pool.map(
                                run_one,
                                *zip(
                                    *[
                                        (
                                            client,
                                            url,
                                            args.model,
                                            q,
                                            choice,
                                            constrained,
                                            args.max_tokens,
                                            args.close,
                                        )
                                        for q in qs
                                    ]
                                ),
                            )
                        )
                        dt = time.perf_counter() - t0
                        n = len(res)
                        errors = [r["error"] for r in res if "error" in r]
                        print(
                            f"| {cat} | {n} | {choice} | {'on' if constrained else 'off'} "
                            f"| {sum(bool(r['calls']) for r in res) / n:.1%} | {sum(r['valid'] for r in res) / n:.1%} "
                            f"| {sum(r['ast'] for r in res) / n:.1%} | {n / dt:.2f} |"
                            + (f" errors: {len(errors)} e.g. {errors[0]}" if errors else ""),
                            flush=True,
                        )


if __name__ == "__main__":
    main()
