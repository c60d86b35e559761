"""Engine metrics in a per-engine prometheus-client registry (served at GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineMetrics:
    """Counters (tokens, preemptions, finished requests by reason), gauges (KV usage, queue
    lengths, cache hit rate) and latency histograms in seconds (TTFT, inter-token, end-to-end)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("agentrt_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.cached_prompt_tokens = Counter("agentrt_cached_prompt_tokens",
                                            "Prompt tokens served from the prefix cache", registry=r)
        self.computed_prefill_tokens = Counter("agentrt_computed_prefill_tokens",
                                               "Prefill tokens computed (incl. recompute)", registry=r)
        self.generation_tokens = Counter("agentrt_generation_tokens", "Tokens generated", registry=r)
        self.length_forced_tokens = Counter("agentrt_length_policy_forced_tokens",
                                            "Tokens replaced by the length-safe policy to close a constraint",
                                            registry=r)
        self.jump_forward_tokens = Counter("agentrt_jump_forward_tokens",
                                           "Output tokens appended by jump-forward over forced grammar text",
                                           registry=r)
        self.preemptions = Counter("agentrt_preemptions", "Requests preempted for lack of KV", registry=r)
        self.finished = Counter("agentrt_requests_finished", "Finished requests", ["reason"], registry=r)
        self.kv_usage = Gauge("agentrt_kv_usage_ratio", "Fraction of KV slots in use (incl. cache)", registry=r)
        self.cache_hit_rate = Gauge("agentrt_prefix_cache_hit_rate",
                                    "Cached prompt tokens / prompt tokens since start", registry=r)
        self.running = Gauge("agentrt_num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("agentrt_num_requests_waiting", "Requests waiting (incl. for grammar)", registry=r)
        self.ttft = Histogram("agentrt_time_to_first_token_seconds", "TTFT", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("agentrt_inter_token_latency_seconds", "Time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("agentrt_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.spec_drafts = Counter("agentrt_spec_drafts", "Speculative verify passes (one per request with a draft)",
                                   registry=r)
        self.spec_draft_tokens = Counter("agentrt_spec_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("agentrt_spec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.spec_acceptance_rate = Gauge("agentrt_spec_acceptance_rate",
                                          "Accepted / drafted tokens since start", registry=r)
        self.spec_mean_accepted_length = Gauge(
            "agentrt_spec_mean_accepted_length",
            "Tokens emitted per verify pass since start (accepted draft tokens + the target's own)", registry=r)
        self.spec_position_acceptance = Gauge("agentrt_spec_position_acceptance_rate",
                                              "Verify passes accepting a token at draft depth / passes drafting it",
                                              ["position"], registry=r)
        self._prompt = 0
        self._cached = 0

    def on_verify(self, num_draft: int, num_accepted: int, depth: int, stats) -> None:
        """One verify pass; `stats` holds the running totals (EngineStats)."""
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(num_draft)
        self.spec_accepted_tokens.inc(num_accepted)
        self.spec_acceptance_rate.set(stats.num_accepted_tokens / max(1, stats.num_draft_tokens))
        self.spec_mean_accepted_length.set((stats.num_accepted_tokens + stats.num_spec_steps) / stats.num_spec_steps)
        for d in range(depth):
            self.spec_position_acceptance.labels(str(d + 1)).set(
                stats.accepted_per_position[d] / max(1, stats.drafted_per_position[d]))

    def on_admit(self, num_prompt: int, num_cached: int) -> None:
        self.prompt_tokens.inc(num_prompt)
        self.cached_prompt_tokens.inc(num_cached)
        self._prompt += num_prompt
        self._cached += num_cached
        self.cache_hit_rate.set(self._cached / self._prompt if self._prompt else 0.0)

    def render(self) -> bytes:
        """Prometheus text exposition format."""
        return generate_latest(self.registry)
