"""The `agentrt` command: `agentrt serve [MODEL] --host --port ...` (flags: engine_args.py, server_args.py), `agentrt sql`, `agentrt extract`
(agentrt/commands/sql.py, extract.py), `agentrt train-medusa`, `agentrt check` (agentrt/commands/check.py)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from agentrt.commands.check import add_check_parser, check_command, checked_before_load
from agentrt.engine_args import add_engine_args, engine_config
from agentrt.server_args import add_serve_args, exposure_warning, server_options


def serve(args: argparse.Namespace) -> int:
    if args.replicas != 1 or args.ray_address is not None:
        from agentrt.scaleout.deploy import serve_replicas

        return serve_replicas(args)
    if args.routing is not None or args.cpus_per_replica is not None:
        print(
            "agentrt: error: --routing and --cpus-per-replica need --replicas N > 1 or --ray-address",
            file=sys.stderr,
        )
        return 2
    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AdmissionConfig, AsyncEngine

    try:
        options = server_options(args)
    except ValueError as e:
        print(f"agentrt: error: {e}", file=sys.stderr)
        return 2
    warning = exposure_warning(args.host, args.port, options.api_keys)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if not checked_before_load(args):
        return 2
    databases = load_databases(args)
    if databases is None:
        return 2
    try:
        admission = AdmissionConfig(
            max_queued_requests=args.max_queued_requests, request_timeout_s=args.request_timeout
        )
        engine = AsyncEngine(engine_config(args), start_thread=False, admission=admission)
    except ValueError as e:
        print(f"agentrt: error: {e}", file=sys.stderr)
        return 2
    print(start_line(args, engine.runner), flush=True)
    message = ready_message(args, bool(options.api_keys))

    def ready() -> None:
        print(message, flush=True)

    app = create_app(
        engine,
        args.model,
        on_ready=ready,
        tool_call_format=args.tool_call_format,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        options=options,
        databases=databases,
        reasoning_format=args.reasoning_format,
        reasoning_budget_message=args.reasoning_budget_message,
    )
    if not template_ready(engine.tokenizer, engine.model_config.chat_template_budget, app):
        engine.shutdown()
        return 2
    return run_server(args, engine, app)


def load_databases(args: argparse.Namespace):
    """serve's --database catalogs, loaded and announced (a warning for one past the table limit);
    None after printing the error when one cannot be read (a ValueError or SchemaError)."""
    from agentrt.sql.errors import SchemaError
    from agentrt.sql.service import SQLDatabases, parse_database_args, table_limit_warning

    try:
        databases = SQLDatabases(parse_database_args(args.database))
        databases.load()
    except (ValueError, SchemaError) as e:
        print(f"agentrt: error: {e}", file=sys.stderr)
        return None
    for name in databases.names:
        db = databases.get(name)
        print(
            f"agentrt: database {name}: {db.dialect}, {len(db.schema.tables)} tables, "
            f"{db.schema.num_columns} columns",
            flush=True,
        )
        if table_limit_warning(db):
            print(table_limit_warning(db), file=sys.stderr, flush=True)
    return databases


def run_server(args: argparse.Namespace, engine, app) -> int:
    """Runs the engine loop on this (the main) thread, faster for torch's CPU kernels, and HTTP on
    another until SIGTERM, Ctrl-C or the HTTP thread's end; then fails the streams in flight and
    shuts both down. Returns the exit status: 0, or 1 when HTTP never started (e.g. the port is taken)."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
        )
    )
    http = threading.Thread(target=server.run, name="agentrt-http", daemon=True)
    http.start()
    signal.signal(signal.SIGTERM, lambda *_: engine.request_stop())  # full shutdown in `finally`
    try:
        engine.run_forever(should_stop=lambda: not http.is_alive())
    except KeyboardInterrupt:
        pass
    finally:
        # streams in flight end with an error event (the loop no longer runs), then HTTP stops
        engine.fail_pending("the server is shutting down")
        app.state.serving.stop_renders()  # a chat template still rendering would hold the exit
        server.should_exit = True
        http.join(timeout=10)
        engine.shutdown()
    return 0 if server.started else 1


def ready_message(args: argparse.Namespace, api_keys: bool) -> str:
    """What serve prints once it listens: its URL and a curl request to try (a json_schema one)."""
    url = f"http://{args.host}:{args.port}"
    example = json.dumps(
        {
            "model": args.model,
            "messages": [{"role": "user", "content": "Name a city in France."}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "city",
                    "schema": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
            },
        }
    )
    return (
        f"agentrt: serving {args.model} at {url}/v1\ntry:\n  curl {url}/v1/chat/completions "
        + ('-H "Authorization: Bearer $AGENTRT_API_KEY" ' if api_keys else "")
        + f"-H 'Content-Type: application/json' -d '{example}'"
    )


def start_line(args: argparse.Namespace, runner) -> str:
    """serve's start line: the model on its device, weight format, threads, attention, how decode
    steps run, KV,
    CUDA graphs, context and full-context sequences, then the memory plan."""
    graphs = list(runner.cuda_graph_sizes)
    from agentrt.runtime.backends import describe_attention

    attention, kv = describe_attention(runner.attention_backend, runner.kv_dtype)
    return (
        f"agentrt: {args.model} on {runner.device} ({runner.weight_format.describe()}), "
        f"{runner.num_threads} thread{'' if runner.num_threads == 1 else 's'}, attention "
        f"{attention}, {runner.decode}, KV {kv}, CUDA graphs "
        f"{graphs or 'off'}; context {runner.max_model_len} tokens, up "
        f"to {runner.kv.num_slots // runner.max_model_len} full-context sequences (prefix cache "
        f"{'off' if args.no_prefix_cache else 'on'})\nagentrt: {runner.memory_plan.describe()}"
    )


def template_ready(tokenizer, budget, app) -> bool:
    """serve's start: the chat template rendered on sample conversations as the app renders requests
    (api/template_check.py); prints its warnings, and its errors, then False: a template that does
    not compile, fails on one user message or spends its budget would fail every chat request."""
    from agentrt.api.template_check import ERROR, template_findings

    findings = template_findings(tokenizer, budget, app.state.serving.tool_prompt)
    for level, message in findings:
        if level != "ok":
            print(f"agentrt: {level}: chat template {message}", file=sys.stderr, flush=True)
    if any(level == ERROR for level, _ in findings):
        print(
            "agentrt: error: the chat template cannot serve chat requests (agentrt check MODEL "
            "--chat-template ... shows the same); fix it or give another with --chat-template",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="agentrt", description="Serving runtime for agents and structured output"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(p)
    from agentrt.commands.sql import add_sql_parser, sql_command

    add_sql_parser(sub, add_engine_args)
    t = sub.add_parser("train-medusa", help="self-distil Medusa heads for a model from a prompt file")
    add_engine_args(t)
    t.add_argument(
        "--prompts",
        required=True,
        help="JSONL: one object per line with `messages` (chat) or `prompt` (text)",
    )
    t.add_argument("--output", required=True, help="directory for config.json + medusa_lm_head.safetensors")
    t.add_argument("--num-heads", type=int, default=4)
    t.add_argument("--max-tokens", type=int, default=192, help="response tokens generated per prompt")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-size", type=int, default=256, help="positions per optimizer step")
    t.add_argument("--seed", type=int, default=0)
    from agentrt.commands.extract import add_extract_parser

    add_extract_parser(sub, add_engine_args)
    add_check_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "check":
        return check_command(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
    except ValueError as e:
        print(f"agentrt: error: {e}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(args)
    if args.command == "sql":
        return sql_command(config, args)
    if args.command == "extract":
        from agentrt.commands.extract import extract_command

        return extract_command(config, args)
    if args.command == "train-medusa":
        from agentrt.train_medusa import train_medusa

        try:
            train_medusa(config, args)
        except ValueError as e:
            print(f"agentrt: error: {e}", file=sys.stderr)
            return 2
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
