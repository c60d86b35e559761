"""The server's command-line flags, shared by `agentrt serve` (cli.py) and the Ray Serve deployment
(scaleout/deploy.py): `add_serve_args` registers every `agentrt serve` flag on a parser (the engine's
through engine_args.py, then listening, tool calls, perimeter, admission, replicas, databases),
`server_options` turns the parsed perimeter flags into the app's ServerOptions, and
`exposure_warning` is the start-up warning for a server open beyond loopback without a key."""

from __future__ import annotations

import argparse
import ipaddress
import os

from agentrt.engine_args import add_engine_args

API_KEY_ENV = "AGENTRT_API_KEY"


def add_server_args(p: argparse.ArgumentParser) -> None:
    """`agentrt serve`'s perimeter flags: API keys, body limit, CORS, request logging."""
    from agentrt.api.middleware import DEFAULT_MAX_BODY_BYTES

    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every route but /health (and /metrics unless "
        f"--metrics-require-key); repeat for several keys; also read from ${API_KEY_ENV}",
    )
    p.add_argument(
        "--metrics-require-key", action="store_true", help="/metrics needs an API key too (default: open)"
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body in bytes, counted as received (chunked bodies too); larger gets "
        "413 (default %(default)s = 16 MiB)",
    )
    p.add_argument(
        "--allowed-origins",
        default="",
        metavar="ORIGIN,...",
        help="comma-separated origins allowed by CORS, e.g. https://app.example.com, or * for any "
        "(default: none, no CORS headers)",
    )
    p.add_argument(
        "--log-requests",
        action="store_true",
        help="log each API request body (prompts included, truncated); default: never logged",
    )


def server_options(args: argparse.Namespace, environ=os.environ):
    """The ServerOptions of parsed serve flags; API keys from --api-key and ${API_KEY_ENV}.
    Raises ValueError for an empty key or a body limit below 1 byte."""
    from agentrt.api.middleware import ServerOptions

    keys = list(args.api_key or [])
    if environ.get(API_KEY_ENV):
        keys.append(environ[API_KEY_ENV])
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    return ServerOptions(
        api_keys=tuple(dict.fromkeys(keys)),
        metrics_require_key=args.metrics_require_key,
        max_body_bytes=args.max_body_bytes,
        allowed_origins=origins,
        log_requests=args.log_requests,
    )


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def exposure_warning(host: str, port: int, api_keys: tuple[str, ...]) -> str | None:
    """The start-up warning for a server that listens beyond loopback without an API key (None
    when it has a key or listens on loopback only)."""
    if api_keys or is_loopback(host):
        return None
    return (
        f"agentrt: warning: listening on {host} without an API key: anyone who can reach port {port} "
        f"can use the model; set --api-key or {API_KEY_ENV}"
    )


def add_admission_args(p: argparse.ArgumentParser) -> None:
    """`agentrt serve`'s admission and time limits (runtime/async_engine.py AdmissionConfig)."""
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        metavar="N",
        help="most requests waiting to run at once (compiling their constraint or queued, not yet "
        "running); one more gets 429 with Retry-After (default: no limit)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop a request still unfinished this many seconds after it was admitted (compile and "
        "queueing included): 504 or a stream's error event; its KV is freed (default: no limit)",
    )


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """`agentrt serve`'s scale-out flags: replicas on Ray Serve (agentrt/scaleout/)."""
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="engine replicas on Ray Serve behind one ingress with prefix-aware routing (pip install "
        '"agentrt[ray]"); 1 without --ray-address: the plain single-process server (default)',
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster (e.g. HEAD:6379) for the replicas (default: RAY_ADDRESS, else a new "
        "local cluster)",
    )
    p.add_argument(
        "--routing",
        choices=["prefix", "round_robin", "least_loaded"],
        default=None,
        help="how the ingress picks a replica: prefix (default: the replica already sent the longest "
        "prefix, unless it is loaded), round_robin, least_loaded",
    )
    p.add_argument(
        "--cpus-per-replica",
        type=int,
        default=None,
        metavar="N",
        help="CPUs each CPU replica reserves and its torch threads (default: the cluster's CPUs / replicas)",
    )


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every `agentrt serve` flag, in `--help` order: the engine's (engine_args.py), --host, --port,
    --log-level, tool calls, the perimeter, admission, replicas and --database."""
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default %(default)s)")
    p.add_argument("--log-level", default="info", help="uvicorn log level (default %(default)s)")
    p.add_argument(
        "--tool-call-format",
        default="auto",
        choices=[
            "auto",
            "hermes",
            "llama3_json",
            "mistral",
            "mistral_v11",
            "phi4_mini",
            "granite",
            "nemotron_json",
            "qwen3_coder",
            "glm45",
            "deepseek_v3_1",
            "deepseek_v3_2",
            "minimax_m2",
            "kimi_k2",
            "pythonic",
            "gemma4",
            "harmony",
        ],
        help="how the model writes tool calls (default: read from its chat template; templates "
        "without tool support get the generic hermes-style format)",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="leave tool definitions out of the prompt when tool_choice is 'none'",
    )
    p.add_argument(
        "--reasoning-format",
        default="auto",
        choices=[
            "auto",
            "none",
            "think",
            "magistral",
            "harmony",
            "gemma4",
            "deepseek_r1",
            "qwen3",
            "glm45",
            "minimax",
        ],
        help="how the model writes its reasoning (default: read from its chat template: <think> "
        "blocks for Qwen3, Qwen3.5, QwQ, DeepSeek-R1/V3.1+, Kimi K2, GLM, MiniMax, SmolLM3, Nemotron; "
        "[THINK] for Magistral; the analysis channel for gpt-oss's Harmony; Gemma 4's thought "
        "channel); "
        "the reasoning goes to reasoning_content and constraints apply to the answer after it",
    )
    p.add_argument(
        "--reasoning-budget-message",
        default="",
        metavar="TEXT",
        help="text forced before the reasoning's end marker when a request's thinking budget is "
        "spent (default: none; e.g. ' Considering the limited time, I have to answer now.')",
    )
    add_server_args(p)
    add_admission_args(p)
    add_replica_args(p)
    p.add_argument(
        "--database",
        action="append",
        default=None,
        metavar="NAME=URL",
        help='a database `sql` constraints may name ({"sql": {"database": NAME}}): sqlite:///PATH, '
        "duckdb:///PATH or postgresql://...; opened read-only and introspected at start; repeatable",
    )
