"""Engine counters, in one store (`EngineStats`), exported to Prometheus at scrape time.

The engine thread only increments `EngineStats` fields; `EngineMetrics` registers a collector that
reads them (and the live gauges: KV usage, running, waiting) when GET /metrics is served, so the
two views can never disagree and gauges are current even when no step has run since an abort.
Latency distributions (TTFT, inter-token, end-to-end) are prometheus-client histograms.
"""

from __future__ import annotations

from collections import Counter as CountsByKey
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclass
class EngineStats:
    """Counters since start (the one store: tests, benchmarks and /metrics read these).

    Token counts are in tokens. batch_sizes: sequences in each recent step; prefill_sizes: prefill
    tokens in each recent step. Speculation: mean accepted length =
    (num_accepted_tokens + num_spec_steps) / num_spec_steps."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_computed_prefill_tokens: int = 0
    num_generated_tokens: int = 0
    num_jump_forward_tokens: int = 0
    num_length_forced_tokens: int = 0  # sampled tokens replaced by the length-safe policy
    num_reasoning_forced_tokens: int = 0  # reasoning end tokens appended at a spent thinking budget
    num_preemptions: int = 0
    num_finished: CountsByKey = field(default_factory=CountsByKey)  # finish reason -> requests
    num_rejected: CountsByKey = field(default_factory=CountsByKey)  # refused at admission: reason -> requests
    num_spec_steps: int = 0  # verify passes (per request)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_tokens_cut_by_grammar: int = 0  # draft nodes the request's grammar rejected before verification
    accepted_per_position: list = field(default_factory=list)  # passes accepting a token at depth d + 1
    drafted_per_position: list = field(default_factory=list)  # passes drafting depth d + 1
    batch_sizes: deque = field(default_factory=lambda: deque(maxlen=4096))
    prefill_sizes: deque = field(default_factory=lambda: deque(maxlen=4096))

    def count_verify(self, num_draft: int, num_accepted: int, depths: list[int]) -> None:
        """One verify pass of a draft with node `depths` (1-based) of which `num_accepted` tokens
        (a path from the root) were accepted."""
        self.num_spec_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < max(depths, default=0):
            self.accepted_per_position.append(0)
            self.drafted_per_position.append(0)
        for d in set(depths):
            self.drafted_per_position[d - 1] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


class LoadGauges(NamedTuple):
    """Live load, read at scrape time. kv_usage: KV slots held for requests (their own and the
    cached prefixes they read) / all slots; kv_cache_usage: slots held only by the prefix cache
    (evictable on demand) / all slots; running and waiting requests (waiting: not yet running, see
    AsyncEngine's AdmissionConfig)."""

    kv_usage: float
    num_running: int
    num_waiting: int
    kv_cache_usage: float = 0.0
    expert_tokens: tuple[tuple[int, tuple[int, ...]], ...] = ()  # MoE: (layer, tokens per expert)
    kv_tiers: object = None  # runtime/kv_tiers.KVTiers (its gauges() and stats), when configured


# Prometheus counter name -> (help, EngineStats field)
_COUNTERS = {
    "agentrt_prompt_tokens": ("Prompt tokens admitted", "num_prompt_tokens"),
    "agentrt_cached_prompt_tokens": (
        "Prompt tokens served from the prefix cache",
        "num_cached_prompt_tokens",
    ),
    "agentrt_computed_prefill_tokens": (
        "Prefill tokens computed (incl. recompute)",
        "num_computed_prefill_tokens",
    ),
    "agentrt_generation_tokens": ("Tokens generated", "num_generated_tokens"),
    "agentrt_length_policy_forced_tokens": (
        "Tokens replaced by the length-safe policy to close a constraint",
        "num_length_forced_tokens",
    ),
    "agentrt_reasoning_budget_forced_tokens": (
        "Tokens appended to end a reasoning whose thinking budget was spent",
        "num_reasoning_forced_tokens",
    ),
    "agentrt_jump_forward_tokens": (
        "Output tokens appended by jump-forward over forced grammar text",
        "num_jump_forward_tokens",
    ),
    "agentrt_preemptions": ("Requests preempted for lack of KV", "num_preemptions"),
    "agentrt_spec_drafts": ("Speculative verify passes (one per request with a draft)", "num_spec_steps"),
    "agentrt_spec_draft_tokens": ("Draft tokens verified", "num_draft_tokens"),
    "agentrt_spec_accepted_tokens": ("Draft tokens accepted", "num_accepted_tokens"),
}


class _StatsCollector:
    """prometheus-client custom collector over EngineStats and the live load gauges."""

    def __init__(self, stats: EngineStats, load: Callable[[], LoadGauges]):
        self.stats, self.load = stats, load  # `load` is replaced by EngineMetrics.set_load

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        for name, (help_, attr) in _COUNTERS.items():
            yield CounterMetricFamily(name, help_, value=getattr(s, attr))
        finished = CounterMetricFamily("agentrt_requests_finished", "Finished requests", labels=["reason"])
        for reason, n in sorted(s.num_finished.items()):
            finished.add_metric([reason], n)
        yield finished
        rejected = CounterMetricFamily(
            "agentrt_requests_rejected", "Requests refused at admission", labels=["reason"]
        )
        for reason, n in sorted(s.num_rejected.items()):
            rejected.add_metric([reason], n)
        yield rejected
        load = self.load()
        yield GaugeMetricFamily(
            "agentrt_kv_usage_ratio",
            "Fraction of KV slots held for requests (incl. cached prefixes they read; not evictable cache)",
            value=load.kv_usage,
        )
        yield GaugeMetricFamily(
            "agentrt_kv_cache_usage_ratio",
            "Fraction of KV slots held only by the prefix cache (evictable)",
            value=load.kv_cache_usage,
        )
        yield GaugeMetricFamily("agentrt_num_requests_running", "Requests running", value=load.num_running)
        yield GaugeMetricFamily(
            "agentrt_num_requests_waiting",
            "Requests admitted and not yet running (compiling, queued, preempted)",
            value=load.num_waiting,
        )
        yield GaugeMetricFamily(
            "agentrt_prefix_cache_hit_rate",
            "Cached prompt tokens / prompt tokens since start",
            value=s.num_cached_prompt_tokens / s.num_prompt_tokens if s.num_prompt_tokens else 0.0,
        )
        yield GaugeMetricFamily(
            "agentrt_spec_acceptance_rate",
            "Accepted / drafted tokens since start",
            value=s.num_accepted_tokens / max(1, s.num_draft_tokens),
        )
        yield GaugeMetricFamily(
            "agentrt_spec_mean_accepted_length",
            "Tokens emitted per verify pass since start (accepted draft tokens + the target's own)",
            value=(s.num_accepted_tokens + s.num_spec_steps) / max(1, s.num_spec_steps),
        )
        experts = CounterMetricFamily(
            "agentrt_moe_expert_tokens",
            "Tokens routed to each expert of each MoE layer (expert load)",
            labels=["layer", "expert"],
        )
        for layer, counts in load.expert_tokens:
            for e, n in enumerate(counts):
                experts.add_metric([str(layer), str(e)], n)
        yield experts
        yield from _tier_metrics(s, load.kv_tiers)
        pos = GaugeMetricFamily(
            "agentrt_spec_position_acceptance_rate",
            "Verify passes accepting a token at draft depth / passes drafting it",
            labels=["position"],
        )
        for d, (acc, drafted) in enumerate(zip(s.accepted_per_position, s.drafted_per_position)):
            pos.add_metric([str(d + 1)], acc / max(1, drafted))
        yield pos


def _tier_metrics(s: EngineStats, tiers) -> Iterator[Metric]:
    """Prefix hits per KV tier (device = the pool), and the lower tiers' bytes, loads and drops."""
    hits = CounterMetricFamily(
        "agentrt_kv_tier_hit_tokens",
        "Prompt tokens served from the prefix cache, by KV tier",
        labels=["tier"],
    )
    lower = tiers.stats.hit_tokens if tiers is not None else {}
    hits.add_metric(["device"], max(0, s.num_cached_prompt_tokens - sum(lower.values())))
    for tier in ("host", "disk"):
        hits.add_metric([tier], lower.get(tier, 0))
    yield hits
    if tiers is None:
        return
    held = GaugeMetricFamily("agentrt_kv_tier_bytes", "Bytes held by a lower KV tier", labels=["tier"])
    blocks = GaugeMetricFamily("agentrt_kv_tier_blocks", "KV blocks held by a lower KV tier", labels=["tier"])
    limit = GaugeMetricFamily("agentrt_kv_tier_limit_bytes", "Byte limit of a lower KV tier", labels=["tier"])
    stored = CounterMetricFamily(
        "agentrt_kv_tier_stored_blocks", "KV blocks stored in a lower tier", labels=["tier"]
    )
    for tier, nbytes, nblocks, budget in tiers.gauges():
        held.add_metric([tier], nbytes)
        blocks.add_metric([tier], nblocks)
        limit.add_metric([tier], budget)
        stored.add_metric([tier], tiers.stats.stored_blocks.get(tier, 0))
    yield from (held, blocks, limit, stored)
    yield CounterMetricFamily(
        "agentrt_kv_tier_loads", "Loads from the lower KV tiers", value=tiers.stats.num_loads
    )
    yield CounterMetricFamily(
        "agentrt_kv_tier_load_seconds",
        "Seconds from lookup to load done, summed",
        value=tiers.stats.load_seconds,
    )
    yield CounterMetricFamily(
        "agentrt_kv_tier_dropped_blocks",
        "KV blocks not stored because the store backlog was full",
        value=tiers.stats.dropped_blocks,
    )
    yield GaugeMetricFamily(
        "agentrt_kv_tier_disk_enabled",
        "1 while the disk tier works (0: off after a failure, or none)",
        value=int(tiers.disk is not None and tiers.disk.enabled),
    )


class EngineMetrics:
    """The Prometheus view of one engine: counters and gauges read from `stats` / `load()` at scrape
    time, plus latency histograms in seconds (TTFT, inter-token, end-to-end) observed by the engine."""

    def __init__(self, stats: EngineStats, load: Callable[[], LoadGauges]) -> None:
        self.registry = r = CollectorRegistry()
        self._collector = _StatsCollector(stats, load)
        r.register(self._collector)
        self.ttft = Histogram(
            "agentrt_time_to_first_token_seconds", "TTFT", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "agentrt_inter_token_latency_seconds",
            "Time between output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "agentrt_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY_BUCKETS, registry=r
        )

    @property
    def load(self) -> Callable[[], LoadGauges]:
        """The live-load function read at scrape time (any thread calls it: plain reads only)."""
        return self._collector.load

    def set_load(self, load: Callable[[], LoadGauges]) -> None:
        """Read the live gauges from `load` from now on (a front such as AsyncEngine adds what only
        it knows, e.g. requests still compiling)."""
        self._collector.load = load

    def render(self) -> bytes:
        """Prometheus text exposition format."""
        return generate_latest(self.registry)
