"""`agentrt check MODEL`, and serve's check before load: what serving a model would run into,
found before any weight is read.

The findings are runtime/models/check.py's (where the model is, its weights' headers, architecture,
shapes, tokenizer, special tokens; check_memory.py's KV capacity), with the chat template between
them as the API renders requests (api/tools/rendering.py's call format, api/template_check.py's
sample renders): that part needs agentrt.api, so the composition lives here, above both. Last, the
run plan serve would take with the same options (runtime/run_plan.plan_run, `check_plan`).
"""

from __future__ import annotations

import argparse
import sys

from agentrt.engine_args import (
    add_run_plan_args,
    add_template_budget_args,
    byte_size,
    cache_config,
    model_config,
    template_budget,
    with_engine_defaults,
)

NO_TEMPLATE_ROUTES = "/v1/chat/completions, /v1/messages and /v1/responses"


def check_chat_template(report, tokenizer, budget=None) -> None:
    """Add the chat template's findings to `report` (a CheckReport): the tool-call and reasoning
    formats it implies (report.tool_format / reasoning_format set), then, when there is one, its
    renders on sample conversations within `budget` (a TemplateBudget; None = TemplateBudget())
    as serve renders requests; a warning when there is none (the chat routes answer 400)."""
    from agentrt.api.template_check import template_findings  # the serving path's own samples
    from agentrt.api.tools.rendering import detect_format
    from agentrt.runtime.models.check import OK, WARNING, reasoning_format, template_text

    template = template_text(getattr(tokenizer, "chat_template", None))
    fmt, native = detect_format(template)
    report.tool_format, report.reasoning_format = fmt, reasoning_format(template)
    how = "the template renders tools" if native else "generic prompt: the template renders no tools"
    formats = f"tool calls {fmt} ({how}); reasoning {report.reasoning_format}"
    if template:
        report.add(OK, "chat template", f"present ({len(template):,} characters): {formats}")
        for level, message in template_findings(tokenizer, budget):
            report.add(level, "chat template", message)
    else:
        report.add(WARNING, "chat template", f"absent: {NO_TEMPLATE_ROUTES} will answer 400; {formats}")


def check_plan(report, files, run_config, run_cache_config) -> None:
    """Add the run plan serve would take to `report` (a CheckReport): runtime/run_plan.plan_run of
    `run_config` (a ModelConfig) and `run_cache_config` (a CacheConfig) for files.arch, one OK
    finding per line of RunPlan.describe() (topic "run plan"), or one error finding naming why
    plan_run refuses them (a ValueError: e.g. --deterministic with --compile, --attention-backend cpu
    at bfloat16), as serve would refuse them at start. files: read_model's ModelFiles (arch known).
    `--quantization auto` asks whether the weights are 4-bit already: a GGUF answers from its tensor
    types (files.four_bit; nothing converted, no data read); a safetensors directory from its first
    layer's projection weights, those few tensors read as serve reads them (formats.four_bit_layers).
    Where the plan takes the CPU kernels (attention cpu, or auto on the CPU at float32) they are
    built on first use (~40 s, cached under AGENTRT_CACHE) as serve builds them."""
    from agentrt.runtime.models.check import ERROR, OK
    from agentrt.runtime.run_plan import plan_run

    try:
        plan = plan_run(run_config, run_cache_config, files.arch, files.path, four_bit=files.four_bit)
    except ValueError as e:
        report.add(ERROR, "run plan", f"these options cannot run here: {e}")
        return
    for line in plan.describe().splitlines():
        report.add(OK, "run plan", line.strip())


def check_model(
    model: str,
    max_model_len: int | None = None,
    max_num_seqs: int = 16,
    device: str = "auto",
    dtype: str = "auto",
    kv_cache_bytes: int | None = None,
    chat_template: str | None = None,
    chat_template_budget=None,
    run_config=None,
    run_cache_config=None,
):
    """Diagnose `model` (registered name, HF directory, .gguf file or cached hub id) without
    reading any weight data (but the first layer's few projection weights of a directory for
    `--quantization auto`'s plan, as serve reads them: `check_plan`): runtime/models/check.py's
    findings, the chat template's (`check_chat_template`), the KV capacity (check_memory.py) and the
    run plan (`check_plan`). Returns a CheckReport; never raises for a broken model: every problem
    is an error finding (exit_status 1).
    max_model_len: tokens, None = the model's limit; kv_cache_bytes: bytes, None = the device's
    default budget; chat_template: a template file or text used instead of the tokenizer's (serve's
    --chat-template); chat_template_budget: a TemplateBudget, what each sample render may spend
    (serve's --chat-template-budget / --chat-template-max-bytes; default TemplateBudget()).
    run_config / run_cache_config: the ModelConfig / CacheConfig serve would run with, for the plan
    (engine_args.model_config / cache_config of its flags); None = the defaults with `model`,
    `device`, `dtype`, `max_model_len` (and `kv_cache_bytes`) above."""
    from agentrt.runtime.config import CacheConfig, ModelConfig
    from agentrt.runtime.models.check import check_special_tokens, check_tokenizer, read_model
    from agentrt.runtime.models.check_memory import check_memory

    report, files = read_model(model, chat_template)
    if files.tokenizer is not None:
        check_tokenizer(report, files)
        check_chat_template(report, files.tokenizer, chat_template_budget)
        check_special_tokens(report, files)
    if files.arch is not None:
        options = {
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "device": device,
            "dtype": dtype,
            "kv_cache_bytes": kv_cache_bytes,
            "state_slots": run_cache_config.state_slots if run_cache_config is not None else None,
        }
        check_memory(report, files.arch, files.tensors, options)
        if run_config is None:
            run_config = ModelConfig(model=model, device=device, dtype=dtype, max_model_len=max_model_len)
        check_plan(report, files, run_config, run_cache_config or CacheConfig(kv_cache_bytes=kv_cache_bytes))
    return report


def check_args(args: argparse.Namespace):
    """`check_model` of args.model with the options check and serve share (a CheckReport), the run
    plan from the ModelConfig / CacheConfig that serve builds of the same flags (engine_args; the
    flags `args` lacks at serve's defaults). Raises ValueError for bad --chat-template-budget /
    --chat-template-max-bytes values, or a value ModelConfig / CacheConfig refuse."""
    budget = template_budget(args)
    from agentrt.runtime.config import SchedulerConfig

    SchedulerConfig(max_num_seqs=args.max_num_seqs)  # serve's check of the value
    engine_args = with_engine_defaults(args)
    return check_model(
        args.model,
        args.max_model_len,
        args.max_num_seqs,
        args.device,
        args.dtype,
        args.kv_cache_bytes,
        args.chat_template,
        budget,
        model_config(engine_args),
        cache_config(engine_args),
    )


def checked_before_load(args: argparse.Namespace) -> bool:
    """serve's start: the whole `agentrt check` of the model (architecture, tokenizer, chat
    template, weight names and shapes, KV capacity) with serve's own options, before any weight is
    read or a GGUF converted. Prints its warnings and errors; False when it found an error (a model
    serve would refuse at load, now refused in seconds with check's findings)."""
    report = check_args(args)
    for finding in report.findings:  # the template's warnings: template_ready's, with the app's tool set-up
        if finding.level == "error" or (finding.level == "warning" and finding.topic != "chat template"):
            print(
                f"agentrt: {finding.level}: {finding.topic}: {finding.message}", file=sys.stderr, flush=True
            )
    if report.errors:
        print(
            f"agentrt: error: {args.model} cannot be served ({len(report.errors)} error"
            f"{'' if len(report.errors) == 1 else 's'} above; `agentrt check {args.model}` with the same options "
            "shows the whole report)",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True


def add_check_parser(sub) -> None:
    """`agentrt check MODEL`: the diagnosis of `check_model`; exit 1 when it finds an error."""
    from agentrt.runtime.config import DEFAULT_MODEL

    c = sub.add_parser(
        "check",
        help="diagnose a model without reading its weights: architecture, tokenizer and chat template, "
        "weight formats, KV bytes and how many sequences fit, and the run plan serve would take with "
        "the same flags; exit 1 on any error",
    )
    c.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"registered name, HF directory, .gguf file or locally cached hub id (default {DEFAULT_MODEL}); "
        "a GGUF is read, not converted",
    )
    c.add_argument(
        "--max-model-len", type=int, default=None, help="context in tokens (default: the model's limit)"
    )
    c.add_argument("--max-num-seqs", type=int, default=16, help="sequences at once (default %(default)s)")
    c.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    c.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto", help="run dtype"
    )
    c.add_argument(
        "--kv-cache-bytes",
        type=byte_size,
        default=None,
        help="KV budget in bytes (default: 1 GiB on CPU, free memory on CUDA)",
    )
    c.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (or text) to check instead of the tokenizer's own, as serve takes it",
    )
    add_template_budget_args(c)
    add_run_plan_args(c)  # serve's flags that decide the plan, as serve takes them


def check_command(args: argparse.Namespace) -> int:
    """`agentrt check`: print the report; exit 0 (no error found), 1 (an error found) or 2 (bad
    template budget flags)."""
    try:
        report = check_args(args)
    except ValueError as e:  # the template budget's flags, or a value the run's configs refuse
        print(f"agentrt: error: {e}", file=sys.stderr)
        return 2
    print(report.describe(), flush=True)
    return report.exit_status
