"""Which replica a request goes to: the routing policies, their state and their counters.

    prefix        (default) the replica whose tree (agentrt/scaleout/radix.py) holds the longest
                  prefix of the request's key, unless that replica has more than `load_threshold`
                  requests in flight beyond the least-loaded replica (then the least-loaded one,
                  reason "load"). A best match under `min_match_ratio` of the key (SGLang router's
                  `cache_threshold`, default 0.5 there too) is no match: the request goes to the
                  least-loaded replica, ties to the one with the smallest tree (reason "no_match"),
                  which spreads new prefixes over the replicas. Requests without a key: least-loaded
                  (reason "no_key").
    round_robin   the live replicas in turn (sorted by id).
    least_loaded  fewest requests in flight, ties to the replica chosen least recently.

Load is counted here, exactly, for the requests this table routed: +1 when a request is routed
(`choose`, keyed by the request id), -1 when it completes (`finished`); a request routed again
(Serve retries a replica that refused it or died) moves. Whatever the policy, the chosen replica's
tree gets the key, so `prefix_match_chars` shows, for any policy, the prefix the chosen replica was
sent before (what its cache could hold).

One RoutingTable serves one engine deployment within one process: Serve constructs the request
router itself (agentrt/scaleout/serve_router.py) in the ingress process, so the ingress and the
router meet through `shared_table(key)`, the one process-wide table of tables (a module-level
dict, the only way to reach an object Serve builds). Every method takes the table's lock: Serve
runs its router on its own event loop thread, the ingress on another.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from agentrt.scaleout.radix import ChunkRadixTree
from agentrt.scaleout.routing_key import RouteKey

logger = logging.getLogger(__name__)

POLICIES = ("prefix", "round_robin", "least_loaded")
MATCH_BUCKETS = (0, 64, 256, 1024, 4096, 16384, 65536)
"""Buckets (characters) of the prefix match length histogram."""


@dataclass(frozen=True)
class RoutingConfig:
    """How the router chooses. policy: one of POLICIES; chunk_chars: characters per chunk of the
    routing key (the match granularity); max_tree_chars: the most key characters remembered per
    replica (LRU beyond it); chars_per_token: with a replica's KV capacity in tokens (reported by
    the replica), its tree is bounded to capacity x this when that is smaller; load_threshold:
    in-flight requests by which the best-matching replica may exceed the least-loaded one before
    the request goes to the latter; min_match_ratio: the share of the key a match must cover to
    count. Raises ValueError for values out of range."""

    policy: str = "prefix"
    chunk_chars: int = 64
    max_tree_chars: int = 8 << 20
    chars_per_token: float = 4.0
    load_threshold: int = 4
    min_match_ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.chunk_chars < 1:
            raise ValueError(f"chunk_chars must be >= 1, got {self.chunk_chars}")
        if self.max_tree_chars < self.chunk_chars:
            raise ValueError(
                f"max_tree_chars must be >= chunk_chars ({self.chunk_chars}), got {self.max_tree_chars}"
            )
        if not self.chars_per_token > 0:
            raise ValueError(f"chars_per_token must be > 0, got {self.chars_per_token}")
        if self.load_threshold < 0:
            raise ValueError(f"load_threshold must be >= 0, got {self.load_threshold}")
        if not 0.0 <= self.min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {self.min_match_ratio}")

    def as_kwargs(self) -> dict:
        """The fields as keyword arguments (Serve's request_router_kwargs)."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


class Decision(NamedTuple):
    """A routing decision: the replica id, why (prefix, load, no_match, no_key, round_robin,
    least_loaded, target) and the chosen replica's match with the key (characters)."""

    replica: str
    reason: str
    match_chars: int


class RoutingTable:
    """Per-replica trees and in-flight counts, the policy over them, and the routing counters."""

    def __init__(self, config: RoutingConfig | None = None):
        self.config = config or RoutingConfig()
        self._lock = threading.Lock()
        self._trees: dict[str, ChunkRadixTree] = {}
        self._capacity_chunks: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}
        self._requests: dict[str, str] = {}  # request id -> replica id
        self._last_chosen: dict[str, int] = {}
        self._seq = 0
        self._rr = 0
        self.registry = CollectorRegistry()
        self._decisions = Counter(
            "agentrt_routing_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=self.registry,
        )
        self._match = Histogram(
            "agentrt_routing_prefix_match_chars",
            "Characters of the request's routing key already sent to the chosen replica",
            buckets=MATCH_BUCKETS,
            registry=self.registry,
        )
        self._replicas_gauge = Gauge(
            "agentrt_routing_replicas", "Live replicas known to the router", registry=self.registry
        )
        self._in_flight_gauge = Gauge(
            "agentrt_routing_in_flight", "Requests in flight per replica", ["replica"], registry=self.registry
        )
        self._tree_gauge = Gauge(
            "agentrt_routing_tree_chars",
            "Key characters remembered per replica (approximate radix tree)",
            ["replica"],
            registry=self.registry,
        )

    # ---- replicas ---------------------------------------------------------------------------
    def update_replicas(self, replicas: Mapping[str, int | None]) -> None:
        """Set the live replicas: id -> KV capacity in tokens (None: unknown). New ids get an empty
        tree; ids no longer present lose theirs (a restarted replica has a new id and an empty
        cache) and their in-flight requests."""
        with self._lock:
            for rid in list(self._trees):
                if rid not in replicas:
                    self._drop(rid)
            for rid, kv_tokens in replicas.items():
                self._ensure(rid)
                if kv_tokens:
                    self._capacity_chunks[rid] = max(
                        1, int(kv_tokens * self.config.chars_per_token) // self.config.chunk_chars
                    )
                    self._trees[rid].max_chunks = self._max_chunks(rid)

    def remove_replica(self, replica: str) -> None:
        """Forget a replica (it died)."""
        with self._lock:
            self._drop(replica)

    def replica_ids(self) -> list[str]:
        """The live replicas' ids, sorted."""
        with self._lock:
            return sorted(self._trees)

    def in_flight(self, replica: str) -> int:
        with self._lock:
            return self._in_flight.get(replica, 0)

    def tree(self, replica: str) -> ChunkRadixTree | None:
        """The replica's tree (for inspection; hold no reference across calls)."""
        with self._lock:
            return self._trees.get(replica)

    def _max_chunks(self, rid: str) -> int:
        bound = self.config.max_tree_chars // self.config.chunk_chars
        return min(bound, self._capacity_chunks.get(rid, bound))

    def _ensure(self, rid: str) -> ChunkRadixTree:
        tree = self._trees.get(rid)
        if tree is None:
            tree = self._trees[rid] = ChunkRadixTree(self._max_chunks(rid))
            self._in_flight.setdefault(rid, 0)
        return tree

    def _drop(self, rid: str) -> None:
        self._trees.pop(rid, None)
        self._capacity_chunks.pop(rid, None)
        self._in_flight.pop(rid, None)
        self._last_chosen.pop(rid, None)
        for req in [q for q, r in self._requests.items() if r == rid]:
            del self._requests[req]

    # ---- decisions --------------------------------------------------------------------------
    def choose(
        self, key: RouteKey | None, candidates: Sequence[str], request_id: str | None = None
    ) -> Decision:
        """Choose one of `candidates` (live replica ids, at least one) for a request with routing
        key `key` (None: none), count it in flight under `request_id` (None: not tracked) and
        insert its key into the chosen replica's tree. Raises ValueError when `candidates` is
        empty."""
        if not candidates:
            raise ValueError("no replica to route to")
        with self._lock:
            for rid in candidates:
                self._ensure(rid)
            if key is not None and key.target is not None and key.target in candidates:
                decision = Decision(key.target, "target", 0)
            else:
                decision = self._decide(key, sorted(candidates))
            self._seq += 1
            self._last_chosen[decision.replica] = self._seq
            if request_id is not None:
                previous = self._requests.get(request_id)
                if previous is not None and previous in self._in_flight:
                    self._in_flight[previous] -= 1
                self._requests[request_id] = decision.replica
                self._in_flight[decision.replica] += 1
            if decision.reason != "target":
                self._decisions.labels(self.config.policy, decision.reason).inc()
                if key is not None and key.chunk_ids:
                    self._match.observe(decision.match_chars)
                    self._trees[decision.replica].insert(key.chunk_ids)
            return decision

    def finished(self, request_id: str) -> None:
        """A request routed by `choose` completed (or failed): it no longer counts as load."""
        with self._lock:
            rid = self._requests.pop(request_id, None)
            if rid is not None and rid in self._in_flight:
                self._in_flight[rid] = max(0, self._in_flight[rid] - 1)

    def _matched_chars(self, key: RouteKey, rid: str) -> int:
        chunks = self._trees[rid].match(key.chunk_ids)
        return min(key.num_chars, chunks * self.config.chunk_chars)

    def _least_loaded(self, ids: list[str], by_tree: bool) -> str:
        def rank(rid: str) -> tuple:
            tree = self._trees[rid].num_chunks if by_tree else 0
            return (self._in_flight[rid], tree, self._last_chosen.get(rid, 0), rid)

        return min(ids, key=rank)

    def _decide(self, key: RouteKey | None, ids: list[str]) -> Decision:
        policy = self.config.policy
        has_key = key is not None and bool(key.chunk_ids)
        if policy == "round_robin":
            rid = ids[self._rr % len(ids)]
            self._rr += 1
            return Decision(rid, "round_robin", self._matched_chars(key, rid) if has_key else 0)
        if policy == "least_loaded":
            rid = self._least_loaded(ids, by_tree=False)
            return Decision(rid, "least_loaded", self._matched_chars(key, rid) if has_key else 0)
        if not has_key:
            return Decision(self._least_loaded(ids, by_tree=False), "no_key", 0)
        matches = {rid: self._matched_chars(key, rid) for rid in ids}
        least = self._least_loaded(ids, by_tree=True)
        best = max(ids, key=lambda r: (matches[r], -self._in_flight[r], -self._trees[r].num_chunks))
        if matches[best] == 0 or matches[best] < self.config.min_match_ratio * key.num_chars:
            return Decision(least, "no_match", matches[least])
        if self._in_flight[best] - self._in_flight[least] > self.config.load_threshold:
            return Decision(least, "load", matches[least])
        return Decision(best, "prefix", matches[best])

    # ---- metrics ----------------------------------------------------------------------------
    def metrics_text(self) -> bytes:
        """The routing counters and per-replica gauges, Prometheus text exposition format."""
        with self._lock:
            self._replicas_gauge.set(len(self._trees))
            self._in_flight_gauge.clear()
            self._tree_gauge.clear()
            for rid, tree in self._trees.items():
                self._in_flight_gauge.labels(rid).set(self._in_flight[rid])
                self._tree_gauge.labels(rid).set(tree.num_chunks * self.config.chunk_chars)
            return generate_latest(self.registry)


_TABLES: dict[str, RoutingTable] = {}
_TABLES_LOCK = threading.Lock()


def table_key(app_name: str, deployment_name: str) -> str:
    """The shared_table key of an engine deployment."""
    return f"{app_name}#{deployment_name}"


def shared_table(key: str, config: RoutingConfig) -> RoutingTable:
    """This process's RoutingTable for `key` (table_key(app, deployment)), created on first use; a
    table made with another config is replaced (a redeploy with new routing settings)."""
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is None or table.config != config:
            if table is not None:
                logger.info("routing table %s: config changed, starting afresh", key)
            table = _TABLES[key] = RoutingTable(config)
        return table
