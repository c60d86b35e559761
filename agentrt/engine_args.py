"""The engine's command-line flags, shared by `agentrt serve`, `agentrt extract`, `agentrt sql` and
the Ray Serve deployment (scaleout/deploy.py): `add_engine_args` registers them on a parser,
`engine_config` turns the parsed namespace into an EngineConfig (as vLLM's engine arg_utils)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from agentrt.grammars.spec import GrammarConfig
from agentrt.runtime.chat_template import TemplateBudget
from agentrt.runtime.config import (
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)

_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """A byte count: an integer with an optional binary unit (K, M, G, T; KiB / KB read the same),
    e.g. 4G. Raises argparse.ArgumentTypeError naming the value."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _BYTE_UNITS else ""
    try:
        n = float(t[: len(t) - len(unit)]) * _BYTE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 1073741824, 512M, 4G)") from None
    if not 0 <= n < float("inf"):
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}")
    if n != int(n):
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}")
    return int(n)


class Option(NamedTuple):
    """One command-line flag: the names and keyword arguments of `ArgumentParser.add_argument`,
    exactly as given (an absent keyword keeps argparse's own default)."""

    flags: tuple[str, ...]
    kwargs: Mapping[str, Any]


def _opt(*flags: str, **kwargs: Any) -> Option:
    return Option(flags, MappingProxyType(kwargs))


# What model to load and how: name, device, dtype, quantization, chat template (ModelConfig).
_MODEL = (
    _opt(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"registered name, HF directory, .gguf file or locally cached hub id (default {DEFAULT_MODEL})",
    ),
    _opt("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N"),
    _opt(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="run dtype: auto = bf16 on CUDA; on a CPU float32 where the C++ kernels' AVX2 path runs "
        "(faster with --quantization auto, and batch-invariant), else bf16 with native bf16, else float32 "
        "(the start line says which and why)",
    ),
    _opt(
        "--quantization",
        choices=["none", "int8", "int4", "auto"],
        default="none",
        help="quantization of the linear layers: int8 or int4 (group-wise scales), cached under "
        "AGENTRT_CACHE; CPU at float32: llama.cpp's Q8_0 / Q4_1 blocks through our C++ kernels "
        "(activations quantized to int8 blocks; int4's LM head int8), else torch's packed weight-only "
        "kernels; CUDA: torchao's kernels. auto (make run's choice): where the C++ kernels run (the CPU at "
        "float32), int4 + LM head when the weights are 4-bit already (a 4-bit GGUF), else int8 + LM "
        "head; elsewhere none",
    ),
    _opt(
        "--chat-template",
        default=None,
        help="a Jinja chat template file (or the template text) to use instead of the tokenizer's own",
    ),
)

# --chat-template-budget and --chat-template-max-bytes (TemplateBudget; serve's, and check's to match it).
_TEMPLATE_BUDGET = (
    _opt(
        "--chat-template-budget",
        type=float,
        default=TemplateBudget.time_s,
        metavar="SECONDS",
        help="wall-clock seconds one render of the chat template may take, enforced while it renders "
        "(every loop iteration, call and output piece checks it); over it the request gets a 400 "
        "naming this flag (default %(default)s; a real template renders a conversation in milliseconds)",
    ),
    _opt(
        "--chat-template-max-bytes",
        type=byte_size,
        default=TemplateBudget.max_bytes,
        metavar="BYTES",
        help="bytes one render of the chat template may produce, and the largest string or list it may "
        "build, refused before it is built (default %(default)s = 16 MiB)",
    ),
)

# The quantized weights' layout, threads and context limit (ModelConfig).
_MODEL_RUN = (
    _opt(
        "--quant-group-size",
        type=int,
        choices=[32, 64, 128, 256],
        default=ModelConfig.quant_group_size,
        help="int4 input columns per scale and zero (default %(default)s)",
    ),
    _opt("--quantize-lm-head", action="store_true", help="quantize the LM head too (default: kept dense)"),
    _opt(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: $OMP_NUM_THREADS when set, else the physical cores; with "
        "several engines on one machine give each its share, e.g. OMP_NUM_THREADS=cores/engines)",
    ),
    _opt("--max-model-len", type=int, default=None, help="context limit in tokens"),
)

# The KV pool: size, dtype, sliding-window rows (CacheConfig).
_KV_POOL = (
    _opt(
        "--kv-cache-bytes",
        type=byte_size,
        default=None,
        help="KV pool size in bytes, e.g. 1073741824 or 1G (default: on CUDA from "
        "--gpu-memory-utilization; 1 GiB on CPU)",
    ),
    _opt(
        "--kv-cache-dtype",
        choices=["auto", "float32", "float16", "bfloat16", "int8", "fp8_e4m3"],
        default="auto",
        help="how the KV pool stores K and V: auto = the model's dtype; float16 = half float32's bytes "
        "(the CPU attention kernel reads it in place: faster decode in long contexts); int8 = one "
        "float32 scale per "
        "token and KV head (about 4x the tokens of float32 per byte); fp8_e4m3 needs CUDA and is not "
        "implemented yet (default %(default)s)",
    ),
    _opt(
        "--swa-full-tokens-ratio",
        type=float,
        default=None,
        help="sliding-window models (Gemma 3, gpt-oss, ...): rows of the windowed layers' K/V per token "
        "slot, in (0, 1] (default: 2 x (max-num-seqs x window + max-num-batched-tokens) rows)",
    ),
    _opt(
        "--disable-hybrid-swa-memory",
        action="store_true",
        help="keep the sliding-window layers' K/V for every token, like the full-attention layers'",
    ),
    _opt(
        "--state-slots",
        type=int,
        default=None,
        help="hybrid models (linear attention / SSM layers): recurrent states kept in all, working "
        "ones (max-num-seqs + 1) and prefix-cache snapshots (default: a quarter of the KV budget)",
    ),
    _opt(
        "--state-snapshot-interval",
        type=int,
        default=CacheConfig.state_snapshot_interval,
        help="hybrid models: snapshot the recurrent state every N prompt tokens, so that a prefix "
        "is reusable up to the last snapshot in it (default %(default)s)",
    ),
    _opt(
        "--gpu-memory-utilization",
        type=float,
        default=CacheConfig.gpu_memory_utilization,
        help="share of the GPU's total memory this process may end up using; the KV pool gets that "
        "minus all memory in use after loading the weights (other processes' too) minus an "
        "activation reserve (default %(default)s)",
    ),
)

# How the forward runs: attention backend, graphs / compiled decode, linear kernel (ModelConfig).
_FORWARD = (
    _opt(
        "--attention-backend",
        choices=["auto", "torch", "cpu", "triton"],
        default="auto",
        help="auto: Triton kernels on CUDA; on the CPU at float32 the C++ kernels (cpu: one "
        "batch-invariant attention kernel for decode and prefill, fused layer ops, int8/int4 matmuls; "
        "built with the system compiler on first use, ~40 s, cached under AGENTRT_CACHE), else torch "
        "(gather + SDPA, not batch-invariant)",
    ),
    _opt(
        "--enforce-eager", action="store_true", help="do not capture CUDA graphs or compile the decode step"
    ),
    _opt(
        "--compile",
        dest="compile_decode",
        action=argparse.BooleanOptionalAction,
        default=ModelConfig.compile_decode,
        help="CPU: run decode steps through AOTInductor-compiled graphs, built at start (minutes the first "
        "time) and cached under AGENTRT_CACHE (later starts load them in seconds); ignored on CUDA "
        "(default: %(default)s)",
    ),
    _opt(
        "--linear-kernel",
        choices=["auto", "onednn", "aten", "triton"],
        default=ModelConfig.linear_kernel,
        help="dense linear layers: auto = oneDNN's packed fp32 matmul on the CPU at float32 (1.8x "
        "F.linear at 16 rows, measured) unless --compile, the batch-invariant Triton matmul on CUDA with "
        "--deterministic, else aten (F.linear); triton = that matmul and RMSNorm (default %(default)s)",
    ),
    _opt(
        "--deterministic",
        action="store_true",
        help="refuse any configuration whose greedy tokens could depend on the batch, the prefix cache or "
        "the chunk size; on CUDA run the linear layers and norms on batch-invariant Triton kernels (the "
        "CPU's default path is invariant without it)",
    ),
)

# The prefix cache and its host and disk tiers (CacheConfig).
_PREFIX_CACHE = (
    _opt("--no-prefix-cache", action="store_true", help="disable the radix-tree prefix cache (A/B runs)"),
    _opt(
        "--kv-host-bytes",
        type=byte_size,
        default=0,
        help="host tier under the prefix cache: KV the pool evicts goes here (on CPU compressed "
        "losslessly) and comes back on a hit instead of being recomputed; bytes, e.g. 4G (default 0: none)",
    ),
    _opt(
        "--kv-disk-dir",
        default=None,
        help="disk tier under the prefix cache: a directory for KV blocks (every finished request's "
        "prefix is written through), found again after a restart with the same model, weights and KV "
        "dtype (default: none)",
    ),
    _opt(
        "--kv-disk-bytes",
        type=byte_size,
        default=CacheConfig.kv_disk_bytes,
        help="byte limit of --kv-disk-dir, least recently used blocks deleted first (default 4G)",
    ),
)

# Batch sizes of one step (SchedulerConfig).
_SCHEDULER = (
    _opt(
        "--kv-tier-compress",
        choices=["zstd", "none"],
        default=CacheConfig.kv_tier_compress,
        help="encoding of blocks in the host and disk tiers: zstd (byte shuffle + zstd, lossless) or none",
    ),
    _opt(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig.max_num_seqs,
        help="sequences decoded together in one step (default %(default)s: CPU-sized; on a GPU "
        "raise it, e.g. 64)",
    ),
)

# Constrained decoding: JSON layout, jump-forward, grammar compiles (GrammarConfig).
_GRAMMAR = (
    _opt(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help="tokens computed in one step, decodes + prefill chunks (default %(default)s; on a GPU "
        "e.g. 8192)",
    ),
    _opt(
        "--any-whitespace",
        action="store_true",
        help="let JSON output use whitespace between tokens (bounded by --max-whitespace)",
    ),
    _opt(
        "--max-whitespace",
        type=int,
        default=GrammarConfig.max_whitespace_cnt,
        help="with --any-whitespace: most whitespace characters in one gap (default %(default)s)",
    ),
    _opt(
        "--indent",
        type=int,
        default=None,
        help="pretty JSON layout with this indent (default: compact one-line layout)",
    ),
    _opt(
        "--no-jump-forward",
        action="store_true",
        help="sample grammar-forced text token by token instead of appending it",
    ),
    _opt(
        "--compile-timeout",
        type=float,
        default=GrammarConfig.compile_timeout_s,
        help="seconds a constraint may take to compile before it is refused (400; default %(default)s)",
    ),
    _opt(
        "--compile-nice",
        type=int,
        default=GrammarConfig.compile_nice,
        help="Linux nice value of the grammar compile threads: higher leaves the engine loop more CPU, "
        "lower compiles faster on a busy machine (default %(default)s)",
    ),
    _opt(
        "--compile-in-process",
        action="store_true",
        help="compile grammars on threads of this process instead of killable child processes "
        "(saves the ~260 MB helper process; a compile past --compile-timeout then keeps running)",
    ),
    _opt(
        "--compile-memory-bytes",
        type=int,
        default=GrammarConfig.compile_memory_bytes,
        help="memory one grammar compile child may allocate; a constraint that needs more is refused "
        "(400) (default %(default)s; 0: no limit)",
    ),
    _opt(
        "--grammar-cache-bytes",
        type=int,
        default=GrammarConfig.cache_bytes,
        help="memory kept for compiled grammars, least recently used out first (default %(default)s)",
    ),
    _opt(
        "--max-constraint-bytes",
        type=int,
        default=GrammarConfig.max_constraint_bytes,
        help="largest schema/regex/grammar text accepted, in bytes (default %(default)s)",
    ),
)

# Speculative decoding (SpecConfig).
_SPECULATIVE = (
    _opt(
        "--speculative-method",
        choices=["ngram", "draft", "medusa"],
        default=None,
        help="speculative decoding: n-gram prompt lookup, a draft model, or Medusa heads (default off)",
    ),
    _opt(
        "--num-speculative-tokens",
        type=int,
        default=SpecConfig.num_speculative_tokens,
        help="draft tokens per verify pass (ngram, draft; default %(default)s)",
    ),
    _opt("--draft-model", default=None, help="draft model (same vocabulary) for --speculative-method draft"),
    _opt(
        "--draft-layers",
        type=int,
        default=None,
        help="self-draft: the target's first N layers + its LM head (when no --draft-model)",
    ),
    _opt(
        "--medusa-heads",
        default=None,
        help="Medusa heads directory (default: the heads shipped for the model)",
    ),
    _opt(
        "--speculative-acceptance",
        choices=["exact", "typical"],
        default="exact",
        help="typical: Medusa's typical acceptance at temperature > 0 (faster, does NOT preserve "
        "the model's distribution); exact (default) preserves it",
    ),
)

# Every engine flag, grouped by subsystem, in the order `--help` lists them.
ENGINE_OPTIONS: tuple[tuple[Option, ...], ...] = (
    _MODEL,
    _TEMPLATE_BUDGET,
    _MODEL_RUN,
    _KV_POOL,
    _FORWARD,
    _PREFIX_CACHE,
    _SCHEDULER,
    _GRAMMAR,
    _SPECULATIVE,
)


def add_options(p: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Registers each option on `p`, in order. Raises argparse.ArgumentError on a flag `p` has already."""
    for option in options:
        p.add_argument(*option.flags, **option.kwargs)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Registers every engine flag (ENGINE_OPTIONS) on `p`; `engine_config` reads them back."""
    for group in ENGINE_OPTIONS:
        add_options(p, group)


def add_template_budget_args(p: argparse.ArgumentParser) -> None:
    """--chat-template-budget and --chat-template-max-bytes (serve's, and check's to match it)."""
    add_options(p, _TEMPLATE_BUDGET)


def template_budget(args: argparse.Namespace) -> TemplateBudget:
    """The TemplateBudget of the parsed flags. Raises ValueError naming a value that is not positive."""
    return TemplateBudget(time_s=args.chat_template_budget, max_bytes=args.chat_template_max_bytes)


def add_run_plan_args(p: argparse.ArgumentParser) -> None:
    """Registers the flags that decide serve's RunPlan (runtime/run_plan.plan_run) that `p` has not
    registered yet, as serve takes them (names, defaults, help): --device, --dtype, --quantization, the
    model-run flags (--quant-group-size, --quantize-lm-head, --threads, --max-model-len),
    --kv-cache-dtype, the hybrid models' --state-slots / --state-snapshot-interval (the capacity they
    leave) and the forward flags (--attention-backend, --enforce-eager, --compile, --linear-kernel,
    --deterministic). `agentrt check` takes them to print the plan serve would take; a flag `p` has
    already (its own --device, say) is kept as it is."""
    plan = [o for o in _MODEL if o.flags[0] in ("--device", "--dtype", "--quantization")]
    pool = ("--kv-cache-dtype", "--state-slots", "--state-snapshot-interval")
    plan += [*_MODEL_RUN, *(o for o in _KV_POOL if o.flags[0] in pool), *_FORWARD]
    for option in plan:
        try:
            p.add_argument(*option.flags, **option.kwargs)
        except argparse.ArgumentError:  # a flag p has: argparse refuses it before changing p
            continue


def with_engine_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """`args` over every engine flag's default: what serve would parse from the flags `args` holds
    (a command that registers only some engine flags, as `agentrt check`), ready for
    `model_config` / `cache_config`."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    return argparse.Namespace(**{**vars(p.parse_args([])), **vars(args)})


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The ModelConfig of the parsed model, template budget, model-run and forward flags. Raises
    ValueError as ModelConfig and TemplateBudget do (a value out of range, named)."""
    return ModelConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        quant_group_size=args.quant_group_size,
        quantize_lm_head=args.quantize_lm_head,
        threads=args.threads,
        max_model_len=args.max_model_len,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        compile_decode=args.compile_decode,
        linear_kernel=args.linear_kernel,
        deterministic=args.deterministic,
        chat_template=args.chat_template,
        chat_template_budget=template_budget(args),
    )


def cache_config(args: argparse.Namespace) -> CacheConfig:
    """The CacheConfig of the parsed KV-pool, prefix-cache and tier flags. Raises ValueError as
    CacheConfig does."""
    return CacheConfig(
        kv_cache_bytes=args.kv_cache_bytes,
        enable_prefix_cache=not args.no_prefix_cache,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_dtype=args.kv_cache_dtype,
        swa_full_tokens_ratio=args.swa_full_tokens_ratio,
        disable_hybrid_swa_memory=args.disable_hybrid_swa_memory,
        state_slots=args.state_slots,
        state_snapshot_interval=args.state_snapshot_interval,
        kv_host_bytes=args.kv_host_bytes,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_bytes=args.kv_disk_bytes,
        kv_tier_compress=args.kv_tier_compress,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=model_config(args),
        cache=cache_config(args),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
        grammar=GrammarConfig(
            any_whitespace=args.any_whitespace,
            max_whitespace_cnt=args.max_whitespace,
            indent=args.indent,
            jump_forward=not args.no_jump_forward,
            compile_timeout_s=args.compile_timeout,
            max_constraint_bytes=args.max_constraint_bytes,
            cache_bytes=args.grammar_cache_bytes,
            compile_nice=args.compile_nice,
            compile_in_child=not args.compile_in_process,
            compile_memory_bytes=args.compile_memory_bytes or None,
        ),
        speculative=SpecConfig(
            method=args.speculative_method,
            num_speculative_tokens=args.num_speculative_tokens,
            draft_model=args.draft_model,
            draft_layers=args.draft_layers,
            medusa_heads=args.medusa_heads,
            acceptance=args.speculative_acceptance,
        ),
    )
