"""The engine deployment's Ray Serve request router: agentrt's policy (policy.py) as a custom
`ray.serve.request_router.RequestRouter` (Serve's documented extension point, "Use Custom Algorithm
for Request Routing"; alpha in Ray 2.4x-2.6x).

Serve builds one of these inside every process holding a handle to the engine deployment (here:
the ingress replica) and calls `choose_replicas` for each request with its `PendingRequest`; the
ingress passes the request's RouteKey as the `route` keyword argument of `EngineReplica.forward`,
which the router reads from `pending_request.kwargs`. It answers with one rank holding one replica,
so the policy alone picks the replica: Serve then only checks that replica's queue
(`max_ongoing_requests`, set high by deploy.py: the engine queues and refuses by itself) and retries
the decision if it cannot take the request. Serve keeps the replica set current (`update_replicas`,
a replica that died: `on_replica_actor_died`; a restarted one comes back under a new id) and
reports each request's completion (`on_request_completed`), which ends its load.

Requests are told apart by Serve's internal request id, which every call made while serving one
HTTP request shares (Serve matches the replica chosen to the pending call by it): the ingress never
has two calls of one HTTP request pending at once (/metrics scrapes the replicas in turn).

Imports Ray: use through deploy.py (`pip install "agentrt[ray]"`).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from agentrt.scaleout.policy import RoutingConfig, shared_table, table_key
from agentrt.scaleout.routing_key import RouteKey


def _kv_tokens(replica: RunningReplica) -> int | None:
    """The KV capacity (tokens) a replica reported in its metadata (record_replica_metadata)."""
    metadata = getattr(replica, "replica_metadata", None) or {}
    value = metadata.get("kv_tokens")
    return int(value) if isinstance(value, int) and value > 0 else None


class PrefixAwareRequestRouter(RequestRouter):
    """Routes the engine deployment's requests by agentrt's RoutingTable (policy.py)."""

    def initialize_state(self, deployment: str, **config) -> None:
        """The RequestRouterConfig.request_router_kwargs: `deployment`, the engine deployment's name
        (the table key, with the app name), and RoutingConfig's fields."""
        self._table = shared_table(table_key(self.app_name, deployment), RoutingConfig(**config))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._table.update_replicas({r.replica_id.unique_id: _kv_tokens(r) for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._table.remove_replica(replica_id.unique_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = None
        request_id = None
        if pending_request is not None:
            route = pending_request.kwargs.get("route")
            key = route if isinstance(route, RouteKey) else None
            request_id = pending_request.metadata.internal_request_id
        decision = self._table.choose(key, list(by_id), request_id)
        return [[by_id[decision.replica]]]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._table.finished(internal_request_id)
