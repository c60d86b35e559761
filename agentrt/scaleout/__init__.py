"""Replicas on Ray Serve with prefix-aware routing (`agentrt serve --replicas N`).

    radix.py         approximate radix tree of chunk ids per replica (bounded, LRU eviction)
    routing_key.py   a request body -> its prefix text -> chunk ids (RouteKey)
    policy.py        RoutingConfig, RoutingTable: prefix / round_robin / least_loaded, counters
    serve_router.py  the policy as Ray Serve's custom RequestRouter (imports Ray)
    replica.py       EngineReplica: engine + app of `agentrt serve`, forwarded requests (ASGI)
    ingress.py       the HTTP front: routing key, forwarding, failures, aggregated /metrics
    metrics.py       replicas' /metrics merged under a `replica` label
    deploy.py        the Serve application and the CLI entry point

Only serve_router.py and deploy.py's Serve calls need Ray; the rest is tested without it.
"""
