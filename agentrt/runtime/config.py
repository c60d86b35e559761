"""Frozen configuration dataclasses, one per subsystem, composed into `EngineConfig`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from agentrt.grammars.spec import GrammarConfig
from agentrt.runtime.chat_template import TemplateBudget

DEFAULT_MODEL = "smollm2-135m-instruct"


def default_cache_dir() -> Path:
    """Cache root for converted weights: `$AGENTRT_CACHE`, else `~/.cache/agentrt`."""
    return Path(os.environ.get("AGENTRT_CACHE") or Path.home() / ".cache" / "agentrt")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and where to run it.

    model: a registered name (`smollm2-135m-instruct`), a local Hugging Face directory, a `.gguf`
        file, or a hub id already present in the local Hugging Face cache (never downloaded).
    device: `auto` (CUDA if available, else CPU), `cpu`, `cuda`, `cuda:N`.
    dtype: `auto` (bf16 on CUDA; on a CPU float32 where the C++ kernels' AVX2 path runs, else bf16
        with native bf16 arithmetic, else fp32: runtime/hardware.py), `float32`, `bfloat16`, `float16`.
    quantization: `none`, `int8` or `int4` (asymmetric, `quant_group_size` input columns per scale and
        minimum) for the linear layers; see models/formats.py. At float32 on the CPU both run our C++
        kernels with the activations quantized to int8 blocks of 32 (llama.cpp's Q8_0): int8 in
        blocks of 32 input columns per scale (Q8_0, kernels/cpu_int8_linear.cpp), int4 in Q4_1
        blocks (kernels/cpu_int4_linear.cpp) with a quantized LM head at int8; at bf16: torch's
        weight-only ops (int8 one scale per output channel). `auto` (`make run` uses it): where the
        C++ kernels run (the CPU at float32 with the kernels built, decode not compiled), int4 with
        the LM head when the layers' weights are 4-bit already (a 4-bit GGUF's, as the default
        model's: the same numbers, fewer bytes), else int8 with the LM head; elsewhere none (the
        fastest formats there that keep quality, docs/benchmarks.md).
    quant_group_size: int4 group size (32, 64, 128 or 256).
    quantize_lm_head: quantize the LM head too (else it stays in the run dtype).
    threads: torch intra-op threads; None = $OMP_NUM_THREADS when set, else the physical cores.
    max_model_len: context limit in tokens; None = the model's `max_position_embeddings`.
    attention_backend: `auto` (Triton kernels on CUDA; on the CPU at float32 `cpu` when its C++
        kernels build, else torch), `torch` (gather + SDPA), `cpu` (the torch path with the C++
        kernels: one batch-invariant attention kernel for decode and prefill, the fused layer ops, the
        int8/int4 kernels; runtime/kernels/cpu_kernels.py),
        `triton` (on CPU only under
        TRITON_INTERPRET=1: the tests' way to run the kernels without a GPU).
    enforce_eager: never capture CUDA graphs, never compile the decode step.
    compile_decode: on CPU (torch attention), run plain decode steps of up to max_num_seqs sequences
        through AOTInductor-compiled graphs (runtime/backends/compiled_decode.py), built at start and cached
        under cache_dir (a first start builds for minutes, later ones load in seconds); eager on any
        build failure. Ignored on CUDA, where decode runs from CUDA graphs.
    cuda_graph_batch_sizes: decode batch sizes captured as CUDA graphs (a batch is padded up to
        the next size; a larger one runs eagerly).
    linear_kernel: the dense linear layers' matmul: `auto` (oneDNN's packed fp32 matmul on the CPU
        at float32 unless the decode step is compiled, else aten), `onednn` (ValueError at load where
        impossible), `aten` (`F.linear`) or `triton` (the batch-invariant Triton matmul and RMSNorm:
        models/triton_linear.py; CUDA, or the CPU under TRITON_INTERPRET=1); see models/cpu_linear.py.
    chat_template: a Jinja chat template file (or the template text itself) used instead of the
        tokenizer's own, as vLLM's --chat-template (a base model's GGUF carries none).
    chat_template_budget: what one render of the chat template may spend (wall-clock seconds, bytes
        built), enforced while it renders: over it, the request is a 400 (runtime/chat_template.py).
    deterministic: refuse any configuration whose greedy tokens could depend on the batch, the prefix
        cache or the chunk size (ValueError at start naming it): on the CPU the float32 kernel path
        (what `auto` picks where AVX2 runs) is required; on CUDA the linear layers and norms take the
        batch-invariant Triton kernels and quantization must be none. The CPU default is invariant
        without it; CUDA's default (cuBLAS) is not.
    """

    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "none"
    quant_group_size: int = 32
    quantize_lm_head: bool = False
    threads: int | None = None
    max_model_len: int | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)
    attention_backend: str = "auto"
    enforce_eager: bool = False
    compile_decode: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    linear_kernel: str = "auto"
    deterministic: bool = False
    chat_template: str | None = None
    chat_template_budget: TemplateBudget = field(default_factory=TemplateBudget)

    def __post_init__(self) -> None:
        if self.linear_kernel not in ("auto", "onednn", "aten", "triton"):
            raise ValueError(
                f"linear_kernel must be auto, onednn, aten or triton, got {self.linear_kernel!r}"
            )
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch, cpu or triton, got {self.attention_backend!r}"
            )
        if self.quantization not in ("none", "int8", "int4", "auto"):
            raise ValueError(f"quantization must be none, int8, int4 or auto, got {self.quantization!r}")
        if self.quant_group_size not in (32, 64, 128, 256):
            raise ValueError(f"quant_group_size must be 32, 64, 128 or 256, got {self.quant_group_size}")
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise ValueError(f"threads must be in [1, {MAX_THREADS}], got {self.threads}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(
                f"max_model_len must be a positive number of tokens (None: the model's limit), got {self.max_model_len!r}"
            )
        if not self.cuda_graph_batch_sizes or any(b < 1 for b in self.cuda_graph_batch_sizes):
            raise ValueError("cuda_graph_batch_sizes must be positive batch sizes")


# torch's OpenMP pool crashes the process (SIGSEGV) on a count far past the cores; 4x the cores is
# already oversubscribed
MAX_THREADS = 4 * max(os.cpu_count() or 1, 16)


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizing. `kv_cache_bytes` is the byte budget of the KV pool (K and V, all layers);
    None = automatic: on CUDA, `gpu_memory_utilization` of the device's total memory minus what is
    in use after loading the weights and an activation reserve (see ModelRunner's memory plan); on
    CPU, 1 GiB. `enable_prefix_cache` keeps finished requests' KV in the radix tree for reuse.
    `kv_cache_dtype`: how the pool stores K and V: `auto` (the model's dtype), `float32`, `float16`
    (half the bytes of float32; the CPU attention kernel reads it in place, batch-invariant like
    float32), `bfloat16`, `int8` (one float32 scale per token and KV head: kv_cache.KVPool; every
    attention backend reads it in place) or `fp8_e4m3` (refused at load: it needs CUDA, and no fp8 KV kernel exists yet).
    ValueError on any other value."""

    kv_cache_bytes: int | None = None
    enable_prefix_cache: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    # Lower KV tiers (runtime/kv_tiers.py; need the prefix cache): a host tier of kv_host_bytes
    # (0 = none), a disk tier in kv_disk_dir (None = none) of at most kv_disk_bytes; blocks of
    # kv_tier_block_tokens tokens, encoded by kv_tier_compress ("zstd": lossless, or "none").
    kv_host_bytes: int = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 4 << 30
    kv_tier_block_tokens: int = 32
    kv_tier_compress: str = "zstd"
    # Sliding-window layers (runtime/kv_window.py): their K/V rows for the tokens still attended
    # only; `swa_full_tokens_ratio` window rows per token slot (None: sized from max_num_seqs x window);
    # `disable_hybrid_swa_memory` keeps every layer for every token (the plain pool).
    swa_full_tokens_ratio: float | None = None
    disable_hybrid_swa_memory: bool = False
    # Recurrent layers (runtime/recurrent_state.py): `state_slots` sequences' states in all (working
    # + prefix snapshots; None: a quarter of the KV budget), a snapshot every
    # `state_snapshot_interval` tokens of a prefill.
    state_slots: int | None = None
    state_snapshot_interval: int = 256

    def __post_init__(self) -> None:
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16", "int8", "fp8_e4m3"):
            raise ValueError(
                "kv_cache_dtype must be auto, float32, float16, bfloat16, int8 or fp8_e4m3, got "
                f"{self.kv_cache_dtype!r}"
            )
        if self.state_slots is not None and (not isinstance(self.state_slots, int) or self.state_slots < 2):
            raise ValueError(f"state_slots must be an integer >= 2, got {self.state_slots!r}")
        if not isinstance(self.state_snapshot_interval, int) or self.state_snapshot_interval < 1:
            raise ValueError(
                f"state_snapshot_interval must be a positive integer, got {self.state_snapshot_interval!r}"
            )
        if self.swa_full_tokens_ratio is not None and not 0.0 < self.swa_full_tokens_ratio <= 1.0:
            raise ValueError(f"swa_full_tokens_ratio must be in (0, 1], got {self.swa_full_tokens_ratio}")
        if self.swa_full_tokens_ratio is not None and self.disable_hybrid_swa_memory:
            raise ValueError(
                "swa_full_tokens_ratio sizes the sliding-window pool, which disable_hybrid_swa_memory turns off: "
                "pass one of them"
            )
        if self.kv_host_bytes < 0:
            raise ValueError(f"kv_host_bytes must be >= 0, got {self.kv_host_bytes}")
        if self.kv_disk_bytes < 1:
            raise ValueError(f"kv_disk_bytes must be positive, got {self.kv_disk_bytes}")
        if not 1 <= self.kv_tier_block_tokens <= 4096:
            raise ValueError(f"kv_tier_block_tokens must be in [1, 4096], got {self.kv_tier_block_tokens}")
        if self.kv_tier_compress not in ("zstd", "none"):
            raise ValueError(f"kv_tier_compress must be zstd or none, got {self.kv_tier_compress!r}")
        if (self.kv_host_bytes or self.kv_disk_dir) and not self.enable_prefix_cache:
            raise ValueError(
                "the KV host and disk tiers hold the prefix cache's blocks: they need the prefix cache"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: sequences running (decoding or prefilling) at once.
    max_num_batched_tokens: tokens computed in one step (decodes + prefill chunks); a longer prompt
    is prefilled in chunks interleaved with running decodes.
    reorder_window_s: waiting requests younger than this are ordered longest-cached-prefix first;
    older ones go first in arrival order (no starvation)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    reorder_window_s: float = 2.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.reorder_window_s < 0:
            raise ValueError(f"reorder_window_s must be >= 0, got {self.reorder_window_s}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (agentrt/speculative). method: None (off), "ngram", "draft" or "medusa".

    num_speculative_tokens: draft tokens per verify pass (n-gram, draft model; for Medusa the tree
        depth is bounded by the number of heads instead).
    ngram_min / ngram_max: n-gram lengths tried by prompt lookup.
    draft_model: a second model (same vocabulary) as for ModelConfig.model; None with
        draft_layers set = self-draft: the target's first `draft_layers` layers + its LM head.
    medusa_heads: a Medusa heads directory (config.json + medusa_lm_head.safetensors); None = the
        heads shipped for the default model.
    medusa_tree: paths of top-k ranks (Medusa's `medusa_choices`); None = DEFAULT_MEDUSA_TREE.
    acceptance: "exact" (greedy / sampled match, rejection sampling: the target distribution is
        preserved) or "typical" (Medusa's typical acceptance at temperature > 0; does not preserve it).
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None
    draft_layers: int | None = None
    medusa_heads: str | None = None
    medusa_tree: tuple[tuple[int, ...], ...] | None = None
    acceptance: str = "exact"
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    def __post_init__(self) -> None:
        if self.method not in (None, "ngram", "draft", "medusa"):
            raise ValueError(f"speculative method must be ngram, draft or medusa, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}")
        if self.medusa_tree is not None and not 1 <= len(self.medusa_tree) <= 64:
            raise ValueError(f"medusa_tree must have 1 to 64 nodes, got {len(self.medusa_tree)}")
        if self.acceptance not in ("exact", "typical"):
            raise ValueError(f"acceptance must be 'exact' or 'typical', got {self.acceptance!r}")
        if self.acceptance == "typical" and self.method != "medusa":
            raise ValueError("acceptance 'typical' applies to Medusa only (--speculative-method medusa)")
        if self.method == "draft" and self.draft_model is None and self.draft_layers is None:
            raise ValueError("speculative method 'draft' needs draft_model or draft_layers (self-draft)")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    speculative: SpecConfig = field(default_factory=SpecConfig)
