"""`agentrt serve --replicas N`: N engine replicas on Ray Serve behind one ingress.

    agentrt serve --replicas 2                                  # a local Ray cluster
    agentrt serve --replicas 4 --ray-address HEAD:6379 --routing round_robin

The application (one Serve app, `APP_NAME`):

    HTTP -> Serve's proxy -> ingress (1 replica, 0 CPUs; ingress.py)
                              | handle.options(stream=True).forward.remote(request, route=key)
                              v  request router in the ingress process (serve_router.py, policy.py)
                         engine deployment, num_replicas=N (replica.py: model + app of `agentrt serve`)

Serve, not agentrt, keeps the replicas alive: a replica whose process dies (or whose health check
fails: its engine loop stopped) is replaced with a new one, which the router sees under a new id
with an empty tree. CPU replicas reserve `cpus_per_replica` CPUs (default: the cluster's CPUs /
N) and run torch with that many threads; on a cluster with GPUs (or --device cuda) each replica
takes one GPU (`num_gpus=1`; Ray sets its CUDA_VISIBLE_DEVICES, so the replica's device is "cuda").
The engine deployment accepts `MAX_ONGOING_REQUESTS` per replica: its engine queues and refuses
(--max-queued-requests: 429) by itself, so Serve's own limit never decides the replica.

Ray is an optional extra (`pip install "agentrt[ray]"`).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentrt.api.middleware import ServerOptions
from agentrt.scaleout.policy import RoutingConfig
from agentrt.scaleout.replica import ReplicaSpec

APP_NAME = "agentrt"
ENGINE_DEPLOYMENT = "engine"
INGRESS_DEPLOYMENT = "ingress"
MAX_ONGOING_REQUESTS = 4096
ROUTER_CLASS = "agentrt.scaleout.serve_router:PrefixAwareRequestRouter"
SERVE_INSTALL_HINT = '--replicas needs Ray Serve, which is not installed: `pip install "agentrt[ray]"` (or `pip install "ray[serve]"`)'


def import_serve():
    """The `ray` module with Ray Serve imported. Raises ImportError with SERVE_INSTALL_HINT when
    Ray Serve is missing, or naming what is missing when its custom request router API lacks the
    completion hook the router counts load with (RequestRouter.on_request_completed, Ray PR #60845;
    tested with Ray 2.60.0)."""
    try:
        import ray
        from ray import serve  # noqa: F401
        from ray.serve.request_router import RequestRouter
    except ImportError:
        raise ImportError(SERVE_INSTALL_HINT) from None
    if not hasattr(RequestRouter, "on_request_completed"):
        raise ImportError(
            f"--replicas needs a Ray Serve whose RequestRouter has on_request_completed; Ray {ray.__version__} "
            'has not: pip install -U "agentrt[ray]"'
        )
    return ray


@dataclass(frozen=True)
class ReplicaResources:
    """Each engine replica's `ray_actor_options` and its torch thread budget (None on GPUs), and
    whether it runs on a GPU."""

    actor_options: dict
    num_threads: int | None
    gpu: bool


def plan_resources(
    cluster: Mapping[str, float], device: str, num_replicas: int, cpus_per_replica: int | None = None
) -> ReplicaResources:
    """The resources of each of `num_replicas` replicas on a cluster with `cluster` resources
    (ray.cluster_resources()) for the engine `device`. Raises ValueError for num_replicas or
    cpus_per_replica < 1, or when the cluster cannot hold the replicas."""
    if num_replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {num_replicas}")
    if cpus_per_replica is not None and cpus_per_replica < 1:
        raise ValueError(f"--cpus-per-replica must be >= 1, got {cpus_per_replica}")
    gpus, cpus = cluster.get("GPU", 0), int(cluster.get("CPU", 0))
    if device.startswith("cuda") or (device == "auto" and gpus > 0):
        if gpus < num_replicas:
            raise ValueError(
                f"--replicas {num_replicas} on GPUs needs a GPU per replica; the Ray cluster has {gpus:g}"
            )
        return ReplicaResources({"num_gpus": 1, "num_cpus": cpus_per_replica or 1}, None, True)
    per = cpus_per_replica or max(1, cpus // num_replicas)
    if per * num_replicas > cpus:
        raise ValueError(
            f"--replicas {num_replicas} x {per} CPUs per replica exceeds the Ray cluster's {cpus} CPUs "
            "(lower --replicas or --cpus-per-replica)"
        )
    env = {"OMP_NUM_THREADS": str(per)}
    return ReplicaResources({"num_cpus": per, "runtime_env": {"env_vars": env}}, per, False)


def replica_spec(spec: ReplicaSpec, resources: ReplicaResources) -> ReplicaSpec:
    """`spec` fitted to the replicas' resources: on CPU the thread budget (unless threads were
    given), on a GPU the device "cuda" (each replica sees only its own GPU)."""
    model = spec.config.model
    if resources.gpu:
        model = dataclasses.replace(model, device="cuda")
    elif model.threads is None:
        model = dataclasses.replace(model, threads=resources.num_threads)
    return dataclasses.replace(spec, config=dataclasses.replace(spec.config, model=model))


def build_application(
    spec: ReplicaSpec,
    num_replicas: int,
    routing: RoutingConfig,
    options: ServerOptions,
    resources: ReplicaResources,
    max_ongoing_requests: int = MAX_ONGOING_REQUESTS,
) -> Any:
    """The Serve application (ingress bound to the engine deployment), ready for `serve.run`."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from agentrt.scaleout.ingress import IngressDeployment
    from agentrt.scaleout.replica import EngineReplica

    engine = serve.deployment(
        EngineReplica,
        name=ENGINE_DEPLOYMENT,
        num_replicas=num_replicas,
        ray_actor_options=resources.actor_options,
        max_ongoing_requests=max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"deployment": ENGINE_DEPLOYMENT, **routing.as_kwargs()},
        ),
        graceful_shutdown_timeout_s=10,
    )
    ingress = serve.deployment(
        serve.ingress()(IngressDeployment),
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max_ongoing_requests,
    )
    return ingress.bind(engine.bind(spec), ENGINE_DEPLOYMENT, routing, options)


def replica_options(options: ServerOptions) -> ServerOptions:
    """The replicas' own perimeter: the ingress checks keys and answers CORS, so none of either."""
    return dataclasses.replace(options, api_keys=(), metrics_require_key=False, allowed_origins=())


def serve_replicas(args: argparse.Namespace) -> int:
    """`agentrt serve --replicas N`: start or join Ray, deploy, serve until SIGTERM / Ctrl-C, then
    shut Serve down (requests in flight end with a 503 or their stream's error event). Exit 0 on
    a clean stop, 1 when the deployment failed, 2 on bad arguments or without Ray Serve."""
    from agentrt.engine_args import engine_config
    from agentrt.runtime.async_engine import AdmissionConfig
    from agentrt.server_args import exposure_warning, server_options
    from agentrt.sql.service import parse_database_args

    try:
        if args.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
        if args.cpus_per_replica is not None and args.cpus_per_replica < 1:
            raise ValueError(f"--cpus-per-replica must be >= 1, got {args.cpus_per_replica}")
        ray = import_serve()
        options = server_options(args)
        parse_database_args(args.database)  # a malformed flag fails here, not in every replica
        routing = RoutingConfig(policy=args.routing or "prefix")
        admission = AdmissionConfig(
            max_queued_requests=args.max_queued_requests, request_timeout_s=args.request_timeout
        )
        base = ReplicaSpec(
            config=engine_config(args),
            model_name=args.model,
            tool_call_format=args.tool_call_format,
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            reasoning_format=args.reasoning_format,
            reasoning_budget_message=args.reasoning_budget_message,
            options=replica_options(options),
            admission=admission,
            databases=tuple(args.database or ()),
        )
    except (ImportError, ValueError) as e:
        print(f"agentrt: error: {e}", file=sys.stderr)
        return 2
    warning = exposure_warning(args.host, args.port, options.api_keys)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    from ray import serve

    started = not ray.is_initialized()
    if started:
        ray.init(address=args.ray_address, include_dashboard=False, logging_level="WARNING")
    try:
        try:
            resources = plan_resources(
                ray.cluster_resources(), base.config.model.device, args.replicas, args.cpus_per_replica
            )
        except ValueError as e:
            print(f"agentrt: error: {e}", file=sys.stderr)
            return 2
        spec = replica_spec(base, resources)
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_application(spec, args.replicas, routing, options, resources)
        print(
            f"agentrt: deploying {args.replicas} replicas of {args.model} "
            f"({'1 GPU' if resources.gpu else f'{resources.num_threads} CPUs'} each, routing {routing.policy})",
            flush=True,
        )
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except Exception as e:  # noqa: BLE001 (Serve raises RuntimeError / RayServeException)
            print(f"agentrt: error: the deployment failed: {e}", file=sys.stderr)
            return 1
        print(
            f"agentrt: serving {args.model} at http://{args.host}:{args.port}/v1 on {args.replicas} replicas",
            flush=True,
        )
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        return 0
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
