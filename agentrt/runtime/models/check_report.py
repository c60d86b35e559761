"""What `agentrt check` reports (runtime/models/check.py): findings at three levels, the KV estimate,
the capacity of the KV budget, and the report that holds them."""

from __future__ import annotations

from dataclasses import dataclass, field

OK, WARNING, ERROR = "ok", "warning", "error"


@dataclass(frozen=True)
class Finding:
    """One result: `level` ok / warning / error, `topic` what was checked, `message` what was found."""

    level: str
    topic: str
    message: str


@dataclass(frozen=True)
class KVEstimate:
    """KV bytes of a model at a dtype, counted per KV cache (a layer's own, or one shared by several
    layers; layers without KV have none). `layer_bytes`: K + V of one token in one cache (bytes);
    `full_layers`: caches of layers attending to the whole context; `windows`: ((window tokens,
    caches), ...) of the sliding-window layers, which hold at most `window` tokens per sequence;
    `full_bytes`: the full caches' bytes per token together when their shape differs from the
    windowed caches' (None: full_layers x layer_bytes)."""

    dtype: str
    num_layers: int
    layer_bytes: int
    full_layers: int
    windows: tuple[tuple[int, int], ...]
    full_bytes: int | None = None

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes per token of the full-attention layers together (`full_bytes` when their caches
        differ from the windowed ones', else full_layers x layer_bytes)."""
        return self.full_layers * self.layer_bytes if self.full_bytes is None else self.full_bytes

    @property
    def pool_bytes_per_token(self) -> int:
        """Bytes per token the engine's pool (kv_cache.KVPool) reserves: every cache, window or not."""
        return self.full_bytes_per_token + sum(n for _, n in self.windows) * self.layer_bytes

    def sequence_bytes(self, tokens: int) -> int:
        """KV bytes one sequence of `tokens` tokens needs when a windowed layer keeps only its window:
        full x tokens + per windowed layer min(tokens, window)."""
        windowed = sum(n * self.layer_bytes * min(tokens, w) for w, n in self.windows)
        return self.full_bytes_per_token * tokens + windowed


@dataclass(frozen=True)
class Capacity:
    """Sequences of `max_model_len` tokens a KV budget holds. `budget_bytes` None: not measurable
    here (`source` says why). `pool_sequences`: with the pool as built (every layer per token);
    `window_sequences`: if windowed layers kept only their window."""

    device: str
    budget_bytes: int | None
    source: str
    max_model_len: int
    pool_sequences: int = 0
    window_sequences: int = 0


@dataclass
class CheckReport:
    """What `check_model` found. `exit_status` 1 when any finding is an error, else 0."""

    model: str
    source: str = ""
    findings: list[Finding] = field(default_factory=list)
    architecture: str | None = None
    family: str | None = None
    weight_bytes: dict[str, int] = field(default_factory=dict)
    tool_format: str | None = None
    reasoning_format: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    stop_ids: tuple[int, ...] = ()
    kv: KVEstimate | None = None
    capacity: Capacity | None = None
    state_bytes: int | None = None  # one sequence's recurrent state (bytes); None: no recurrent layers

    def add(self, level: str, topic: str, message: str) -> None:
        self.findings.append(Finding(level, topic, message))

    def of(self, topic: str) -> list[Finding]:
        """The findings about `topic`."""
        return [f for f in self.findings if f.topic == topic]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == ERROR]

    @property
    def exit_status(self) -> int:
        return 1 if self.errors else 0

    def describe(self) -> str:
        """The report as text: a header line, one line per finding, a summary line."""
        lines = [f"agentrt check {self.model}: {self.source}"]
        lines += [f"  [{f.level}] {f.topic}: {f.message}" for f in self.findings]
        warnings = sum(f.level == WARNING for f in self.findings)
        lines.append(f"{len(self.errors)} errors, {warnings} warnings: exit {self.exit_status}")
        return "\n".join(lines)
