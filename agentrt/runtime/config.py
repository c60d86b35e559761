"""Frozen configuration dataclasses, one per subsystem, composed into `EngineConfig`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from agentrt.grammars.spec import GrammarConfig

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
    dtype: `auto` (bf16 on CUDA, fp32 on CPU), `float32`, `bfloat16`, `float16`.
    max_model_len: context limit in tokens; None = the model's `max_position_embeddings`.
    """

    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    cache_dir: Path = field(default_factory=default_cache_dir)


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizing. `kv_cache_bytes` is the byte budget of the KV pool (K and V, all layers);
    `enable_prefix_cache` keeps finished requests' KV in the radix tree for reuse."""

    kv_cache_bytes: int = 1 << 30
    enable_prefix_cache: bool = True


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
