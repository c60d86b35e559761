"""`agentrt extract`: a resumable extraction job, JSON Lines / CSV / Parquet in, JSON Lines out.

    agentrt extract --input docs.jsonl --output out.jsonl --schema schema.json
    agentrt extract --input docs.jsonl --output out.jsonl --schema-field schema_name --schemas DIR
    agentrt extract ... --server http://127.0.0.1:8000/v1 [--api-key KEY] [--model NAME]
    agentrt extract ... --ray [--ray-address ADDR] --num-workers N [--cpus-per-worker C]

Exit status: 0 every row of the output is valid (or --allow-failures), 1 some row is not, 2 bad
arguments (an invalid or unenforceable schema included, before anything runs; an output path that
cannot be written), 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from agentrt.extract.job import EXIT_USAGE, JobPlan, run_job
from agentrt.extract.types import DEFAULT_MAX_TOKENS

# The flags after the engine's, in the order `agentrt extract --help` lists them: (flags, keywords).
_IO_OPTIONS = (
    (("--input",), {"required": True, "help": "documents: .jsonl, .csv or .parquet (pyarrow)"}),
    (
        ("--input-format",),
        {"choices": ["jsonl", "csv", "parquet"], "default": None, "help": "default: by suffix"},
    ),
    (("--output",), {"required": True, "help": "JSON Lines output; an existing file is resumed"}),
)
_SCHEMA_SOURCES = (  # exactly one of these (a required mutually exclusive group)
    (("--schema",), {"help": "a JSON Schema file"}),
    (("--pydantic",), {"metavar": "MODULE:CLASS", "help": "a pydantic model class whose schema to use"}),
    (("--schemas",), {"metavar": "DIR", "help": "with --schema-field: NAME.json schema files"}),
)
_JOB_OPTIONS = (
    (("--schema-field",), {"help": "the row field naming its schema (a file NAME.json in --schemas)"}),
    (("--id-field",), {"default": "id", "help": "the row's id field (default %(default)s)"}),
    (("--text-field",), {"default": "text", "help": "the row's document field (default %(default)s)"}),
    (("--gold-field",), {"default": None, "help": "expected outputs: adds field accuracy to the summary"}),
    (
        ("--prompt",),
        {
            "metavar": "FILE",
            "help": "prompt template with {text} and {schema}; a line '---' splits system (above) from user "
            "(below) message, else it is all the user message (default: the schema in a system message)",
        },
    ),
    (
        ("--min-confidence",),
        {
            "type": float,
            "default": None,
            "help": "mark rows with a field below this confidence (in [0, 1]) needs_review",
        },
    ),
    (("--allow-failures",), {"action": "store_true", "help": "exit 0 even when some rows failed"}),
    (
        ("--max-in-flight",),
        {"type": int, "default": None, "help": "documents in flight (default 2 x --max-num-seqs)"},
    ),
    (
        ("--max-tokens",),
        {
            "type": int,
            "default": DEFAULT_MAX_TOKENS,
            "help": "output tokens per document (default %(default)s)",
        },
    ),
    (("--temperature",), {"type": float, "default": 0.0, "help": "default 0 (greedy)"}),
    (
        ("--no-repair",),
        {
            "action": "store_true",
            "help": "do not close values that repeat themselves (runaway repair is on by default; the "
            "closed values are listed in the row's 'repaired')",
        },
    ),
    (
        ("--max-tokens-policy",),
        {
            "choices": ["close", "length"],
            "default": "close",
            "help": "close (default): keep enough of --max-tokens to finish the JSON and, when the budget "
            "runs short, end it on the shortest valid completion (the row says closed_by_budget: true); "
            "length: cut at --max-tokens (the row is then invalid). A schema the closer cannot close "
            "(e.g. a long minLength) runs under length, with a warning",
        },
    ),
    (("--no-progress",), {"action": "store_true", "help": "no progress bar"}),
)
_WHERE_OPTIONS = (  # where the job runs: in process (default), on a server, on Ray
    (
        ("--server",),
        {"metavar": "URL", "help": "an OpenAI-compatible server (base URL, e.g. http://HOST:8000/v1)"},
    ),
    (("--api-key",), {"default": None, "help": "the server's API key (default $OPENAI_API_KEY)"}),
    (
        ("--model",),
        {"dest": "model_name", "default": None, "help": "model name: with --server, the server's"},
    ),
    (
        ("--ray",),
        {"action": "store_true", "help": "run on Ray Data, one engine actor per worker (agentrt[ray])"},
    ),
    (
        ("--ray-address",),
        {"default": None, "help": "with --ray: the cluster (default: RAY_ADDRESS or local)"},
    ),
    (
        ("--num-workers",),
        {"type": int, "default": 1, "help": "with --ray: engine actors (default %(default)s)"},
    ),
    (
        ("--cpus-per-worker",),
        {
            "type": int,
            "default": None,
            "help": "with --ray on CPUs: CPUs (and torch threads) per actor (default: cluster CPUs / workers)",
        },
    ),
)


def _add_options(parser, options) -> None:
    """Add each (flags, keywords) of `options` to `parser` (an ArgumentParser or a group), in order."""
    for flags, keywords in options:
        parser.add_argument(*flags, **keywords)


def add_extract_parser(sub, add_engine_args) -> argparse.ArgumentParser:
    """Register the `extract` subcommand (engine flags from `add_engine_args`, as `agentrt serve`)."""
    e = sub.add_parser(
        "extract",
        help="run a resumable JSON extraction job over a file of documents",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(e)
    _add_options(e, _IO_OPTIONS)
    _add_options(e.add_mutually_exclusive_group(required=True), _SCHEMA_SOURCES)
    _add_options(e, _JOB_OPTIONS)
    _add_options(e, _WHERE_OPTIONS)
    # one job, not a server: its compiles need not yield to other requests, and may take longer
    e.set_defaults(compile_nice=0, compile_timeout=120.0)
    return e


def _load_pydantic(spec: str) -> dict:
    mod_name, _, cls_name = spec.partition(":")
    if not mod_name or not cls_name:
        raise ValueError(f"--pydantic must be MODULE:CLASS, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--pydantic {spec}: {e}") from None
    if not hasattr(cls, "model_json_schema"):
        raise ValueError(f"--pydantic {spec} is not a pydantic model class")
    return cls.model_json_schema()


def _load_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{what} {path}: {e}") from None


def load_schemas(args: argparse.Namespace) -> dict[str | None, dict]:
    """The job's schemas: {None: schema} or, with --schema-field, {name: schema} of --schemas DIR.
    Raises ValueError (bad flags, unreadable files) and ConstraintError (not a JSON Schema)."""
    from agentrt.grammars.spec import ConstraintSpec

    if args.schemas is not None and not args.schema_field:
        raise ValueError("--schemas needs --schema-field (the row field naming each row's schema)")
    if args.schema_field and args.schemas is None:
        raise ValueError("--schema-field needs --schemas DIR (where NAME.json schemas are)")
    if args.schemas is not None:
        files = sorted(Path(args.schemas).glob("*.json"))
        if not files:
            raise ValueError(f"--schemas {args.schemas}: no .json schema files there")
        schemas: dict[str | None, dict] = {p.stem: _load_json(p, "schema") for p in files}
    elif args.pydantic:
        schemas = {None: _load_pydantic(args.pydantic)}
    else:
        schemas = {None: _load_json(Path(args.schema), "schema")}
    for name, schema in schemas.items():
        try:
            ConstraintSpec.json_schema(schema, strict=True)
        except ValueError as e:
            raise ValueError(f"schema {name or args.schema or args.pydantic}: {e}") from None
    return schemas


def run_extract(argv: list[str], llm=None) -> int:
    """`agentrt extract ARGV...` in this process; `llm`: an SDK LLM to run on instead of loading
    the model of the engine flags (tests, notebooks). Returns the exit status."""
    from agentrt.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser(prog="agentrt")
    add_extract_parser(parser.add_subparsers(dest="command", required=True), add_engine_args)
    args = parser.parse_args(["extract", *argv])
    try:
        config = engine_config(args)
    except ValueError as e:
        print(f"agentrt extract: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return extract_command(config, args, llm)


def extract_command(config, args: argparse.Namespace, llm=None) -> int:
    """Run `agentrt extract` with parsed flags and the engine config of the engine flags (or on
    `llm`, an existing SDK LLM)."""
    from agentrt.extract.prompt import PromptTemplate
    from agentrt.extract.reader import InputReader
    from agentrt.extract.writer import OutputWriter

    def usage(msg: str) -> int:
        print(f"agentrt extract: error: {msg}", file=sys.stderr)
        return EXIT_USAGE

    if args.min_confidence is not None and not 0.0 <= args.min_confidence <= 1.0:
        return usage(f"--min-confidence must be in [0, 1], got {args.min_confidence}")
    if args.max_in_flight is not None and args.max_in_flight < 1:
        return usage(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    if args.ray:
        from agentrt.extract.ray_job import import_ray

        if args.server:
            return usage("--ray and --server cannot be used together")
        try:
            import_ray()
        except ImportError as e:
            return usage(str(e))
    elif args.ray_address or args.cpus_per_worker is not None or args.num_workers != 1:
        return usage("--ray-address, --num-workers and --cpus-per-worker need --ray")
    try:
        schemas = load_schemas(args)
        template = PromptTemplate.load(args.prompt) if args.prompt else None
        reader = InputReader(
            args.input,
            id_field=args.id_field,
            text_field=args.text_field,
            schema_field=args.schema_field,
            gold_field=args.gold_field,
            fmt=args.input_format,
        )
    except (OSError, ValueError) as e:
        return usage(str(e))
    try:
        writer = OutputWriter.open(args.output)
    except (OSError, ValueError) as e:
        return usage(f"cannot write the output {args.output}: {e}")
    plan = JobPlan(reader, writer, schemas, args.allow_failures, not args.no_progress, args.min_confidence)
    try:
        if args.ray:
            driver = _ray_driver(config, args, template, schemas)
        elif args.server:
            driver = _server_driver(args, template, schemas)
        else:
            driver = _engine_driver(config, args, template, schemas, llm)
    except (OSError, ValueError) as e:  # ConstraintError / InvalidRequestError are ValueErrors
        writer.close()
        return usage(str(e))
    return run_job(plan, driver, Path(f"{args.output}.summary.json"))


def _engine_driver(config, args, template, schemas, llm=None):
    """The in-process driver; every schema compiled before anything runs (ConstraintError)."""
    from agentrt.extract.batch import SchemaRegistry, run_batch
    from agentrt.runtime.request import SamplingParams
    from agentrt.sdk import LLM

    if llm is None:
        if args.model_name:
            from dataclasses import replace

            config = replace(config, model=replace(config.model, model=args.model_name))
        llm = LLM.from_config(config)
    registry = SchemaRegistry(llm.engine)
    for name, schema in schemas.items():
        try:
            registry.require(schema)
        except ValueError as e:
            raise ValueError(f"schema {name or args.schema or args.pydantic}: {e}") from None
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        repetition_repair=not args.no_repair,
        max_tokens_policy=args.max_tokens_policy,
    )
    params.validate(llm.engine.vocab_size)

    def results_of(inputs):
        return run_batch(
            llm.engine,
            llm._chat_ids,
            inputs,
            None,
            sampling_params=params,
            max_in_flight=args.max_in_flight,
            prompt=template,
            min_confidence=args.min_confidence,
            registry=registry,
        )

    return results_of


def _ray_driver(config, args, template, schemas):
    """The --ray driver (agentrt/extract/ray_job.py); schemas compiled on the driver first."""
    from dataclasses import replace

    from agentrt.extract.ray_job import RayJobOptions, WorkerPlan, ray_driver
    from agentrt.runtime.request import SamplingParams

    if args.model_name:
        config = replace(config, model=replace(config.model, model=args.model_name))
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        repetition_repair=not args.no_repair,
        max_tokens_policy=args.max_tokens_policy,
    )
    plan = WorkerPlan(
        config,
        schemas,
        params,
        args.max_in_flight,
        template,
        args.min_confidence,
        None,
    )
    opts = RayJobOptions(args.num_workers, args.cpus_per_worker, args.ray_address)
    return ray_driver(config, plan, opts, args.schema or args.pydantic)


def _server_driver(args, template, schemas):
    """The --server driver (schemas checked against their meta-schema only: enforcement is the
    server's, and a schema it refuses fails each of its rows with the server's message)."""
    from agentrt.extract.server import ServerExtractor, server_model

    url = args.server.rstrip("/")
    if not url.endswith("/v1"):
        url += "/v1"
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    model = args.model_name or server_model(url, api_key)
    extractor = ServerExtractor(
        url,
        model,
        api_key=api_key,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        max_in_flight=args.max_in_flight or 8,
        prompt=template,
        min_confidence=args.min_confidence,
        repetition_repair=not args.no_repair,
        max_tokens_policy=args.max_tokens_policy,
    )
    return lambda inputs: extractor.run(inputs)
